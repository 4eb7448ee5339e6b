//! The Open Inference Protocol (KServe v2) end to end with the small
//! exported model: its requests fuse with narsil.v1's and TorchRec's in one
//! forward and score alike, ranking requests in KServe's grouped form
//! (`request_*` inputs) score as the same requests sent flat, and a stock
//! `tritonclient` (Python, project venv) works against the real binary
//! unchanged, flat and grouped; a sequence model's history travels once in
//! the request-level inputs.
#![cfg(feature = "torch")]

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::ranking::{ranking, request_level};
use common::{assert_close, batch_mode, start_with, wire};
use narsil::kserve_proto::grpc_inference_service_client::GrpcInferenceServiceClient;
use narsil::kserve_proto::{ModelInferRequest, ModelMetadataRequest};
use narsil::torchrec_proto::predictor_client::PredictorClient as TorchRecClient;
use narsil::wire::kserve::{encode, first_scores};
use narsil::wire::torchrec::SCORES_KEY;
use narsil_core::golden::{test_model_dir, Golden};
use narsil_engine::EngineConfig;
use narsil_torch::{SplitFactory, TorchConfig, TorchFactory};

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
    // Declares the ranking workload's request-level features, so the
    // script's grouped call is taken (its flat calls are, as for any model).
    let server = Command::new(env!("CARGO_BIN_EXE_narsil"))
        .args(["serve", "--log-level", "warn"])
        .arg("--request-level")
        .arg(request_level().join(","))
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

/// A version of a served model that is not served (still loading, failed,
/// retired or never published): ModelReady answers not ready, so a
/// readiness poll waits on it instead of failing, and ModelInfer and
/// ModelMetadata answer NOT_FOUND naming the version, as Triton answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_that_is_not_served_is_not_ready_and_not_found_as_triton_answers() {
    let server = common::start(common::batch_mode(1, 4), 0).await.ready().await;
    let mut kserve = GrpcInferenceServiceClient::new(server.channel().await);
    for (version, want) in [("", true), ("99", false)] {
        let ready = kserve
            .model_ready(narsil::kserve_proto::ModelReadyRequest {
                name: String::new(),
                version: version.into(),
            })
            .await
            .unwrap_or_else(|status| panic!("ModelReady of version {version:?}: {status:?}"))
            .into_inner()
            .ready;
        assert_eq!(ready, want, "ModelReady of version {version:?}");
    }
    let mut request = encode(&common::request(1, 2), 13, 26);
    request.model_version = "99".into();
    let status = kserve.model_infer(request).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    assert!(status.message().contains("model_version") && status.message().contains("\"99\""), "{status:?}");
    let status = kserve
        .model_metadata(ModelMetadataRequest { name: String::new(), version: "99".into() })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    server.stop().await.unwrap();
}

/// The ranking workload's server: its request-level features declared.
fn ranking_config() -> EngineConfig {
    EngineConfig { request_level: Some(request_level()), max_batch_rows: 128, ..batch_mode(1, 16) }
}

fn split_factory() -> Arc<SplitFactory> {
    Arc::new(SplitFactory::load(TorchConfig::new(test_model_dir().join("split"))).unwrap())
}

/// A raw-contents ModelInfer request with typed contents instead.
fn typed(request: &ModelInferRequest) -> ModelInferRequest {
    let mut typed = request.clone();
    for (tensor, bytes) in typed.inputs.iter_mut().zip(std::mem::take(&mut typed.raw_input_contents)) {
        let mut contents = narsil::kserve_proto::InferTensorContents::default();
        match tensor.datatype.as_str() {
            "FP32" => {
                contents.fp32_contents =
                    bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
            }
            _ => {
                contents.int64_contents =
                    bytes.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap())).collect()
            }
        }
        tensor.contents = Some(contents);
    }
    typed
}

fn position(request: &ModelInferRequest, name: &str) -> usize {
    request.inputs.iter().position(|t| t.name == name).unwrap_or_else(|| panic!("no input {name}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grouped_kserve_requests_score_as_the_same_requests_sent_flat() {
    let server = start_with(split_factory(), ranking_config()).await.ready().await;
    let channel = server.channel().await;
    let mut kserve = GrpcInferenceServiceClient::new(channel.clone());
    let metadata = kserve
        .model_metadata(ModelMetadataRequest { name: "dlrm".into(), version: String::new() })
        .await
        .unwrap()
        .into_inner();
    let inputs: Vec<(&str, &str, &[i64])> =
        metadata.inputs.iter().map(|t| (t.name.as_str(), t.datatype.as_str(), t.shape.as_slice())).collect();
    assert_eq!(
        inputs,
        [
            ("dense", "FP32", &[-1, 13][..]),
            ("lengths", "INT64", &[-1, 26]),
            ("ids", "INT64", &[-1]),
            ("request_dense", "FP32", &[1, 13]),
            ("request_lengths", "INT64", &[1, 13]),
            ("request_ids", "INT64", &[1, -1]),
        ],
        "ModelMetadata lists the request-level inputs"
    );
    // Alone: users 1..3, 1 to 300 candidates (the largest split across
    // forwards of 128 rows, its block shared by the parts); the grouped
    // form with raw contents, typed contents and B from lengths (no dense).
    let requests: Vec<_> =
        [(1, 40), (2, 1), (3, 300), (1, 7)].iter().map(|&(u, c)| ranking(u, c, 1000)).collect();
    let mut flat_scores = Vec::new();
    for (i, (grouped, flat)) in requests.iter().enumerate() {
        let want =
            first_scores(&kserve.model_infer(encode(flat, 13, 26)).await.unwrap().into_inner()).unwrap();
        assert_eq!(want.len(), flat.batch_size as usize);
        let raw = encode(grouped, 13, 26);
        assert_eq!(raw.inputs[0].shape, [i64::from(grouped.batch_size), 0], "dense [B, 0]");
        let mut without_dense = typed(&raw);
        without_dense.inputs.remove(position(&raw, "dense"));
        for (form, request) in
            [("raw", raw.clone()), ("typed", typed(&raw)), ("without dense", without_dense)]
        {
            let response = kserve.model_infer(request).await.unwrap().into_inner();
            assert_eq!(response.id, grouped.request_id);
            assert_eq!(response.outputs[0].shape, [i64::from(grouped.batch_size)]);
            assert_close(&first_scores(&response).unwrap(), &want, &format!("grouped request {i}, {form}"));
        }
        flat_scores.push(want);
    }
    // Concurrently, grouped twice beside their flat twin, so they fuse.
    let calls = requests.iter().flat_map(|(g, f)| [g, f, g]).map(|r| {
        let (request, mut kserve) = (encode(r, 13, 26), GrpcInferenceServiceClient::new(channel.clone()));
        tokio::spawn(async move {
            first_scores(&kserve.model_infer(request).await.unwrap().into_inner()).unwrap()
        })
    });
    for (i, scores) in futures_util::future::join_all(calls).await.into_iter().enumerate() {
        assert_close(&scores.unwrap(), &flat_scores[i / 3], &format!("concurrent call {i}"));
    }
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_request_level_inputs_get_invalid_argument_naming_them() {
    let server = start_with(split_factory(), ranking_config()).await.ready().await;
    let mut kserve = GrpcInferenceServiceClient::new(server.channel().await);
    let (grouped, _) = ranking(5, 3, 1000);
    let grouped = encode(&grouped, 13, 26);
    let edited = |name: &'static str, shape: Vec<i64>, bytes: Vec<u8>| {
        let mut request = grouped.clone();
        let i = position(&request, name);
        request.inputs[i].shape = shape;
        request.raw_input_contents[i] = bytes.into();
        request
    };
    let floats = |n: usize, v: f32| v.to_le_bytes().repeat(n);
    let ints = |values: &[i64]| values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
    let user_ids = grouped.raw_input_contents[position(&grouped, "request_ids")].len() as i64 / 8;
    let mut out_of_range = grouped.raw_input_contents[position(&grouped, "request_ids")].to_vec();
    out_of_range[..8].copy_from_slice(&1000i64.to_le_bytes());
    let mut with_weights = grouped.clone();
    with_weights.inputs.push(narsil::kserve_proto::model_infer_request::InferInputTensor {
        name: "request_weights".into(),
        datatype: "FP32".into(),
        shape: vec![1, 2],
        ..Default::default()
    });
    with_weights.raw_input_contents.push(floats(2, 1.0).into());
    let cases: Vec<(&str, &str, ModelInferRequest)> = vec![
        (
            "request_dense",
            "has shape [1, 12], expected [1, 13]",
            edited("request_dense", vec![1, 12], floats(12, 0.5)),
        ),
        ("request_dense", "is NaN", edited("request_dense", vec![1, 13], floats(13, f32::NAN))),
        (
            "request_lengths",
            "has shape [1, 12], expected [1, 13] or [13]",
            edited("request_lengths", vec![1, 12], ints(&[1; 12])),
        ),
        ("request_lengths", "has length -1", edited("request_lengths", vec![13], ints(&[-1; 13]))),
        (
            "request_ids",
            "has id 1000 outside [0, 1000)",
            edited("request_ids", vec![1, user_ids], out_of_range),
        ),
        ("request_ids", "has 2 ids but", edited("request_ids", vec![2], ints(&[1, 2]))),
        (
            "request_ids",
            "expected [1, N] or [N]",
            edited("request_ids", vec![2, user_ids / 2], ints(&vec![1; user_ids as usize / 2 * 2])),
        ),
        ("request_weights", "has 2 weights", with_weights),
        ("dense", "has shape [3, 13], expected [B, 0]", edited("dense", vec![3, 13], floats(39, 0.5))),
        ("lengths", "has shape [3, 26], expected [3, 13]", edited("lengths", vec![3, 26], ints(&[1; 78]))),
        ("ids", "has 3 ids but the lengths sum to 39", edited("ids", vec![3], ints(&[1, 2, 3]))),
    ];
    for (input, says, request) in cases {
        let status = kserve.model_infer(request).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{input}: {status:?}");
        let prefix = format!("invalid inputs[{input}]: ");
        assert!(
            status.message().starts_with(&prefix) && status.message().contains(says),
            "{input}: want {prefix}...{says}, got {}",
            status.message()
        );
    }
    server.stop().await.unwrap();
    // A model served declaring no request-level feature (`--request-level
    // none`; the test model's export declares some) refuses request_*.
    let none = EngineConfig { request_level: Some(vec!["none".into()]), ..batch_mode(1, 16) };
    let server = start_with(split_factory(), none).await.ready().await;
    let mut kserve = GrpcInferenceServiceClient::new(server.channel().await);
    let status = kserve.model_infer(grouped).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().starts_with("invalid inputs[request_*]: ")
            && status.message().contains("declares no request-level feature"),
        "{}",
        status.message()
    );
    server.stop().await.unwrap();
}

/// A sequence model (the DIN ranker `models/export_din.py` exports): the
/// user's history sent once in KServe's request-level inputs (its two
/// channels' lengths in `request_lengths`, their ids in `request_ids`),
/// the candidates' own bags per row, scores as TorchRec's eager forward.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_models_history_sent_once_as_request_inputs_scores_as_torchrec() {
    let din = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/generated/test-din");
    let factory = Arc::new(SplitFactory::load(TorchConfig::new(din.join("split"))).unwrap());
    let server = start_with(factory, batch_mode(1, 16)).await.ready().await;
    let mut kserve = GrpcInferenceServiceClient::new(server.channel().await);
    let declared = ["user_0", "user_1", "user_2", "hist_item", "hist_cat", "dense"].map(String::from);
    let goldens = common::ranking::golden_ranking_declaring(&din, &declared);
    assert!(goldens.len() >= 4);
    for (i, golden) in goldens.into_iter().enumerate() {
        // 8 dense features (request-level), 7 sparse (2 per candidate row).
        let response = kserve.model_infer(encode(&golden.grouped, 8, 7)).await.unwrap().into_inner();
        assert_close(&first_scores(&response).unwrap(), &golden.scores_int8, &format!("ranking request {i}"));
    }
    server.stop().await.unwrap();
}
