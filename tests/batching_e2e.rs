//! End to end over real gRPC on loopback: a fused forward gives every request
//! exactly the scores it gets alone, in batch and worker modes.

mod common;

use std::time::Duration;

use common::{batch_mode, bits, request, start, worker_mode};
use futures_util::future::join_all;

/// Sends each request alone, one after another, and returns their scores.
async fn scores_alone(server: &common::TestServer, tags: &[u64]) -> Vec<Vec<u32>> {
    let mut client = server.client().await;
    let mut out = Vec::new();
    for &tag in tags {
        let response = client.predict(request(tag, 1 + tag as usize % 9)).await.unwrap().into_inner();
        assert_eq!(response.fused_requests, 1, "sent alone on an idle server");
        out.push(bits(&response.scores));
    }
    out
}

/// Sends all requests at once from separate clients.
async fn scores_concurrent(server: &common::TestServer, tags: &[u64]) -> Vec<narsil::proto::PredictResponse> {
    let channel = server.channel().await;
    join_all(tags.iter().map(|&tag| {
        let mut client = narsil::proto::predictor_client::PredictorClient::new(channel.clone());
        async move { client.predict(request(tag, 1 + tag as usize % 9)).await.unwrap().into_inner() }
    }))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fused_scores_equal_each_request_alone_with_64_concurrent_clients() {
    let server = start(batch_mode(1, 16), 20).await.ready().await;
    let tags: Vec<u64> = (0..64).collect();
    let alone = scores_alone(&server, &tags).await;
    let fused = scores_concurrent(&server, &tags).await;
    for ((tag, alone), response) in tags.iter().zip(&alone).zip(&fused) {
        assert_eq!(&bits(&response.scores), alone, "request {tag}");
        assert_eq!(response.scores.len(), 1 + *tag as usize % 9);
        assert_eq!(response.request_id, format!("req-{tag}"));
    }
    let max_fused = fused.iter().map(|r| r.fused_requests).max().unwrap();
    assert!(max_fused > 1, "64 concurrent requests on one lane must share forwards");
    assert!(fused.iter().all(|r| r.fused_requests <= 16), "batch-size caps requests per forward");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_mode_runs_one_request_per_forward_with_the_same_scores() {
    let server = start(worker_mode(4), 5).await.ready().await;
    let tags: Vec<u64> = (100..132).collect();
    let alone = scores_alone(&server, &tags).await;
    let concurrent = scores_concurrent(&server, &tags).await;
    for (alone, response) in alone.iter().zip(&concurrent) {
        assert_eq!(&bits(&response.scores), alone);
        assert_eq!(response.fused_requests, 1);
        assert_eq!(response.fused_rows, response.scores.len() as u32);
    }
    let stats = server.engine.stats();
    assert_eq!(stats.forwards, 64, "one forward per request");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_timeout_lets_a_lone_request_wait_for_company() {
    // Three requests fill a batch of three, which goes at once; the
    // timeout is far longer than they take to arrive, even on a loaded
    // machine (without it, the first would go alone to the idle lane).
    let waits = start(
        common::config(|c| {
            c.batch_timeout = Duration::from_secs(20);
            c.max_batch_requests = 3;
        }),
        1,
    )
    .await
    .ready()
    .await;
    let fused = scores_concurrent(&waits, &[1, 2, 3]).await;
    assert!(fused.iter().all(|r| r.fused_requests == 3), "{fused:?}");
    waits.stop().await.unwrap();
    // A request no other joins goes alone once the timeout is over, not
    // before.
    let timeout = Duration::from_millis(200);
    let server = start(common::config(|c| c.batch_timeout = timeout), 1).await.ready().await;
    let alone = server.client().await.predict(request(4, 2)).await.unwrap().into_inner();
    assert_eq!(alone.fused_requests, 1);
    assert!(alone.queue_time_us >= timeout.as_micros() as u64, "waited only {} us", alone.queue_time_us);
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reported_queue_and_compute_times_are_plausible() {
    // The mock's forward sleeps 200 ms: at least that is compute time.
    let server = start(batch_mode(1, 16), 200).await.ready().await;
    let response = server.client().await.predict(request(5, 3)).await.unwrap().into_inner();
    assert!(response.compute_time_us >= 200_000, "{response:?}");
    // On an idle server a request waits only for the lane to take it: its
    // queue time does not include the forward (a bound of a whole forward
    // leaves a loaded machine ample room).
    assert!(response.queue_time_us < response.compute_time_us, "idle server: {response:?}");
    assert_eq!(response.fused_rows, 3);
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn narsil_load_sends_skewed_ids_the_server_accepts() {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        load: narsil::load::LoadArgs,
    }
    let server = start(batch_mode(1, 16), 1).await.ready().await;
    let args = <Cli as clap::Parser>::parse_from([
        "load",
        "--addr",
        &server.url,
        "--id-distribution",
        "zipf:1.05",
        "--ids-per-feature",
        "3",
        "--requests",
        "80",
        "--concurrency",
        "8",
        "--warmup",
        "0",
        "--samples-per-request",
        "20",
    ]);
    let report = narsil::load::drive(&args.load).await.unwrap();
    assert_eq!((report.requests, report.ok), (80, 80), "every id is inside its table: {:?}", report.by_code);
    assert_eq!(report.id_distribution, "zipf:1.05");
    server.stop().await.unwrap();
}
