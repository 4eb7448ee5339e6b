//! A split model whose dense network writes into its inputs (`add_` on the
//! dense features, `relu_` on the pooled block: in-place ops a TorchScript
//! graph may hold) never writes into memory the caller holds: the caller's
//! batch is unchanged after a forward, the same batch scores the same twice
//! (unstaged and staged), and fused scores equal scores alone.
//!
//! The network is a real TorchScript module, traced here with tch from a
//! function that modifies its inputs in place and saved over a copy of the
//! test model's `split/dense.pt` (`scripts/test.sh` exports
//! `models/generated/test-small`; without it the tests say `skipped`, or
//! fail under `NARSIL_REQUIRE_TEST_MODEL=1`, which CI sets).

/// Set to `1`, a test without the exported test model fails instead of
/// skipping.
const REQUIRE_TEST_MODEL: &str = "NARSIL_REQUIRE_TEST_MODEL";

use std::path::{Path, PathBuf};

use narsil_core::conformance::{self, assert_close, fused_equals_alone};
use narsil_core::golden::{copy_split_model, test_model_dir, Golden};
use narsil_core::request::IdPolicy;
use narsil_core::{assemble, error_chain, BackendFactory};
use narsil_embedding::SplitSchema;
use narsil_torch::script_module::ScriptModule;
use narsil_torch::{DenseForm, DensePrecision, SplitFactory, TorchConfig};
use tch::{CModule, Device, Kind, Tensor};

const TOLERANCE: f32 = 1e-6;

/// The network: `dense += 1; relu_(pooled)`, both in place, then
/// `sigmoid(0.01 * sum(dense) + 0.1 * sum(pooled))` per row.
fn writes_its_inputs(inputs: &[Tensor]) -> Vec<Tensor> {
    let (mut dense, mut pooled) = (inputs[0].shallow_clone(), inputs[1].shallow_clone());
    let _ = dense.g_add_scalar_(1.0);
    let _ = pooled.relu_();
    let dense_sum = dense.sum_dim_intlist(1, false, Kind::Float);
    let pooled_sum = pooled.sum_dim_intlist(1, false, Kind::Float);
    vec![(dense_sum * 0.01 + pooled_sum * 0.1).sigmoid()]
}

/// A copy of the test model's split model (in a directory of its own for
/// `test`) whose `dense.pt` is [`writes_its_inputs`], traced; `None` (having
/// said why) when there is no split test model.
fn model_whose_network_writes_its_inputs(test: &str) -> Option<PathBuf> {
    let source = test_model_dir().join("split");
    if !source.join("schema.json").is_file() {
        let why = format!("no split test model in {} (scripts/test.sh exports it)", source.display());
        narsil_core::skip::skip_or_fail(REQUIRE_TEST_MODEL, test, &why);
        return None;
    }
    let split = SplitSchema::read(&source).unwrap();
    let dir = std::env::temp_dir().join(format!("narsil-inplace-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    copy_split_model(&source, &dir).unwrap();
    let width = (split.features.len() * split.pooled_dim()) as i64;
    let example = [
        Tensor::randn([4, split.num_dense as i64], (Kind::Float, Device::Cpu)),
        Tensor::randn([4, width], (Kind::Float, Device::Cpu)),
    ];
    let network =
        CModule::create_by_tracing("WritesItsInputs", "forward", &example, &mut writes_its_inputs).unwrap();
    network.save(dir.join(&split.dense_network)).unwrap();
    Some(dir)
}

fn load(dir: &Path) -> SplitFactory {
    let mut config = TorchConfig::new(dir);
    config.dense_form = DenseForm::TorchScript;
    SplitFactory::load(config).unwrap_or_else(|e| panic!("{}", error_chain(&e)))
}

/// The network as the lane loads it (frozen) does write into a tensor it
/// is given, or the test below would prove nothing.
fn assert_network_writes_its_inputs(dir: &Path, split: &SplitSchema) {
    let loaded =
        ScriptModule::load(&dir.join(&split.dense_network), Device::Cpu, DensePrecision::Fp32).unwrap();
    let dense = Tensor::zeros([2, split.num_dense as i64], (Kind::Float, Device::Cpu));
    let pooled =
        Tensor::zeros([2, (split.features.len() * split.pooled_dim()) as i64], (Kind::Float, Device::Cpu));
    let _scores = loaded.module.forward_tensors(&[&dense, &pooled]).unwrap();
    assert_eq!(dense.sum(Kind::Float).double_value(&[]), 2.0 * split.num_dense as f64, "no write in place");
}

#[test]
fn a_dense_network_that_writes_its_inputs_leaves_the_callers_batch_unchanged() {
    let test = "a_dense_network_that_writes_its_inputs_leaves_the_callers_batch_unchanged";
    let Some(dir) = model_whose_network_writes_its_inputs(test) else { return };
    assert_network_writes_its_inputs(&dir, &SplitSchema::read(&dir).unwrap());
    let factory = load(&dir);
    let schema = factory.schema().clone();
    let requests =
        conformance::requests(&factory, &Golden::read(&test_model_dir()).unwrap(), IdPolicy::Reject);
    let batch = assemble(schema.num_dense, schema.num_sparse(), requests.iter());
    let dense = batch.dense.clone();

    let mut lane = factory.create_lane(0).unwrap();
    let first = lane.forward(&batch).unwrap();
    assert!(batch.dense == dense, "the dense network wrote into the caller's batch");
    let second = lane.forward(&batch).unwrap();
    assert_close(&second, &first, TOLERANCE, "the same batch again");

    // Staged: the pooled block comes from the lane's stage, twice (the
    // second time into the block the first forward handed back).
    let mut stage = lane.take_stage().expect("a split lane has a stage");
    for round in 0..2 {
        let staged = stage.stage(&batch).unwrap();
        let scores = lane.forward_staged(&batch, staged).unwrap();
        assert!(
            batch.dense == dense,
            "staged round {round}: the dense network wrote into the caller's batch"
        );
        assert_close(&scores, &first, TOLERANCE, &format!("staged round {round}"));
    }

    fused_equals_alone(&factory, &requests, 4, TOLERANCE);
    drop(factory);
    std::fs::remove_dir_all(&dir).unwrap();
}
