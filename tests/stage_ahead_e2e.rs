//! End to end over real gRPC on loopback: lanes that stage batches one
//! batch ahead (`--stage-ahead`). A batch staged while its lane is busy
//! still honours its callers: requests whose deadline passed meanwhile are
//! answered DEADLINE_EXCEEDED and their rows never reach the forward; a
//! staged batch nobody waits for is never computed; a stage that fails
//! fails its batch, naming the cause.
//!
//! The backend is the mock behind a gate, with a stage that hands each
//! row's first dense value to the forward, which checks it against the
//! batch (so a staged block that lost other rows than its batch fails).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{batch_mode, request};
use narsil::proto::predictor_client::PredictorClient;
use narsil::proto::PredictRequest;
use narsil_core::mock::mock_scores;
use narsil_core::{
    BackendError, BackendFactory, BatchStage, KeyedBatch, ModelBackend, ModelSchema, StagedBatch,
};
use tonic::Code;

/// Dense value that makes the stage fail, as a store that cannot deliver.
const UNSTAGEABLE: f32 = -1.0;

/// What the staged forwards saw, and the gate they wait at.
#[derive(Default)]
struct Shared {
    open: AtomicBool,
    /// Each staged forward's `request_rows`.
    forwards: Mutex<Vec<Vec<usize>>>,
}

impl Shared {
    fn forwards(&self) -> Vec<Vec<usize>> {
        self.forwards.lock().unwrap().clone()
    }
}

struct StagedFactory {
    schema: ModelSchema,
    shared: Arc<Shared>,
}

struct StagedBackend {
    shared: Arc<Shared>,
}

struct FirstDenseStage;

impl BackendFactory for StagedFactory {
    fn schema(&self) -> &ModelSchema {
        &self.schema
    }

    fn create_lane(&self, _lane: usize) -> Result<Box<dyn ModelBackend>, BackendError> {
        Ok(Box::new(StagedBackend { shared: Arc::clone(&self.shared) }))
    }
}

impl BatchStage for FirstDenseStage {
    fn stage(&mut self, batch: &KeyedBatch) -> Result<StagedBatch, BackendError> {
        let values: Vec<f32> = batch.dense.chunks_exact(batch.num_dense).map(|row| row[0]).collect();
        if values.contains(&UNSTAGEABLE) {
            return Err(BackendError::Unavailable {
                reason: "reading rows: the store is gone".into(),
                source: None,
            });
        }
        Ok(StagedBatch { values, width: 1, took: Duration::ZERO, ticket: None })
    }
}

impl ModelBackend for StagedBackend {
    /// Warm-up and probes: the whole forward, ungated.
    fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
        Ok(mock_scores(batch))
    }

    fn take_stage(&mut self) -> Option<Box<dyn BatchStage>> {
        Some(Box::new(FirstDenseStage))
    }

    fn forward_staged(&mut self, batch: &KeyedBatch, staged: StagedBatch) -> Result<Vec<f32>, BackendError> {
        while !self.shared.open.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(2));
        }
        let expected = FirstDenseStage.stage(batch)?;
        if staged.values != expected.values {
            return Err(BackendError::forward("the staged block does not match the batch's rows"));
        }
        self.shared.forwards.lock().unwrap().push(batch.request_rows.clone());
        Ok(mock_scores(batch))
    }
}

/// A server of the staged mock, one lane, two requests per batch: a lone
/// request waits up to a second for a second one.
async fn start() -> (common::TestServer, Arc<Shared>) {
    let shared = Arc::new(Shared::default());
    let factory = StagedFactory { schema: common::schema(), shared: Arc::clone(&shared) };
    let mut config = batch_mode(1, 2);
    config.stage_ahead = true;
    config.batch_timeout = Duration::from_secs(1);
    let server = common::start_with(Arc::new(factory), config).await.ready().await;
    (server, shared)
}

/// `request` with a `grpc-timeout` header alone (no client-side timer,
/// which would race the server's DEADLINE_EXCEEDED with its CANCELLED).
fn with_deadline(request: PredictRequest, deadline: Option<Duration>) -> tonic::Request<PredictRequest> {
    let mut request = tonic::Request::new(request);
    if let Some(deadline) = deadline {
        let header = format!("{}m", deadline.as_millis()).parse().unwrap();
        request.metadata_mut().insert("grpc-timeout", header);
    }
    request
}

/// Sends request `tag` (`rows` samples) in the background.
fn send(
    channel: &tonic::transport::Channel,
    tag: u64,
    rows: usize,
    deadline: Option<Duration>,
) -> tokio::task::JoinHandle<Result<narsil::proto::PredictResponse, tonic::Status>> {
    let mut client = PredictorClient::new(channel.clone());
    tokio::spawn(async move {
        client.predict(with_deadline(request(tag, rows), deadline)).await.map(|r| r.into_inner())
    })
}

/// Whether `answer` says its deadline passed: Narsil's DEADLINE_EXCEEDED
/// (2 ms before the deadline), or, when the server's own transport timer
/// from the same header fires first on a loaded machine, its CANCELLED.
fn expired(answer: &Result<narsil::proto::PredictResponse, tonic::Status>) -> bool {
    answer.as_ref().is_err_and(|status| {
        status.code() == Code::DeadlineExceeded
            || (status.code() == Code::Cancelled && status.message() == "Timeout expired")
    })
}

/// Requests taken from the queue so far (by the stage thread, here).
fn taken(server: &common::TestServer) -> f64 {
    common::metric(&server.engine.metrics_text(), "narsil_queue_seconds_count")
}

/// Holds the lane in batch A's forward (gate shut) while the stage thread
/// takes and stages the next batch of two requests with `deadlines`, lets
/// their deadlines pass, then opens the gate. Returns A's answer and the
/// two others, the server, and what its staged forwards see.
async fn staged_behind_a_busy_lane(
    deadlines: [Option<Duration>; 2],
) -> (Vec<Result<narsil::proto::PredictResponse, tonic::Status>>, common::TestServer, Arc<Shared>) {
    let (server, shared) = start().await;
    let channel = server.channel().await;
    let a = send(&channel, 1, 3, None);
    common::wait_until("batch A taken", common::PATIENCE, || taken(&server) >= 1.0).await;
    // B waits for C to fill the batch, which the stage thread then takes
    // and stages while A's forward waits at the gate.
    let b = send(&channel, 2, 2, deadlines[0]);
    let c = send(&channel, 3, 4, deadlines[1]);
    common::wait_until("B and C taken", common::PATIENCE, || taken(&server) >= 3.0).await;
    let longest = deadlines.iter().flatten().max().copied().unwrap_or_default();
    tokio::time::sleep(longest + Duration::from_millis(50)).await;
    shared.open.store(true, Ordering::SeqCst);
    let mut answers = Vec::new();
    for call in [a, b, c] {
        answers.push(call.await.unwrap());
    }
    (answers, server, shared)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_deadline_passed_while_staged_never_reaches_the_forward() {
    let (answers, server, shared) = staged_behind_a_busy_lane([Some(Duration::from_millis(300)), None]).await;
    assert_eq!(answers[0].as_ref().unwrap().scores.len(), 3, "A");
    assert!(expired(&answers[1]), "B: {:?}", answers[1]);
    let fused_c = answers[2].as_ref().unwrap().scores.clone();
    // A alone, then the staged batch of B and C without B's 2 rows.
    assert_eq!(shared.forwards(), vec![vec![3], vec![4]]);
    // C's scores are the ones it gets alone.
    let alone =
        PredictorClient::new(server.channel().await).predict(request(3, 4)).await.unwrap().into_inner();
    assert_eq!(common::bits(&fused_c), common::bits(&alone.scores));
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_batch_nobody_waits_for_any_more_is_never_computed() {
    let deadline = Some(Duration::from_millis(250));
    let started = Instant::now();
    let (answers, server, shared) = staged_behind_a_busy_lane([deadline, deadline]).await;
    assert!(answers[0].is_ok(), "A: {:?}", answers[0]);
    for (name, answer) in [("B", &answers[1]), ("C", &answers[2])] {
        assert!(expired(answer), "{name}: {answer:?}");
    }
    // The lane meets the staged batch once A's forward is over.
    common::wait_until("the staged batch dropped", common::PATIENCE, || {
        server.engine.stats().requests_abandoned >= 2
    })
    .await;
    assert_eq!(shared.forwards(), vec![vec![3]], "only A was computed ({:?} in)", started.elapsed());
    assert_eq!(server.engine.stats().requests_computed, 1);
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_stage_fails_its_batch_naming_the_cause_and_the_lane_serves_on() {
    let (server, shared) = start().await;
    shared.open.store(true, Ordering::SeqCst);
    let mut client = PredictorClient::new(server.channel().await);
    let mut unstageable = request(5, 2);
    unstageable.dense[0] = UNSTAGEABLE;
    let failed = client.predict(unstageable).await.unwrap_err();
    assert_eq!(failed.code(), Code::Unavailable, "{failed:?}");
    assert!(failed.message().contains("the store is gone"), "{failed:?}");
    let answer = client.predict(request(6, 2)).await.unwrap().into_inner();
    assert_eq!(answer.scores.len(), 2);
    assert_eq!(shared.forwards(), vec![vec![2]], "the failed batch reached the forward");
    server.stop().await.unwrap();
}
