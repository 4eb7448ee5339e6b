//! End to end over real gRPC on loopback: health, reflection, model info,
//! bad input, overload and draining shutdown.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{batch_mode, request, start};
use futures_util::future::join_all;
use narsil::proto::{ModelInfoRequest, PredictRequest};
use narsil_core::mock::{MockConfig, MockFactory};
use narsil_core::{BackendError, BackendFactory, KeyedBatch, ModelBackend, ModelSchema};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

async fn health(server: &common::TestServer, service: &str) -> i32 {
    HealthClient::new(server.channel().await)
        .check(HealthCheckRequest { service: service.into() })
        .await
        .unwrap()
        .into_inner()
        .status
}

/// The mock behind a gate: every forward, warm-up included, waits until
/// the gate is open.
struct GatedFactory {
    mock: MockFactory,
    open: Arc<AtomicBool>,
}

struct GatedBackend {
    inner: Box<dyn ModelBackend>,
    open: Arc<AtomicBool>,
}

impl BackendFactory for GatedFactory {
    fn schema(&self) -> &ModelSchema {
        self.mock.schema()
    }

    fn create_lane(&self, lane: usize) -> Result<Box<dyn ModelBackend>, BackendError> {
        Ok(Box::new(GatedBackend { inner: self.mock.create_lane(lane)?, open: Arc::clone(&self.open) }))
    }
}

impl ModelBackend for GatedBackend {
    fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
        while !self.open.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.inner.forward(batch)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_turns_serving_only_after_every_lane_warmed_up() {
    // The lanes' warm-up forwards wait at the gate until the test opens it.
    let open = Arc::new(AtomicBool::new(false));
    let mock =
        MockFactory::new(common::schema(), MockConfig { latency: Duration::ZERO, per_row: Duration::ZERO });
    let factory = GatedFactory { mock, open: Arc::clone(&open) };
    let server = common::start_with(Arc::new(factory), batch_mode(2, 16)).await;
    assert_eq!(health(&server, "").await, ServingStatus::NotServing as i32);
    let early = server.client().await.predict(request(1, 1)).await.unwrap_err();
    assert_eq!(early.code(), Code::Unavailable, "{early:?}");
    assert!(!server.engine.is_ready());
    open.store(true, Ordering::SeqCst);
    common::poll_until("narsil.v1.Predictor to be SERVING", common::PATIENCE, || async {
        (health(&server, "narsil.v1.Predictor").await == ServingStatus::Serving as i32).then_some(())
    })
    .await;
    assert!(server.engine.is_ready());
    assert!(server.client().await.predict(request(1, 1)).await.is_ok());
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_under_load_answers_every_accepted_request() {
    // 64 requests, 16 per forward, 100 ms per forward: ~400 ms of queued work.
    let server = start(batch_mode(1, 16), 100).await.ready().await;
    let channel = server.channel().await;
    let calls = tokio::spawn(join_all((0..64).map(|tag| {
        let mut client = narsil::proto::predictor_client::PredictorClient::new(channel.clone());
        async move { client.predict(request(tag, 2)).await }
    })));
    // Stop once every request is accepted (one not yet accepted would be
    // refused, rightly); most of them are still queued then.
    common::wait_until("all 64 requests accepted", common::PATIENCE, || {
        let first = server.engine.metrics_text();
        common::admitted(&first, &server.engine.metrics_text()) >= 64.0
    })
    .await;
    let engine = server.engine.clone();
    server.stop().await.unwrap();
    let results = calls.await.unwrap();
    let failed: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(failed.is_empty(), "accepted requests lost at shutdown: {failed:?}");
    assert_eq!(engine.stats().requests_computed, 64);
}

/// `request(1, 2)` edited by `edit`.
fn edited(edit: impl FnOnce(&mut PredictRequest)) -> PredictRequest {
    let mut r = request(1, 2);
    edit(&mut r);
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_invalid_argument_naming_field_sample_and_feature() {
    let server = start(batch_mode(1, 16), 1).await.ready().await;
    let mut client = server.client().await;
    let ids_of_request_1_2 = request(1, 2).sparse_ids.len();
    let oversized = edited(|r| r.dense = vec![0.5; common::MAX_MESSAGE_BYTES / 4]);
    let cases: Vec<(&str, PredictRequest, String)> = vec![
        ("zero samples", edited(|r| r.batch_size = 0), "invalid batch_size: must be at least 1".into()),
        (
            "too many samples",
            edited(|r| r.batch_size = 70_000),
            "invalid batch_size: 70000 exceeds the server's limit of 65536".into(),
        ),
        (
            "short dense",
            edited(|r| {
                r.dense.pop();
            }),
            "invalid dense: has 25 values, expected batch_size x num_dense = 2 x 13 = 26".into(),
        ),
        (
            "NaN dense",
            edited(|r| r.dense[14] = f32::NAN),
            "invalid dense: sample 1 feature 1 is NaN (values must be finite)".into(),
        ),
        (
            "infinite dense",
            edited(|r| r.dense[2] = f32::NEG_INFINITY),
            "invalid dense: sample 0 feature 2 is -inf (values must be finite)".into(),
        ),
        (
            "lengths count",
            edited(|r| {
                r.sparse_lengths.pop();
            }),
            "invalid sparse_lengths: has 51 entries, expected batch_size x num_sparse = 2 x 26 = 52 (or none for one id per bag)".into(),
        ),
        (
            "ids count",
            edited(|r| r.sparse_ids.push(1)),
            format!(
                "invalid sparse_ids: has {} ids but the lengths sum to {ids_of_request_1_2}",
                ids_of_request_1_2 + 1
            ),
        ),
        (
            "id out of range",
            edited(|r| {
                r.sparse_lengths = vec![1; 52];
                r.sparse_ids = vec![0; 52];
                r.sparse_ids[26 + 3] = 1000;
            }),
            "invalid sparse_ids: sample 1 feature 3 (cat_3) has id 1000 outside [0, 1000)".into(),
        ),
        (
            "negative id",
            edited(|r| {
                r.sparse_lengths = vec![];
                r.sparse_ids = vec![-5; 52];
            }),
            "invalid sparse_ids: sample 0 feature 0 (cat_0) has id -5 outside [0, 1000)".into(),
        ),
        (
            "unknown model",
            edited(|r| r.model = "ranker-v9".into()),
            r#"invalid model: unknown model "ranker-v9"; this server serves ["dlrm"]"#.into(),
        ),
        (
            "version not served",
            edited(|r| r.model_version = "7".into()),
            r#"invalid model_version: version "7" of model "dlrm" is not served"#.into(),
        ),
        (
            "message over --max-message-bytes",
            oversized.clone(),
            format!(
                "invalid message: {} bytes exceeds the server's limit of {} bytes (--max-message-bytes)",
                prost::Message::encoded_len(&oversized),
                common::MAX_MESSAGE_BYTES
            ),
        ),
    ];
    let count = cases.len();
    for (name, message, expected) in cases {
        let status = client.predict(message).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{name}: {status:?}");
        assert_eq!(status.message(), expected, "{name}");
    }
    assert_eq!(server.engine.stats().forwards, 0, "invalid requests never reach the model");
    let metrics = server.scrape().await;
    assert_eq!(common::metric(&metrics, r#"narsil_requests_total{outcome="invalid"}"#), count as f64);
    assert_eq!(common::metric(&metrics, "narsil_forwards_total"), 0.0);
    // The server still serves.
    assert_eq!(client.predict(request(1, 2)).await.unwrap().into_inner().scores.len(), 2);
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_rejects_at_once_with_resource_exhausted() {
    let config = common::config(|c| {
        c.max_batch_requests = 1;
        c.max_queue_requests = 2;
    });
    // Forwards of 500 ms, one request each: the accepted requests are
    // answered 0.5, 1 and 1.5 s after the first starts.
    let server = start(config, 500).await.ready().await;
    let channel = server.channel().await;
    let results = join_all((0..10).map(|tag| {
        let mut client = narsil::proto::predictor_client::PredictorClient::new(channel.clone());
        async move { (client.predict(request(tag, 1)).await, Instant::now()) }
    }))
    .await;
    let rejected: Vec<_> = results.iter().filter_map(|(r, at)| r.as_ref().err().map(|s| (s, *at))).collect();
    assert!(rejected.len() >= 6, "at most 1 running + 2 queued (+ one racing): {rejected:?}");
    // At once: every rejection is answered before the first accepted
    // request is (a queue that made the rest wait for room would answer
    // them after it).
    let first_ok = results.iter().filter(|(r, _)| r.is_ok()).map(|(_, at)| *at).min().expect("some accepted");
    for (status, at) in rejected {
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert!(status.message().contains("--max-queue-requests"), "{status:?}");
        assert!(at < first_ok, "a rejection came after the first answer: it was not immediate");
    }
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_deadline_is_answered_and_never_computed() {
    // The first request's forward (500 ms) keeps the lane busy far past
    // the second's 50 ms deadline.
    let server = start(common::config(|c| c.max_batch_requests = 1), 500).await.ready().await;
    let mut client = server.client().await;
    let mut slow = client.clone();
    let first = tokio::spawn(async move { slow.predict(request(1, 1)).await });
    common::wait_until("the first request's forward to start", common::PATIENCE, || {
        server.engine.stats().busy_lanes == 1
    })
    .await;
    // The header alone (no client-side timer) shows what the server answers.
    let mut late = tonic::Request::new(request(2, 1));
    late.metadata_mut().insert("grpc-timeout", "50m".parse().unwrap());
    let status = client.predict(late).await.unwrap_err();
    // The server answers DEADLINE_EXCEEDED 2 ms before the deadline; tonic's
    // client runs its own timer from the same header and, if the server's
    // answer is late on a loaded machine, reports CANCELLED "Timeout expired".
    let client_timer = status.code() == Code::Cancelled && status.message() == "Timeout expired";
    assert!(status.code() == Code::DeadlineExceeded || client_timer, "{status:?}");
    first.await.unwrap().unwrap();
    common::wait_until("the expired request to be counted abandoned", common::PATIENCE, || {
        server.engine.stats().requests_abandoned == 1
    })
    .await;
    let stats = server.engine.stats();
    assert_eq!(stats.requests_computed, 1, "the expired request must not be computed");
    assert_eq!(stats.requests_abandoned, 1);
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_info_describes_the_served_schema() {
    let server = start(batch_mode(1, 16), 1).await.ready().await;
    let info = server.client().await.model_info(ModelInfoRequest::default()).await.unwrap().into_inner();
    assert_eq!(info.backend, "mock");
    assert_eq!(info.num_dense, 13);
    assert_eq!(info.sparse_features.len(), 26);
    assert_eq!(info.sparse_features[25].name, "cat_25");
    assert_eq!(info.sparse_features[0].num_rows, 1000);
    assert_eq!(info.max_batch_size, 65_536);
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_lists_the_predictor_and_health_services() {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;

    let server = start(batch_mode(1, 16), 1).await.ready().await;
    let mut client = ServerReflectionClient::new(server.channel().await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses =
        client.server_reflection_info(tokio_stream::iter([request])).await.unwrap().into_inner();
    let response = responses.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("unexpected reflection answer: {response:?}");
    };
    let names: Vec<_> = list.service.iter().map(|s| s.name.as_str()).collect();
    assert!(names.contains(&"narsil.v1.Predictor"), "{names:?}");
    assert!(names.contains(&"grpc.health.v1.Health"), "{names:?}");
    server.stop().await.unwrap();
}
