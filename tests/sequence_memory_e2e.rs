//! A sequence model's per-request working set is charged to the memory
//! bound (`--max-queue-bytes`) before the request is queued, on the real
//! binary serving the HSTU and DIN test models (`models/export_hstu.py`,
//! `models/export_din.py`; their split form, its sequence's `working_set`
//! as the exporters declare it).
//!
//! With a 64 MiB bound, flat requests of 8 to 2,048 rows with a maximal
//! history (the model's `max_len` on every row: HSTU's block attention
//! grows with its square on each row), ranking requests of 64 to 16,384
//! candidates, then the largest flat request four times at once. The
//! largest are charged several times the bound: each is cut into parts by
//! `--max-batch-tokens` and queued in waves within the bound, and answered
//! (every row scored), or RESOURCE_EXHAUSTED naming `--max-queue-bytes`
//! while the bound is held by the others. The server's peak resident
//! memory (VmHWM) grows over its idle peak by at most the bound plus
//! `MARGIN_MIB`, and a small request after it all is served. Under a 64 KiB
//! bound, which no row with a maximal history fits, such a request is
//! refused, INVALID_ARGUMENT naming both flags, and a row without a
//! history is served.
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
    assert!(
        dir.join("split/schema.json").is_file(),
        "no exported model in {}: run scripts/test.sh",
        dir.display()
    );
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
    let arch: Vec<u64> =
        manifest["attention_arch"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
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

    /// Feature `f`'s bag for row (or user) `r`: `history` positions for a
    /// sequence's channel, else one id.
    fn bag(&self, f: usize, r: usize, history: usize) -> Vec<i64> {
        let feature = &self.info.sparse_features[f];
        let rows = feature.num_rows as i64;
        let len = if feature.sequence.is_empty() { 1 } else { history };
        (0..len).map(|p| ((r * 104_729 + p * 977 + f * 31) as i64) % rows).collect()
    }

    /// `rows` rows, each with its own maximal history.
    fn flat(&self, rows: usize) -> PredictRequest {
        self.flat_with_history(rows, self.max_len())
    }

    /// `rows` rows, each with its own history of `history` positions.
    fn flat_with_history(&self, rows: usize, history: usize) -> PredictRequest {
        let num_dense = self.info.num_dense as usize;
        let mut request = PredictRequest {
            batch_size: rows as u32,
            dense: vec![0.25; rows * num_dense],
            ..Default::default()
        };
        for r in 0..rows {
            for f in 0..self.info.sparse_features.len() {
                let bag = self.bag(f, r, history);
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
                let bag = self.bag(f, 0, self.max_len());
                block.sparse_lengths.push(bag.len() as u32);
                block.sparse_ids.extend(bag);
            }
        }
        for r in 0..rows {
            for (f, feature) in info.sparse_features.iter().enumerate() {
                if !feature.request_level {
                    let bag = self.bag(f, r, self.max_len());
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
    overloaded: usize,
}

impl Outcomes {
    /// Counts `result` of a request of `rows` rows: scored, or refused
    /// while the bound is held; any other outcome fails the test.
    fn count(&mut self, result: Result<tonic::Response<proto::PredictResponse>, tonic::Status>, rows: usize) {
        match result {
            Ok(response) => {
                assert_eq!(response.get_ref().scores.len(), rows);
                self.answered += 1;
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

/// `narsil serve` of `model` under a memory bound of `bound` bytes: the
/// process, its URL, and requests to it.
async fn serve(model: &Path, bound: usize) -> (common::KillOnDrop, String, Requests) {
    let listeners = common::Listeners::new();
    let child = Command::new(env!("CARGO_BIN_EXE_narsil"))
        .args(["serve", "--log-level", "warn", "--lanes", "2"])
        .args(["--max-queue-bytes", &bound.to_string()])
        .args(listeners.args(false))
        .arg("--model")
        .arg(model)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut server = common::KillOnDrop(child);
    let url = listeners.wait(&mut server.0, common::PATIENCE).await.url();
    common::wait_serving(&url, common::PATIENCE).await;
    let info = client(&url).await.model_info(proto::ModelInfoRequest::default()).await.unwrap().into_inner();
    (server, url, Requests { info })
}

/// Serves `name`'s split model and sends it the requests of the module
/// docs.
async fn every_request_is_answered_or_refused_within_the_bound(name: &str) {
    let temp = tempfile::tempdir().unwrap();
    let model = declared_copy(name, temp.path());
    let (server, url, requests) = serve(&model, BOUND_MIB << 20).await;
    let pid = server.0.id();
    let mut client = client(&url).await;
    // Warm: every path once, small.
    client.predict(requests.flat(2)).await.unwrap();
    client.predict(requests.ranking(2)).await.unwrap();
    let (_, idle) = memory_mib(pid);
    let mut alone = Outcomes::default();
    for rows in (3..12).map(|k| 1usize << k) {
        alone.count(client.predict(requests.flat(rows)).await, rows);
    }
    for rows in (6..15).map(|k| 1usize << k) {
        alone.count(client.predict(requests.ranking(rows)).await, rows);
    }
    let mut together = Outcomes::default();
    let clients = join_all((0..4).map(|_| self::client(&url))).await;
    let calls = join_all(clients.into_iter().map(|mut client| {
        let request = requests.flat(2048);
        async move { client.predict(request).await }
    }))
    .await;
    for call in calls {
        together.count(call, 2048);
    }
    let (_, peak) = memory_mib(pid);
    let grown = peak - idle;
    eprintln!(
        "{name}: peak RSS {idle:.0} MiB idle, {peak:.0} after (+{grown:.0}); {} positions a history; one at a \
         time {alone:?}; four at once {together:?}",
        requests.max_len()
    );
    assert_eq!(alone.overloaded, 0, "nothing else held the bound: {alone:?}");
    // Four at once each fill the bound in waves: any of them may find it
    // held by the others (RESOURCE_EXHAUSTED, counted) at any wave.
    assert_eq!(together.answered + together.overloaded, 4);
    assert!(grown <= BOUND_MIB as f64 + MARGIN_MIB, "peak RSS grew {grown:.0} MiB");
    // Served at once after it all (the bound released).
    let small = client.predict(requests.flat(1)).await.unwrap().into_inner();
    assert_eq!(small.scores.len(), 1);
    drop(server);
    // A bound no row with a maximal history fits: refused, naming both
    // flags, and still serving.
    let (_server, url, requests) = serve(&model, 64 << 10).await;
    let mut client = self::client(&url).await;
    let status = client.predict(requests.flat(4)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    for words in ["--max-queue-bytes", "--max-batch-tokens", "working set"] {
        assert!(status.message().contains(words), "{words}: {status:?}");
    }
    let empty = requests.flat_with_history(1, 0);
    assert_eq!(client.predict(empty).await.unwrap().into_inner().scores.len(), 1);
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hstu_requests_with_maximal_histories_are_answered_or_refused_within_the_memory_bound() {
    every_request_is_answered_or_refused_within_the_bound("test-hstu").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn din_requests_with_maximal_histories_are_answered_or_refused_within_the_memory_bound() {
    every_request_is_answered_or_refused_within_the_bound("test-din").await;
}
