//! The serving process: bind, start the models (one fixed `--model`, or a
//! repository and its watcher), report health, serve the three protocols
//! until asked to stop, then drain.
//!
//! The admin address (`--metrics-addr`) serves metrics, `/healthz` and the
//! model calls over HTTP until the drain is over; the calls that change what
//! is served need the `--control-token-file` token, and without one a
//! repository server refuses to open them on a non-loopback address. Both
//! listeners serve plaintext, or TLS and mutual TLS with certificates
//! reloaded when their files change and connections that end with their
//! age ([`tls`]).
//!
//! Health ([`health`]: `grpc.health.v1`, and `/healthz`) says NOT_SERVING
//! until every model that should serve has a warm version, then follows
//! their backends (NOT_SERVING after `--unhealthy-after-failures` failed or
//! stalled forwards in a row, a batch abandoned while a table store stalled
//! it counting as failed, SERVING again after a successful one; and
//! NOT_SERVING while a split model's table store does not answer, whatever
//! the count: a Redis Cluster's masters silent, or the `disk` store's probe
//! read of a table file failing or slower than 1 s); each model also has
//! its own status under its name. When a stop is asked for ([`drain`]),
//! health turns NOT_SERVING for good at once; calls are still accepted for
//! `--drain-grace-secs`; then the listener closes, every call in flight is
//! answered, and the models stop.

pub mod admin_http;
pub mod bound;
pub mod drain;
pub mod health;
mod run;
pub mod signal;
pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use narsil_core::BackendFactory;
use narsil_engine::{Engine, EngineConfig, EngineHandle, MemoryBudget};
use tokio::net::{TcpListener, TcpSocket};

use self::tls::ServerTls;
use crate::lifecycle::control::ModelControl;
use crate::lifecycle::control_token::ControlToken;
use crate::lifecycle::watcher::{Repository, Watcher};
use crate::lifecycle::ModelRegistry;

/// Where and how the server listens.
#[derive(Debug, Clone, Copy)]
pub struct Listen {
    /// gRPC address.
    pub addr: SocketAddr,
    /// Prometheus (and model control) address, if any.
    pub metrics_addr: Option<SocketAddr>,
    /// Largest gRPC message accepted, bytes.
    pub max_message_bytes: usize,
}

/// A model repository to serve, and how it is watched.
#[derive(Clone)]
pub struct RepositoryServe {
    /// The repository and how its versions are served.
    pub repository: Repository,
    /// The model requests naming none go to (default: the only model).
    pub default_model: Option<String>,
    /// How often the repository is rescanned; none: only on SIGHUP and
    /// control calls.
    pub poll: Option<Duration>,
    /// Whether the load/unload control calls are on.
    pub control: bool,
    /// The token the control calls must present; none: open, which only a
    /// loopback admin address allows.
    pub control_token: Option<Arc<ControlToken>>,
}

/// What the server serves.
enum Served {
    /// One fixed `--model`, whose engine started with the server; if it
    /// fails to load, the server stops.
    Fixed(EngineHandle),
    /// A repository, whose versions the watcher loads and switches.
    Repository {
        watcher: Box<Watcher>,
        poll: Option<Duration>,
        control: bool,
        control_token: Option<Arc<ControlToken>>,
    },
}

/// Bound listeners and started models, ready to serve.
pub struct Server {
    listener: TcpListener,
    metrics_listener: Option<TcpListener>,
    models: Arc<ModelRegistry>,
    served: Served,
    max_message_bytes: usize,
    /// The bound on request memory every engine shares.
    memory: MemoryBudget,
    drain_grace: Duration,
    /// TLS on the listeners; none: plaintext (h2c, HTTP/1.1).
    tls: Option<ServerTls>,
}

/// Whether `addr` is a loopback address (IPv4-mapped IPv6 ones included).
pub fn is_loopback(addr: SocketAddr) -> bool {
    addr.ip().to_canonical().is_loopback()
}

/// The risk of model control's token on the admin address `admin`, if it
/// crosses the network in clear: a token, plain HTTP, and an address
/// other hosts reach.
fn token_in_clear(control: &ModelControl, admin: SocketAddr, plain: bool) -> Option<String> {
    (control.enabled && control.token.is_some() && plain && !is_loopback(admin)).then(|| {
        format!(
            "model control's token crosses the network in clear: --metrics-addr {admin} is not a loopback \
             address and speaks plain HTTP, so anyone who can watch its traffic can read the token and \
             load, unload and push ids; serve it over TLS (--tls-cert and --tls-key, without \
             --metrics-tls off) or keep it on a loopback address"
        )
    })
}

/// Why model control without a token may not listen on `admin`.
pub fn open_control_refused(admin: SocketAddr) -> String {
    format!(
        "--model-control on --metrics-addr {admin}, which is not a loopback address, needs \
         --control-token-file (NARSIL_CONTROL_TOKEN_FILE): a file holding the token the control \
         calls must present as `Authorization: Bearer <token>` (docs/guide/security.md)"
    )
}

/// Connections the kernel queues for a listener before the accept loop
/// takes them (capped by `net.core.somaxconn`, 4096 on current kernels):
/// a burst of connects, a flood's included, is queued rather than answered
/// with a dropped SYN and a client's 1 s retransmission.
const ACCEPT_BACKLOG: u32 = 4096;

async fn bind(addr: SocketAddr, what: &str) -> anyhow::Result<TcpListener> {
    let listen = || {
        let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        socket.listen(ACCEPT_BACKLOG)
    };
    listen().with_context(|| format!("cannot listen on {addr} ({what})"))
}

async fn bind_all(listen: Listen) -> anyhow::Result<(TcpListener, Option<TcpListener>)> {
    let listener = bind(listen.addr, "--addr").await?;
    let metrics_listener = match listen.metrics_addr {
        Some(addr) => Some(bind(addr, "--metrics-addr").await?),
        None => None,
    };
    Ok((listener, metrics_listener))
}

impl Server {
    /// Binds the addresses and starts the engine over `factory`: a
    /// repository of one model and one version. Lanes load in the
    /// background; health turns SERVING once they are warm.
    pub async fn start(
        listen: Listen,
        factory: Arc<dyn BackendFactory>,
        config: EngineConfig,
    ) -> anyhow::Result<Self> {
        let (listener, metrics_listener) = bind_all(listen).await?;
        let name = factory.schema().name.clone();
        let memory = config.memory.clone();
        let engine = Engine::start(factory, config)?;
        let handle = engine.handle();
        let models = ModelRegistry::new(Some(name.clone()));
        models.install(&name, 0, engine);
        Ok(Self {
            listener,
            metrics_listener,
            models,
            served: Served::Fixed(handle),
            max_message_bytes: listen.max_message_bytes,
            memory,
            drain_grace: Duration::ZERO,
            tls: None,
        })
    }

    /// Binds the addresses and serves the models of a repository. Versions
    /// load in the background once [`Server::run`] starts; health turns
    /// SERVING once every model has a warm version.
    pub async fn start_repository(listen: Listen, repository: RepositoryServe) -> anyhow::Result<Self> {
        let source = &repository.repository.source;
        let found = source.scan().with_context(|| {
            format!("cannot read the model repository {} (--model-repository)", source.describe())
        })?;
        let names: Vec<&String> = found.keys().collect();
        let default_model = match repository.default_model {
            Some(name) if found.contains_key(&name) => Some(name),
            Some(name) => anyhow::bail!(
                "--default-model {name:?} is not a model of {}; it holds {names:?}",
                source.describe()
            ),
            None if names.len() == 1 => Some(names[0].clone()),
            None => {
                tracing::info!(models = ?names, "no --default-model: requests must name their model");
                None
            }
        };
        let (listener, metrics_listener) = bind_all(listen).await?;
        if let Some(admin) = metrics_listener.as_ref().and_then(|l| l.local_addr().ok()) {
            if repository.control && repository.control_token.is_none() && !is_loopback(admin) {
                anyhow::bail!("{}", open_control_refused(admin));
            }
        }
        let models = ModelRegistry::new(default_model);
        let memory = repository.repository.engine.memory.clone();
        let watcher = Box::new(Watcher::new(repository.repository, Arc::clone(&models)));
        Ok(Self {
            listener,
            metrics_listener,
            models,
            served: Served::Repository {
                watcher,
                poll: repository.poll,
                control: repository.control,
                control_token: repository.control_token,
            },
            max_message_bytes: listen.max_message_bytes,
            memory,
            drain_grace: Duration::ZERO,
            tls: None,
        })
    }

    /// After a stop is asked for, health turns NOT_SERVING at once, but
    /// calls are still accepted and served for `grace` before the listener
    /// closes and the drain begins, so that load balancers stop sending first.
    pub fn with_drain_grace(mut self, grace: Duration) -> Self {
        self.drain_grace = grace;
        self
    }

    /// Serves gRPC, and the admin address as [`ServerTls::admin`] says,
    /// over TLS ([`tls`]: a certificate, and a client CA for mutual TLS)
    /// instead of plaintext.
    pub fn with_tls(mut self, tls: ServerTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// The gRPC address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("bound listener has an address")
    }

    /// The metrics address actually bound, if metrics are served.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_listener.as_ref().map(|l| l.local_addr().expect("bound listener has an address"))
    }

    /// Every bound listener by name ([`bound`]): `grpc`, and `metrics` if
    /// metrics are served.
    pub fn bound_addresses(&self) -> Vec<(&'static str, SocketAddr)> {
        let metrics = self.metrics_addr().map(|addr| (bound::METRICS, addr));
        std::iter::once((bound::GRPC, self.local_addr())).chain(metrics).collect()
    }

    /// The engine of a server of one fixed model (schema, readiness,
    /// counters); none for a repository.
    pub fn engine(&self) -> Option<EngineHandle> {
        match &self.served {
            Served::Fixed(handle) => Some(handle.clone()),
            Served::Repository { .. } => None,
        }
    }

    /// The served models.
    pub fn models(&self) -> Arc<ModelRegistry> {
        Arc::clone(&self.models)
    }
}
