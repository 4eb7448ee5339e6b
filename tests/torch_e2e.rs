//! The libtorch backend end to end over real gRPC on loopback, with the small
//! model `scripts/test.sh` exports to `models/generated/test-small`: Python's
//! golden scores in both execution modes, fused == alone with 16 concurrent
//! clients, and ids checked before the (unchecked) FBGEMM lookup.
#![cfg(feature = "torch")]

mod common;

use std::sync::Arc;

use common::{assert_close, batch_mode, start_with, wire, worker_mode, TestServer};
use narsil::proto::ModelInfoRequest;
use narsil_core::golden::{test_model_dir, Golden, GoldenRequest};
use narsil_engine::EngineConfig;
use narsil_torch::{TorchConfig, TorchFactory};

async fn start_torch(config: EngineConfig) -> TestServer {
    let factory = TorchFactory::load(TorchConfig::new(test_model_dir().join("model_default.pt"))).unwrap();
    start_with(Arc::new(factory), config).await.ready().await
}

/// Returns how many forwards the requests took, all told.
async fn golden_requests_match_python_one_by_one(config: EngineConfig) -> u32 {
    let server = start_torch(config).await;
    let golden = Golden::read(&test_model_dir()).unwrap();
    let mut client = server.client().await;
    let mut forwards = 0;
    for (i, g) in golden.requests.iter().enumerate() {
        let response = client.predict(wire(g, &format!("golden-{i}"))).await.unwrap().into_inner();
        forwards += response.forwards;
        assert_close(&response.scores, &g.scores_int8, &format!("golden request {i}"));
        assert_eq!(response.request_id, format!("golden-{i}"));
    }
    server.stop().await.unwrap();
    forwards
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_mode_serves_python_golden_scores() {
    golden_requests_match_python_one_by_one(batch_mode(1, 16)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_mode_serves_python_golden_scores() {
    golden_requests_match_python_one_by_one(worker_mode(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_split_across_forwards_serve_the_same_scores() {
    let golden = Golden::read(&test_model_dir()).unwrap();
    let forwards = golden_requests_match_python_one_by_one(common::config(|c| c.max_batch_rows = 2)).await;
    assert!(forwards as usize > golden.requests.len(), "no golden request was split ({forwards} forwards)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fused_scores_equal_alone_with_16_concurrent_clients() {
    let server = start_torch(batch_mode(1, 16)).await;
    let golden = Golden::read(&test_model_dir()).unwrap();
    // 16 clients: every golden request, twice, all at once.
    let requests: Vec<&GoldenRequest> = golden.requests.iter().cycle().take(16).collect();
    let channel = server.channel().await;
    let mut rounds_fused = 0;
    for round in 0..5 {
        let responses = common::predict_all(&channel, &requests).await;
        for (i, (response, g)) in responses.iter().zip(&requests).enumerate() {
            assert_close(&response.scores, &g.scores_int8, &format!("round {round} client {i}"));
        }
        if responses.iter().any(|r| r.fused_requests > 1) {
            rounds_fused += 1;
        }
    }
    assert!(rounds_fused > 0, "16 concurrent requests on one lane never shared a forward");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torchrec_protocol_serves_python_golden_scores() {
    let server = start_torch(batch_mode(1, 16)).await;
    let golden = Golden::read(&test_model_dir()).unwrap();
    let mut client = narsil::torchrec_proto::predictor_client::PredictorClient::new(server.channel().await);
    for (i, g) in golden.requests.iter().enumerate() {
        let request = narsil::wire::torchrec::encode(&wire(g, ""), 26);
        let mut response = client.predict(request).await.unwrap().into_inner();
        let scores = response.predictions.remove(narsil::wire::torchrec::SCORES_KEY).unwrap().data;
        assert_close(&scores, &g.scores_int8, &format!("golden request {i} over TorchRec's protocol"));
    }
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_info_reports_the_exported_schema() {
    let server = start_torch(batch_mode(1, 16)).await;
    let info = server.client().await.model_info(ModelInfoRequest::default()).await.unwrap().into_inner();
    assert_eq!(info.backend, "torch");
    assert_eq!(info.device, "cpu");
    assert_eq!(info.num_dense, 13);
    assert_eq!(info.sparse_features.len(), 26);
    assert!(info.sparse_features.iter().all(|f| f.num_rows == 1000));
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_ids_are_rejected_before_the_model() {
    let server = start_torch(batch_mode(1, 16)).await;
    let golden = Golden::read(&test_model_dir()).unwrap();
    let mut request = wire(&golden.requests[0], "bad");
    request.sparse_ids[3] = 1000; // table rows are [0, 1000)
    let forwards_before = server.engine.stats().forwards;
    let status = server.client().await.predict(request).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().contains("cat_3") && status.message().contains("1000"), "{}", status.message());
    assert_eq!(server.engine.stats().forwards, forwards_before, "never reached the model");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modulo_policy_hashes_ids_into_range() {
    let server =
        start_torch(common::config(|c| c.limits.id_policy = narsil_core::request::IdPolicy::Modulo)).await;
    let golden = Golden::read(&test_model_dir()).unwrap();
    let g = &golden.requests[0]; // one sample, one id per bag
    let mut shifted = wire(g, "shifted");
    for id in &mut shifted.sparse_ids {
        *id += 1000 * 7;
    }
    let response = server.client().await.predict(shifted).await.unwrap().into_inner();
    assert_close(&response.scores, &g.scores_int8, "ids shifted by 7 x rows");
    server.stop().await.unwrap();
}
