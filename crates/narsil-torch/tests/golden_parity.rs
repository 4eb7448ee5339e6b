//! The libtorch backend in process against the scores `models/export_dlrm.py`
//! computed in Python with the same TorchScript files: each golden request
//! alone, then all of them fused into one batch; split models in bf16 and
//! with the AOTInductor-compiled dense network.
//!
//! Needs an exported model: `scripts/test.sh` writes a small one to
//! `models/generated/test-small` (or set `NARSIL_TEST_MODEL_DIR`).

use narsil_core::conformance::{self, concurrent_lanes, fused_equals_alone, golden_parity};
use narsil_core::golden::{copy_split_model, max_abs_diff, test_model_dir, Golden};
use narsil_core::request::IdPolicy;
use narsil_core::{assemble, error_chain, BackendFactory};
use narsil_torch::aoti_package::{self, AotiPackage};
use narsil_torch::{
    cpu_bf16_instructions, DenseForm, DensePrecision, SplitFactory, TorchConfig, TorchFactory,
};

/// Same libtorch and kernels as the Python side.
const TOLERANCE: f32 = 1e-6;

fn factory(file: &str) -> TorchFactory {
    TorchFactory::load(TorchConfig::new(test_model_dir().join(file))).unwrap()
}

fn golden() -> Golden {
    Golden::read(&test_model_dir()).unwrap()
}

#[test]
fn int8_model_matches_python_alone_and_fused() {
    golden_parity(&factory("model_default.pt"), &golden(), |g| g.scores_int8.clone(), TOLERANCE);
}

#[test]
fn fp32_model_matches_python_alone_and_fused() {
    golden_parity(&factory("model_fp32.pt"), &golden(), |g| g.scores_fp32.clone(), TOLERANCE);
}

/// Lanes share one TorchScript module and run forwards on it at once.
#[test]
fn concurrent_lanes_sharing_the_module_give_the_scores_alone() {
    let factory = factory("model_default.pt");
    let requests = conformance::requests(&factory, &golden(), IdPolicy::Reject);
    concurrent_lanes(&factory, &requests, 3, 3, TOLERANCE);
}

#[test]
fn schema_is_read_from_the_model() {
    let factory = factory("model_default.pt");
    let schema = factory.schema();
    assert_eq!(schema.backend, "torch");
    assert_eq!(schema.num_dense, 13);
    assert_eq!(schema.num_sparse(), 26);
    assert_eq!(schema.sparse[25].name, "cat_25");
    assert_eq!(schema.sparse[0].num_rows, 1000);
}

#[test]
fn a_missing_model_file_is_a_clear_error() {
    let err = error_chain(&TorchFactory::load(TorchConfig::new("/nonexistent/model.pt")).err().unwrap());
    assert!(err.contains("/nonexistent/model.pt") && err.contains("export_dlrm.py"), "{err}");
}

#[test]
fn a_file_that_is_not_torchscript_is_a_clear_error() {
    let path = std::env::temp_dir().join(format!("narsil-not-a-model-{}.pt", std::process::id()));
    std::fs::write(&path, b"not a model").unwrap();
    let err = error_chain(&TorchFactory::load(TorchConfig::new(&path)).err().unwrap());
    std::fs::remove_file(&path).unwrap();
    assert!(err.contains(&path.display().to_string()) && err.contains("not a TorchScript model"), "{err}");
}

/// On a machine without a GPU, `cuda:0` is a clear error at load time. With
/// one, the FP32 model runs there (pinned staging, asynchronous copies) and
/// stays within 1e-5 of Python's CPU scores (different kernels).
#[test]
fn cuda_device_is_selectable_and_errors_clearly_without_a_gpu() {
    let mut config = TorchConfig::new(test_model_dir().join("model_fp32.pt"));
    config.device = "cuda:0".into();
    match TorchFactory::load(config) {
        Err(err) => {
            let err = error_chain(&err);
            assert_eq!(tch::Cuda::device_count(), 0, "a GPU is visible, yet: {err}");
            assert!(err.contains("cuda:0") && err.contains("CUDA device"), "{err}");
        }
        Ok(factory) => {
            let schema = factory.schema().clone();
            assert_eq!(schema.device, "cuda:0");
            let mut lane = factory.create_lane(0).unwrap();
            let golden = Golden::read(&test_model_dir()).unwrap();
            for g in &golden.requests {
                let batch = g.validated(&schema, IdPolicy::Reject).unwrap();
                let scores =
                    lane.forward(&assemble(schema.num_dense, schema.num_sparse(), [&batch])).unwrap();
                let diff = max_abs_diff(&scores, &g.scores_fp32).unwrap();
                assert!(diff <= 1e-5, "CUDA vs Python CPU: {diff}");
            }
        }
    }
}

/// bf16 dense arithmetic against the FP32 scores Python computed.
const BF16_TOLERANCE_VS_FP32: f32 = 5e-3;
/// bf16, one request fused with others vs alone: oneDNN's blocking changes
/// with the number of rows, and a different summation order can round a bf16
/// activation the other way.
const BF16_FUSED_VS_ALONE: f32 = 1e-3;

/// `--dense-precision bf16` on this test's model (`file` in the test model's
/// directory); on a CPU without bf16
/// instructions, emulated (same numerics, slower), so the numerics are
/// checked on every CPU.
fn bf16_config(file: &str) -> TorchConfig {
    let mut config = TorchConfig::new(test_model_dir().join(file));
    config.dense_precision = DensePrecision::Bf16;
    config.bf16_emulated = cpu_bf16_instructions().is_empty();
    if config.bf16_emulated {
        eprintln!("bf16 emulated: this CPU has neither AVX512-BF16 nor AMX-BF16");
    }
    config
}

/// `factory`'s scores within `tolerance` of Python's INT8-model scores
/// alone, and fused (the golden requests four times over: 1,564 rows)
/// within `fused_tolerance` of alone; prints both differences.
fn close_to_golden_alone_and_fused(
    what: &str,
    factory: &dyn BackendFactory,
    tolerance: f32,
    fused_tolerance: f32,
) {
    let golden = golden();
    let worst = golden_parity(factory, &golden, |g| g.scores_int8.clone(), tolerance);
    let requests = conformance::requests(factory, &golden, IdPolicy::Reject);
    let fused = fused_equals_alone(factory, &requests, 4, fused_tolerance);
    eprintln!("{what}: max |diff| vs golden {worst:e}, fused vs alone {fused:e}");
}

/// `--dense-precision bf16` stays within [`BF16_TOLERANCE_VS_FP32`] of
/// Python's FP32-dense scores, and a request's scores fused stay within
/// [`BF16_FUSED_VS_ALONE`] of its scores alone.
#[test]
fn bf16_dense_precision_stays_close_to_fp32_alone_and_fused() {
    let factory = TorchFactory::load(bf16_config("model_default.pt")).unwrap();
    close_to_golden_alone_and_fused("bf16", &factory, BF16_TOLERANCE_VS_FP32, BF16_FUSED_VS_ALONE);
}

/// A split model in bf16 (its tables pooled by Narsil's stage in FP32, the
/// dense network and its inputs in bf16) keeps the same bounds as the
/// single-file model in bf16, alone and fused.
#[test]
fn bf16_split_model_stays_close_to_fp32_alone_and_fused() {
    let factory = load_in(bf16_config("split"), DenseForm::TorchScript).unwrap();
    close_to_golden_alone_and_fused("split bf16", &factory, BF16_TOLERANCE_VS_FP32, BF16_FUSED_VS_ALONE);
}

/// Without bf16 instructions (and without asking for emulation), bf16 is
/// refused at load with a message naming the flag, for single-file and
/// split models alike; with them, both load.
#[test]
fn bf16_is_refused_on_a_cpu_without_bf16_instructions_naming_the_flag() {
    let mut single = bf16_config("model_default.pt");
    let mut split = bf16_config("split");
    single.bf16_emulated = false;
    split.bf16_emulated = false;
    let results = [
        ("single-file", TorchFactory::load(single).err().map(|e| error_chain(&e))),
        ("split", SplitFactory::load(split).err().map(|e| error_chain(&e))),
    ];
    for (form, error) in results {
        match (cpu_bf16_instructions().is_empty(), error) {
            (true, Some(err)) => {
                assert!(err.contains("--dense-precision") && err.contains("AVX512-BF16"), "{err}")
            }
            (true, None) => panic!("{form}: bf16 loaded on a CPU without bf16 instructions"),
            (false, Some(err)) => panic!("{form}: this CPU has bf16 instructions, yet: {err}"),
            (false, None) => {}
        }
    }
}

/// The AOTInductor package against the TorchScript dense network it was
/// compiled from (`models/export_dlrm.py --split` writes both).
const PT2_TOLERANCE: f32 = 1e-5;

fn split_in(form: DenseForm) -> Result<SplitFactory, String> {
    load_in(TorchConfig::new(test_model_dir().join("split")), form)
}

/// A split model loaded from `config` with the dense network in `form`.
fn load_in(mut config: TorchConfig, form: DenseForm) -> Result<SplitFactory, String> {
    config.dense_form = form;
    SplitFactory::load(config).map_err(|e| error_chain(&e))
}

/// `--dense-form pt2`: the split model's scores within [`PT2_TOLERANCE`] of
/// Python's (the TorchScript network's) alone and fused, and of the
/// TorchScript form's fused scores.
#[test]
fn pt2_dense_network_gives_the_torchscript_scores_alone_and_fused() {
    let pt2 = split_in(DenseForm::Pt2).unwrap();
    close_to_golden_alone_and_fused("pt2", &pt2, PT2_TOLERANCE, PT2_TOLERANCE);
    let requests = conformance::requests(&pt2, &golden(), IdPolicy::Reject);
    concurrent_lanes(&pt2, &requests, 3, 3, PT2_TOLERANCE);
}

/// `--dense-form pt2 --dense-precision bf16`: the bf16 package
/// (`dense_bf16.pt2`, written where the exporting CPU has bf16
/// instructions) keeps the bounds of bf16 TorchScript, alone and fused.
#[test]
fn bf16_pt2_dense_network_stays_close_to_fp32_alone_and_fused() {
    let name = "bf16_pt2_dense_network_stays_close_to_fp32_alone_and_fused";
    let schema = narsil_embedding::SplitSchema::read(&test_model_dir().join("split")).unwrap();
    if schema.dense_package_bf16.is_none() {
        eprintln!("skipped: {name}: the test model has no dense_bf16.pt2 (exported on a CPU without bf16 instructions)");
        return;
    }
    let factory = load_in(bf16_config("split"), DenseForm::Pt2).unwrap();
    close_to_golden_alone_and_fused("pt2 bf16", &factory, BF16_TOLERANCE_VS_FP32, BF16_FUSED_VS_ALONE);
}

/// `--dense-form torchscript`: the split model's TorchScript network gives
/// Python's scores alone and fused.
#[test]
fn torchscript_dense_network_matches_python_alone_and_fused() {
    let torchscript = split_in(DenseForm::TorchScript).unwrap();
    close_to_golden_alone_and_fused("split torchscript", &torchscript, TOLERANCE, TOLERANCE);
}

/// A package that is not one fails `--dense-form pt2` naming the file;
/// `auto` serves the TorchScript network instead. A schema without a
/// package fails `pt2` naming the schema and the field.
#[test]
fn a_corrupt_or_missing_package_fails_pt2_naming_the_file_and_auto_falls_back() {
    let copy = std::env::temp_dir().join(format!("narsil-pt2-{}", std::process::id()));
    copy_split_model(&test_model_dir().join("split"), &copy).unwrap();
    std::fs::write(copy.join("dense.pt2"), b"not a package").unwrap();
    let load = |form| load_in(TorchConfig::new(&copy), form);
    let err = load(DenseForm::Pt2).err().expect("a corrupt package loaded");
    assert!(err.contains(&copy.join("dense.pt2").display().to_string()), "{err}");
    let auto = load(DenseForm::Auto).expect("auto falls back to TorchScript");
    golden_parity(&auto, &golden(), |g| g.scores_int8.clone(), TOLERANCE);
    std::fs::remove_dir_all(&copy).unwrap();

    let fp32 = TorchConfig::new(test_model_dir().join("split_fp32"));
    let err = load_in(fp32, DenseForm::Pt2).err().expect("pt2 without a package loaded");
    assert!(err.contains("schema.json") && err.contains("dense_package"), "{err}");
    let err = load_in(bf16_config("split_fp32"), DenseForm::Pt2)
        .err()
        .expect("pt2 bf16 without a bf16 package loaded");
    assert!(err.contains("schema.json") && err.contains("dense_package_bf16"), "{err}");
}

/// A package compiled for instructions this CPU lacks is refused before
/// its code is loaded, naming them.
#[test]
fn a_package_for_instructions_the_cpu_lacks_is_refused_naming_them() {
    let path = test_model_dir().join("split/dense.pt2");
    let needed = AotiPackage::metadata(&path, aoti_package::CPU_FLAGS_KEY).unwrap().expect("flags recorded");
    let first = needed.split_whitespace().next().expect("at least one flag");
    let err = AotiPackage::load(&path, 1, &[]).err().expect("loaded without the CPU's flags").to_string();
    assert!(err.contains(first) && err.contains("lacks"), "{err}");
    assert!(AotiPackage::load(&path, 1, &needed.split_whitespace().collect::<Vec<_>>()).is_ok());
}
