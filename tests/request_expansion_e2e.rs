//! One ranking request cannot exhaust a server's memory: a request block
//! of 1,000,000 user ids with 4,096 candidates (about 2 MB on the wire) is
//! sent to real `narsil serve` processes of the test model, single-file
//! (whose lanes take only flat batches: the block would be copied into
//! every candidate row, about 49 GB) and split (which pools the block once
//! per request). With default flags both refuse it naming
//! `--max-request-level-ids`; with that bound raised, the single-file
//! server refuses it naming `--max-queue-bytes` (the copy is charged before
//! the request is queued) and the split server scores it, each candidate
//! as it scores beside one other. Every server keeps serving, and its peak
//! resident memory grows by at most the memory bound (`--max-queue-bytes`,
//! 256 MiB by default) plus [`MARGIN_MIB`].
#![cfg(feature = "torch")]

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::ranking::{ranking, request_level};
use common::{assert_close, memory_mib, KillOnDrop};
use narsil::proto::predictor_client::PredictorClient;
use narsil::proto::PredictRequest;
use narsil_core::golden::test_model_dir;
use tonic::transport::Channel;
use tonic::Code;

const BUDGET_MIB: f64 = 256.0;
/// What a server may hold beyond the budget at its peak: the allocator's
/// slack and connection buffers (as `memory_bound_e2e.rs` measured), and
/// the forward's own tensors for 4,096 rows.
const MARGIN_MIB: f64 = 128.0;
const USER_IDS: usize = 1_000_000;
const CANDIDATES: usize = 4096;
/// The test model's rows per table.
const ROWS: u64 = 1000;

/// User 1's request of `candidates` candidates with `USER_IDS` ids spread
/// over its 13 request-level features.
fn huge_user(candidates: usize) -> PredictRequest {
    let (mut grouped, _) = ranking(1, candidates, ROWS);
    let block = grouped.request.as_mut().unwrap();
    let per_feature = USER_IDS / 13;
    block.sparse_lengths = (0..13).map(|f| (per_feature + usize::from(f < USER_IDS % 13)) as u32).collect();
    block.sparse_ids = (0..USER_IDS as u64).map(|k| ((k * 7919) % ROWS) as i64).collect();
    grouped
}

struct Served {
    server: KillOnDrop,
    client: PredictorClient<Channel>,
}

async fn serve(model: PathBuf, extra: &[&str]) -> Served {
    let listeners = common::Listeners::new();
    let mut command = listeners.serve(false, "warn");
    command.arg("--model").arg(model).arg("--request-level").arg(request_level().join(",")).args(extra);
    let mut server = KillOnDrop(command.spawn().unwrap());
    let url = listeners.wait(&mut server.0, Duration::from_secs(60)).await.url();
    let channel = common::wait_serving(&url, Duration::from_secs(60)).await;
    let client = PredictorClient::new(channel).max_encoding_message_size(64 << 20);
    Served { server, client }
}

impl Served {
    /// Its resident memory now, MiB, with the peak reset to it where the
    /// kernel allows (`clear_refs` 5), so the next peak is this test's.
    fn resident_now(&self) -> f64 {
        let pid = self.server.0.id();
        let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
        memory_mib(pid).0
    }

    /// Sends the huge request; checks the server still serves a small
    /// one at once and that its peak memory stayed within the bound.
    async fn send_huge(&mut self, what: &str) -> Result<Vec<f32>, tonic::Status> {
        let (small, _) = ranking(2, 3, ROWS);
        self.client.predict(small.clone()).await.unwrap();
        let before = self.resident_now();
        let answer = self.client.predict(huge_user(CANDIDATES)).await.map(|r| r.into_inner().scores);
        let mut call = tonic::Request::new(small);
        call.set_timeout(Duration::from_secs(10));
        let after = self.client.predict(call).await;
        assert!(after.is_ok(), "{what}: the next request: {after:?}");
        let (_, peak) = memory_mib(self.server.0.id());
        let grown = peak - before;
        eprintln!(
            "{what}: RSS {before:.0} MiB before, peak +{grown:.0} MiB; answer: {:?}",
            answer.as_ref().map(Vec::len)
        );
        assert!(grown <= BUDGET_MIB + MARGIN_MIB, "{what}: peak RSS grew {grown:.0} MiB");
        answer
    }
}

fn refused(answer: Result<Vec<f32>, tonic::Status>, flag: &str, what: &str) {
    let status = answer.expect_err(what);
    assert_eq!(status.code(), Code::InvalidArgument, "{what}: {status:?}");
    assert!(status.message().contains(flag), "{what}: {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_file_server_refuses_a_user_block_whose_copy_per_candidate_exceeds_its_memory() {
    let model = test_model_dir().join("model_default.pt");
    let mut defaults = serve(model.clone(), &[]).await;
    let answer = defaults.send_huge("single-file, default flags").await;
    refused(answer, "--max-request-level-ids", "single-file, default flags");
    drop(defaults);
    let mut raised = serve(model, &["--max-request-level-ids", "2000000"]).await;
    let answer = raised.send_huge("single-file, bound on user ids raised").await;
    refused(answer, "--max-queue-bytes", "single-file, bound on user ids raised");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_server_pools_a_million_user_ids_once_for_4096_candidates() {
    let model = test_model_dir().join("split");
    let mut defaults = serve(model.clone(), &[]).await;
    let answer = defaults.send_huge("split, default flags").await;
    refused(answer, "--max-request-level-ids", "split, default flags");
    drop(defaults);
    let mut raised = serve(model, &["--max-request-level-ids", "2000000"]).await;
    let scores = raised.send_huge("split, bound on user ids raised").await.unwrap();
    assert_eq!(scores.len(), CANDIDATES);
    let two = raised.client.predict(huge_user(2)).await.unwrap().into_inner().scores;
    assert_close(&scores[..2], &two, "the first two candidates, alone and among 4,096");
}
