//! `narsil load`: a low-overhead load generator for Narsil's Predict.
//!
//! Closed loop (`--concurrency N`): N callers, each sending its next request
//! when the previous one is answered. Open loop (`--rate R`): requests start
//! on a fixed schedule whatever the server does, and latency is measured
//! from each request's scheduled start, so a stalled server cannot hide its
//! queueing (no coordinated omission).
//!
//! Requests are built once, before the run, from the server's ModelInfo
//! (random valid ids), so the client spends its CPU on sending, not building.
//! `--protocol torchrec` speaks TorchRec's inference protocol instead (to
//! Narsil or to TorchRec's own servers); that protocol has no ModelInfo, so
//! the model's shape comes from `--num-dense`, `--num-sparse` and
//! `--table-rows`. `--protocol kserve` speaks the Open Inference Protocol
//! (KServe v2), reading the shape from ModelMetadata and ids below
//! `--table-rows`.
//!
//! `--candidates N` sends the ranking workload instead ([`ranking`]): one
//! user and N candidate rows a request, the user's request-level features
//! sent once in the request's request-level block (`--ranking-form grouped`,
//! narsil.v1) or repeated on every row (`flat`, every protocol).
//! `--compare-flat` also sends a grouped run's requests flat, once each
//! before the measured phase, and compares every grouped answer with its
//! flat twin's scores (`max_abs_diff_vs_flat`).
//!
//! It speaks TLS to servers that do ([`tls`]: `--tls-ca`, and a client
//! certificate for mutual TLS).

pub mod ids;
pub mod ranking;
pub mod report;
pub mod tls;
pub mod workload;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tonic::transport::Channel;

use self::ids::{IdDistribution, IdDistributions};
use crate::kserve_proto::grpc_inference_service_client::GrpcInferenceServiceClient as KServeClient;
use crate::kserve_proto::{ModelInferRequest, ModelMetadataRequest};
use crate::proto::predictor_client::PredictorClient;
use crate::proto::{ModelInfoRequest, ModelInfoResponse, PredictRequest, PredictResponse, SparseFeature};
use crate::torchrec_proto::predictor_client::PredictorClient as TorchRecClient;
use crate::torchrec_proto::PredictionRequest;
use report::{Recorder, Report};

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
    /// order --id-log`.
    #[arg(long, env = "NARSIL_LOAD_ID_LOG")]
    pub id_log: Option<std::path::PathBuf>,
    /// Print one JSON object instead of the text report.
    #[arg(long, env = "NARSIL_LOAD_JSON")]
    pub json: bool,
    /// Wire protocol.
    #[arg(long, env = "NARSIL_LOAD_PROTOCOL", value_enum, default_value_t = Protocol::Narsil)]
    pub protocol: Protocol,
    /// `--protocol torchrec`: dense features per sample.
    #[arg(long, default_value_t = 13)]
    pub num_dense: u32,
    /// `--protocol torchrec`: sparse features per sample.
    #[arg(long, default_value_t = 26)]
    pub num_sparse: u32,
    /// `--protocol torchrec` and `kserve`: rows of every table (ids are
    /// drawn below it).
    #[arg(long, default_value_t = 100_000)]
    pub table_rows: u64,
    /// TLS to the server.
    #[command(flatten)]
    pub tls: tls::ClientTlsArgs,
}

impl LoadArgs {
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

/// One connection, in the protocol of the run.
#[derive(Clone)]
enum Client {
    Narsil(PredictorClient<Channel>),
    TorchRec(TorchRecClient<Channel>),
    KServe(KServeClient<Channel>),
}

/// One prebuilt request, with its flat twin's scores when --compare-flat
/// fetched them.
struct Prebuilt {
    message: Message,
    flat_scores: Option<Vec<f32>>,
}

/// One prebuilt request, in the protocol of the run.
enum Message {
    Narsil(Box<PredictRequest>),
    TorchRec(Box<PredictionRequest>),
    KServe(Box<ModelInferRequest>),
}

impl Client {
    /// Sends `message`; TorchRec answers become a `PredictResponse` with
    /// the scores only (that protocol reports no server-side timings).
    async fn call(
        &mut self,
        message: &Message,
        timeout_ms: Option<u64>,
    ) -> Result<PredictResponse, tonic::Status> {
        match (self, message) {
            (Client::Narsil(client), Message::Narsil(m)) => {
                Ok(client.predict(with_timeout(m.as_ref().clone(), timeout_ms)).await?.into_inner())
            }
            (Client::TorchRec(client), Message::TorchRec(m)) => {
                let mut response =
                    client.predict(with_timeout(m.as_ref().clone(), timeout_ms)).await?.into_inner();
                // A multi-output model's scores are counted by any output.
                let default = response.predictions.remove(crate::wire::torchrec::SCORES_KEY);
                let scores = default
                    .or_else(|| response.predictions.into_values().next())
                    .map(|v| v.data)
                    .ok_or_else(|| tonic::Status::internal("response has no predictions"))?;
                Ok(PredictResponse { scores, ..Default::default() })
            }
            (Client::KServe(client), Message::KServe(m)) => {
                let response =
                    client.model_infer(with_timeout(m.as_ref().clone(), timeout_ms)).await?.into_inner();
                let scores = crate::wire::kserve::first_scores(&response)
                    .ok_or_else(|| tonic::Status::internal("response has no outputs"))?;
                Ok(PredictResponse { scores, ..Default::default() })
            }
            _ => unreachable!("clients and messages are built for one protocol"),
        }
    }
}

impl Message {
    /// Its protobuf-encoded size: the bytes the request takes on the wire
    /// (before gRPC's 5-byte frame and HTTP/2's).
    fn encoded_len(&self) -> usize {
        match self {
            Message::Narsil(m) => prost::Message::encoded_len(m.as_ref()),
            Message::TorchRec(m) => prost::Message::encoded_len(m.as_ref()),
            Message::KServe(m) => prost::Message::encoded_len(m.as_ref()),
        }
    }
}

/// Runs the load described by `args` and prints the report.
pub async fn run(args: LoadArgs) -> anyhow::Result<()> {
    let report = drive(&args).await?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.text());
    }
    Ok(())
}

/// Runs the load and returns the report (used by `run` and by tests).
pub async fn drive(args: &LoadArgs) -> anyhow::Result<Report> {
    if args.concurrency == 0 || args.connections == 0 || args.rows_per_request() == 0 {
        anyhow::bail!("--concurrency, --connections and --samples-per-request must be at least 1");
    }
    if let Some(rate) = args.rate {
        if !(rate.is_finite() && rate > 0.0) {
            anyhow::bail!("--rate must be a positive number, got {rate}");
        }
    }
    let clients = connect(args).await?;
    let info = match &clients[0] {
        Client::Narsil(client) => client
            .clone()
            .model_info(ModelInfoRequest { model: args.model.clone() })
            .await
            .context("ModelInfo failed")?
            .into_inner(),
        Client::KServe(client) => {
            let request = ModelMetadataRequest { name: args.model.clone(), version: String::new() };
            let metadata =
                client.clone().model_metadata(request).await.context("ModelMetadata failed")?.into_inner();
            let width = |name: &str| {
                metadata
                    .inputs
                    .iter()
                    .find(|t| t.name == name)
                    .and_then(|t| t.shape.get(1).copied())
                    .unwrap_or(0)
            };
            let (dense, sparse) = (width(crate::wire::kserve::DENSE), width(crate::wire::kserve::LENGTHS));
            shaped_info(&metadata.name, &metadata.platform, dense as u32, sparse as u32, args.table_rows)
        }
        Client::TorchRec(_) => {
            shaped_info("torchrec", "torchrec-protocol", args.num_dense, args.num_sparse, args.table_rows)
        }
    };
    let form = ranking::form(args, &info)?;
    let requests = workload::build_pool(&info, args)?;
    if let Some(path) = &args.id_log {
        workload::write_id_log(path, &info, &requests)?;
    }
    let pool: Vec<Message> = match args.protocol {
        Protocol::Narsil => requests.into_iter().map(|r| Message::Narsil(Box::new(r))).collect(),
        Protocol::Torchrec => requests
            .iter()
            .map(|r| {
                Message::TorchRec(Box::new(crate::wire::torchrec::encode(r, info.sparse_features.len())))
            })
            .collect(),
        Protocol::Kserve => requests
            .iter()
            .map(|r| {
                let encoded =
                    crate::wire::kserve::encode(r, info.num_dense as usize, info.sparse_features.len());
                Message::KServe(Box::new(encoded))
            })
            .collect(),
    };
    let request_bytes_mean =
        pool.iter().map(|m| m.encoded_len() as f64).sum::<f64>() / pool.len().max(1) as f64;
    let flat_scores = match args.compare_flat {
        Some(count) => flat_twin_scores(args, &info, &clients[0], count.min(pool.len())).await?,
        None => Vec::new(),
    };
    let flat_reference_requests = flat_scores.len();
    let mut flat_scores = flat_scores.into_iter();
    let pool: Vec<Prebuilt> =
        pool.into_iter().map(|message| Prebuilt { message, flat_scores: flat_scores.next() }).collect();
    let pool = Arc::new(pool);
    let warmup = Phase { requests: Some(args.warmup), duration: None };
    let measured = Phase {
        requests: if args.duration.is_some() { None } else { Some(args.requests) },
        duration: args.duration.map(Duration::from_secs_f64),
    };
    if args.warmup > 0 {
        run_phase(args, &clients, &pool, warmup).await;
    }
    let (recorder, elapsed) = run_phase(args, &clients, &pool, measured).await;
    let mut report = Report::new(args, &info, form, recorder, elapsed, request_bytes_mean);
    report.flat_reference_requests = flat_reference_requests;
    Ok(report)
}

/// --compare-flat: the scores of the first `count` prebuilt requests sent
/// flat (their twins, built from the same draws), one at a time.
async fn flat_twin_scores(
    args: &LoadArgs,
    info: &ModelInfoResponse,
    client: &Client,
    count: usize,
) -> anyhow::Result<Vec<Vec<f32>>> {
    let twins = workload::build_flat_twins(info, args)?;
    let mut scores = Vec::with_capacity(count);
    for (index, twin) in twins.into_iter().take(count).enumerate() {
        let response = client
            .clone()
            .call(&Message::Narsil(Box::new(twin)), args.timeout_ms)
            .await
            .with_context(|| format!("--compare-flat: the flat twin of request {index} failed"))?;
        anyhow::ensure!(
            response.scores.len() == args.candidates,
            "--compare-flat: the flat twin of request {index} got {} scores for {} candidates",
            response.scores.len(),
            args.candidates
        );
        scores.push(response.scores);
    }
    Ok(scores)
}

/// A model of `num_sparse` unweighted features `cat_i` of `table_rows` ids,
/// for protocols whose metadata does not give table sizes.
fn shaped_info(
    name: &str,
    backend: &str,
    num_dense: u32,
    num_sparse: u32,
    table_rows: u64,
) -> ModelInfoResponse {
    ModelInfoResponse {
        name: name.into(),
        backend: backend.into(),
        num_dense,
        sparse_features: (0..num_sparse)
            .map(|i| SparseFeature {
                name: format!("cat_{i}"),
                num_rows: table_rows,
                weighted: false,
                request_level: false,
                raw_ids: false,
            })
            .collect(),
        ..Default::default()
    }
}

async fn connect(args: &LoadArgs) -> anyhow::Result<Vec<Client>> {
    let mut clients = Vec::with_capacity(args.connections);
    let endpoint = args.tls.endpoint(&args.addr)?.tcp_nodelay(true);
    for _ in 0..args.connections {
        let channel = endpoint
            .clone()
            .connect()
            .await
            .map_err(|e| anyhow::anyhow!("cannot connect to {}: {}", args.addr, tls::causes(&e)))?;
        clients.push(match args.protocol {
            Protocol::Narsil => Client::Narsil(
                PredictorClient::new(channel)
                    .max_decoding_message_size(usize::MAX)
                    .max_encoding_message_size(usize::MAX),
            ),
            Protocol::Torchrec => Client::TorchRec(
                TorchRecClient::new(channel)
                    .max_decoding_message_size(usize::MAX)
                    .max_encoding_message_size(usize::MAX),
            ),
            Protocol::Kserve => Client::KServe(
                KServeClient::new(channel)
                    .max_decoding_message_size(usize::MAX)
                    .max_encoding_message_size(usize::MAX),
            ),
        });
    }
    Ok(clients)
}

#[derive(Debug, Clone, Copy)]
struct Phase {
    requests: Option<u64>,
    duration: Option<Duration>,
}

/// Issues request numbers until the phase's count or time is used up.
struct Issuer {
    phase: Phase,
    issued: AtomicU64,
    start: Instant,
}

impl Issuer {
    fn next(&self) -> Option<u64> {
        if self.phase.duration.is_some_and(|d| self.start.elapsed() >= d) {
            return None;
        }
        let n = self.issued.fetch_add(1, Ordering::Relaxed);
        self.phase.requests.is_none_or(|limit| n < limit).then_some(n)
    }
}

async fn run_phase(
    args: &LoadArgs,
    clients: &[Client],
    pool: &Arc<Vec<Prebuilt>>,
    phase: Phase,
) -> (Recorder, Duration) {
    let issuer = Arc::new(Issuer { phase, issued: AtomicU64::new(0), start: Instant::now() });
    let recorder = match args.rate {
        None => closed_loop(args, clients, pool, &issuer).await,
        Some(rate) => open_loop(args, clients, pool, &issuer, rate).await,
    };
    (recorder, issuer.start.elapsed())
}

fn with_timeout<T>(message: T, timeout_ms: Option<u64>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(ms) = timeout_ms {
        request.set_timeout(Duration::from_millis(ms));
    }
    request
}

async fn closed_loop(
    args: &LoadArgs,
    clients: &[Client],
    pool: &Arc<Vec<Prebuilt>>,
    issuer: &Arc<Issuer>,
) -> Recorder {
    let callers: Vec<_> = (0..args.concurrency)
        .map(|caller| {
            let mut client = clients[caller % clients.len()].clone();
            let pool = Arc::clone(pool);
            let issuer = Arc::clone(issuer);
            let timeout_ms = args.timeout_ms;
            tokio::spawn(async move {
                let mut recorder = Recorder::default();
                while let Some(n) = issuer.next() {
                    let prebuilt = &pool[n as usize % pool.len()];
                    let start = Instant::now();
                    let result = client.call(&prebuilt.message, timeout_ms).await;
                    let latency = start.elapsed();
                    if let (Ok(response), Some(flat)) = (&result, &prebuilt.flat_scores) {
                        recorder.compare_with_flat(&response.scores, flat);
                    }
                    recorder.record(latency, result);
                }
                recorder
            })
        })
        .collect();
    let mut total = Recorder::default();
    for caller in callers {
        if let Ok(recorder) = caller.await {
            total.merge(recorder);
        }
    }
    total
}

async fn open_loop(
    args: &LoadArgs,
    clients: &[Client],
    pool: &Arc<Vec<Prebuilt>>,
    issuer: &Arc<Issuer>,
    rate: f64,
) -> Recorder {
    let interval = Duration::from_secs_f64(1.0 / rate);
    let in_flight = Arc::new(tokio::sync::Semaphore::new(args.max_in_flight));
    // Each call reports its latency and outcome; one recorder (one
    // histogram) collects them all.
    let (done_tx, mut done_rx) =
        tokio::sync::mpsc::unbounded_channel::<(Duration, usize, Result<PredictResponse, tonic::Status>)>();
    let mut overflow = 0u64;
    while let Some(n) = issuer.next() {
        let scheduled = issuer.start + interval.mul_f64(n as f64);
        tokio::time::sleep_until(scheduled.into()).await;
        let Ok(permit) = Arc::clone(&in_flight).try_acquire_owned() else {
            overflow += 1;
            continue;
        };
        let mut client = clients[n as usize % clients.len()].clone();
        let pool = Arc::clone(pool);
        let done = done_tx.clone();
        let timeout_ms = args.timeout_ms;
        tokio::spawn(async move {
            let index = n as usize % pool.len();
            let result = client.call(&pool[index].message, timeout_ms).await;
            let _ = done.send((scheduled.elapsed(), index, result));
            drop(permit);
        });
    }
    drop(done_tx);
    let mut total = Recorder::default();
    while let Some((latency, index, result)) = done_rx.recv().await {
        if let (Ok(response), Some(flat)) = (&result, &pool[index].flat_scores) {
            total.compare_with_flat(&response.scores, flat);
        }
        total.record(latency, result);
    }
    total.client_overflow = overflow;
    total
}
