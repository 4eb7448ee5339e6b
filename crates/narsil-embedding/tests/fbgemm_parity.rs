//! Narsil's pooling against FBGEMM's lookup on the same rows and ids: the
//! split export of the test model (`scripts/test.sh` writes it with
//! `models/export_dlrm.py --split`) carries, for its small golden requests,
//! the pooled embeddings FBGEMM's INT8 table-batched embedding computed;
//! the sequence model's (`models/export_din.py --split`) carries, for its
//! small golden requests, `QuantEmbeddingCollection`'s rows of each history
//! (FBGEMM's nobag lookup), which the stage's sequence values must equal bit
//! for bit.

use std::path::{Path, PathBuf};

use narsil_embedding::{pool_rows, LocalRows, Pooling, PoolingMode, SplitSchema, Storage, Table};
use serde::Deserialize;

#[derive(Deserialize)]
struct Golden {
    requests: Vec<GoldenRequest>,
}

#[derive(Deserialize)]
struct GoldenRequest {
    batch_size: usize,
    lengths: Vec<u32>,
    ids: Vec<i64>,
    pooled: Option<Vec<f32>>,
}

fn split_model() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/generated/test-small/split");
    assert!(
        dir.join("schema.json").exists(),
        "{} is missing: run scripts/test.sh (it exports the test model with --split)",
        dir.display()
    );
    dir
}

#[test]
fn pooling_equals_fbgemm_on_the_exported_tables() {
    let dir = split_model();
    let schema = SplitSchema::read(&dir).unwrap();
    // Mapped: the same rows as read into memory (tested in the crate), so
    // this also checks that lookups through a map see the file.
    let tables: Vec<Table> =
        schema.tables.iter().map(|spec| Table::load(&dir, spec, LocalRows::Mmap).unwrap()).collect();
    let golden: Golden =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let features = schema.features.len();
    let dim = schema.pooled_dim();
    let mut compared = 0;
    let mut max_diff = 0f32;
    for request in golden.requests.iter().filter(|r| r.pooled.is_some()) {
        let b = request.batch_size;
        let mut out = vec![f32::NAN; b * features * dim];
        // The wire is sample-major: bag (sample s, feature f) is number s * F + f.
        let mut starts = Vec::with_capacity(b * features);
        let mut at = 0;
        for &len in &request.lengths {
            starts.push(at);
            at += len as usize;
        }
        for (f, feature) in schema.features.iter().enumerate() {
            let table = tables.iter().find(|t| t.name == feature.table).unwrap();
            let lengths: Vec<i32> = (0..b).map(|s| request.lengths[s * features + f] as i32).collect();
            let ids: Vec<i64> = (0..b)
                .flat_map(|s| {
                    let bag = s * features + f;
                    request.ids[starts[bag]..starts[bag] + request.lengths[bag] as usize].iter().copied()
                })
                .collect();
            let pooling = Pooling { mode: PoolingMode::Sum, weights: None };
            let stride = features * dim;
            pool_rows(
                Storage::Int8Rowwise,
                table.bytes(),
                table.row_bytes,
                dim,
                &lengths,
                &ids,
                pooling,
                &mut out[f * dim..],
                stride,
            )
            .unwrap();
        }
        let expected = request.pooled.as_ref().unwrap();
        assert_eq!(out.len(), expected.len());
        for (got, want) in out.iter().zip(expected) {
            max_diff = max_diff.max((got - want).abs());
        }
        compared += 1;
    }
    assert!(compared >= 2, "the golden file has pooled embeddings for its small requests");
    // FBGEMM accumulates `fma(scale, q, acc + bias)` in FP32, as Narsil does.
    assert_eq!(max_diff, 0.0, "pooled embeddings differ from FBGEMM's by up to {max_diff}");
}

/// A golden request of the sequence model with QuantEmbeddingCollection's
/// rows of its history (as served: cut to the maximum).
#[derive(Deserialize)]
struct SequenceGolden {
    requests: Vec<SequenceRequest>,
}

#[derive(Deserialize)]
struct SequenceRequest {
    batch_size: usize,
    dense: Vec<f32>,
    lengths: Vec<u32>,
    ids: Vec<i64>,
    sequence_values: Option<std::collections::BTreeMap<String, Vec<f32>>>,
}

#[test]
fn sequence_rows_equal_quant_embedding_collections_bit_for_bit() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/generated/test-din/split");
    assert!(dir.join("schema.json").exists(), "{} is missing: run scripts/test.sh", dir.display());
    let split = SplitSchema::read(&dir).unwrap();
    let model = split.model_schema("torch", "cpu");
    let store = narsil_embedding::TableStore::Memory;
    let (stage, _) = narsil_embedding::EmbeddingStage::open(&dir, &split, &store).unwrap();
    let golden: SequenceGolden =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let sequence = &model.sequences[0];
    let mut compared = 0;
    for request in golden.requests.iter().filter(|r| r.sequence_values.is_some()) {
        let mut samples = narsil_core::RequestSamples {
            num_samples: request.batch_size,
            dense: request.dense.clone(),
            lengths: request.lengths.clone(),
            ids: request.ids.clone(),
            ..Default::default()
        };
        samples.validate(&model, narsil_core::request::RequestLimits::new(64, Default::default())).unwrap();
        let batch = narsil_core::assemble(model.num_dense, model.num_sparse(), [&samples]);
        let mut scratch = narsil_embedding::StageScratch::default();
        stage.pool(&batch, &mut scratch, &mut Vec::new()).unwrap();
        let values = &scratch.sequences()[0];
        let expected = request.sequence_values.as_ref().unwrap();
        let mut column = 0;
        for &f in &sequence.features {
            let name = &model.sparse[f].name;
            let dim = split.table(&split.features[f].table).unwrap().dim;
            let got: Vec<u32> = values
                .values
                .chunks_exact(values.width)
                .flat_map(|position| position[column..column + dim].iter().map(|v| v.to_bits()))
                .collect();
            let want: Vec<u32> = expected[name].iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "{name}: the stage's positions differ from QuantEmbeddingCollection's");
            column += dim;
        }
        compared += 1;
    }
    assert!(compared >= 4, "the golden file carries QuantEmbeddingCollection's rows for its small requests");
}
