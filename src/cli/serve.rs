//! `narsil serve`: its flags, the rules between them, and serving until
//! SIGINT/SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::ValueEnum;
use narsil_core::request::{IdPolicy, RequestLimits};
use narsil_engine::{EngineConfig, ExecutionMode, MemoryBudget};

use crate::flags::backend::BackendArgs;
use crate::flags::request_level::{self, RequestLevelForm};
use crate::flags::serve_flag;
use crate::lifecycle::control_token::ControlToken;
use crate::lifecycle::repository::{self, VersionPolicy};
use crate::lifecycle::watcher::Repository;
use crate::server::tls::aged::MAX_CONNECTION_AGE_SECS;
use crate::server::tls::{AdminTls, ConnectionAge, ServerTls};
use crate::server::{bound, is_loopback, open_control_refused, Listen, RepositoryServe, Server};

/// `--execution-mode`: the engine's modes, by name.
fn execution_mode() -> impl clap::builder::TypedValueParser<Value = ExecutionMode> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    let names = ExecutionMode::ALL.map(|m| PossibleValue::new(m.name()).help(m.help()));
    PossibleValuesParser::new(names).map(|name| name.parse::<ExecutionMode>().expect("a listed mode"))
}

/// Whether each lane's embedding stage runs one batch ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StageAhead {
    /// Ahead where the table store's fetches wait on the disk (`disk`),
    /// on the lane otherwise.
    Auto,
    /// Always ahead.
    #[value(alias = "true")]
    On,
    /// Always on the lane.
    #[value(alias = "false")]
    Off,
}

/// Out-of-range sparse id handling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum IdPolicyArg {
    /// INVALID_ARGUMENT naming feature, sample and id.
    Reject,
    /// Hash into range: id mod rows.
    Modulo,
}

/// `narsil serve` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, env = "NARSIL_ADDR", default_value = "127.0.0.1:50051")]
    pub addr: SocketAddr,
    /// The model and where it runs.
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Serve every model of this repository (`DIR/<model>/<version>/`
    /// holding `model.pt` or `model.safetensors`; see docs/guide/model-repository.md) instead of one
    /// `--model`, switching versions live.
    #[arg(long, env = "NARSIL_MODEL_REPOSITORY", conflicts_with_all = ["model", "model_config", "backend"])]
    pub model_repository: Option<PathBuf>,
    /// Seconds between rescans of --model-repository; 0 rescans only on
    /// SIGHUP and control calls.
    #[arg(long, env = "NARSIL_REPOSITORY_POLL_SECS", default_value_t = 5.0)]
    pub repository_poll_secs: f64,
    /// Versions of each model served: `latest`, `latest:N` or
    /// `specific:V1,V2`.
    #[arg(long, env = "NARSIL_VERSION_POLICY", default_value = "latest")]
    pub version_policy: VersionPolicy,
    /// Model of --model-repository that requests naming none go to (default:
    /// the only model, if there is one).
    #[arg(long, env = "NARSIL_DEFAULT_MODEL", requires = "model_repository")]
    pub default_model: Option<String>,
    /// Turn on the load/unload calls on --metrics-addr (`POST /v1/models/…`);
    /// listing (`GET /v1/models`) is always on.
    /// Without --control-token-file they are open to anyone who reaches
    /// --metrics-addr, which must then be a loopback address.
    #[arg(long, env = "NARSIL_MODEL_CONTROL", requires_all = ["model_repository", "metrics_addr"])]
    pub model_control: bool,
    /// File holding the token the --model-control calls must present as
    /// `Authorization: Bearer <token>` (its trailing line end is not part of
    /// it); read once at start. Calls without it get 401, with another
    /// token 403. Listing, /metrics and /healthz stay open.
    #[arg(long, env = "NARSIL_CONTROL_TOKEN_FILE", value_name = "PATH", requires = "model_control")]
    pub control_token_file: Option<PathBuf>,
    /// Most bytes the raw ids pushed to one table (`narsil tables
    /// push-ids`) may hold in each version: their rows and 32 bytes of
    /// index each (`narsil_table_pushed_bytes`). A push past it is refused
    /// (422) naming this flag; a version whose push log holds more fails to
    /// load, naming it. 1 GiB: about 9.5M ids of 80-byte rows.
    #[arg(long, env = "NARSIL_MAX_PUSHED_BYTES", default_value_t = 1 << 30)]
    pub max_pushed_bytes: u64,
    /// Execution mode.
    #[arg(long, env = "NARSIL_EXECUTION_MODE", default_value = "batch", value_parser = execution_mode())]
    pub execution_mode: ExecutionMode,
    /// Most requests fused into one forward (batch mode). `--batch-size` is
    /// an older name for it.
    #[arg(long, alias = "batch-size", env = "NARSIL_MAX_BATCH_REQUESTS", default_value_t = 16)]
    pub max_batch_requests: usize,
    /// Once a lane is free, how long the oldest queued request may wait for
    /// more to fuse with; 0 sends at once.
    #[arg(long, env = "NARSIL_BATCH_TIMEOUT_MS", default_value_t = 0.0)]
    pub batch_timeout_ms: f64,
    /// Most rows (samples) fused into one forward.
    #[arg(long, env = "NARSIL_MAX_BATCH_ROWS", default_value_t = 4096)]
    pub max_batch_rows: usize,
    /// Models with sequence features: most tokens fused into one forward,
    /// rows plus the sequence positions they look up (a ranking request's
    /// history counted once, or on every row where the model's lanes take
    /// only flat batches, which copy it there). Longer histories seal
    /// batches sooner, keeping a forward's work bounded; a request over it
    /// is cut into parts within it (a row over it alone is a part of its
    /// own; a ranking request's parts each keep its history, and one whose
    /// history is over half of it is cut by rows only). (On one Zen 4
    /// core, a DIN ranker served 500-candidate requests fastest one per
    /// forward: fused ones cost more per candidate.)
    #[arg(long, env = "NARSIL_MAX_BATCH_TOKENS", default_value_t = 1024)]
    pub max_batch_tokens: usize,
    /// Most samples one request may carry. Requests with more samples than
    /// --max-batch-rows are split across forwards and reassembled in order.
    #[arg(long, env = "NARSIL_MAX_REQUEST_SAMPLES", default_value_t = 65_536)]
    pub max_request_samples: usize,
    /// Most ids one ranking request's request-level block may carry, its
    /// features together; more are refused with INVALID_ARGUMENT. A model
    /// whose backend takes only flat batches (a single-file model, Burn,
    /// the mock) copies the block into every candidate row: that copy is
    /// charged to --max-queue-bytes before the request is queued.
    #[arg(long, env = "NARSIL_MAX_REQUEST_LEVEL_IDS", default_value_t = RequestLimits::DEFAULT_MAX_REQUEST_LEVEL_IDS)]
    pub max_request_level_ids: usize,
    /// Executor lanes: threads each owning a model instance.
    #[arg(long, env = "NARSIL_LANES", default_value_t = 1)]
    pub lanes: usize,
    /// Most threads one forward may use. A forward that starts while the
    /// other lanes are idle and nothing else is queued takes the cores they
    /// leave free, up to this; under load each lane runs on one thread
    /// (torch; `--intra-op-threads` is the floor). Unset: the cores this
    /// process may run on. 1: every forward on one thread.
    #[arg(long, env = "NARSIL_MAX_FORWARD_THREADS")]
    pub max_forward_threads: Option<usize>,
    /// Most requests admitted and waiting for a forward; more are rejected
    /// with RESOURCE_EXHAUSTED.
    #[arg(long, env = "NARSIL_MAX_QUEUE_REQUESTS", default_value_t = 1024)]
    pub max_queue_requests: usize,
    /// Most rows admitted and waiting for a forward.
    #[arg(long, env = "NARSIL_MAX_QUEUE_ROWS", default_value_t = 131_072)]
    pub max_queue_rows: usize,
    /// Most bytes all requests together may hold, process-wide: messages
    /// being received and decoded (reserved from their encoded size before
    /// they are read), queued requests, and batches being computed. More
    /// are rejected with RESOURCE_EXHAUSTED, and a single request that
    /// decodes larger than this with INVALID_ARGUMENT. Unset: 4 x
    /// --max-message-bytes (256 MiB by default).
    #[arg(long, env = "NARSIL_MAX_QUEUE_BYTES")]
    pub max_queue_bytes: Option<usize>,
    /// Longest a request may wait for its forward to start, ms; past it the
    /// request gets DEADLINE_EXCEEDED and is never computed. Unset: only the
    /// caller's gRPC deadline applies.
    #[arg(long, env = "NARSIL_QUEUE_TIMEOUT_MS")]
    pub queue_timeout_ms: Option<f64>,
    /// Largest gRPC message accepted, bytes; larger ones get INVALID_ARGUMENT.
    #[arg(long, env = "NARSIL_MAX_MESSAGE_BYTES", default_value_t = 64 << 20)]
    pub max_message_bytes: usize,
    /// PEM certificate (chain) to serve gRPC (--addr) and, as --metrics-tls
    /// says, --metrics-addr over TLS with; needs --tls-key. Every protocol
    /// is then TLS only. Unset: plaintext. When the files (--tls-key and
    /// --tls-client-ca too) change, new connections get the new ones within
    /// a few seconds; a change that cannot be used keeps the old ones.
    #[arg(long, env = "NARSIL_TLS_CERT", value_name = "PATH", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "NARSIL_TLS_KEY", value_name = "PATH", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificate(s) for mutual TLS: a client must present a
    /// certificate signed by one of them, or is refused at the handshake.
    /// Needs --tls-cert.
    #[arg(long, env = "NARSIL_TLS_CLIENT_CA", value_name = "PATH", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// With --tls-cert, TLS on --metrics-addr: `same` as on --addr (client
    /// certificates too, with --tls-client-ca), `no-client-cert` (the
    /// certificate, but none asked of clients: scrapers and probes without
    /// one), or `off` (plain HTTP).
    #[arg(long, env = "NARSIL_METRICS_TLS", value_enum, default_value_t = AdminTls::Same)]
    pub metrics_tls: AdminTls,
    /// With --tls-cert, the longest a TLS connection lives, seconds
    /// (default 3600): then its client is told to go (gRPC: an HTTP/2
    /// GOAWAY, the calls in flight finish and new ones go to a new
    /// connection; the admin address: the connection closes after its
    /// response), and its next handshake is checked against the
    /// certificate and client CA in service. 0: as long as clients keep
    /// them. Plaintext connections never age.
    #[arg(long, env = "NARSIL_TLS_MAX_CONNECTION_AGE_SECS", value_name = "SECS", requires = "tls_cert",
          value_parser = clap::value_parser!(u64).range(..=MAX_CONNECTION_AGE_SECS))]
    pub tls_max_connection_age_secs: Option<u64>,
    /// How long a TLS connection past its age may take to go before it is
    /// closed, calls in flight or not, seconds (default 30).
    #[arg(long, env = "NARSIL_TLS_CONNECTION_AGE_GRACE_SECS", value_name = "SECS", requires = "tls_cert",
          value_parser = clap::value_parser!(u64).range(..=MAX_CONNECTION_AGE_SECS))]
    pub tls_connection_age_grace_secs: Option<u64>,
    /// Address to serve Prometheus metrics on (`GET /metrics`); unset: no
    /// metrics endpoint.
    #[arg(long, env = "NARSIL_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Once every listener is bound, write the address each one got to
    /// this file, one `NAME=HOST:PORT` line each: `grpc` (--addr) and, with
    /// --metrics-addr, `metrics`. With port 0 in an address it tells the
    /// port the kernel chose. Written to a temporary file beside it and
    /// renamed into place, so a reader sees all of it or none; a file left
    /// by an earlier run is removed at start.
    #[arg(long, env = "NARSIL_BOUND_ADDRESSES_FILE", value_name = "PATH")]
    pub bound_addresses_file: Option<PathBuf>,
    /// Failed or stalled forwards in a row after which grpc.health says
    /// NOT_SERVING (a batch abandoned at its deadline while a table store
    /// stalled it counts as failed); idle lanes then probe the backend every
    /// second, and the first success turns it SERVING again; 0 never.
    /// Besides, a split model whose table store stops answering is
    /// NOT_SERVING until it answers again, whatever this count: a Redis
    /// Cluster none of whose masters answers pings for 1 s, or a `disk`
    /// store whose probe (a direct read of one block of every table file
    /// each second) fails or takes over 1 s.
    #[arg(long, env = "NARSIL_UNHEALTHY_AFTER_FAILURES", default_value_t = 5)]
    pub unhealthy_after_failures: u32,
    /// On SIGTERM/SIGINT, seconds to keep accepting and serving calls after
    /// health turns NOT_SERVING, before the listener closes and the drain
    /// begins: long enough for load balancers to see NOT_SERVING (their
    /// check interval times the failures they need).
    #[arg(long, env = "NARSIL_DRAIN_GRACE_SECS", default_value_t = 0.0)]
    pub drain_grace_secs: f64,
    /// Split models on the torch backend: run each lane's embedding stage
    /// (dedup, row fetches, pooling) one batch ahead, on a stage thread of
    /// its own, while the lane runs the previous batch's dense network.
    /// Helps where fetches wait (tables read from disk, a Redis Cluster on
    /// other machines); costs where the stage only computes and every core
    /// is busy (docs/guide/split-models.md). `auto`: ahead for the `disk`
    /// store only; `--stage-ahead` alone means `on`.
    #[arg(long, env = "NARSIL_STAGE_AHEAD", value_enum, default_value_t = StageAhead::Auto,
          num_args = 0..=1, default_missing_value = "on")]
    pub stage_ahead: StageAhead,
    /// What to do with sparse ids outside a table.
    #[arg(long, env = "NARSIL_ID_POLICY", value_enum, default_value_t = IdPolicyArg::Reject)]
    pub id_policy: IdPolicyArg,
    /// The features that are the same for every candidate of a ranking
    /// request: requests may send them once, in their request-level block
    /// (docs/guide/ranking.md). `MODEL:NAMES` for a model, or `NAMES` alone
    /// for a --model server's one model; NAMES comma-separated (`dense`
    /// for the dense features, `none` for none). Repeat the flag for
    /// several models (the variable: forms separated by `;`); a repository
    /// takes MODEL:NAMES only. Replaces what that model declares (its
    /// `schema.json` or `model.json` `request_level`); a model no form
    /// names keeps its own. A sequence is request-level when NAMES lists
    /// all its channels, per row when none: listing some only fails that
    /// model's load, naming the sequence and its channels.
    #[arg(long, env = "NARSIL_REQUEST_LEVEL", value_delimiter = ';', value_name = "[MODEL:]NAMES")]
    pub request_level: Vec<RequestLevelForm>,
}

impl ServeArgs {
    /// Checks rules between flags and returns the engine's configuration.
    pub fn engine_config(&self) -> anyhow::Result<EngineConfig> {
        if !self.batch_timeout_ms.is_finite() || self.batch_timeout_ms < 0.0 {
            anyhow::bail!("--batch-timeout-ms must be a non-negative number, got {}", self.batch_timeout_ms);
        }
        let queue_timeout = match self.queue_timeout_ms {
            Some(ms) if !ms.is_finite() || ms <= 0.0 => {
                anyhow::bail!("--queue-timeout-ms must be a positive number, got {ms}")
            }
            ms => ms.map(|ms| Duration::from_secs_f64(ms / 1e3)),
        };
        if self.model_repository.is_some() {
            // Every version brings its own model file; check the rest.
            self.backend.validate_options()?;
        } else {
            self.backend.validate()?;
        }
        let config = EngineConfig {
            // Per model: `repository` for a repository's, `serve_until_signal`
            // for a --model server's once its model is known.
            request_level: None,
            mode: self.execution_mode,
            max_batch_requests: self.max_batch_requests,
            max_batch_rows: self.max_batch_rows,
            max_batch_tokens: self.max_batch_tokens,
            unhealthy_after_failures: self.unhealthy_after_failures,
            health_probe_interval: Duration::from_secs(1),
            stage_ahead: match self.stage_ahead {
                StageAhead::On => true,
                StageAhead::Off => false,
                StageAhead::Auto => self.backend.table_store.fetches_wait(),
            },
            batch_timeout: Duration::from_secs_f64(self.batch_timeout_ms / 1e3),
            lanes: self.lanes,
            max_forward_threads: self
                .max_forward_threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
            max_queue_requests: self.max_queue_requests,
            max_queue_rows: self.max_queue_rows,
            memory: MemoryBudget::new(
                self.max_queue_bytes.unwrap_or(self.max_message_bytes.saturating_mul(4)),
            ),
            queue_timeout,
            limits: RequestLimits {
                max_samples: self.max_request_samples,
                max_request_level_ids: self.max_request_level_ids,
                id_policy: match self.id_policy {
                    IdPolicyArg::Reject => IdPolicy::Reject,
                    IdPolicyArg::Modulo => IdPolicy::Modulo,
                },
            },
        };
        config.validate().map_err(|e| anyhow::anyhow!(e.describe(serve_flag)))?;
        Ok(config)
    }
}

impl ServeArgs {
    /// `--drain-grace-secs` as a duration.
    pub fn drain_grace(&self) -> anyhow::Result<Duration> {
        match self.drain_grace_secs {
            secs if secs.is_finite() && secs >= 0.0 => Ok(Duration::from_secs_f64(secs)),
            secs => anyhow::bail!("--drain-grace-secs must be a non-negative number, got {secs}"),
        }
    }

    /// The repository to serve, if `--model-repository` is set, with every
    /// version's engine configured by `engine`.
    pub fn repository(&self, engine: EngineConfig) -> anyhow::Result<Option<RepositoryServe>> {
        let Some(dir) = &self.model_repository else { return Ok(None) };
        let poll = match self.repository_poll_secs {
            secs if !secs.is_finite() || secs < 0.0 => {
                anyhow::bail!("--repository-poll-secs must be a non-negative number, got {secs}")
            }
            0.0 => None,
            secs => Some(Duration::from_secs_f64(secs)),
        };
        Ok(Some(RepositoryServe {
            repository: Repository {
                source: repository::open(dir),
                policy: self.version_policy.clone(),
                load: self.backend.load_options(),
                engine,
                request_level: request_level::per_model(&self.request_level).map_err(anyhow::Error::msg)?,
                max_pushed_bytes: self.max_pushed_bytes,
            },
            default_model: self.default_model.clone(),
            poll,
            control: self.model_control,
            control_token: self.control_token()?,
        }))
    }

    /// TLS for the listeners from `--tls-cert`, `--tls-key`,
    /// `--tls-client-ca` and `--metrics-tls`, read and checked now (and
    /// followed: [`ServerTls::read`]); none without them.
    pub fn server_tls(&self) -> anyhow::Result<Option<ServerTls>> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                let tls = ServerTls::read(cert, key, self.tls_client_ca.as_deref())?;
                Ok(Some(tls.with_admin(self.metrics_tls).with_connection_age(self.connection_age())))
            }
            (None, None) if self.tls_client_ca.is_none() => {
                if self.metrics_tls != AdminTls::Same {
                    anyhow::bail!("--metrics-tls needs --tls-cert and --tls-key: the certificate to serve");
                }
                Ok(None)
            }
            _ => anyhow::bail!("--tls-cert and --tls-key go together (and --tls-client-ca needs them)"),
        }
    }

    /// How long TLS connections live: `--tls-max-connection-age-secs` (0:
    /// forever) and `--tls-connection-age-grace-secs`, or their defaults.
    pub fn connection_age(&self) -> Option<ConnectionAge> {
        let default = ConnectionAge::default();
        let max = self.tls_max_connection_age_secs.map_or(default.max, Duration::from_secs);
        let grace = self.tls_connection_age_grace_secs.map_or(default.grace, Duration::from_secs);
        (!max.is_zero()).then_some(ConnectionAge { max, grace })
    }

    /// The model-control token from `--control-token-file`, read now; none
    /// without the flag, which `--model-control` allows only on a loopback
    /// `--metrics-addr` (and says once that the calls are open).
    pub fn control_token(&self) -> anyhow::Result<Option<Arc<ControlToken>>> {
        if let Some(path) = &self.control_token_file {
            return Ok(Some(Arc::new(ControlToken::read(path)?)));
        }
        if self.model_control {
            if let Some(admin) = self.metrics_addr.filter(|&addr| !is_loopback(addr)) {
                anyhow::bail!("{}", open_control_refused(admin));
            }
            tracing::warn!(
                "model control is open: no --control-token-file, so any local process that reaches \
                 --metrics-addr can load and unload models"
            );
        }
        Ok(None)
    }
}

impl ServeArgs {
    /// The defaults, as if no flag were given (for tests and embedding).
    pub fn defaults() -> Self {
        <super::Cli as clap::Parser>::parse_from(["narsil", "serve"]).serve_args().expect("serve")
    }
}

/// `narsil serve`: build the backend (or watch the repository), serve,
/// drain on SIGINT/SIGTERM.
pub async fn serve_until_signal(args: ServeArgs) -> anyhow::Result<()> {
    let config = args.engine_config()?;
    let drain_grace = args.drain_grace()?;
    let tls = args.server_tls()?;
    let listen = Listen {
        addr: args.addr,
        metrics_addr: args.metrics_addr,
        max_message_bytes: args.max_message_bytes,
    };
    if let Some(path) = &args.bound_addresses_file {
        bound::remove_stale(path)?;
    }
    let server = match args.repository(config.clone())? {
        Some(served) => {
            tracing::info!(repository = %served.repository.source.describe(), mode = ?config.mode,
                lanes = config.lanes, "starting");
            Server::start_repository(listen, served).await?
        }
        None => {
            tracing::info!(backend = args.backend.kind().name(), mode = ?config.mode, lanes = config.lanes,
                batch_size = config.max_batch_requests, "starting");
            let factory = args.backend.build()?;
            let request_level = request_level::for_single_model(&args.request_level, &factory.schema().name)
                .map_err(anyhow::Error::msg)?;
            Server::start(listen, factory, EngineConfig { request_level, ..config }).await?
        }
    };
    let server = match tls {
        Some(tls) => server.with_tls(tls),
        None => server,
    };
    if let Some(path) = &args.bound_addresses_file {
        bound::write(path, &server.bound_addresses())?;
        tracing::info!(file = %path.display(), "wrote the bound addresses");
    }
    server.with_drain_grace(drain_grace).run(crate::server::signal::signal()).await
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::cli::{Cli, Command};

    fn serve(args: &[&str]) -> ServeArgs {
        let mut argv = vec!["narsil", "serve"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).unwrap().serve_args().unwrap()
    }

    #[test]
    fn defaults_give_a_valid_batch_mode_config() {
        let config = ServeArgs::defaults().engine_config().unwrap();
        assert_eq!(config.mode, ExecutionMode::Batch);
        assert_eq!(config.max_batch_requests, 16);
        assert_eq!(config.batch_timeout, Duration::ZERO);
    }

    #[test]
    fn the_stage_runs_ahead_by_default_only_for_the_disk_store_and_as_told_otherwise() {
        let ahead = |args: &[&str]| serve(args).engine_config().unwrap().stage_ahead;
        assert!(!ahead(&[]));
        assert!(ahead(&["--table-store", "disk"]));
        assert!(!ahead(&["--table-store", "mmap"]));
        assert!(!ahead(&["--table-store", "disk", "--stage-ahead", "off"]));
        assert!(ahead(&["--stage-ahead", "--table-store", "memory"]), "the flag alone means on");
        assert!(ahead(&["--stage-ahead", "true"]));
    }

    #[test]
    fn batch_size_is_kept_as_an_older_name_for_max_batch_requests() {
        assert_eq!(serve(&["--batch-size", "4"]).engine_config().unwrap().max_batch_requests, 4);
        assert_eq!(serve(&["--max-batch-requests", "5"]).engine_config().unwrap().max_batch_requests, 5);
        let load = |flag: &str| match Cli::try_parse_from(["narsil", "load", flag, "7"]).unwrap().command {
            Command::Load(args) => args.samples_per_request,
            _ => unreachable!(),
        };
        assert_eq!((load("--batch-size"), load("--samples-per-request")), (7, 7));
    }

    #[test]
    fn the_backend_follows_the_model_file_unless_named() {
        use crate::flags::backend::BackendKind;
        assert_eq!(serve(&[]).backend.kind(), BackendKind::Mock);
        assert_eq!(serve(&["--model", "m/model.pt"]).backend.kind(), BackendKind::Torch);
        assert_eq!(serve(&["--model", "m/weights.safetensors"]).backend.kind(), BackendKind::Burn);
        assert_eq!(
            serve(&["--backend", "torch", "--model", "w.safetensors"]).backend.kind(),
            BackendKind::Torch
        );
    }

    #[test]
    fn zero_lanes_is_rejected_with_the_flag_name() {
        let err = serve(&["--lanes", "0"]).engine_config().unwrap_err();
        assert!(err.to_string().contains("--lanes"), "{err}");
    }

    #[test]
    fn request_limit_above_queue_rows_is_rejected() {
        let err =
            serve(&["--max-queue-rows", "100", "--max-request-samples", "200"]).engine_config().unwrap_err();
        assert!(err.to_string().contains("--max-request-samples"), "{err}");
    }

    #[test]
    fn queue_timeout_is_optional_and_must_be_positive() {
        assert_eq!(ServeArgs::defaults().engine_config().unwrap().queue_timeout, None);
        let config = serve(&["--queue-timeout-ms", "2.5"]).engine_config().unwrap();
        assert_eq!(config.queue_timeout, Some(Duration::from_micros(2500)));
        let err = serve(&["--queue-timeout-ms", "0"]).engine_config().unwrap_err();
        assert!(err.to_string().contains("--queue-timeout-ms"), "{err}");
    }

    #[test]
    fn tls_files_that_cannot_be_read_or_used_are_refused_naming_the_flag() {
        let err = serve(&["--tls-cert", "/nonexistent/cert.pem", "--tls-key", "/nonexistent/key.pem"])
            .server_tls()
            .unwrap_err();
        assert!(format!("{err:#}").contains("cannot read --tls-cert /nonexistent/cert.pem"), "{err:#}");
        let junk = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(junk.path(), "not a PEM file").unwrap();
        let path = junk.path().to_str().unwrap();
        let err = serve(&["--tls-cert", path, "--tls-key", path]).server_tls().unwrap_err();
        assert!(format!("{err:#}").contains("cannot serve TLS with --tls-cert, --tls-key"), "{err:#}");
        assert!(serve(&[]).server_tls().unwrap().is_none());
        let err = serve(&["--metrics-tls", "off"]).server_tls().unwrap_err();
        assert!(err.to_string().contains("--metrics-tls needs --tls-cert"), "{err}");
        assert!(Cli::try_parse_from(["narsil", "serve", "--tls-cert", path]).is_err(), "needs --tls-key");
    }

    #[test]
    fn tls_connections_age_an_hour_with_30_s_of_grace_unless_told_otherwise() {
        let secs = Duration::from_secs;
        let age = |max: u64, grace: u64| Some(ConnectionAge { max: secs(max), grace: secs(grace) });
        assert_eq!(serve(&[]).connection_age(), age(3600, 30));
        let tls = ["--tls-cert", "c.pem", "--tls-key", "k.pem"];
        let given = |flags: &[&str]| serve(&[&tls[..], flags].concat()).connection_age();
        assert_eq!(given(&["--tls-max-connection-age-secs", "60"]), age(60, 30));
        assert_eq!(given(&["--tls-connection-age-grace-secs", "0"]), age(3600, 0));
        assert_eq!(given(&["--tls-max-connection-age-secs", "0"]), None);
        for refused in [
            vec!["--tls-max-connection-age-secs", "60"],
            [&tls[..], &["--tls-max-connection-age-secs", "99999999999"]].concat(),
        ] {
            let err = Cli::try_parse_from([&["narsil", "serve"], &refused[..]].concat()).err();
            let err = err.map(|e| e.to_string()).unwrap_or_default();
            assert!(
                err.contains("--tls-max-connection-age-secs") || err.contains("--tls-cert"),
                "{refused:?}: {err}"
            );
        }
    }

    #[test]
    fn negative_timeout_is_rejected() {
        let err = serve(&["--batch-timeout-ms=-1"]).engine_config().unwrap_err();
        assert!(err.to_string().contains("--batch-timeout-ms"), "{err}");
    }

    #[test]
    fn request_level_forms_repeat_or_share_one_value_and_a_repository_takes_model_forms_only() {
        let repo = tempfile::tempdir().unwrap();
        let repo_flag = repo.path().to_str().unwrap();
        let forms = ["--request-level", "dlrm:cat_0,dense", "--request-level", "other:none"];
        let by_model = |args: &[&str]| {
            let args = serve(&[&["--model-repository", repo_flag], args].concat());
            args.repository(args.engine_config().unwrap()).map(|r| r.unwrap().repository.request_level)
        };
        let repeated = by_model(&forms).unwrap();
        assert_eq!(repeated["dlrm"], ["cat_0", "dense"]);
        assert_eq!(repeated["other"], ["none"]);
        assert_eq!(by_model(&["--request-level", "dlrm:cat_0,dense;other:none"]).unwrap(), repeated);
        assert!(by_model(&[]).unwrap().is_empty());
        let err = by_model(&["--request-level", "cat_0,dense"]).unwrap_err().to_string();
        assert!(err.contains("names no model") && err.contains("MODEL:cat_0,dense"), "{err}");
        assert!(Cli::try_parse_from(["narsil", "serve", "--request-level", "dlrm:"]).is_err(), "no names");
        let engine = serve(&["--request-level", "cat_0"]).engine_config().unwrap();
        assert_eq!(engine.request_level, None, "a --model server's is set once its model is known");
    }
}
