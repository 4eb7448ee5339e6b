//! End to end over real gRPC on loopback: health, reflection, model info,
//! bad input, overload and draining shutdown.

mod common;

use std::time::{Duration, Instant};

use common::{batch_mode, request, start};
use futures_util::future::join_all;
use narsil::proto::ModelInfoRequest;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_turns_serving_only_after_every_lane_warmed_up() {
    // Warm-up runs two forwards per lane: at 300 ms each, lanes take ~600 ms.
    let server = start(batch_mode(2, 16), 300).await;
    assert_eq!(health(&server, "").await, ServingStatus::NotServing as i32);
    let early = server.client().await.predict(request(1, 1)).await.unwrap_err();
    assert_eq!(early.code(), Code::Unavailable, "{early:?}");
    let started = Instant::now();
    while health(&server, "narsil.v1.Predictor").await != ServingStatus::Serving as i32 {
        assert!(started.elapsed() < Duration::from_secs(10), "never became SERVING");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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
    let started = Instant::now();
    while server.engine.stats().queued_requests + 16 * server.engine.stats().busy_lanes < 64 {
        assert!(started.elapsed() < Duration::from_secs(10), "requests never queued");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let engine = server.engine.clone();
    server.stop().await.unwrap();
    let results = calls.await.unwrap();
    let failed: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(failed.is_empty(), "accepted requests lost at shutdown: {failed:?}");
    assert_eq!(engine.stats().requests_computed, 64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_invalid_argument_naming_the_field() {
    let server = start(batch_mode(1, 16), 1).await.ready().await;
    let mut client = server.client().await;
    let cases: Vec<(&str, narsil::proto::PredictRequest, &str)> = vec![
        (
            "zero batch",
            narsil::proto::PredictRequest { batch_size: 0, ..request(1, 1) },
            "invalid batch_size",
        ),
        (
            "short dense",
            {
                let mut r = request(1, 2);
                r.dense.pop();
                r
            },
            "invalid dense",
        ),
        (
            "nan dense",
            {
                let mut r = request(1, 2);
                r.dense[14] = f32::NAN;
                r
            },
            "sample 1 feature 1",
        ),
        (
            "lengths count",
            {
                let mut r = request(1, 2);
                r.sparse_lengths.pop();
                r
            },
            "invalid sparse_lengths",
        ),
        (
            "ids count",
            {
                let mut r = request(1, 2);
                r.sparse_ids.push(1);
                r
            },
            "invalid sparse_ids",
        ),
        (
            "id range",
            {
                let mut r = request(1, 1);
                r.sparse_lengths = vec![1; 26];
                r.sparse_ids = vec![0; 26];
                r.sparse_ids[3] = 1000;
                r
            },
            "sample 0 feature 3 (cat_3) has id 1000",
        ),
        (
            "negative id",
            {
                let mut r = request(1, 1);
                r.sparse_lengths = vec![];
                r.sparse_ids = vec![-5; 26];
                r
            },
            "id -5",
        ),
        ("too many samples", request(1, 5000), "exceeds the server's limit"),
    ];
    for (name, message, expected) in cases {
        let status = client.predict(message).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{name}: {status:?}");
        assert!(status.message().contains(expected), "{name}: {}", status.message());
    }
    assert_eq!(server.engine.stats().forwards, 0, "invalid requests never reach the model");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_rejects_at_once_with_resource_exhausted() {
    let config = common::config(|c| {
        c.max_batch_requests = 1;
        c.max_queue_requests = 2;
    });
    let server = start(config, 300).await.ready().await;
    let channel = server.channel().await;
    let started = Instant::now();
    let results = join_all((0..10).map(|tag| {
        let mut client = narsil::proto::predictor_client::PredictorClient::new(channel.clone());
        async move { (client.predict(request(tag, 1)).await, Instant::now()) }
    }))
    .await;
    let rejected: Vec<_> = results.iter().filter_map(|(r, at)| r.as_ref().err().map(|s| (s, *at))).collect();
    assert!(rejected.len() >= 6, "at most 1 running + 2 queued (+ one racing): {rejected:?}");
    for (status, at) in rejected {
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert!(status.message().contains("--max-queue-requests"), "{status:?}");
        assert!(at.duration_since(started) < Duration::from_millis(250), "rejection was not immediate");
    }
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_deadline_is_answered_and_never_computed() {
    let server = start(common::config(|c| c.max_batch_requests = 1), 200).await.ready().await;
    let mut client = server.client().await;
    let mut slow = client.clone();
    let first = tokio::spawn(async move { slow.predict(request(1, 1)).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
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
    tokio::time::sleep(Duration::from_millis(50)).await;
    let stats = server.engine.stats();
    assert_eq!(stats.requests_computed, 1, "the expired request must not be computed");
    assert_eq!(stats.requests_abandoned, 1);
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_info_describes_the_served_schema() {
    let server = start(batch_mode(1, 16), 1).await.ready().await;
    let info = server.client().await.model_info(ModelInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.backend, "mock");
    assert_eq!(info.num_dense, 13);
    assert_eq!(info.sparse_features.len(), 26);
    assert_eq!(info.sparse_features[25].name, "cat_25");
    assert_eq!(info.sparse_features[0].num_rows, 1000);
    assert_eq!(info.max_batch_size, 4096);
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
