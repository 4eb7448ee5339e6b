//! The stage's test fixtures, shared by the tests of its files: a split
//! schema of two tables (one indexed by two features, one weighted), rows
//! for its tables, a fused batch of two requests, a store of local rows
//! laid out or watched, and the check that a bf16 block is the FP32 one
//! rounded.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use narsil_core::{assemble, DependencyWatcher, KeyedBatch, RequestSamples};

use super::{EmbeddingStage, StageScratch};
use crate::pooled_value::Bf16;
use crate::popularity_order::SlotIndex;
use crate::schema::{FeatureSpec, PoolingMode, SplitSchema, Storage, TableSpec};
use crate::stores::local::table::Table;
use crate::stores::row_store::{FetchError, Fetched, RowStore};

/// `stage` pools `batch` into FP32 (returned, as bits) and into bf16, and
/// the bf16 block is the FP32 one rounded, bit for bit (what libtorch's
/// cast of the FP32 block gives).
pub(super) fn pooled_bits_both_ways(stage: &EmbeddingStage, batch: &KeyedBatch) -> Vec<u32> {
    let (mut fp32, mut bf16) = (Vec::<f32>::new(), vec![Bf16(0xFFFF); 3]);
    stage.pool(batch, &mut StageScratch::default(), &mut fp32).unwrap();
    stage.pool_into(batch, &mut StageScratch::default(), &mut bf16).unwrap();
    let rounded: Vec<Bf16> = fp32.iter().map(|&v| Bf16::from_f32(v)).collect();
    assert_eq!(bf16, rounded, "the bf16 block is the FP32 one rounded");
    assert!(fp32.iter().any(|&v| Bf16::from_f32(v).to_f32() != v), "some values round");
    fp32.iter().map(|v| v.to_bits()).collect()
}

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

/// [`rows`] of `spec`'s `row_bytes` (16 or more): each 16-byte row
/// followed by zeros (room for a raw id where a table is laid out by its
/// id map).
pub(super) fn wide_rows(spec: &TableSpec, seed: u8) -> Table {
    let narrow = rows(&TableSpec { row_bytes: 16, ..spec.clone() }, seed);
    let pad = spec.row_bytes - 16;
    let bytes =
        narrow.bytes().chunks(16).flat_map(|row| row.iter().copied().chain(std::iter::repeat_n(0, pad)));
    Table::from_rows(spec, bytes.collect())
}

pub(super) fn batch() -> KeyedBatch {
    let [first, second] = requests();
    assemble(1, 3, [&first, &second])
}

/// The two requests [`batch`] fuses.
pub(super) fn requests() -> [RequestSamples; 2] {
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
    [first, second]
}

/// Local rows, read in place: laid out through a slot index, or watched.
pub(super) struct LocalRows {
    kind: &'static str,
    rows: Vec<u8>,
    index: Option<SlotIndex>,
    /// How many watchers it took, for a store that can stop answering.
    watchers: Option<Arc<Mutex<usize>>>,
}

impl LocalRows {
    /// `table`'s `rows` rows laid out in reverse order, found through a
    /// slot index (what `narsil tables order` writes).
    pub(super) fn laid_out(table: &Table, rows: usize, row_bytes: usize) -> Self {
        let slots: Vec<u32> = (0..rows as u32).map(|id| rows as u32 - 1 - id).collect();
        let mut laid = vec![0u8; rows * row_bytes];
        for (id, &slot) in slots.iter().enumerate() {
            let slot = slot as usize;
            laid[slot * row_bytes..(slot + 1) * row_bytes]
                .copy_from_slice(&table.bytes()[id * row_bytes..(id + 1) * row_bytes]);
        }
        Self {
            kind: "laid-out",
            rows: laid,
            index: Some(SlotIndex::from_slots(&slots).unwrap()),
            watchers: None,
        }
    }

    /// `table`'s rows in a store that can stop answering: it keeps the
    /// watchers it takes, counting them in `watchers`.
    pub(super) fn watched(table: &Table, watchers: Arc<Mutex<usize>>) -> Self {
        Self { kind: "watched", rows: table.bytes().to_vec(), index: None, watchers: Some(watchers) }
    }
}

impl RowStore for LocalRows {
    fn kind(&self) -> &'static str {
        self.kind
    }
    fn local_rows(&self) -> Option<&[u8]> {
        Some(&self.rows)
    }
    fn slots(&self) -> Option<&SlotIndex> {
        self.index.as_ref()
    }
    fn fetch(&self, _: &[i64], _: usize, _: &mut [u8], _: Option<Instant>) -> Result<Fetched, FetchError> {
        unreachable!("local rows")
    }
    fn may_fault(&self) -> bool {
        false
    }
    fn watch_reachability(&self, watcher: DependencyWatcher) -> Option<DependencyWatcher> {
        let Some(watchers) = &self.watchers else { return Some(watcher) };
        watcher(true);
        *watchers.lock().unwrap() += 1;
        None
    }
}
