//! `--dense-precision int8`: a split model's INT8 dense network
//! (`dense_int8.pt2`, `models/export_dlrm.py --split --int8`) against the
//! FP32 scores of the golden requests, alone and fused, within a bound
//! derived from what the export measured (`int8_quality.json`); and the
//! refusals that keep INT8 from being served as something else.
//!
//! Needs the test model `scripts/test.sh` exports with `--int8`
//! (`models/generated/test-small`, or `NARSIL_TEST_MODEL_DIR`); a model
//! exported without `--int8` (or on a CPU without AVX2) has no INT8
//! package, and the tests that need one say `skipped`; under
//! `NARSIL_REQUIRE_INT8=1` (CI sets it where the CPU has AVX2, as
//! `scripts/test.sh` exports the package there) they fail instead.

/// Set to `1`, the INT8 tests fail instead of skipping.
const REQUIRE_INT8: &str = "NARSIL_REQUIRE_INT8";

use narsil_core::conformance::{int8_parity, int8_quality, INT8_CAP};
use narsil_core::error_chain;
use narsil_core::golden::{test_model_dir, Golden};
use narsil_embedding::SplitSchema;
use narsil_torch::{
    cpu_identity, cpu_int8_instructions, DenseForm, DensePrecision, SplitFactory, TorchConfig, TorchFactory,
};

fn split_dir() -> std::path::PathBuf {
    test_model_dir().join("split")
}

/// Why the INT8 package cannot be tested here, if it cannot.
fn skip_reason() -> Option<&'static str> {
    let schema = SplitSchema::read(&split_dir()).unwrap();
    if schema.dense_package_int8.is_none() {
        return Some(
            "the test model has no dense_int8.pt2 (exported without --int8, or on a CPU without AVX2)",
        );
    }
    if cpu_int8_instructions().is_empty() {
        return Some(
            "this CPU has neither AVX2 nor INT8 dot-product instructions (AVX512-VNNI, AVX-VNNI, AMX-INT8)",
        );
    }
    None
}

/// Whether test `name` cannot run here ([`skip_reason`]): it says so, or
/// fails under `NARSIL_REQUIRE_INT8=1`.
fn skipped(name: &str) -> bool {
    let Some(why) = skip_reason() else { return false };
    narsil_core::skip::skip_or_fail(REQUIRE_INT8, name, why);
    true
}

fn int8_config(dir: std::path::PathBuf, form: DenseForm) -> TorchConfig {
    let mut config = TorchConfig::new(dir);
    config.dense_precision = DensePrecision::Int8;
    config.dense_form = form;
    config
}

/// The INT8 package serves the golden requests within twice what the export
/// recorded of the FP32 scores, alone and fused, in both forms that take it
/// ([`int8_parity`]).
#[test]
fn int8_package_serves_golden_within_the_recorded_bound_alone_and_fused() {
    let name = "int8_package_serves_golden_within_the_recorded_bound_alone_and_fused";
    if skipped(name) {
        return;
    }
    for form in [DenseForm::Auto, DenseForm::Pt2] {
        let factory = SplitFactory::load(int8_config(split_dir(), form))
            .unwrap_or_else(|e| panic!("int8 {form}: {}", error_chain(&e)));
        let golden = Golden::read(&test_model_dir()).unwrap();
        // The top-level golden scores of the INT8-table model are the split
        // model's FP32 dense network's, bit for bit.
        let parity = int8_parity(&factory, &golden, &split_dir(), |g| g.scores_int8.clone());
        eprintln!("int8 {form}: {parity:?}");
    }
}

/// The export's INT8 quality verdict (`int8_quality.json`'s
/// `labelled.auc_goal_met`) is met, and agrees with the numbers it rests
/// on: |AUC change| within the stated goal, and the sampled and golden
/// score differences within the cap the serving test holds them to.
#[test]
fn the_exports_int8_quality_verdict_is_met_and_agrees_with_its_numbers() {
    let name = "the_exports_int8_quality_verdict_is_met_and_agrees_with_its_numbers";
    if skipped(name) {
        return;
    }
    let quality = int8_quality(&split_dir());
    let number = |pointer: &str| {
        quality
            .pointer(pointer)
            .and_then(serde_json::Value::as_f64)
            .unwrap_or_else(|| panic!("{pointer} in {quality}"))
    };
    let (change, goal) = (number("/labelled/auc_change"), number("/labelled/auc_change_goal"));
    let met = quality.pointer("/labelled/auc_goal_met").and_then(serde_json::Value::as_bool);
    assert_eq!(met, Some(change.abs() <= goal), "the verdict disagrees with |{change}| <= {goal}");
    assert_eq!(
        met,
        Some(true),
        "the export's INT8 quality goal is missed: AUC change {change} (goal {goal})"
    );
    for pointer in ["/golden/max_abs_diff", "/sampled/max_abs_diff"] {
        let diff = number(pointer);
        assert!(
            diff > 0.0 && diff <= f64::from(INT8_CAP),
            "{pointer} = {diff:e}: not an INT8 network's, or over the cap"
        );
    }
}

/// Where the export timed INT8 against FP32 (`int8_quality.json`'s
/// `timed`, on the CPU that exported it), the schema carries the package's
/// times beside FP32's forms, and the server's reading of them (what it
/// states, or warns, at load) is the ratio the export logged.
#[test]
fn the_schema_carries_the_int8_timing_the_export_logged_and_reads_the_same_ratio() {
    let name = "the_schema_carries_the_int8_timing_the_export_logged_and_reads_the_same_ratio";
    if skipped(name) {
        return;
    }
    let quality = int8_quality(&split_dir());
    let timed = &quality["timed"];
    let Some(logged) = timed["int8_vs_fp32"].as_f64() else {
        // The export times INT8 only where it timed FP32's forms on the same CPU.
        assert!(timed.as_object().is_none_or(|t| t.is_empty()), "timed without a ratio: {timed}");
        let why = "the export timed no INT8 against FP32 (FP32's forms were not timed on its CPU)";
        narsil_core::skip::skip_or_fail(REQUIRE_INT8, name, why);
        return;
    };
    let schema = SplitSchema::read(&split_dir()).unwrap();
    let timings =
        schema.dense_form_timings.expect("int8_quality.json has timed, the schema no dense_form_timings");
    let int8_us: Vec<u64> = serde_json::from_value(timed["int8_us"].clone()).unwrap();
    assert_eq!(timings.int8.as_ref().map(|t| &t.pt2_us), Some(&int8_us), "{timed}");
    let read = timings.int8_vs_fp32(&timings.cpu).expect("the schema's INT8 and FP32 times give no ratio");
    assert!((read - logged).abs() <= 1e-3, "the server reads {read}, the export logged {logged}");
    if timings.cpu == cpu_identity() {
        eprintln!("{name}: INT8 {read:.2}x FP32's samples/s as timed at export on this CPU");
    }
}

/// INT8 is never served as another form: `--dense-form torchscript`, a
/// split model without the package (naming the field and the command that
/// makes it) and a single-file model are refused. On a CPU without INT8
/// instructions every INT8 load is refused naming them.
#[test]
fn int8_without_its_package_or_form_is_refused_naming_what_is_missing() {
    let no_package = SplitFactory::load(int8_config(test_model_dir().join("split_fp32"), DenseForm::Auto))
        .err()
        .map(|e| error_chain(&e))
        .expect("int8 loaded a split model without dense_package_int8");
    let torchscript = SplitFactory::load(int8_config(split_dir(), DenseForm::TorchScript))
        .err()
        .map(|e| error_chain(&e))
        .expect("int8 loaded with --dense-form torchscript");
    assert!(torchscript.contains("int8") && torchscript.contains("TorchScript"), "{torchscript}");
    let single = TorchFactory::load(int8_config(test_model_dir().join("model_default.pt"), DenseForm::Auto))
        .err()
        .map(|e| error_chain(&e))
        .expect("int8 loaded a single-file model");
    assert!(single.contains("single-file") && single.contains("--split --int8"), "{single}");
    if !cpu_int8_instructions().is_empty() {
        assert!(
            no_package.contains("schema.json")
                && no_package.contains("dense_package_int8")
                && no_package.contains("export_dlrm.py --split --int8"),
            "{no_package}"
        );
    } else {
        assert!(no_package.contains("AVX2") && no_package.contains("--dense-precision"), "{no_package}");
    }
}
