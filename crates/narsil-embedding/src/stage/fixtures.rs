//! The stage's test fixtures, shared by the tests of its files: a split
//! schema of two tables (one indexed by two features, one weighted), rows
//! for its tables, and a fused batch of two requests.

use narsil_core::{assemble, KeyedBatch, RequestSamples};

use crate::schema::{FeatureSpec, PoolingMode, SplitSchema, Storage, TableSpec};
use crate::stores::local::table::Table;

pub(super) fn schema() -> SplitSchema {
    let table = |name: &str, rows| TableSpec {
        name: name.into(),
        rows,
        dim: 8,
        storage: Storage::Int8Rowwise,
        row_bytes: 16,
        file: format!("tables/{name}.bin").into(),
        sha256: String::new(),
        redis: None,
        layout: None,
        ids: Default::default(),
    };
    let feature = |name: &str, table: &str, pooling, weighted| FeatureSpec {
        name: name.into(),
        table: table.into(),
        pooling,
        weighted,
    };
    SplitSchema {
        tables: vec![table("shared", 50), table("own", 10)],
        features: vec![
            feature("a", "shared", PoolingMode::Sum, false),
            feature("b", "own", PoolingMode::Mean, false),
            feature("c", "shared", PoolingMode::Sum, true),
        ],
        outputs: vec!["default".into()],
        dense_network: "dense.pt".into(),
        // Format, name "m", version "1", one dense feature, no other
        // dense form.
        ..SplitSchema::one_table_per_feature("m", "1", 1, Vec::new(), Vec::new())
    }
}

pub(super) fn rows(spec: &TableSpec, seed: u8) -> Table {
    let data = (0..spec.rows as usize * 16)
        .map(|i| match i % 16 {
            0 | 2 => 0,
            1 => 0x20,                         // scale 2^-7
            3 => 0xa4,                         // bias -2^-6
            _ => (i as u8).wrapping_mul(seed), // values
        })
        .collect();
    Table::from_rows(spec, data)
}

pub(super) fn batch() -> KeyedBatch {
    // Two requests of two samples, sample-major as they arrive; feature
    // c (weighted) last, as the wire orders them. Weights come one per
    // id, 1.0 for the unweighted features' ids.
    let request = |ids: Vec<i64>, c_weights: [f32; 2]| RequestSamples {
        num_samples: 2,
        dense: vec![0.5, 0.25],
        // Sample 0: a 2 ids, b 1, c 1; sample 1: a none, b 3, c 1.
        lengths: vec![2, 1, 1, 0, 3, 1],
        ids,
        weights: vec![1.0, 1.0, 1.0, c_weights[0], 1.0, 1.0, 1.0, c_weights[1]],
        ..Default::default()
    };
    let first = request(vec![4, 4, 9, 3, 4, 9, 9, 40], [0.5, -1.25]);
    let second = request(vec![9, 4, 4, 0, 4, 4, 4, 9], [1.5, 3.0]);
    assemble(1, 3, [&first, &second])
}
