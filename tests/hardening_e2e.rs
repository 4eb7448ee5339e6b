//! End to end over real gRPC on loopback: what happens when things go
//! wrong. Queue timeouts fire by timer, cancelled and expired requests are
//! never computed (checked on the server's own counters and metrics), large
//! requests are split and reassembled, backend faults stay inside their
//! batch, and the metrics endpoint reports all of it.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{batch_mode, bits, metric, request, start, start_with};
use narsil::torchrec_proto::predictor_client::PredictorClient as TorchRecClient;
use narsil::wire::torchrec::{encode, SCORES_KEY};
use narsil_core::mock::{MockConfig, MockFactory};
use narsil_core::{BackendError, BackendFactory, KeyedBatch, ModelBackend, ModelSchema};
use tonic::Code;

/// Polls the metrics until `sample` reads `value` (the server may count a
/// cancellation a moment after the client sent it).
async fn wait_for_metric(server: &common::TestServer, sample: &str, value: f64) -> String {
    common::poll_until(&format!("{sample} to reach {value}"), common::PATIENCE, || async {
        let text = server.scrape().await;
        (metric(&text, sample) == value).then_some(text)
    })
    .await
}

/// Waits until the server's one lane is running a forward.
async fn wait_busy(server: &common::TestServer) {
    common::wait_until("the lane to start a forward", common::PATIENCE, || {
        server.engine.stats().busy_lanes == 1
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_timeout_fires_by_timer_while_the_lane_is_busy_and_the_request_is_never_computed() {
    let config = common::config(|c| {
        c.max_batch_requests = 1;
        c.queue_timeout = Some(Duration::from_millis(50));
    });
    // The first request's forward (1.5 s) keeps the lane busy far past the
    // second's 50 ms queue timeout.
    let server = start(config, 1500).await.ready().await;
    let mut busy = server.client().await;
    let first = tokio::spawn(async move { busy.predict(request(1, 1)).await });
    wait_busy(&server).await;
    let status = server.client().await.predict(request(2, 1)).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    // Answered by its own timer while the lane is still busy with the
    // first, not when the lane freed up.
    assert_eq!(server.engine.stats().busy_lanes, 1, "answered only once the lane was free");
    assert!(!first.is_finished(), "answered only after the first request was");
    // The request that started is not expired by the queue timeout, though
    // its forward takes 30 times as long.
    assert_eq!(first.await.unwrap().unwrap().into_inner().scores.len(), 1);
    let text = wait_for_metric(&server, "narsil_abandoned_total", 1.0).await;
    assert_eq!(metric(&text, r#"narsil_requests_total{outcome="deadline"}"#), 1.0);
    assert_eq!(metric(&text, r#"narsil_requests_total{outcome="ok"}"#), 1.0);
    assert_eq!(server.engine.stats().requests_computed, 1, "the expired request must not be computed");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_request_is_dropped_before_assembly_and_never_computed() {
    // The first request's forward (1 s) keeps the lane busy while the
    // second is queued and cancelled.
    let server = start(common::config(|c| c.max_batch_requests = 1), 1000).await.ready().await;
    let mut busy = server.client().await;
    let first = tokio::spawn(async move { busy.predict(request(1, 1)).await });
    wait_busy(&server).await;
    let mut doomed = server.client().await;
    let cancelled = tokio::spawn(async move { doomed.predict(request(2, 1)).await });
    common::wait_until("the second request to queue behind the first", common::PATIENCE, || {
        server.engine.stats().queued_requests == 1
    })
    .await;
    // The client goes away: its call is reset on the wire.
    cancelled.abort();
    wait_for_metric(&server, r#"narsil_requests_total{outcome="cancelled"}"#, 1.0).await;
    first.await.unwrap().unwrap();
    let text = wait_for_metric(&server, "narsil_abandoned_total", 1.0).await;
    assert_eq!(metric(&text, "narsil_forwards_total"), 1.0);
    assert_eq!(server.engine.stats().requests_computed, 1, "the cancelled request must not be computed");
    assert_eq!(metric(&text, "narsil_queue_depth"), 0.0, "its queue place was freed");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_larger_than_max_batch_rows_is_split_and_reassembled_in_order() {
    let small = start(common::config(|c| c.max_batch_rows = 64), 1).await.ready().await;
    let whole = start(batch_mode(1, 16), 1).await.ready().await;
    let large = request(7, 200);
    let expected = whole.client().await.predict(large.clone()).await.unwrap().into_inner();
    assert_eq!(expected.forwards, 1);
    let split = small.client().await.predict(large.clone()).await.unwrap().into_inner();
    assert_eq!((split.forwards, split.fused_rows), (4, 200), "64 + 64 + 64 + 8 rows");
    assert_eq!(bits(&split.scores), bits(&expected.scores));
    // TorchRec's key-major requests are split by feature runs.
    let mut torchrec = TorchRecClient::new(small.channel().await);
    let response = torchrec.predict(encode(&large, 26)).await.unwrap().into_inner();
    assert_eq!(bits(&response.predictions[SCORES_KEY].data), bits(&expected.scores));
    assert_eq!(small.engine.stats().forwards, 8);
    small.stop().await.unwrap();
    whole.stop().await.unwrap();
}

/// The mock, made to fail on purpose: a forward whose first dense value is
/// -1 returns an error, one whose first dense value is -2 panics.
struct FaultyFactory(MockFactory);

struct FaultyBackend(Box<dyn ModelBackend>);

impl BackendFactory for FaultyFactory {
    fn schema(&self) -> &ModelSchema {
        self.0.schema()
    }

    fn create_lane(&self, lane: usize) -> Result<Box<dyn ModelBackend>, BackendError> {
        Ok(Box::new(FaultyBackend(self.0.create_lane(lane)?)))
    }
}

impl ModelBackend for FaultyBackend {
    fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
        match batch.dense.first() {
            Some(-1.0) => Err(BackendError::forward("injected failure")),
            Some(-2.0) => panic!("injected panic"),
            _ => self.0.forward(batch),
        }
    }
}

/// Everything logged in this test process, from every thread (lanes log
/// on their own).
fn captured_logs() -> Arc<std::sync::Mutex<Vec<u8>>> {
    static LOGS: std::sync::OnceLock<Arc<std::sync::Mutex<Vec<u8>>>> = std::sync::OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = Arc::clone(&logs);
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || LogSink(Arc::clone(&sink)))
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
        logs
    })
    .clone()
}

struct LogSink(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for LogSink {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_or_panicking_forward_fails_only_its_batch_and_the_lane_keeps_serving() {
    let logs = captured_logs();
    let mock =
        MockFactory::new(common::schema(), MockConfig { latency: Duration::ZERO, per_row: Duration::ZERO });
    let server = start_with(Arc::new(FaultyFactory(mock)), common::worker_mode(1)).await.ready().await;
    let mut client = server.client().await;
    for (poison, cause) in [(-1.0, "injected failure"), (-2.0, "backend panicked during forward")] {
        let mut bad = request(1, 2);
        bad.dense[0] = poison;
        let status = client.predict(bad).await.unwrap_err();
        assert_eq!(status.code(), Code::Internal, "{status:?}");
        assert!(status.message().contains(cause), "{status:?}");
        let fine = client.predict(request(2, 2)).await.unwrap().into_inner();
        assert_eq!(fine.scores.len(), 2, "the lane serves on after the fault");
    }
    let text = server.scrape().await;
    assert_eq!(metric(&text, r#"narsil_requests_total{outcome="backend_error"}"#), 2.0);
    assert_eq!(metric(&text, r#"narsil_requests_total{outcome="ok"}"#), 2.0);
    assert_eq!(metric(&text, "narsil_forward_errors_total"), 2.0);
    server.stop().await.unwrap();
    // Each failed forward's log names the requests in it by their engine id.
    let logs = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    // (Other tests in this process fail forwards with "backend down".)
    let failures: Vec<&str> =
        logs.lines().filter(|l| l.contains("forward failed") && !l.contains("backend down")).collect();
    assert_eq!(failures.len(), 2, "{logs}");
    assert!(failures.iter().all(|l| l.contains("requests=[")), "{failures:?}");
    assert!(failures[0].contains("injected failure") && failures[1].contains("panicked"), "{failures:?}");
}

/// The mock behind a switch: while `broken` is set, every forward fails,
/// probes included.
struct SwitchedFactory {
    mock: MockFactory,
    broken: Arc<std::sync::atomic::AtomicBool>,
}

struct SwitchedBackend {
    inner: Box<dyn ModelBackend>,
    broken: Arc<std::sync::atomic::AtomicBool>,
}

impl BackendFactory for SwitchedFactory {
    fn schema(&self) -> &ModelSchema {
        self.mock.schema()
    }

    fn create_lane(&self, lane: usize) -> Result<Box<dyn ModelBackend>, BackendError> {
        Ok(Box::new(SwitchedBackend {
            inner: self.mock.create_lane(lane)?,
            broken: Arc::clone(&self.broken),
        }))
    }
}

impl ModelBackend for SwitchedBackend {
    fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
        if self.broken.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(BackendError::forward("injected failure: backend down"));
        }
        self.inner.forward(batch)
    }
}

/// grpc.health follows the backend: NOT_SERVING after 3 failed forwards in a
/// row (not after 2), and SERVING again once an idle lane's probe succeeds,
/// with no request sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_turns_not_serving_after_failed_forwards_and_back_after_a_probe() {
    const SERVING: i32 = 1;
    const NOT_SERVING: i32 = 2;
    let broken = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mock =
        MockFactory::new(common::schema(), MockConfig { latency: Duration::ZERO, per_row: Duration::ZERO });
    let factory = SwitchedFactory { mock, broken: Arc::clone(&broken) };
    let config = common::config(|c| {
        c.mode = narsil_engine::ExecutionMode::Worker;
        c.unhealthy_after_failures = 3;
        c.health_probe_interval = Duration::from_millis(50);
    });
    let server = start_with(Arc::new(factory), config).await.ready().await;
    let channel = server.channel().await;
    let mut client = server.client().await;
    let wait_for = |want: i32| {
        let channel = channel.clone();
        async move {
            common::poll_until(&format!("grpc.health to say {want}"), common::PATIENCE, || {
                let channel = channel.clone();
                async move { (common::health_status(channel).await.unwrap() == want).then_some(()) }
            })
            .await
        }
    };
    wait_for(SERVING).await;
    broken.store(true, std::sync::atomic::Ordering::SeqCst);
    for _ in 0..2 {
        assert_eq!(client.predict(request(1, 2)).await.unwrap_err().code(), Code::Internal);
    }
    // A lane records each forward's health before it answers, so the
    // backend's health is settled once the second failure is answered.
    let text = server.scrape().await;
    assert_eq!(metric(&text, "narsil_backend_healthy"), 1.0, "2 failures in a row are not 3");
    assert_eq!(
        common::health_status(channel.clone()).await.unwrap(),
        SERVING,
        "2 failures in a row are not 3"
    );
    assert_eq!(client.predict(request(1, 2)).await.unwrap_err().code(), Code::Internal);
    wait_for(NOT_SERVING).await;
    let text = server.scrape().await;
    assert_eq!(metric(&text, "narsil_backend_healthy"), 0.0);
    // Still down: probes run, fail, and it stays NOT_SERVING.
    let probes = metric(&text, "narsil_probe_forwards_total");
    common::poll_until("two more probes", common::PATIENCE, || async {
        (metric(&server.scrape().await, "narsil_probe_forwards_total") >= probes + 2.0).then_some(())
    })
    .await;
    assert_eq!(common::health_status(channel.clone()).await.unwrap(), NOT_SERVING);
    broken.store(false, std::sync::atomic::Ordering::SeqCst);
    wait_for(SERVING).await;
    let text = server.scrape().await;
    assert_eq!(metric(&text, "narsil_backend_healthy"), 1.0);
    assert!(metric(&text, "narsil_probe_forwards_total") >= 2.0, "probes ran while down and on recovery");
    assert_eq!(metric(&text, "narsil_forward_errors_total"), 3.0, "probes are not counted as forward errors");
    assert_eq!(client.predict(request(2, 2)).await.unwrap().into_inner().scores.len(), 2);
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_report_latency_histograms_batch_shapes_and_gauges() {
    let server = start(batch_mode(1, 16), 5).await.ready().await;
    let channel = server.channel().await;
    let calls = (0..12).map(|tag| {
        let mut client = narsil::proto::predictor_client::PredictorClient::new(channel.clone());
        async move { client.predict(request(tag, 3)).await.unwrap() }
    });
    futures_util::future::join_all(calls).await;
    let text = server.scrape().await;
    let forwards = metric(&text, "narsil_forwards_total");
    assert_eq!(metric(&text, r#"narsil_requests_total{outcome="ok"}"#), 12.0);
    assert_eq!(metric(&text, "narsil_request_seconds_count"), 12.0);
    assert_eq!(metric(&text, "narsil_queue_seconds_count"), 12.0);
    assert_eq!(metric(&text, "narsil_compute_seconds_count"), forwards);
    assert_eq!(metric(&text, "narsil_batch_rows_count"), forwards);
    assert_eq!(metric(&text, "narsil_batch_rows_sum"), 36.0);
    assert_eq!(metric(&text, "narsil_batch_requests_sum"), 12.0);
    assert!(metric(&text, "narsil_compute_seconds_sum") >= forwards * 0.005, "mock forwards take 5 ms");
    assert_eq!(metric(&text, "narsil_queue_depth"), 0.0);
    assert_eq!(metric(&text, "narsil_busy_lanes"), 0.0);
    server.stop().await.unwrap();
}

/// Sends raw bytes as a gRPC message (whatever they encode).
#[derive(Debug, Clone, Default)]
struct RawCodec;

struct RawEncoder;

impl tonic::codec::Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn encode(&mut self, item: Vec<u8>, buf: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), tonic::Status> {
        prost::bytes::BufMut::put_slice(buf, &item);
        Ok(())
    }
}

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = narsil::proto::PredictResponse;
    type Encoder = RawEncoder;
    type Decoder = tonic_prost::ProstDecoder<narsil::proto::PredictResponse>;

    fn encoder(&mut self) -> Self::Encoder {
        RawEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstDecoder::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_protobuf_is_invalid_argument_in_both_protocols_and_the_server_serves_on() {
    let server = start(batch_mode(1, 16), 0).await.ready().await;
    // Field 2 (dense / float_features), length-delimited, claiming 100 bytes
    // of which none follow.
    let garbage = vec![0x12, 100];
    for path in ["/narsil.v1.Predictor/Predict", "/predictor.Predictor/Predict"] {
        let mut grpc = tonic::client::Grpc::new(server.channel().await);
        grpc.ready().await.unwrap();
        let status = grpc
            .unary(tonic::Request::new(garbage.clone()), path.parse().unwrap(), RawCodec)
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{path}: {status:?}");
        assert!(status.message().contains("invalid message"), "{path}: {status:?}");
    }
    let mut client = server.client().await;
    assert_eq!(client.predict(request(1, 2)).await.unwrap().into_inner().scores.len(), 2);
}
