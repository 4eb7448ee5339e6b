//! `narsil load`'s flags ([`LoadArgs`]) and the wire protocol it speaks
//! ([`Protocol`]).

use super::ids::{IdDistribution, IdDistributions};
use super::{ranking, tls};

/// Which wire protocol the load speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Protocol {
    /// `narsil.v1.Predictor` (sample-major, with server-side timings).
    Narsil,
    /// TorchRec's `predictor.Predictor` (key-major bytes).
    Torchrec,
    /// The Open Inference Protocol (KServe v2 `ModelInfer`, raw contents).
    Kserve,
}

/// `narsil load` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct LoadArgs {
    /// Server address (`https://`: over TLS, with --tls-ca).
    #[arg(long, env = "NARSIL_LOAD_ADDR", default_value = "http://127.0.0.1:50051")]
    pub addr: String,
    /// narsil.v1: the model to load (empty: the server's default model).
    #[arg(long, env = "NARSIL_LOAD_MODEL", default_value = "")]
    pub model: String,
    /// Closed loop: callers each keeping one request in flight.
    #[arg(long, env = "NARSIL_LOAD_CONCURRENCY", default_value_t = 1)]
    pub concurrency: usize,
    /// Open loop: requests started per second (overrides --concurrency).
    #[arg(long, env = "NARSIL_LOAD_RATE")]
    pub rate: Option<f64>,
    /// Measured requests (after warm-up). Ignored when --duration is set.
    #[arg(long, env = "NARSIL_LOAD_REQUESTS", default_value_t = 1000)]
    pub requests: u64,
    /// Measure for this many seconds instead of a request count.
    #[arg(long, env = "NARSIL_LOAD_DURATION")]
    pub duration: Option<f64>,
    /// Requests sent before measuring (not counted).
    #[arg(long, env = "NARSIL_LOAD_WARMUP", default_value_t = 100)]
    pub warmup: u64,
    /// Samples per request (the wire's `batch_size`). `--batch-size` is an
    /// older name for it.
    #[arg(long, alias = "batch-size", env = "NARSIL_LOAD_SAMPLES_PER_REQUEST", default_value_t = 100)]
    pub samples_per_request: usize,
    /// Ids per (sample, feature) bag; above 1, bag sizes vary in [0, 2N-1]
    /// (multi-hot). With --candidates: the candidate features' bags.
    #[arg(long, env = "NARSIL_LOAD_IDS_PER_FEATURE", default_value_t = 1)]
    pub ids_per_feature: u32,
    /// Which ids are sent: `uniform`, or `zipf:ALPHA` (skewed traffic: rank
    /// r drawn with probability proportional to 1/(r+1)^ALPHA, hot ids
    /// scattered over the table); one for every feature, or one per feature,
    /// comma-separated. Draws are seeded by --seed; which ids are hot is
    /// the same for every seed. Default: `uniform`, or `zipf:1.05` with
    /// --candidates.
    #[arg(long, env = "NARSIL_LOAD_ID_DISTRIBUTION")]
    pub id_distribution: Option<IdDistributions>,
    /// Ranking workload: each request is one user and this many candidate
    /// rows (overrides --samples-per-request), in the form --ranking-form
    /// says. 0: independent samples.
    #[arg(long, env = "NARSIL_LOAD_CANDIDATES", default_value_t = 0)]
    pub candidates: usize,
    /// --candidates: `grouped` sends the user's request-level features once
    /// per request (narsil.v1's `request` block), the rows only the
    /// candidate features; `flat` repeats them on every row. Both forms are
    /// built from the same draws. Default: grouped over narsil.v1 to a model
    /// that declares request-level features (ModelInfo), else flat; the
    /// TorchRec protocol and KServe take flat only.
    #[arg(long, env = "NARSIL_LOAD_RANKING_FORM", value_enum)]
    pub ranking_form: Option<ranking::RankingForm>,
    /// --ranking-form grouped: first send up to this many of the prebuilt
    /// requests flat (default 200 when the flag has no value), then compare
    /// every grouped answer of the run with its flat twin's scores; the
    /// report gives the largest difference (`max_abs_diff_vs_flat`).
    #[arg(long, env = "NARSIL_LOAD_COMPARE_FLAT", value_name = "REQUESTS", num_args = 0..=1,
          default_missing_value = "200")]
    pub compare_flat: Option<usize>,
    /// --candidates: users, drawn per request by Zipf (--user-zipf); a
    /// user's request-level features are a function of its id.
    #[arg(long, env = "NARSIL_LOAD_USERS", default_value_t = 100_000)]
    pub users: u64,
    /// --candidates: Zipf exponent of the users' popularity (users recur).
    #[arg(long, env = "NARSIL_LOAD_USER_ZIPF", default_value_t = 1.05)]
    pub user_zipf: f64,
    /// --candidates: the request-level (user) sparse features are the first
    /// K of the model's schema (default: half of them, rounded down), or
    /// those the model declares request-level when it declares any (K must
    /// then count them); all dense features are the user's, the other
    /// sparse features the candidates' own.
    #[arg(long, env = "NARSIL_LOAD_REQUEST_FEATURES")]
    pub request_features: Option<usize>,
    /// --candidates: ids in each request-level bag: `N`, or `MIN-MAX`
    /// (uniform, drawn per user and feature).
    #[arg(long, env = "NARSIL_LOAD_USER_BAG_IDS", default_value = "20")]
    pub user_bag_ids: ranking::BagLength,
    /// --candidates, models with sequence features: positions in a user's
    /// history (each sequence, its channels aligned): `N`, or `MIN-MAX`
    /// (uniform, drawn per user and sequence); by default uniform from
    /// half the sequence's max_len to its max_len. Its ids are drawn per
    /// --id-distribution from each channel's table.
    #[arg(long, env = "NARSIL_LOAD_HISTORY_LEN")]
    pub history_len: Option<ranking::BagLength>,
    /// --candidates, models with raw integer inputs: the raw features that
    /// carry times (a history's increasing timestamps, a candidate's query
    /// time), comma-separated; by default those whose name contains `time`
    /// but not `watch`. Other raw inputs get small values in [0, 256).
    #[arg(long, env = "NARSIL_LOAD_RAW_TIMES", value_delimiter = ',')]
    pub raw_times: Option<Vec<String>>,
    /// The unit of those times: `s` (epoch seconds) or `ms` (epoch
    /// milliseconds, as KuaiRand's).
    #[arg(long, env = "NARSIL_LOAD_RAW_TIME_UNIT", value_enum, default_value_t = TimeUnit::S)]
    pub raw_time_unit: TimeUnit,
    /// Distinct prebuilt requests cycled through.
    #[arg(long, env = "NARSIL_LOAD_DISTINCT_REQUESTS", default_value_t = 64)]
    pub distinct_requests: usize,
    /// HTTP/2 connections shared round-robin by the callers.
    #[arg(long, env = "NARSIL_LOAD_CONNECTIONS", default_value_t = 1)]
    pub connections: usize,
    /// Per-request deadline sent as grpc-timeout, milliseconds.
    #[arg(long, env = "NARSIL_LOAD_TIMEOUT_MS")]
    pub timeout_ms: Option<u64>,
    /// Open loop: most requests in flight; beyond it a scheduled request is
    /// counted as `client_overflow` and not sent.
    #[arg(long, env = "NARSIL_LOAD_MAX_IN_FLIGHT", default_value_t = 10_000)]
    pub max_in_flight: usize,
    /// Seed for the generated requests.
    #[arg(long, env = "NARSIL_LOAD_SEED", default_value_t = 7)]
    pub seed: u64,
    /// Also write every id of the prebuilt requests to this file, one
    /// `FEATURE ID` line each: a log of the traffic, for `narsil tables
    /// order --id-log` (raw integer inputs' values are no ids: skipped).
    #[arg(long, env = "NARSIL_LOAD_ID_LOG")]
    pub id_log: Option<std::path::PathBuf>,
    /// Print one JSON object instead of the text report.
    #[arg(long, env = "NARSIL_LOAD_JSON")]
    pub json: bool,
    /// Exit 0 even when measured requests failed (the report still counts
    /// them by status code): for runs whose failures are what they measure
    /// (overload, deadlines, restarts). Without it a run in which any
    /// measured request failed exits 1, saying how many.
    #[arg(long, env = "NARSIL_LOAD_ALLOW_FAILURES")]
    pub allow_failures: bool,
    /// Wire protocol.
    #[arg(long, env = "NARSIL_LOAD_PROTOCOL", value_enum, default_value_t = Protocol::Narsil)]
    pub protocol: Protocol,
    /// `--protocol torchrec`: dense features per sample.
    #[arg(long, default_value_t = 13)]
    pub num_dense: u32,
    /// `--protocol torchrec`: sparse features per sample.
    #[arg(long, default_value_t = 26)]
    pub num_sparse: u32,
    /// `--protocol torchrec`: how many of the sparse features, the last
    /// ones, are weighted (sent in `id_score_list_features` with a weight
    /// per id, as TorchRec's signature takes them).
    #[arg(long, default_value_t = 0)]
    pub weighted_features: u32,
    /// `--protocol torchrec` and `kserve`: rows of every table (ids are
    /// drawn below it).
    #[arg(long, default_value_t = 100_000)]
    pub table_rows: u64,
    /// TLS to the server.
    #[command(flatten)]
    pub tls: tls::ClientTlsArgs,
}

impl LoadArgs {
    /// Which raw inputs carry times (--raw-times, --raw-time-unit).
    pub fn raw_times(&self) -> super::raw::RawTimes {
        super::raw::RawTimes {
            names: self.raw_times.clone(),
            milliseconds: self.raw_time_unit == TimeUnit::Ms,
        }
    }

    /// Rows per request: --candidates when set, else --samples-per-request.
    pub fn rows_per_request(&self) -> usize {
        if self.candidates > 0 {
            self.candidates
        } else {
            self.samples_per_request
        }
    }

    /// --id-distribution, or its default for the workload.
    pub fn id_distributions(&self) -> IdDistributions {
        self.id_distribution.clone().unwrap_or_else(|| {
            let default =
                if self.candidates > 0 { IdDistribution::Zipf(1.05) } else { IdDistribution::Uniform };
            IdDistributions(vec![default])
        })
    }
}

/// The unit `narsil load` sends raw times in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TimeUnit {
    /// Epoch seconds.
    S,
    /// Epoch milliseconds.
    Ms,
}
