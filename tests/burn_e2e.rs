//! The Burn backend end to end over real gRPC on loopback, with the FP32
//! weights of the small model `scripts/test.sh` exports: Python's FP32 golden
//! scores within 1e-5 in both execution modes, and fused == alone within 1e-6
//! with 16 concurrent clients; and the same model's split form (INT8 tables
//! through the embedding stage, `dense.safetensors`) with the INT8 model's
//! scores and the stage's metrics.
#![cfg(feature = "burn")]

mod common;

use std::sync::Arc;

use common::{batch_mode, start_with, wire, worker_mode, TestServer};
use narsil_burn::BurnFactory;
use narsil_core::golden::{max_abs_diff, test_model_dir, Golden, GoldenRequest};
use narsil_engine::EngineConfig;

async fn start_burn(config: EngineConfig) -> TestServer {
    let factory = BurnFactory::load(&test_model_dir().join("weights_fp32.safetensors")).unwrap();
    start_with(Arc::new(factory), config).await.ready().await
}

/// Returns how many forwards the requests took, all told.
async fn golden_requests_match_python_fp32(config: EngineConfig) -> u32 {
    let server = start_burn(config).await;
    let golden = Golden::read(&test_model_dir()).unwrap();
    let mut client = server.client().await;
    let mut forwards = 0;
    for (i, g) in golden.requests.iter().enumerate() {
        let response = client.predict(wire(g, "g")).await.unwrap().into_inner();
        forwards += response.forwards;
        let diff = max_abs_diff(&response.scores, &g.scores_fp32).unwrap();
        assert!(diff <= 1e-5, "golden request {i}: max |burn - python fp32| = {diff}");
    }
    server.stop().await.unwrap();
    forwards
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_mode_serves_python_fp32_scores() {
    golden_requests_match_python_fp32(batch_mode(1, 16)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_mode_serves_python_fp32_scores() {
    golden_requests_match_python_fp32(worker_mode(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_split_across_forwards_serve_the_same_scores() {
    let golden = Golden::read(&test_model_dir()).unwrap();
    let forwards = golden_requests_match_python_fp32(common::config(|c| c.max_batch_rows = 2)).await;
    assert!(forwards as usize > golden.requests.len(), "no golden request was split ({forwards} forwards)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fused_scores_equal_alone_with_16_concurrent_clients() {
    let server = start_burn(batch_mode(1, 16)).await;
    let golden = Golden::read(&test_model_dir()).unwrap();
    let requests: Vec<&GoldenRequest> = golden.requests.iter().cycle().take(16).collect();
    let mut client = server.client().await;
    let mut alone = Vec::new();
    for g in &golden.requests {
        alone.push(client.predict(wire(g, "alone")).await.unwrap().into_inner().scores);
    }
    let channel = server.channel().await;
    let mut rounds_fused = 0;
    for round in 0..5 {
        let responses = common::predict_all(&channel, &requests).await;
        for (i, response) in responses.iter().enumerate() {
            let diff = max_abs_diff(&response.scores, &alone[i % alone.len()]).unwrap();
            assert!(diff <= 1e-6, "round {round} client {i}: fused vs alone {diff}");
        }
        rounds_fused += usize::from(responses.iter().any(|r| r.fused_requests > 1));
    }
    assert!(rounds_fused > 0, "16 concurrent requests on one lane never shared a forward");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_model_serves_the_int8_scores_and_counts_its_lookups() {
    let factory =
        BurnFactory::load_split(&test_model_dir().join("split"), narsil_embedding::TableStore::Mmap).unwrap();
    let server = start_with(Arc::new(factory), batch_mode(1, 16)).await.ready().await;
    let golden = Golden::read(&test_model_dir()).unwrap();
    let mut client = server.client().await;
    let mut ids = 0;
    for (i, g) in golden.requests.iter().enumerate() {
        let response = client.predict(wire(g, "g")).await.unwrap().into_inner();
        let diff = max_abs_diff(&response.scores, &g.scores_int8).unwrap();
        assert!(diff <= 1e-5, "golden request {i}: max |burn split - python int8| = {diff}");
        // cat_0's bags: the first of each sample's 26 lengths.
        ids += g.lengths.chunks(26).map(|sample| sample[0] as usize).sum::<usize>();
    }
    let text = server.scrape().await;
    // Warm-up forwards look ids up too: at least the golden requests' ids.
    assert!(common::metric(&text, r#"narsil_table_ids_total{table="cat_0"}"#) >= ids as f64, "{text}");
    assert!(common::metric(&text, r#"narsil_table_major_faults_total{table="cat_0"}"#) >= 0.0);
    server.stop().await.unwrap();
}

/// `narsil verify`, run as the binary against a live server.
fn narsil_verify(url: &str, scores: &str, tolerance: &str) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_narsil"))
        .args(["verify", "--addr", url, "--scores", scores, "--tolerance", tolerance, "--wait-secs", "10"])
        .arg("--golden")
        .arg(test_model_dir())
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn narsil_verify_accepts_the_served_scores_and_names_the_request_that_differs() {
    let server = start_burn(batch_mode(1, 16)).await;
    let url = server.url.clone();
    let (served, other) = tokio::task::spawn_blocking(move || {
        (narsil_verify(&url, "fp32", "1e-5"), narsil_verify(&url, "int8", "1e-7"))
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&served.stdout);
    assert!(served.status.success(), "{stdout}{}", String::from_utf8_lossy(&served.stderr));
    assert!(stdout.contains("golden requests (fp32 scores) match"), "{stdout}");
    // The FP32 model's scores are not the INT8 model's: verify must say so.
    let stderr = String::from_utf8_lossy(&other.stderr);
    assert!(!other.status.success(), "verify passed against the wrong scores");
    assert!(stderr.contains("golden request 0: max |served - golden|"), "{stderr}");
    server.stop().await.unwrap();
}
