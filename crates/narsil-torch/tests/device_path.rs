//! The GPU path's logic, on the CPU device: the tensor stage (tables as
//! tensors; lookup, INT8 row-wise dequantisation and pooling as tensor ops)
//! against the CPU stage; split models served through the device lane
//! (staging buffers, the tensor stage or the host stage, padded
//! batch-size buckets, the double-buffer hand-off one batch ahead) against
//! Python's golden scores, alone and fused; the device table budget's
//! refusal. Then the same on CUDA where a device is present; without one
//! those tests print `skipped: NAME: no CUDA device` and check nothing.
//!
//! The order of the lane's stream, event and graph calls, which the CPU
//! device does not make, is checked by unit tests through a recording fake
//! of the CUDA shim (`src/device_lane/tests.rs`, `src/cuda.rs`).
//!
//! Needs the exported test models (`scripts/test.sh`).

use std::path::PathBuf;
use std::sync::mpsc::sync_channel;
use std::sync::Arc;

use narsil_core::conformance::{self, fused_equals_alone, golden_parity};
use narsil_core::golden::{test_model_dir, Golden, GoldenRequest};
use narsil_core::request::{IdPolicy, RequestLimits};
use narsil_core::{
    assemble, error_chain, BackendFactory, KeyedBatch, RequestBlock, RequestLevel, RequestSamples,
};
use narsil_embedding::{EmbeddingStage, RowStore, SplitSchema, StageScratch, TableStore};
use narsil_torch::buckets::Buckets;
use narsil_torch::tensor_stage::{DeviceLookup, Lookup, TensorTables, TOLERANCE};
use narsil_torch::{DenseForm, DensePrecision, SplitFactory, TorchConfig};
use tch::{Device, Tensor};

/// The device lane in FP32 against Python's scores: the CPU device runs the
/// same kernels as Python for the dense network; the tensor stage's pooled
/// values differ from FBGEMM's by FP32 rounding ([`TOLERANCE`]).
const FP32_TOLERANCE: f32 = 1e-5;

fn model(name: &str) -> PathBuf {
    match name {
        "multitask" => test_model_dir().with_file_name("test-torchrec-multitask").join("split"),
        other => test_model_dir().join(other),
    }
}

/// A deterministic pseudo-random batch for `schema`: 0 to 3 ids a bag
/// (empty bags included), weights in [0.25, 2) for weighted features.
fn random_batch(schema: &SplitSchema, rows: usize, seed: u64) -> KeyedBatch {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut next = move || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        state >> 33
    };
    let features = schema.features.len();
    let mut batch = KeyedBatch {
        rows,
        num_dense: schema.num_dense,
        num_sparse: features,
        dense: (0..rows * schema.num_dense).map(|_| (next() % 1000) as f32 / 1000.0).collect(),
        feature_offsets: vec![0],
        request_rows: vec![rows],
        ..Default::default()
    };
    let weighted = schema.features.iter().any(|f| f.weighted);
    for feature in &schema.features {
        let table_rows = schema.table(&feature.table).unwrap().rows;
        for _ in 0..rows {
            let len = (next() % 4) as i32;
            batch.lengths.push(len);
            for _ in 0..len {
                batch.ids.push((next() % table_rows) as i64);
                if weighted {
                    batch.weights.push(if feature.weighted {
                        0.25 + (next() % 1750) as f32 / 1000.0
                    } else {
                        1.0
                    });
                }
            }
        }
        batch.feature_offsets.push(batch.ids.len());
    }
    batch
}

/// `|a - b| <= TOLERANCE * (1 + |b|)` everywhere; the largest difference.
fn assert_close(what: &str, got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut worst = 0.0f32;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let diff = (g - w).abs();
        assert!(diff <= TOLERANCE * (1.0 + w.abs()), "{what}: value {i}: tensor stage {g}, CPU stage {w}");
        worst = worst.max(diff);
    }
    worst
}

/// Ranking requests for `schema` fused (users 1, 2 and 1 again, 5, 3 and 4
/// candidates): the first two features, the last (weighted, where the
/// model has weighted features) and the dense features request-level.
fn ranking_batch(schema: &SplitSchema) -> KeyedBatch {
    let mut model = schema.model_schema("torch", "cpu");
    let last = model.sparse.len() - 1;
    model.request_level = RequestLevel { features: vec![0, 1, last], dense: true };
    let rows = |f: usize| model.sparse[f].num_rows as i64;
    let requests: Vec<RequestSamples> = [(1usize, 5usize), (2, 3), (1, 4)]
        .into_iter()
        .map(|(user, candidates)| {
            let mut block = RequestBlock {
                dense: (0..model.num_dense).map(|d| (user + d) as f32 / 10.0).collect(),
                ..Default::default()
            };
            for &f in &model.request_level.features {
                let len = 1 + (user + f) % 3;
                block.lengths.push(len as u32);
                for k in 0..len {
                    block.ids.push((user as i64 * 31 + k as i64 * 7 + f as i64) % rows(f));
                    if model.sparse[f].weighted {
                        block.weights.push(0.5 + k as f32);
                    }
                }
            }
            let mut request = RequestSamples {
                num_samples: candidates,
                request: Some(Arc::new(block)),
                ..Default::default()
            };
            for c in 0..candidates {
                for f in (0..model.sparse.len()).filter(|f| !model.request_level.contains(*f)) {
                    let len = (c + f) % 3;
                    request.lengths.push(len as u32);
                    for k in 0..len {
                        request.ids.push((c as i64 * 13 + f as i64 * 5 + k as i64) % rows(f));
                        if model.sparse[f].weighted {
                            request.weights.push(0.25 * (k + 1) as f32);
                        }
                    }
                }
            }
            request.validate(&model, RequestLimits::new(64, IdPolicy::Reject)).unwrap();
            request
        })
        .collect();
    let batch = assemble(schema.num_dense, schema.features.len(), &requests);
    assert_eq!(batch.request_blocks.as_ref().map(|b| b.unit_count), Some(2));
    batch
}

fn tensor_pool(tables: &TensorTables, batch: &KeyedBatch, lookup: &mut Lookup) -> Vec<f32> {
    lookup.fill(batch, tables.features(), tables.groups()).unwrap();
    let lookups: Vec<DeviceLookup> = lookup
        .groups
        .iter()
        .map(|g| DeviceLookup {
            rows: Tensor::from_slice(&g.rows).to_device(tables.device()),
            bags: Tensor::from_slice(&g.bags).to_device(tables.device()),
            multipliers: g.scaled.then(|| Tensor::from_slice(&g.multipliers).to_device(tables.device())),
        })
        .collect();
    let gather = Tensor::from_slice(&lookup.gather).to_device(tables.device());
    let broadcast = (lookup.units > 0).then_some((lookup.units, &gather));
    let pooled = tables.pool(batch.rows, &lookups, broadcast).unwrap().to_device(Device::Cpu).reshape([-1]);
    let len = pooled.numel();
    let mut out = vec![0.0f32; len];
    pooled.copy_data(&mut out, len);
    out
}

/// The tensor stage on `device` against the CPU stage for the model `name`:
/// random batches of 1 to 1,600 rows and the golden requests alone and
/// fused.
fn tensor_stage_matches_cpu_stage(name: &str, device: Device) {
    let dir = model(name);
    let schema = SplitSchema::read(&dir).unwrap();
    let (stores, _) = TableStore::Memory.open(&dir, &schema).unwrap();
    let stage = EmbeddingStage::new(&schema, stores.clone());
    let tables = TensorTables::upload(&schema, &stores, device, u64::MAX).unwrap();
    assert_eq!(tables.pooled_width(), stage.pooled_width());
    let (mut scratch, mut lookup, mut cpu) = (StageScratch::default(), Lookup::default(), Vec::new());
    let mut worst = 0.0f32;
    let mut batches: Vec<(String, KeyedBatch)> = [1, 7, 100, 1600]
        .iter()
        .map(|&rows| (format!("{rows} random rows"), random_batch(&schema, rows, rows as u64)))
        .collect();
    let ranking = ranking_batch(&schema);
    batches.push(("ranking requests, flat".into(), ranking.clone().into_flat()));
    batches.push(("ranking requests, grouped".into(), ranking));
    if let Ok(golden) = Golden::read(&dir) {
        let model_schema = schema.model_schema("torch", "cpu");
        let requests: Vec<_> =
            golden.requests.iter().map(|g| g.validated(&model_schema, IdPolicy::Reject).unwrap()).collect();
        for (i, request) in requests.iter().enumerate() {
            batches.push((
                format!("golden request {i}"),
                assemble(schema.num_dense, schema.features.len(), [request]),
            ));
        }
        batches.push((
            "golden requests fused".into(),
            assemble(schema.num_dense, schema.features.len(), requests.iter()),
        ));
    }
    for (what, batch) in &batches {
        stage.pool(batch, &mut scratch, &mut cpu).unwrap();
        let on_device = tensor_pool(&tables, batch, &mut lookup);
        worst = worst.max(assert_close(&format!("{name}: {what}"), &on_device, &cpu));
    }
    eprintln!(
        "{name} on {device:?}: tensor stage vs CPU stage, max |diff| {worst:e} over {} batches",
        batches.len()
    );
}

#[test]
fn tensor_stage_matches_the_cpu_stage_on_int8_sum_tables() {
    tensor_stage_matches_cpu_stage("split", Device::Cpu);
}

#[test]
fn tensor_stage_matches_the_cpu_stage_on_fp32_tables() {
    tensor_stage_matches_cpu_stage("split_fp32", Device::Cpu);
}

#[test]
fn tensor_stage_matches_the_cpu_stage_on_mean_and_weighted_features() {
    tensor_stage_matches_cpu_stage("multitask", Device::Cpu);
}

/// Tables that do not fit the budget are refused, naming their total and
/// the budget; at load, naming the model's directory.
#[test]
fn tables_over_the_device_budget_are_refused_naming_total_and_budget() {
    let dir = model("split");
    let schema = SplitSchema::read(&dir).unwrap();
    let (stores, _): (Vec<Arc<dyn RowStore>>, _) = TableStore::Memory.open(&dir, &schema).unwrap();
    let total = narsil_torch::tensor_stage::device_bytes(&schema);
    let error = TensorTables::upload(&schema, &stores, Device::Cpu, total - 1).err().unwrap().to_string();
    assert!(error.contains(&total.to_string()) && error.contains(&(total - 1).to_string()), "{error}");
    assert!(TensorTables::upload(&schema, &stores, Device::Cpu, total).is_ok(), "exactly the budget fits");

    let mut config = device_path_config("split");
    config.device_table_bytes = Some(1000);
    let error = error_chain(&SplitFactory::load(config).err().unwrap());
    assert!(
        error.contains(&total.to_string())
            && error.contains("1000")
            && error.contains("NARSIL_DEVICE_TABLE_BYTES"),
        "{error}"
    );
    assert!(error.contains(&dir.display().to_string()), "{error}");
}

fn device_path_config(name: &str) -> TorchConfig {
    let mut config = TorchConfig::new(model(name));
    config.device_path_on_cpu = true;
    config.dense_form = DenseForm::TorchScript;
    config
}

/// The variants of the device lane served on the CPU device.
fn variants(name: &str) -> Vec<(&'static str, TorchConfig)> {
    let host = device_path_config(name);
    let mut tables = device_path_config(name);
    tables.device_table_bytes = Some(u64::MAX);
    let mut buckets = device_path_config(name);
    buckets.device_table_bytes = Some(u64::MAX);
    // Padded forwards in buckets (the graphs' logic): the golden requests
    // are 1 to ~200 rows, the fused batch ~1,600: some run padded, the
    // largest eagerly.
    buckets.graph_buckets = Some(Buckets::new(vec![8, 64, 256]));
    vec![("host tables", host), ("device tables", tables), ("device tables, padded buckets", buckets)]
}

fn int8_scores(g: &GoldenRequest) -> Vec<f32> {
    g.scores_int8.clone()
}

/// Python's golden scores, alone and fused (four copies), through each
/// variant of the device lane on the CPU device.
#[test]
fn the_device_lane_on_the_cpu_gives_golden_scores_alone_and_fused() {
    let golden = Golden::read(&test_model_dir()).unwrap();
    for (what, config) in variants("split") {
        let factory = SplitFactory::load(config).unwrap();
        let worst = golden_parity(&factory, &golden, int8_scores, FP32_TOLERANCE);
        let requests = conformance::requests(&factory, &golden, IdPolicy::Reject);
        let fused = fused_equals_alone(&factory, &requests, 4, FP32_TOLERANCE);
        eprintln!("device lane on the CPU, {what}: max |diff| vs golden {worst:e}, fused vs alone {fused:e}");
    }
}

/// Every output of the two-task model (mean-pooled and weighted features),
/// tables on the device, against Python's.
#[test]
fn the_device_lane_serves_mean_and_weighted_features_and_every_output() {
    let dir = model("multitask");
    let golden = Golden::read(&dir).unwrap();
    let mut config = TorchConfig::new(&dir);
    config.device_path_on_cpu = true;
    config.dense_form = DenseForm::TorchScript;
    config.device_table_bytes = Some(u64::MAX);
    config.graph_buckets = Some(Buckets::new(vec![4, 32]));
    let factory = SplitFactory::load(config).unwrap();
    let outputs = factory.schema().outputs.clone();
    let want = |g: &GoldenRequest| outputs.iter().flat_map(|o| g.outputs[o].clone()).collect::<Vec<f32>>();
    let worst = golden_parity(&factory, &golden, want, FP32_TOLERANCE);
    eprintln!("multitask on the device lane: max |diff| vs golden {worst:e}");
}

/// The device lane in bf16 (floating-point parameters cast, inputs cast as
/// they enter) keeps the CPU bf16 bound against Python's FP32-dense scores.
#[test]
fn the_device_lane_in_bf16_stays_close_to_fp32() {
    let golden = Golden::read(&test_model_dir()).unwrap();
    let mut config = device_path_config("split");
    config.dense_precision = DensePrecision::Bf16;
    config.bf16_emulated = narsil_torch::cpu_bf16_instructions().is_empty();
    config.device_table_bytes = Some(u64::MAX);
    config.graph_buckets = Some(Buckets::new(vec![64, 256]));
    let factory = SplitFactory::load(config).unwrap();
    let worst = golden_parity(&factory, &golden, int8_scores, 5e-3);
    eprintln!("device lane bf16: max |diff| vs golden {worst:e}");
}

/// Stage ahead as the engine runs it (a stage thread handing batches over
/// through a rendezvous; the lane takes the next only when done), with some
/// batches dropped untouched and some losing requests after staging (a new
/// batch: staged again by the lane): every forward's scores are the ones
/// the lane computes alone.
#[test]
fn staging_one_batch_ahead_on_two_buffer_sets_gives_the_scores_alone() {
    let golden = Golden::read(&test_model_dir()).unwrap();
    for (what, config) in variants("split") {
        let factory = SplitFactory::load(config).unwrap();
        let schema = factory.schema().clone();
        let requests = conformance::requests(&factory, &golden, IdPolicy::Reject);
        let batches: Vec<KeyedBatch> = (0..24)
            .map(|i| {
                let take = 1 + i % 4;
                let picked = (0..take).map(|j| &requests[(i + j) % requests.len()]);
                assemble(schema.num_dense, schema.num_sparse(), picked)
            })
            .collect();
        let mut alone = factory.create_lane(0).unwrap();
        let want: Vec<Vec<f32>> = batches.iter().map(|b| alone.forward(b).unwrap()).collect();
        let mut lane = factory.create_lane(1).unwrap();
        let mut stage = lane.take_stage().expect("the device lane has a stage");
        let (to_lane, from_stage) = sync_channel(0);
        std::thread::scope(|scope| {
            let batches = &batches;
            scope.spawn(move || {
                for (i, batch) in batches.iter().enumerate() {
                    let staged = stage.stage(batch).unwrap();
                    if to_lane.send((i, staged)).is_err() {
                        return;
                    }
                }
            });
            let mut checked = 0;
            for (i, staged) in from_stage {
                match i % 5 {
                    3 => continue, // dropped: every caller stopped waiting
                    4 if batches[i].request_rows.len() < 2 => continue,
                    4 => {
                        // Its first request dropped after staging.
                        let kept = batches[i].retain_requests(|r| r > 0);
                        let mut shorter = staged;
                        shorter.retain_requests(&batches[i].request_rows, |r| r > 0);
                        let scores = lane.forward_staged(&kept, shorter).unwrap();
                        let expected = alone.forward(&kept).unwrap();
                        assert_eq!(scores, expected, "{what}: batch {i} with a request dropped");
                    }
                    _ => {
                        let scores = lane.forward_staged(&batches[i], staged).unwrap();
                        assert_eq!(scores, want[i], "{what}: batch {i}");
                    }
                }
                checked += 1;
            }
            assert!(checked >= 15, "{what}: {checked} forwards");
        });
    }
}

/// A model on `cuda` when CUDA is not available is a clear error at load.
#[test]
fn a_split_model_on_cuda_without_a_gpu_is_refused_clearly() {
    if tch::Cuda::is_available() {
        eprintln!(
            "skipped: a_split_model_on_cuda_without_a_gpu_is_refused_clearly: a CUDA device is present"
        );
        return;
    }
    let mut config = TorchConfig::new(model("split"));
    config.device = "cuda".into();
    let error = error_chain(&SplitFactory::load(config).err().unwrap());
    assert!(error.contains("--device cuda") && error.contains("CUDA is not available"), "{error}");
}

/// On CUDA: the tensor stage against the CPU stage; split models served on
/// the device (graphs, tables in GPU memory or on the host) in FP32 and bf16
/// against golden, alone and fused.
#[test]
fn cuda_tensor_stage_and_golden_parity() {
    let name = "cuda_tensor_stage_and_golden_parity";
    if !cuda_present() {
        eprintln!("skipped: {name}: no CUDA device");
        return;
    }
    for model_name in ["split", "split_fp32", "multitask"] {
        tensor_stage_matches_cpu_stage(model_name, Device::Cuda(0));
    }
    let golden = Golden::read(&test_model_dir()).unwrap();
    for (tables, precision, tolerance) in [
        (Some(u64::MAX), DensePrecision::Fp32, 1e-5),
        (Some(0), DensePrecision::Fp32, 1e-5),
        (Some(u64::MAX), DensePrecision::Bf16, 2e-2),
    ] {
        let mut config = TorchConfig::new(model("split"));
        config.device = "cuda:0".into();
        config.device_table_bytes = tables;
        config.dense_precision = precision;
        let factory = SplitFactory::load(config).unwrap();
        let worst = golden_parity(&factory, &golden, int8_scores, tolerance);
        let requests = conformance::requests(&factory, &golden, IdPolicy::Reject);
        let fused = fused_equals_alone(&factory, &requests, 4, tolerance);
        eprintln!(
            "cuda {precision} tables {tables:?}: max |diff| vs golden {worst:e}, fused vs alone {fused:e}"
        );
    }
}

fn cuda_present() -> bool {
    narsil_torch::device::split_model_device("cuda").is_ok()
}
