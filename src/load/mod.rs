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
//!
//! Its files, by job: the flags ([`LoadArgs`], `args.rs`), the connections and
//! the prebuilt requests they send (`client.rs`), a phase's callers, closed
//! or open loop (`phase.rs`), the requests built (`workload`, `ranking`,
//! `ids`, `raw`: the values of raw integer inputs), the accounting and the report (`report`), and TLS (`tls`).

mod args;
mod bag_length;
mod client;
pub mod ids;
mod phase;
pub mod ranking;
pub mod raw;
pub mod report;
pub mod tls;
pub mod workload;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

pub use self::args::{LoadArgs, Protocol};
use self::client::{connect, Client, Message, Prebuilt};
use self::phase::{run_phase, Phase};
use crate::kserve_proto::ModelMetadataRequest;
use crate::proto::{ModelInfoRequest, ModelInfoResponse, SparseFeature};
use report::Report;

/// Runs the load described by `args` and prints the report; an error when
/// any measured request failed, unless `--allow-failures`.
pub async fn run(args: LoadArgs) -> anyhow::Result<()> {
    let report = drive(&args).await?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.text());
    }
    match report.failures() {
        Some(failures) if !args.allow_failures => {
            anyhow::bail!("{failures} (--allow-failures exits 0 for runs whose failures are expected)")
        }
        _ => Ok(()),
    }
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
            shaped_info(&metadata.name, &metadata.platform, dense as u32, sparse as u32, 0, args.table_rows)
        }
        Client::TorchRec(_) => {
            anyhow::ensure!(
                args.weighted_features <= args.num_sparse,
                "--weighted-features {} is more than --num-sparse {}",
                args.weighted_features,
                args.num_sparse
            );
            shaped_info(
                "torchrec",
                "torchrec-protocol",
                args.num_dense,
                args.num_sparse,
                args.weighted_features,
                args.table_rows,
            )
        }
    };
    let form = ranking::form(args, &info)?;
    let requests = workload::build_pool(&info, args)?;
    if let Some(path) = &args.id_log {
        workload::write_id_log(path, &info, &requests)?;
    }
    let pool: Vec<Message> = match args.protocol {
        Protocol::Narsil => requests.into_iter().map(|r| Message::Narsil(Box::new(r))).collect(),
        Protocol::Torchrec => {
            let num_sparse = info.sparse_features.len();
            let unweighted = info.sparse_features.iter().filter(|f| !f.weighted).count();
            requests
                .iter()
                .map(|r| {
                    let encoded = crate::wire::torchrec::encode_weighted(r, unweighted, num_sparse);
                    Message::TorchRec(Box::new(encoded))
                })
                .collect()
        }
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

/// A model of `num_sparse` features of `table_rows` ids, the last
/// `weighted` of them weighted (`wcat_i`, the others `cat_i`), for
/// protocols whose metadata does not give table sizes.
fn shaped_info(
    name: &str,
    backend: &str,
    num_dense: u32,
    num_sparse: u32,
    weighted: u32,
    table_rows: u64,
) -> ModelInfoResponse {
    let unweighted = num_sparse.saturating_sub(weighted);
    ModelInfoResponse {
        name: name.into(),
        backend: backend.into(),
        num_dense,
        sparse_features: (0..num_sparse)
            .map(|i| SparseFeature {
                name: if i < unweighted { format!("cat_{i}") } else { format!("wcat_{}", i - unweighted) },
                num_rows: table_rows,
                weighted: i >= unweighted,
                request_level: false,
                raw_ids: false,
                sequence: String::new(),
                raw_input: false,
            })
            .collect(),
        ..Default::default()
    }
}
