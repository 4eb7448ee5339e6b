//! The Burn backend against the FP32 TorchScript model's scores that
//! `models/export_dlrm.py` computed in Python (same weights, from
//! `weights_fp32.safetensors`), alone and fused; and the load errors.
//!
//! Needs an exported model: `scripts/test.sh` writes a small one to
//! `models/generated/test-small` (or set `NARSIL_TEST_MODEL_DIR`).
// Cases are tables of (name, input, expected) tuples, read best inline.
#![allow(clippy::type_complexity)]

use std::path::{Path, PathBuf};

use narsil_burn::{BurnFactory, DlrmShape, DlrmWeights};
use narsil_core::conformance::{self, concurrent_lanes, fused_equals_alone, golden_parity};
use narsil_core::golden::{test_model_dir, Golden};
use narsil_core::request::IdPolicy;
use narsil_core::BackendFactory;
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;

/// Burn vs libtorch FP32: different GEMM kernels, same math.
const VS_PYTHON: f32 = 1e-5;
/// Fused vs alone in the same backend.
const FUSED_VS_ALONE: f32 = 1e-6;

fn exported() -> BurnFactory {
    BurnFactory::load(&test_model_dir().join("weights_fp32.safetensors")).unwrap()
}

#[test]
fn scores_match_python_fp32_alone_and_fused_equals_alone() {
    let factory = exported();
    let golden = Golden::read(&test_model_dir()).unwrap();
    golden_parity(&factory, &golden, |g| g.scores_fp32.clone(), VS_PYTHON);
    let requests = conformance::requests(&factory, &golden, IdPolicy::Reject);
    fused_equals_alone(&factory, &requests, 2, FUSED_VS_ALONE);
    concurrent_lanes(&factory, &requests, 2, 2, FUSED_VS_ALONE);
}

/// Split models through the embedding stage and the Burn dense network:
/// FP32 tables against the FP32 model, INT8 tables (in either store)
/// against the INT8 model.
#[test]
fn split_models_match_python_alone_and_fused_equals_alone() {
    use narsil_embedding::TableStore;
    let golden = Golden::read(&test_model_dir()).unwrap();
    let cases: [(&str, TableStore, fn(&narsil_core::golden::GoldenRequest) -> Vec<f32>); 3] = [
        ("split_fp32", TableStore::Memory, |g| g.scores_fp32.clone()),
        ("split", TableStore::Memory, |g| g.scores_int8.clone()),
        ("split", TableStore::Mmap, |g| g.scores_int8.clone()),
    ];
    for (i, (dir, store, want)) in cases.into_iter().enumerate() {
        let factory = BurnFactory::load_split(&test_model_dir().join(dir), store).unwrap();
        assert_eq!(factory.schema().backend, "burn");
        golden_parity(&factory, &golden, want, VS_PYTHON);
        // Batching checks once: the stage is the same for every case.
        if i == 0 {
            let requests = conformance::requests(&factory, &golden, IdPolicy::Reject);
            fused_equals_alone(&factory, &requests, 2, FUSED_VS_ALONE);
            concurrent_lanes(&factory, &requests, 2, 2, FUSED_VS_ALONE);
        }
    }
}

#[test]
fn a_split_model_without_dense_weights_is_refused_naming_what_to_do() {
    let source = test_model_dir().join("split");
    let copy = tempfile::tempdir().unwrap();
    narsil_core::golden::copy_split_model(&source, copy.path()).unwrap();
    let schema = std::fs::read_to_string(copy.path().join("schema.json")).unwrap();
    let mut schema: serde_json::Value = serde_json::from_str(&schema).unwrap();
    schema.as_object_mut().unwrap().remove("dense_weights");
    std::fs::write(copy.path().join("schema.json"), schema.to_string()).unwrap();
    let error = match BurnFactory::load_split(copy.path(), Default::default()) {
        Ok(_) => panic!("loaded without dense weights"),
        Err(e) => narsil_core::error_chain(&e),
    };
    assert!(error.contains("dense_weights") && error.contains("--backend torch"), "{error}");
}

#[test]
fn schema_is_read_from_the_tensors() {
    let factory = exported();
    let schema = factory.schema();
    assert_eq!((schema.backend.as_str(), schema.num_dense, schema.num_sparse()), ("burn", 13, 26));
    assert_eq!(schema.sparse[25].name, "cat_25");
    assert!(schema.sparse.iter().all(|f| f.num_rows == 1000));
}

/// Rewrites the exported file with `edit` applied to its tensor list.
fn rewritten(edit: impl FnOnce(&mut Vec<(String, Vec<usize>, Vec<u8>)>)) -> PathBuf {
    let bytes = std::fs::read(test_model_dir().join("weights_fp32.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| (name, view.shape().to_vec(), view.data().to_vec()))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(name, shape, data)| {
            (name.clone(), TensorView::new(safetensors::Dtype::F32, shape.clone(), data).unwrap())
        })
        .collect();
    let path = std::env::temp_dir().join(format!(
        "narsil-burn-{}-{}.safetensors",
        std::process::id(),
        rand_suffix()
    ));
    safetensors::serialize_to_file(views, None, &path).unwrap();
    path
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

fn load_error(path: &Path) -> String {
    let err = DlrmWeights::load(path).expect_err("must not load");
    let err = narsil_core::error_chain(&err);
    std::fs::remove_file(path).ok();
    err
}

#[test]
fn a_missing_tensor_is_named() {
    let path = rewritten(|t| t.retain(|(name, _, _)| name != "over.1.bias"));
    let err = load_error(&path);
    assert!(err.contains("missing tensor `over.1.bias`"), "{err}");
}

#[test]
fn a_mis_shaped_tensor_is_named() {
    let path = rewritten(|t| {
        let layer = t.iter_mut().find(|(name, _, _)| name == "over.0.weight").unwrap();
        // [512, 415] -> [1024, 415 / 2]: same bytes, wrong shape.
        layer.1 = vec![layer.1[0] * 2, layer.1[1] / 2];
        layer.2.truncate(layer.1[0] * layer.1[1] * 4);
    });
    let err = load_error(&path);
    assert!(err.contains("over.0.weight"), "{err}");
}

#[test]
fn a_torchscript_file_is_refused_naming_the_torch_backend() {
    let path = test_model_dir().join("model_default.pt");
    let err = narsil_core::error_chain(&DlrmWeights::load(&path).err().unwrap());
    assert!(err.contains("not a safetensors file") && err.contains("--backend torch"), "{err}");
}

#[test]
fn a_missing_file_says_how_to_make_one() {
    let err = DlrmWeights::load(Path::new("/nonexistent/weights.safetensors")).err().unwrap();
    let err = narsil_core::error_chain(&err);
    assert!(err.contains("/nonexistent/weights.safetensors") && err.contains("export_dlrm.py"), "{err}");
}

#[test]
fn random_models_are_deterministic_and_fused_equals_alone() {
    let shape = DlrmShape { num_rows: 50, ..DlrmShape::default() };
    let a = BurnFactory::random(&shape, 3).unwrap();
    let b = BurnFactory::random(&shape, 3).unwrap();
    let golden = Golden::read(&test_model_dir()).unwrap();
    // Golden requests' ids are < 1000; fold them into this model's 50 rows.
    let requests = conformance::requests(&a, &golden, IdPolicy::Modulo);
    let scores = conformance::scores_alone(&a, &requests).concat();
    assert_eq!(scores, conformance::scores_alone(&b, &requests).concat(), "same seed, same model");
    fused_equals_alone(&a, &requests, 1, FUSED_VS_ALONE);
    let spread =
        scores.iter().cloned().fold(f32::MIN, f32::max) - scores.iter().cloned().fold(f32::MAX, f32::min);
    assert!(spread > 1e-4, "scores must depend on the inputs (spread {spread})");
}

/// The exported model with a second task: the over arch's last layer grows
/// a unit with the same weights and a bias 1 higher, so task 0 must score
/// like Python's single output and task 1 like `sigmoid(logit + 1)`.
#[test]
fn a_multi_task_over_arch_serves_one_output_per_unit() {
    let last = |t: &[(String, Vec<usize>, Vec<u8>)]| {
        (0..).take_while(|i| t.iter().any(|(n, _, _)| n == &format!("over.{i}.weight"))).count() - 1
    };
    let path = rewritten(|t| {
        let j = last(t);
        let weight = t.iter_mut().find(|(n, _, _)| n == &format!("over.{j}.weight")).unwrap();
        weight.1[0] = 2;
        weight.2 = [weight.2.clone(), weight.2.clone()].concat();
        let bias = t.iter_mut().find(|(n, _, _)| n == &format!("over.{j}.bias")).unwrap();
        let b = f32::from_le_bytes(bias.2[..4].try_into().unwrap());
        bias.1[0] = 2;
        bias.2 = [b.to_le_bytes(), (b + 1.0).to_le_bytes()].concat();
    });
    let factory = BurnFactory::load(&path).unwrap();
    std::fs::remove_file(&path).ok();
    assert_eq!(factory.schema().outputs, ["task_0", "task_1"]);
    let golden = Golden::read(&test_model_dir()).unwrap();
    let shifted = |p: f32| 1.0 / (1.0 + (-((p / (1.0 - p)).ln() + 1.0)).exp());
    golden_parity(
        &factory,
        &golden,
        |g| g.scores_fp32.iter().copied().chain(g.scores_fp32.iter().map(|&p| shifted(p))).collect(),
        VS_PYTHON,
    );
    let requests = conformance::requests(&factory, &golden, IdPolicy::Reject);
    fused_equals_alone(&factory, &requests, 2, FUSED_VS_ALONE);
}
