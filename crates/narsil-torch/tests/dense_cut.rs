//! The dense network cut for ranking requests (`dense_bottom.pt` +
//! `dense_top.pt` and its packages, written by `models/export_dlrm.py
//! --split` and `models/export_torchrec.py --split`): a lane scores a
//! batch of ranking requests (whose dense arch then runs once per user) as
//! it scores the same requests sent flat, within 1e-6 in FP32 (TorchScript
//! and `.pt2`) and the bf16 bound in bf16, with flat requests fused in; for
//! the DLRM and TorchRec's DLRM, DLRM_DCN and two-task models. The DLRM's
//! user-once top (`dense_user_once.pt` and `.pt2`) serves the batches
//! whose request-level features it was cut for, and only those.
//!
//! Needs the exported test model (`scripts/test.sh`).

use std::sync::Arc;

use narsil_core::golden::{max_abs_diff, test_model_dir};
use narsil_core::request::{IdPolicy, RequestLimits};
use narsil_core::{assemble, BackendFactory, KeyedBatch, RequestBlock, RequestLevel, RequestSamples};
use narsil_torch::{cpu_bf16_instructions, DenseForm, DensePrecision, SplitFactory, TorchConfig};

/// Users 1, 2 and 1 again (4, 3 and 5 candidates) and one flat request:
/// cat_0..cat_{user_features - 1} and the dense features request-level.
fn ranking_batch(factory: &SplitFactory, user_features: usize) -> KeyedBatch {
    let mut schema = factory.schema().clone();
    let names: Vec<String> = (0..user_features).map(|f| format!("cat_{f}")).chain(["dense".into()]).collect();
    schema.request_level = RequestLevel::parse(names.iter().map(String::as_str), &schema).unwrap();
    let rows = |f: usize| schema.sparse[f].num_rows as i64;
    let limits = RequestLimits::new(64, IdPolicy::Reject);
    let mut requests: Vec<RequestSamples> = [(1i64, 4usize), (2, 3), (1, 5)]
        .into_iter()
        .map(|(user, candidates)| {
            let mut block = RequestBlock {
                dense: (0..schema.num_dense).map(|d| ((user as usize * 7 + d) % 10) as f32 / 10.0).collect(),
                ..Default::default()
            };
            for f in 0..user_features {
                block.lengths.push(2);
                block.ids.extend([(user * 31 + f as i64) % rows(f), (user * 17 + 3) % rows(f)]);
            }
            let mut request = RequestSamples {
                num_samples: candidates,
                request: Some(Arc::new(block)),
                ..Default::default()
            };
            for c in 0..candidates {
                for f in user_features..schema.num_sparse() {
                    request.ids.push((c as i64 * 7919 + f as i64) % rows(f));
                    if schema.sparse[f].weighted {
                        request.weights.push(0.5 + c as f32);
                    }
                }
            }
            request
        })
        .collect();
    let mut flat = RequestSamples {
        num_samples: 2,
        dense: (0..2 * schema.num_dense).map(|d| d as f32 / 30.0).collect(),
        ..Default::default()
    };
    for s in 0..2 {
        for f in 0..schema.num_sparse() {
            flat.ids.push((s as i64 * 104_729 + f as i64) % rows(f));
            if schema.sparse[f].weighted {
                flat.weights.push(1.5);
            }
        }
    }
    requests.push(flat);
    for r in &mut requests {
        r.validate(&schema, limits).unwrap();
    }
    assemble(schema.num_dense, schema.num_sparse(), &requests)
}

fn grouped_scores_equal_flat(precision: DensePrecision, form: DenseForm, bound: f32) {
    grouped_scores_equal_flat_for(test_model_dir().join("split"), precision, form, bound);
}

fn grouped_scores_equal_flat_for(
    dir: std::path::PathBuf,
    precision: DensePrecision,
    form: DenseForm,
    bound: f32,
) {
    let factory = load(dir, precision, form);
    grouped_scores_equal_flat_in(&factory, &ranking_batch(&factory, 13), bound, (precision, form));
}

fn load(dir: std::path::PathBuf, precision: DensePrecision, form: DenseForm) -> SplitFactory {
    let mut config = TorchConfig::new(dir);
    (config.dense_precision, config.dense_form) = (precision, form);
    config.bf16_emulated = cpu_bf16_instructions().is_empty();
    let factory = SplitFactory::load(config).unwrap();
    assert!(factory.runs_dense_cut(), "the export wrote the cut ({precision}, {form})");
    factory
}

fn grouped_scores_equal_flat_in(
    factory: &SplitFactory,
    batch: &KeyedBatch,
    bound: f32,
    (precision, form): (DensePrecision, DenseForm),
) {
    let mut lane = factory.lane().unwrap();
    let grouped = lane.forward(batch).unwrap();
    let flat = lane.forward(&batch.clone().into_flat()).unwrap();
    assert_eq!(grouped.len(), batch.rows * factory.schema().outputs.len());
    let diff = max_abs_diff(&grouped, &flat).unwrap();
    assert!(diff <= bound, "{precision} {form}: grouped (cut) vs flat (whole network): {diff} > {bound}");
}

#[test]
fn the_cut_scores_ranking_requests_as_the_whole_network_in_fp32() {
    grouped_scores_equal_flat(DensePrecision::Fp32, DenseForm::TorchScript, 1e-6);
    grouped_scores_equal_flat(DensePrecision::Fp32, DenseForm::Pt2, 1e-6);
}

#[test]
fn the_user_once_top_serves_only_the_request_level_features_it_was_cut_for() {
    // The export cut it for cat_0..cat_12 and the dense features.
    let factory = load(test_model_dir().join("split"), DensePrecision::Fp32, DenseForm::TorchScript);
    let cut_for = ranking_batch(&factory, 13);
    assert!(factory.runs_user_once(&cut_for), "the user-once top serves the features it was cut for");
    grouped_scores_equal_flat_in(&factory, &cut_for, 1e-6, (DensePrecision::Fp32, DenseForm::TorchScript));
    // Fewer request-level features (a server started with another
    // --request-level): cat_6..cat_12 are the candidates' there, and the
    // user-once top would take them for the user's.
    // A batch whose second caller left before its forward keeps that
    // user's unit, used by no row: it runs nothing.
    let left = cut_for.retain_requests(|r| r != 1);
    assert_eq!(left.request_blocks.as_ref().unwrap().unit_count, 2, "the unit stays in the blocks");
    assert!(factory.runs_user_once(&left));
    grouped_scores_equal_flat_in(&factory, &left, 1e-6, (DensePrecision::Fp32, DenseForm::TorchScript));
    // Its package, where the top runs as one.
    let package = load(test_model_dir().join("split"), DensePrecision::Fp32, DenseForm::Pt2);
    assert!(package.runs_user_once(&cut_for), "the export compiled dense_user_once.pt2");
    grouped_scores_equal_flat_in(&package, &cut_for, 1e-6, (DensePrecision::Fp32, DenseForm::Pt2));
    let other = ranking_batch(&factory, 6);
    assert!(!factory.runs_user_once(&other), "another request-level set runs the top");
    grouped_scores_equal_flat_in(&factory, &other, 1e-6, (DensePrecision::Fp32, DenseForm::TorchScript));
    // FP32 tables, bf16 network.
    let fp32_tables = load(test_model_dir().join("split_fp32"), DensePrecision::Bf16, DenseForm::TorchScript);
    let batch = ranking_batch(&fp32_tables, 13);
    assert!(fp32_tables.runs_user_once(&batch));
    grouped_scores_equal_flat_in(&fp32_tables, &batch, 2e-2, (DensePrecision::Bf16, DenseForm::TorchScript));
}

#[test]
fn the_cut_scores_ranking_requests_as_the_whole_network_in_bf16() {
    // bf16 rounding differs between the whole network and the two parts.
    grouped_scores_equal_flat(DensePrecision::Bf16, DenseForm::TorchScript, 2e-2);
    if cpu_bf16_instructions().is_empty() {
        // The exporter compiles bf16 packages only where it can run them.
        let test = "the_cut_scores_ranking_requests_as_the_whole_network_in_bf16 (.pt2)";
        return narsil_core::skip::skip_or_fail(
            "NARSIL_REQUIRE_BF16",
            test,
            "this CPU has no bf16 instructions",
        );
    }
    grouped_scores_equal_flat(DensePrecision::Bf16, DenseForm::Pt2, 2e-2);
}

#[test]
fn the_cut_of_torchrec_models_scores_ranking_requests_as_the_whole_network() {
    let torchrec =
        |kind: &str| test_model_dir().with_file_name(format!("test-torchrec-{kind}")).join("split");
    grouped_scores_equal_flat_for(torchrec("dlrm"), DensePrecision::Fp32, DenseForm::TorchScript, 1e-6);
    for kind in ["dcn", "multitask"] {
        grouped_scores_equal_flat_for(torchrec(kind), DensePrecision::Fp32, DenseForm::TorchScript, 1e-6);
        grouped_scores_equal_flat_for(torchrec(kind), DensePrecision::Fp32, DenseForm::Pt2, 1e-6);
    }
}
