//! The Open Inference Protocol (KServe v2) end to end with the small
//! exported model: its requests fuse with narsil.v1's and TorchRec's in one
//! forward and score alike, and a stock `tritonclient` (Python, project venv)
//! works against the real binary unchanged.
#![cfg(feature = "torch")]

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::{assert_close, batch_mode, start_with, wire};
use narsil::kserve_proto::grpc_inference_service_client::GrpcInferenceServiceClient;
use narsil::torchrec_proto::predictor_client::PredictorClient as TorchRecClient;
use narsil::wire::kserve::{encode, first_scores};
use narsil::wire::torchrec::SCORES_KEY;
use narsil_core::golden::{test_model_dir, Golden};
use narsil_torch::{TorchConfig, TorchFactory};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kserve_requests_fuse_with_the_other_protocols_and_score_like_them() {
    let factory = TorchFactory::load(TorchConfig::new(test_model_dir().join("model_default.pt"))).unwrap();
    let server = start_with(Arc::new(factory), batch_mode(1, 64)).await.ready().await;
    let golden = Golden::read(&test_model_dir()).unwrap();
    let channel = server.channel().await;
    let mut calls = Vec::new();
    for (i, g) in golden.requests.iter().enumerate() {
        let request = wire(g, &format!("k{i}"));
        let want = g.scores_int8.clone();
        let (mut kserve, mut torchrec, mut narsil) = (
            GrpcInferenceServiceClient::new(channel.clone()),
            TorchRecClient::new(channel.clone()),
            narsil::proto::predictor_client::PredictorClient::new(channel.clone()),
        );
        calls.push(tokio::spawn(async move {
            let (k, t, n) = tokio::join!(
                kserve.model_infer(encode(&request, 13, 26)),
                torchrec.predict(narsil::wire::torchrec::encode(&request, 26)),
                narsil.predict(request.clone()),
            );
            let k = k.unwrap().into_inner();
            assert_eq!(
                (k.id.as_str(), k.model_name.as_str(), k.model_version.as_str()),
                (request.request_id.as_str(), "dlrm", "1")
            );
            assert_eq!((k.outputs[0].name.as_str(), k.outputs[0].datatype.as_str()), ("default", "FP32"));
            assert_eq!(k.outputs[0].shape, [i64::from(request.batch_size)]);
            assert_close(&first_scores(&k).unwrap(), &want, &format!("KServe request {i}"));
            assert_close(
                &t.unwrap().into_inner().predictions[SCORES_KEY].data,
                &want,
                &format!("TorchRec request {i}"),
            );
            assert_close(&n.unwrap().into_inner().scores, &want, &format!("narsil.v1 request {i}"));
        }));
    }
    for call in calls {
        call.await.unwrap();
    }
    let stats = server.engine.stats();
    let requests = 3 * golden.requests.len() as u64;
    assert_eq!(stats.requests_computed, requests);
    assert!(stats.forwards < requests, "{} forwards for {requests} requests: nothing fused", stats.forwards);
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stock_tritonclient_gets_golden_scores_from_the_real_binary() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = root.join(".venv/bin/python");
    assert!(python.is_file(), "no project venv: run scripts/setup_python.sh");
    let listeners = common::Listeners::new();
    let server = Command::new(env!("CARGO_BIN_EXE_narsil"))
        .args(["serve", "--log-level", "warn"])
        .args(listeners.args(false))
        .arg("--model")
        .arg(test_model_dir().join("model_default.pt"))
        .spawn()
        .unwrap();
    let mut server = common::KillOnDrop(server);
    let grpc = listeners.wait(&mut server.0, Duration::from_secs(60)).await.grpc;
    common::wait_serving(&format!("http://{grpc}"), Duration::from_secs(60)).await;
    let golden = test_model_dir().join("golden.json");
    let script = root.join("tests/python/kserve_tritonclient.py");
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python).arg(script).arg(grpc.to_string()).arg(golden).output().unwrap()
    })
    .await
    .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "tritonclient failed:\n{stdout}\n{stderr}");
    let matched: usize = stdout.trim().strip_prefix("ok ").unwrap().parse().unwrap();
    assert_eq!(matched, Golden::read(&test_model_dir()).unwrap().requests.len());
    unsafe { libc::kill(server.0.id() as i32, libc::SIGTERM) };
    assert!(server.0.wait().unwrap().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn narsil_load_speaks_kserve() {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        load: narsil::load::LoadArgs,
    }
    let factory = TorchFactory::load(TorchConfig::new(test_model_dir().join("model_default.pt"))).unwrap();
    let server = start_with(Arc::new(factory), batch_mode(1, 16)).await.ready().await;
    let args = <Cli as clap::Parser>::parse_from([
        "load",
        "--addr",
        &server.url,
        "--protocol",
        "kserve",
        "--table-rows",
        "1000",
        "--requests",
        "60",
        "--concurrency",
        "4",
        "--warmup",
        "0",
        "--samples-per-request",
        "5",
    ]);
    let report = narsil::load::drive(&args.load).await.unwrap();
    assert_eq!((report.requests, report.ok), (60, 60));
    assert_eq!(server.engine.stats().rows_computed, 300);
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_that_is_not_served_is_not_found_as_triton_answers() {
    let server = common::start(common::batch_mode(1, 4), 0).await.ready().await;
    let mut kserve = GrpcInferenceServiceClient::new(server.channel().await);
    let status = kserve
        .model_ready(narsil::kserve_proto::ModelReadyRequest { name: "nope".into(), version: String::new() })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    assert!(status.message().contains("model_name") && status.message().contains("\"nope\""), "{status:?}");
    let mut request = encode(&common::request(1, 2), 13, 26);
    request.model_name = "nope".into();
    let status = kserve.model_infer(request).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    server.stop().await.unwrap();
}
