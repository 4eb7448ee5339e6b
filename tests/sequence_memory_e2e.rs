//! A sequence model's per-request working set is charged to the memory
//! bound (`--max-queue-bytes`) before the request is queued, on the real
//! binary serving the HSTU and DIN test models (`models/export_hstu.py`,
//! `models/export_din.py`; their split form, its sequence's `working_set`
//! as the exporters declare it).
//!
//! With a 64 MiB bound, flat requests of ever more rows with a maximal
//! history (the model's `max_len` on every row: HSTU's block attention
//! grows with its square on each row), then ranking requests of ever more
//! candidates, then the largest answered flat request four times at once:
//! each is answered (every row scored) or refused, INVALID_ARGUMENT naming
//! `--max-queue-bytes` and `--max-batch-tokens` for one that can never
//! fit, RESOURCE_EXHAUSTED naming `--max-queue-bytes` while the bound is
//! held by others. At least one of each size class is answered and one
//! refused, so the bound was reached. The server's peak resident memory
//! (VmHWM) grows over its idle peak by at most the bound plus
//! `MARGIN_MIB`, and a small request after it all is served.
#![cfg(feature = "torch")]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::memory_mib;
use futures_util::future::join_all;
use narsil::proto::predictor_client::PredictorClient;
use narsil::proto::{self, PredictRequest, RequestFeatures};
use tonic::transport::Channel;
use tonic::Code;

/// The memory bound the servers run with.
const BOUND_MIB: usize = 64;
/// What the server's peak may grow by beyond the bound: the allocator's
/// slack, libtorch's per-thread buffers and the connections' (the
/// declared working sets are upper bounds of what one forward holds at
/// once: 1.1-1.9x the measured peak, `benchmarks/working_set_peak.py`).
const MARGIN_MIB: f64 = 128.0;

/// The exported model `models/generated/NAME`'s split form, copied into
/// `into` with its sequence's working set declared where the export
/// predates the declaration (the exporter's formula, from its manifest).
fn declared_copy(name: &str, into: &Path) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/generated").join(name);
    assert!(dir.join("split/schema.json").is_file(), "no exported model in {}: run scripts/test.sh", dir.display());
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let split = into.join(name);
    link_tree(&dir.join("split"), &split);
    let path = split.join("schema.json");
    std::fs::remove_file(&path).unwrap();
    let mut schema: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("split/schema.json")).unwrap()).unwrap();
    let sequence = &mut schema["sequences"][0];
    if sequence.get("working_set").is_none() {
        sequence["working_set"] = working_set(&manifest);
    }
    std::fs::write(&path, serde_json::to_string(&schema).unwrap()).unwrap();
    split
}

/// What `models/working_sets.py` declares for the model `manifest`
/// describes.
fn working_set(manifest: &serde_json::Value) -> serde_json::Value {
    let n = |key: &str| manifest[key].as_u64().unwrap();
    if manifest["kind"] == "hstu" {
        return serde_json::json!({
            "kind": "block_attention", "block": n("attention_block"), "heads": n("heads"),
            "head_dim": n("head_dim"), "contexts": n("num_user"), "model_dim": n("model_dim"),
        });
    }
    let arch: Vec<u64> = manifest["attention_arch"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    let (history, first, rest) = (2 * n("embedding_dim"), arch[0], arch[1..].iter().sum::<u64>());
    let (width, position_width) = match manifest["dense_attention"].as_str() {
        Some("exact") => (5 * history + 2 * first + 2 * rest + 1, history),
        _ => (2 * history + 3 * first + 2 * rest + 1, history + first),
    };
    serde_json::json!({"kind": "gather", "width": width, "position_width": position_width})
}

/// `from`'s files hard-linked (copied across devices) under `to`.
fn link_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            link_tree(&entry.path(), &target);
        } else if std::fs::hard_link(entry.path(), &target).is_err() {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// Requests to the served model, every sequence at its maximum.
struct Requests {
    info: proto::ModelInfoResponse,
}

impl Requests {
    fn max_len(&self) -> usize {
        self.info.sequences[0].max_len as usize
    }

    /// Feature `f`'s bag for row (or user) `r`: `max_len` positions for a
    /// sequence's channel, else one id.
    fn bag(&self, f: usize, r: usize) -> Vec<i64> {
        let feature = &self.info.sparse_features[f];
        let rows = feature.num_rows as i64;
        let len = if feature.sequence.is_empty() { 1 } else { self.max_len() };
        (0..len).map(|p| ((r * 104_729 + p * 977 + f * 31) as i64) % rows).collect()
    }

    /// `rows` rows, each with its own maximal history.
    fn flat(&self, rows: usize) -> PredictRequest {
        let num_dense = self.info.num_dense as usize;
        let mut request = PredictRequest {
            batch_size: rows as u32,
            dense: vec![0.25; rows * num_dense],
            ..Default::default()
        };
        for r in 0..rows {
            for f in 0..self.info.sparse_features.len() {
                let bag = self.bag(f, r);
                request.sparse_lengths.push(bag.len() as u32);
                request.sparse_ids.extend(bag);
            }
        }
        request
    }

    /// One user's maximal history and `rows` candidates.
    fn ranking(&self, rows: usize) -> PredictRequest {
        let info = &self.info;
        let num_dense = info.num_dense as usize;
        let mut block = RequestFeatures::default();
        let mut request = PredictRequest { batch_size: rows as u32, ..Default::default() };
        match info.dense_request_level {
            true => block.dense = vec![0.25; num_dense],
            false => request.dense = vec![0.25; rows * num_dense],
        }
        for (f, feature) in info.sparse_features.iter().enumerate() {
            if feature.request_level {
                let bag = self.bag(f, 0);
                block.sparse_lengths.push(bag.len() as u32);
                block.sparse_ids.extend(bag);
            }
        }
        for r in 0..rows {
            for (f, feature) in info.sparse_features.iter().enumerate() {
                if !feature.request_level {
                    let bag = self.bag(f, r);
                    request.sparse_lengths.push(bag.len() as u32);
                    request.sparse_ids.extend(bag);
                }
            }
        }
        request.request = Some(block);
        request
    }
}

/// How a request ended.
#[derive(Debug, Default)]
struct Outcomes {
    answered: usize,
    refused: usize,
    overloaded: usize,
}

impl Outcomes {
    /// Counts `result` of a request of `rows` rows; any other outcome
    /// fails the test.
    fn count(&mut self, result: Result<tonic::Response<proto::PredictResponse>, tonic::Status>, rows: usize) {
        match result {
            Ok(response) => {
                assert_eq!(response.get_ref().scores.len(), rows);
                self.answered += 1;
            }
            Err(status) if status.code() == Code::InvalidArgument => {
                for flag in ["--max-queue-bytes", "--max-batch-tokens", "working set"] {
                    assert!(status.message().contains(flag), "{flag}: {status:?}");
                }
                self.refused += 1;
            }
            Err(status) => {
                assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
                assert!(status.message().contains("--max-queue-bytes"), "{status:?}");
                self.overloaded += 1;
            }
        }
    }
}

async fn client(url: &str) -> PredictorClient<Channel> {
    let channel = Channel::from_shared(url.to_string()).unwrap().connect().await.unwrap();
    PredictorClient::new(channel).max_encoding_message_size(64 << 20).max_decoding_message_size(64 << 20)
}

/// Serves `model` under a 64 MiB bound and sends it the requests of the
/// module docs.
async fn every_request_is_answered_or_refused_within_the_bound(name: &str) {
    let temp = tempfile::tempdir().unwrap();
    let model = declared_copy(name, temp.path());
    let listeners = common::Listeners::new();
    let child = Command::new(env!("CARGO_BIN_EXE_narsil"))
        .args(["serve", "--log-level", "warn", "--lanes", "2"])
        .args(["--max-queue-bytes", &(BOUND_MIB << 20).to_string()])
        .args(listeners.args(false))
        .arg("--model")
        .arg(&model)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut server = common::KillOnDrop(child);
    let pid = server.0.id();
    let url = listeners.wait(&mut server.0, common::PATIENCE).await.url();
    common::wait_serving(&url, common::PATIENCE).await;
    let mut client = client(&url).await;
    let info = client.model_info(proto::ModelInfoRequest::default()).await.unwrap().into_inner();
    let requests = Requests { info };
    // Warm: every path once, small.
    client.predict(requests.flat(2)).await.unwrap();
    client.predict(requests.ranking(2)).await.unwrap();
    let (_, idle) = memory_mib(pid);
    let mut flat = Outcomes::default();
    let mut largest = 0;
    for rows in (3..16).map(|k| 1usize << k) {
        let before = flat.refused;
        flat.count(client.predict(requests.flat(rows)).await, rows);
        if flat.refused > before {
            break;
        }
        largest = rows;
    }
    let mut ranking = Outcomes::default();
    for rows in (6..17).map(|k| 1usize << k) {
        let before = ranking.refused;
        ranking.count(client.predict(requests.ranking(rows)).await, rows);
        if ranking.refused > before {
            break;
        }
    }
    let mut together = Outcomes::default();
    let clients = join_all((0..4).map(|_| self::client(&url))).await;
    let calls = join_all(clients.into_iter().map(|mut client| {
        let request = requests.flat(largest);
        async move { client.predict(request).await }
    }))
    .await;
    for call in calls {
        together.count(call, largest);
    }
    let (_, peak) = memory_mib(pid);
    let grown = peak - idle;
    eprintln!(
        "{name}: peak RSS {idle:.0} MiB idle, {peak:.0} after (+{grown:.0}); flat up to {largest} rows x {} \
         positions {flat:?}; ranking {ranking:?}; four at once {together:?}",
        requests.max_len()
    );
    assert!(flat.answered >= 1 && flat.refused == 1, "flat {flat:?}");
    assert!(ranking.answered >= 1 && ranking.refused == 1, "ranking {ranking:?}");
    assert!(together.answered >= 1, "four at once {together:?}");
    assert!(grown <= BOUND_MIB as f64 + MARGIN_MIB, "peak RSS grew {grown:.0} MiB");
    // Served at once after it all (the bound released).
    let small = client.predict(requests.flat(1)).await.unwrap().into_inner();
    assert_eq!(small.scores.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hstu_requests_with_maximal_histories_are_answered_or_refused_within_the_memory_bound() {
    every_request_is_answered_or_refused_within_the_bound("test-hstu").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn din_requests_with_maximal_histories_are_answered_or_refused_within_the_memory_bound() {
    every_request_is_answered_or_refused_within_the_bound("test-din").await;
}
