//! Models with TorchRec's inference signature (`forward(Dict[str, Tensor]) ->
//! Dict[str, Tensor]`), packaged the way TorchRec's tooling does by
//! `models/export_torchrec.py`, served end to end over real gRPC with the
//! schema from the `model.json` beside them:
//!
//! * TorchRec's `DLRMPredictModule` (one output, `default`);
//! * TorchRec's `DLRM_DCN` (DCNv2 cross layers) behind the same signature;
//! * a two-task model (`click`, `conversion`) with weighted (id-score-list)
//!   features.
//!
//! Both protocols, batch and worker modes, against Python's golden scores;
//! fused == alone for every output; bf16 dense arithmetic on every kind and
//! form; bad weights and schema mismatches.
// Cases are tables of (name, input, expected) tuples, read best inline.
#![allow(clippy::type_complexity)]
#![cfg(feature = "torch")]

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{assert_close, batch_mode, wire, worker_mode, TestServer, SCORE_TOLERANCE};
use narsil::proto::predictor_client::PredictorClient;
use narsil::proto::{ModelInfoRequest, PredictResponse};
use narsil::torchrec_proto::predictor_client::PredictorClient as TorchRecClient;
use narsil::wire::torchrec::{encode_weighted, MODEL_VERSION_HEADER};
use narsil_core::conformance::{self, concurrent_lanes, golden_outputs, golden_parity};
use narsil_core::golden::{Golden, GoldenRequest};
use narsil_core::request::IdPolicy;
use narsil_core::{error_chain, BackendError, BackendFactory, ModelSchema};
use narsil_engine::EngineConfig;
use narsil_torch::{
    cpu_bf16_instructions, DenseForm, DensePrecision, SplitFactory, TorchConfig, TorchFactory,
};
use tonic::Code;

fn model_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/generated").join(name);
    assert!(
        dir.join("golden.json").is_file(),
        "no exported model in {0}: run scripts/test.sh, or .venv/bin/python models/export_torchrec.py --out {0}",
        dir.display()
    );
    dir
}

/// `name` is an export (its model.pt) or an export's split form, its
/// tables pooled by Narsil's embedding stage: `NAME/split`, written from the
/// model before packaging, or `NAME/extracted`, extracted from the packaged
/// model.pt by models/extract_split.py.
fn load(name: &str) -> Arc<dyn BackendFactory> {
    load_with(name, |_| {}).unwrap()
}

/// [`load`] with the config changed by `configure` first.
fn load_with(
    name: &str,
    configure: impl Fn(&mut TorchConfig),
) -> Result<Arc<dyn BackendFactory>, BackendError> {
    let dir = model_dir(name);
    if name.ends_with("/split") || name.ends_with("/extracted") {
        let mut config = TorchConfig::new(dir);
        configure(&mut config);
        Ok(Arc::new(SplitFactory::load(config)?))
    } else {
        let mut config = TorchConfig::new(dir.join("model.pt"));
        configure(&mut config);
        Ok(Arc::new(TorchFactory::load(config)?))
    }
}

async fn serve(name: &str, config: EngineConfig) -> TestServer {
    common::start_with(load(name), config).await.ready().await
}

/// Every output of a narsil.v1 response against the golden request's.
fn check_narsil(response: &PredictResponse, schema: &ModelSchema, g: &GoldenRequest, what: &str) {
    let first = &schema.outputs[0];
    assert_close(&response.scores, &g.outputs[first], &format!("{what}: scores ({first})"));
    if schema.outputs.len() > 1 {
        for name in &schema.outputs {
            let got =
                &response.outputs.get(name).unwrap_or_else(|| panic!("{what}: no output {name}")).scores;
            assert_close(got, &g.outputs[name], &format!("{what}: output {name}"));
        }
    } else {
        assert!(response.outputs.is_empty(), "{what}: single-output models fill only scores");
    }
}

/// Each golden request over both protocols, one at a time.
async fn golden_over_both_protocols(name: &str, config: EngineConfig) {
    let server = serve(name, config).await;
    let schema = server.engine.schema().clone();
    let golden = Golden::read(&model_dir(name)).unwrap();
    let mut narsil = server.client().await;
    let mut torchrec = TorchRecClient::new(server.channel().await);
    let version = narsil.model_info(ModelInfoRequest::default()).await.unwrap().into_inner().version;
    assert_eq!(version, "1", "model.json's default version");
    for (i, g) in golden.requests.iter().enumerate() {
        let response = narsil.predict(wire(g, "")).await.unwrap().into_inner();
        check_narsil(&response, &schema, g, &format!("{name} narsil.v1 request {i}"));
        assert_eq!(response.model_version, version, "every answer names the model version");
        let request = encode_weighted(&wire(g, ""), schema.num_unweighted(), schema.num_sparse());
        let response = torchrec.predict(request).await.unwrap();
        assert_eq!(response.metadata().get(MODEL_VERSION_HEADER).unwrap(), version.as_str());
        let predictions = response.into_inner().predictions;
        assert_eq!(predictions.len(), schema.outputs.len(), "every output by name");
        for output in &schema.outputs {
            assert_close(
                &predictions[output].data,
                &g.outputs[output],
                &format!("{name} TorchRec request {i} {output}"),
            );
        }
    }
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torchrec_dlrm_serves_python_golden_scores_in_batch_and_worker_modes() {
    golden_over_both_protocols("test-torchrec-dlrm", batch_mode(1, 16)).await;
    golden_over_both_protocols("test-torchrec-dlrm", worker_mode(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torchrec_dlrm_dcn_serves_python_golden_scores_in_batch_and_worker_modes() {
    golden_over_both_protocols("test-torchrec-dcn", batch_mode(1, 16)).await;
    golden_over_both_protocols("test-torchrec-dcn", worker_mode(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multitask_weighted_model_serves_every_output_in_batch_and_worker_modes() {
    golden_over_both_protocols("test-torchrec-multitask", batch_mode(1, 16)).await;
    golden_over_both_protocols("test-torchrec-multitask", worker_mode(2)).await;
}

/// `narsil load --protocol torchrec --weighted-features 4` drives the
/// two-task model, whose last four features are weighted: every request is
/// answered. Without the flag every one is refused (its weighted features
/// arrive without weights, as unweighted ones).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn narsil_load_drives_a_weighted_model_over_torchrecs_protocol() {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        load: narsil::load::LoadArgs,
    }
    let server = serve("test-torchrec-multitask", batch_mode(1, 16)).await;
    let run = |weighted: &str| {
        let flags = ["--protocol", "torchrec", "--num-sparse", "30", "--weighted-features", weighted];
        let rest =
            ["--table-rows", "1000", "--requests", "40", "--warmup", "0", "--samples-per-request", "4"];
        let argv = [&["load", "--addr", server.url.as_str()][..], &flags, &rest].concat();
        <Cli as clap::Parser>::parse_from(argv).load
    };
    let report = narsil::load::drive(&run("4")).await.unwrap();
    assert_eq!((report.requests, report.ok), (40, 40), "{:?}", report.by_code);
    let unweighted = narsil::load::drive(&run("0")).await.unwrap();
    assert_eq!((unweighted.requests, unweighted.ok), (40, 0), "{:?}", unweighted.by_code);
    server.stop().await.unwrap();
}

/// The split forms, written before packaging and extracted after: shared,
/// mean-pooled and weighted features and two outputs through the embedding
/// stage, against the single-file model's golden scores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_forms_serve_the_packaged_models_scores_in_batch_and_worker_modes() {
    for name in [
        "test-torchrec-dlrm/split",
        "test-torchrec-dcn/split",
        "test-torchrec-multitask/split",
        "test-torchrec-dlrm/extracted",
        "test-torchrec-dcn/extracted",
        "test-torchrec-multitask/extracted",
    ] {
        golden_over_both_protocols(name, batch_mode(1, 16)).await;
        golden_over_both_protocols(name, worker_mode(2)).await;
    }
}

/// Every TorchRec-packaged model and both of its split forms.
const EVERY_MODEL_AND_FORM: [&str; 9] = [
    "test-torchrec-dlrm",
    "test-torchrec-dcn",
    "test-torchrec-multitask",
    "test-torchrec-dlrm/split",
    "test-torchrec-dcn/split",
    "test-torchrec-multitask/split",
    "test-torchrec-dlrm/extracted",
    "test-torchrec-dcn/extracted",
    "test-torchrec-multitask/extracted",
];

/// In process: alone and fused against Python, and several lanes at once.
#[test]
fn every_model_and_its_split_form_pass_the_backend_conformance_kit() {
    for name in EVERY_MODEL_AND_FORM {
        let factory = load(name);
        let golden = Golden::read(&model_dir(name)).unwrap();
        let schema = factory.schema().clone();
        golden_parity(&*factory, &golden, |g| golden_outputs(&schema, g), SCORE_TOLERANCE);
        let requests = conformance::requests(&*factory, &golden, IdPolicy::Reject);
        concurrent_lanes(&*factory, &requests, 2, 2, SCORE_TOLERANCE);
    }
}

/// bf16 dense arithmetic against Python's FP32 scores (the bound of the
/// single-file bf16 path, `golden_parity.rs` in narsil-torch).
const BF16_TOLERANCE_VS_FP32: f32 = 5e-3;
/// bf16, one request fused with others vs alone (oneDNN's blocking changes
/// with the row count).
const BF16_FUSED_VS_ALONE: f32 = 1e-3;

/// `--dense-precision bf16` on every kind TorchRec packages (DLRM, DLRM_DCN,
/// two-task with weighted features) and both split forms: within
/// [`BF16_TOLERANCE_VS_FP32`] of the FP32 golden scores alone, and fused
/// (the golden requests four times over) within [`BF16_FUSED_VS_ALONE`] of
/// alone. On a CPU without bf16 instructions it is emulated (the same
/// numerics, slower), so this runs on every CPU.
#[test]
fn every_model_and_form_runs_in_bf16_close_to_fp32_alone_and_fused() {
    let emulated = cpu_bf16_instructions().is_empty();
    if emulated {
        eprintln!("bf16 emulated: this CPU has neither AVX512-BF16 nor AMX-BF16");
    }
    for name in EVERY_MODEL_AND_FORM {
        let factory = load_with(name, |config| {
            config.dense_precision = DensePrecision::Bf16;
            config.bf16_emulated = emulated;
        })
        .unwrap_or_else(|e| panic!("{name} in bf16: {}", error_chain(&e)));
        close_to_golden_alone_and_fused(name, &*factory, BF16_TOLERANCE_VS_FP32, BF16_FUSED_VS_ALONE, "bf16");
    }
}

/// `factory`'s outputs within `tolerance` of model `name`'s golden outputs
/// alone, and fused (the golden requests four times over) within
/// `fused_tolerance` of alone; prints both differences, labelled `what`.
fn close_to_golden_alone_and_fused(
    name: &str,
    factory: &dyn BackendFactory,
    tolerance: f32,
    fused_tolerance: f32,
    what: &str,
) {
    let golden = Golden::read(&model_dir(name)).unwrap();
    let schema = factory.schema().clone();
    let worst = golden_parity(factory, &golden, |g| golden_outputs(&schema, g), tolerance);
    let requests = conformance::requests(factory, &golden, IdPolicy::Reject);
    let fused = conformance::fused_equals_alone(factory, &requests, 4, fused_tolerance);
    eprintln!("{name} {what}: max |diff| vs golden {worst:e}, fused vs alone {fused:e}");
}

/// The split forms whose dense network was also compiled by AOTInductor
/// (`export_torchrec.py --split --pt2`) in both forms, FP32 and bf16, as
/// written from the Python model (`split`) and as extracted from the
/// TorchScript file alone (`extracted`, its graph retraced for the package):
/// TorchScript and the package each give Python's scores alone and fused.
/// The bf16 package exists only where the exporting CPU had bf16
/// instructions; elsewhere its case is skipped, saying so.
#[test]
fn split_forms_serve_the_same_scores_from_torchscript_and_from_the_package() {
    let test = "split_forms_serve_the_same_scores_from_torchscript_and_from_the_package";
    let emulated = cpu_bf16_instructions().is_empty();
    for name in [
        "test-torchrec-dcn/split",
        "test-torchrec-multitask/split",
        "test-torchrec-dcn/extracted",
        "test-torchrec-multitask/extracted",
    ] {
        let split = narsil_embedding::SplitSchema::read(&model_dir(name)).unwrap();
        assert!(split.dense_package.is_some(), "{name}: no dense.pt2 (export it with --split --pt2)");
        for (form, precision) in [
            (DenseForm::TorchScript, DensePrecision::Fp32),
            (DenseForm::Pt2, DensePrecision::Fp32),
            (DenseForm::TorchScript, DensePrecision::Bf16),
            (DenseForm::Pt2, DensePrecision::Bf16),
        ] {
            let what = format!("{form} {precision}");
            if form == DenseForm::Pt2
                && precision == DensePrecision::Bf16
                && split.dense_package_bf16.is_none()
            {
                eprintln!(
                    "skipped: {test}: {name} {what}: no dense_bf16.pt2 (exported on a CPU without bf16 instructions)"
                );
                continue;
            }
            let factory = load_with(name, |config| {
                config.dense_form = form;
                config.dense_precision = precision;
                config.bf16_emulated = emulated;
            })
            .unwrap_or_else(|e| panic!("{name} {what}: {}", error_chain(&e)));
            let (tolerance, fused_tolerance) = match precision {
                DensePrecision::Fp32 => (SCORE_TOLERANCE, SCORE_TOLERANCE),
                DensePrecision::Bf16 => (BF16_TOLERANCE_VS_FP32, BF16_FUSED_VS_ALONE),
                DensePrecision::Int8 => unreachable!("INT8: crates/narsil-torch/tests/int8_dense.rs"),
            };
            close_to_golden_alone_and_fused(name, &*factory, tolerance, fused_tolerance, &what);
        }
    }
}

/// `--dense-precision int8` on a DLRM_DCN (`export_torchrec.py --split --pt2
/// --int8`: every GEMM, the cross layers' included, in INT8, none left in
/// FP32): within twice what the export recorded of Python's FP32 scores,
/// alone and fused ([`conformance::int8_parity`]; the test model records
/// ~7e-4). The package exists only where the exporting CPU had AVX2 (7-bit
/// activations) or INT8 dot-product instructions; elsewhere the test says
/// skipped (fails under NARSIL_REQUIRE_INT8=1).
#[test]
fn dcn_split_serves_its_int8_package_within_the_recorded_bound_alone_and_fused() {
    let test = "dcn_split_serves_its_int8_package_within_the_recorded_bound_alone_and_fused";
    let name = "test-torchrec-dcn/split";
    let split = narsil_embedding::SplitSchema::read(&model_dir(name)).unwrap();
    if split.dense_package_int8.is_none() {
        let why = "test-torchrec-dcn/split has no dense_int8.pt2 (exported without --int8: this CPU has \
                   neither AVX2 nor AVX512-VNNI, AVX-VNNI or AMX-INT8)";
        narsil_core::skip::skip_or_fail("NARSIL_REQUIRE_INT8", test, why);
        return;
    }
    let quality = conformance::int8_quality(&model_dir(name));
    assert_eq!(quality["linear_layers"]["fp32"], 0, "a linear layer left in FP32: {quality}");
    let factory = load_with(name, |config| config.dense_precision = DensePrecision::Int8)
        .unwrap_or_else(|e| panic!("{name} int8: {}", error_chain(&e)));
    let golden = Golden::read(&model_dir(name)).unwrap();
    let schema = factory.schema().clone();
    let parity =
        conformance::int8_parity(&*factory, &golden, &model_dir(name), |g| golden_outputs(&schema, g));
    eprintln!("{name} int8: {parity:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fused_outputs_equal_alone_with_16_concurrent_clients() {
    for name in
        ["test-torchrec-multitask", "test-torchrec-multitask/split", "test-torchrec-multitask/extracted"]
    {
        fused_equal_alone(name).await;
    }
}

async fn fused_equal_alone(name: &str) {
    let server = serve(name, batch_mode(1, 16)).await;
    let schema = server.engine.schema().clone();
    let golden = Golden::read(&model_dir(name)).unwrap();
    let requests: Vec<&GoldenRequest> = golden.requests.iter().cycle().take(16).collect();
    let channel = server.channel().await;
    let mut fused = 0;
    for round in 0..4 {
        let responses = common::predict_all(&channel, &requests).await;
        for (i, (response, g)) in responses.iter().zip(&requests).enumerate() {
            check_narsil(response, &schema, g, &format!("round {round} client {i}"));
            fused += usize::from(response.fused_requests > 1);
        }
    }
    assert!(fused > 0, "no request was fused with another");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_info_lists_outputs_and_weighted_features() {
    let server = serve("test-torchrec-multitask", batch_mode(1, 16)).await;
    let info = server.client().await.model_info(ModelInfoRequest::default()).await.unwrap().into_inner();
    assert_eq!(info.outputs, ["click", "conversion"]);
    assert_eq!(info.sparse_features.len(), 30);
    assert!(info.sparse_features[..26].iter().all(|f| !f.weighted));
    assert!(info.sparse_features[26..].iter().all(|f| f.weighted && f.name.starts_with("wcat_")));
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_weights_are_invalid_argument_naming_the_field() {
    let name = "test-torchrec-multitask";
    let server = serve(name, batch_mode(1, 16)).await;
    let schema = server.engine.schema().clone();
    let golden = Golden::read(&model_dir(name)).unwrap();
    let g = golden.requests.iter().find(|g| !g.weights.is_empty()).expect("a golden request with weights");
    let mut narsil = server.client().await;
    let mut torchrec = TorchRecClient::new(server.channel().await);
    let edits: [(&str, fn(&mut Vec<f32>)); 3] = [
        ("one weight short", |w| {
            w.pop();
        }),
        ("one weight too many", |w| w.push(1.0)),
        ("a NaN weight", |w| w[0] = f32::NAN),
    ];
    for (what, edit) in edits {
        let mut bad = wire(g, "");
        edit(&mut bad.sparse_weights);
        let status = narsil.predict(bad.clone()).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{what}: {status:?}");
        assert!(status.message().starts_with("invalid sparse_weights:"), "{what}: {}", status.message());
        // The same edit on TorchRec's wire: its weights are f32 bytes.
        let mut request = encode_weighted(&wire(g, ""), schema.num_unweighted(), schema.num_sparse());
        let group = request.id_score_list_features.as_mut().unwrap();
        let mut weights: Vec<f32> =
            group.weights.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
        edit(&mut weights);
        group.weights = weights.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>().into();
        let status = torchrec.predict(request).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{what}: {status:?}");
        assert!(status.message().contains("id_score_list_features.weights"), "{what}: {}", status.message());
    }
    // An out-of-range id of a weighted feature is named in its own group.
    let mut request = encode_weighted(&wire(g, ""), schema.num_unweighted(), schema.num_sparse());
    let values = &mut request.id_score_list_features.as_mut().unwrap().values;
    *values = [&5000i32.to_le_bytes()[..], &values[4..]].concat().into();
    let status = torchrec.predict(request).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().starts_with("invalid id_score_list_features.values:")
            && status.message().contains("(wcat_")
            && status.message().contains("has id 5000"),
        "{}",
        status.message()
    );
    // A model without weighted features takes none.
    server.stop().await.unwrap();
    let server = serve("test-torchrec-dlrm", batch_mode(1, 16)).await;
    let dlrm = Golden::read(&model_dir("test-torchrec-dlrm")).unwrap();
    let mut request = wire(&dlrm.requests[0], "");
    request.sparse_weights = vec![1.0];
    let status = server.client().await.predict(request).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("sparse_weights") && status.message().contains("no weighted feature"),
        "{status:?}"
    );
    server.stop().await.unwrap();
}

/// A copy of an exported model in a fresh directory, with `model.json`
/// rewritten by `edit` (or removed when it returns `None`).
fn with_config(name: &str, edit: impl FnOnce(serde_json::Value) -> Option<serde_json::Value>) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let from = model_dir(name);
    let dir = std::env::temp_dir().join(format!(
        "narsil-config-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(from.join("model.pt"), dir.join("model.pt")).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(from.join("model.json")).unwrap()).unwrap();
    if let Some(config) = edit(config) {
        std::fs::write(dir.join("model.json"), config.to_string()).unwrap();
    }
    dir
}

fn load_error(dir: &Path) -> String {
    let error = TorchFactory::load(TorchConfig::new(dir.join("model.pt"))).err().expect("must not load");
    std::fs::remove_dir_all(dir).ok();
    error_chain(&error)
}

#[test]
fn a_config_that_does_not_match_the_model_fails_at_start_up_naming_the_field() {
    let cases: Vec<(&str, Box<dyn FnOnce(serde_json::Value) -> Option<serde_json::Value>>, &str)> = vec![
        ("no model.json", Box::new(|_| None), "model.json"),
        (
            "dense_features off by one",
            Box::new(|mut c| {
                c["dense_features"] = 12.into();
                Some(c)
            }),
            "does not match the model: a 2-row forward with dense_features 12,",
        ),
        (
            "a sparse feature missing",
            Box::new(|mut c| {
                c["sparse_features"].as_array_mut().unwrap().pop();
                Some(c)
            }),
            "does not match the model: a 2-row forward with dense_features 13, 29 sparse_features",
        ),
        (
            "an output the model does not return",
            Box::new(|mut c| {
                c["outputs"] = serde_json::json!(["click", "purchase"]);
                Some(c)
            }),
            "the model returned no tensor named `purchase`",
        ),
        (
            "a table without rows",
            Box::new(|mut c| {
                c["sparse_features"][3]["num_rows"] = 0.into();
                Some(c)
            }),
            "sparse_features[3].num_rows",
        ),
    ];
    for (what, edit, field) in cases {
        let err = load_error(&with_config("test-torchrec-multitask", edit));
        assert!(err.contains(field), "{what}: {err}");
    }
}

#[test]
fn model_config_flag_names_a_config_elsewhere() {
    let dir = with_config("test-torchrec-dlrm", |_| None);
    let mut config = TorchConfig::new(dir.join("model.pt"));
    config.model_config = Some(model_dir("test-torchrec-dlrm").join("model.json"));
    let factory = TorchFactory::load(config).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(factory.schema().outputs, ["default"]);
    assert_eq!(factory.schema().num_sparse(), 26);
}

/// The real binary: `narsil serve --model DIR/model.pt` and nothing else
/// serves a TorchRec-signature model with the `model.json` beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn narsil_serve_with_only_the_model_path_serves_it() {
    use std::process::{Command, Stdio};
    let dir = model_dir("test-torchrec-multitask");
    let listeners = common::Listeners::new();
    let mut child = Command::new(env!("CARGO_BIN_EXE_narsil"))
        .arg("serve")
        .args(listeners.args(false))
        .arg("--model")
        .arg(dir.join("model.pt"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let url = listeners.wait(&mut child, std::time::Duration::from_secs(60)).await.url();
    let channel = common::wait_serving(&url, std::time::Duration::from_secs(60)).await;
    let mut client = PredictorClient::new(channel);
    let info = client.model_info(ModelInfoRequest::default()).await.unwrap().into_inner();
    assert_eq!((info.backend.as_str(), info.name.as_str()), ("torch", "test-torchrec-multitask"));
    let golden = Golden::read(&dir).unwrap();
    let schema = load("test-torchrec-multitask").schema().clone();
    let response = client.predict(wire(&golden.requests[2], "")).await.unwrap().into_inner();
    check_narsil(&response, &schema, &golden.requests[2], "narsil serve --model");
    common::stop(&mut child);
}
