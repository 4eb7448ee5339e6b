//! The embedding stage: for a fused batch, each table's ids are collected
//! across every feature that indexes it, deduplicated, their rows fetched
//! once from the table's store, and every bag pooled (sum or mean, with
//! per-id weights for weighted features) into the dense network's pooled
//! input, `[rows, features * dim]` row-major.
//!
//! Stores that hold their rows in this process's address space (`memory`,
//! `mmap`) are pooled straight from those rows: reading a row twice costs a
//! cache hit, not a fetch, so deduplication there only feeds the metrics.
//! A store that fetches rows gets each distinct id once, and the bags are
//! pooled from the fetched copies through each id's slot.
//!
//! One stage serves every lane of a model version (its tables and metrics
//! are shared); each lane brings its own [`StageScratch`].

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use narsil_core::KeyedBatch;

use crate::dedup::DistinctIds;
use crate::metrics::{StageMetrics, TableCounters};
use crate::pool::{pool_rows, OutOfRange, Pooling};
use crate::schema::{PoolingMode, SplitSchema, TableSpec};
use crate::shared::open_shared;
use crate::store::{FetchError, RowStore};
use crate::table::{TableError, TableStore};

struct StageTable {
    spec: TableSpec,
    store: Arc<dyn RowStore>,
    /// The features that index it, in schema order.
    features: Vec<usize>,
    counters: TableCounters,
}

struct FeatureLookup {
    name: String,
    pooling: PoolingMode,
    weighted: bool,
}

/// Why a batch's embeddings cannot be pooled.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// An id outside its table (requests are validated before they get
    /// here, so this is a bug or a schema mismatch).
    #[error("feature {feature:?}: {source}")]
    OutOfRange {
        /// The feature.
        feature: String,
        /// The id and the table's rows.
        source: OutOfRange,
    },
    /// The store could not deliver rows.
    #[error("table {table:?}: the {store} store failed: {source}")]
    Fetch {
        /// The table.
        table: String,
        /// Which store.
        store: &'static str,
        /// Why.
        source: FetchError,
    },
}

/// A lane's buffers, reused from batch to batch.
#[derive(Default)]
pub struct StageScratch {
    distinct: DistinctIds,
    fetched: Vec<u8>,
}

/// How a stage's tables were opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Opened {
    /// Tables read (or mapped) now.
    pub read: usize,
    /// Tables another live model version already held.
    pub shared: usize,
    /// Bytes of every table.
    pub bytes: u64,
}

/// A split model's embedding stage.
pub struct EmbeddingStage {
    tables: Vec<StageTable>,
    features: Vec<FeatureLookup>,
    dim: usize,
    metrics: StageMetrics,
}

impl EmbeddingStage {
    /// A stage over `schema` whose table `i` is `stores[i]`.
    pub fn new(schema: &SplitSchema, stores: Vec<Arc<dyn RowStore>>) -> Self {
        assert_eq!(stores.len(), schema.tables.len(), "one store per table");
        let metrics = StageMetrics::default();
        let tables = schema
            .tables
            .iter()
            .zip(stores)
            .map(|(spec, store)| StageTable {
                spec: spec.clone(),
                store,
                features: (0..schema.features.len())
                    .filter(|&f| schema.features[f].table == spec.name)
                    .collect(),
                counters: metrics.table(&spec.name),
            })
            .collect();
        let features = schema
            .features
            .iter()
            .map(|f| FeatureLookup { name: f.name.clone(), pooling: f.pooling, weighted: f.weighted })
            .collect();
        Self { tables, features, dim: schema.pooled_dim(), metrics }
    }

    /// Opens every table of the split model in `dir` in `store`, sharing
    /// those a live model version already holds (see [`crate::shared`]).
    pub fn open(dir: &Path, schema: &SplitSchema, store: TableStore) -> Result<(Self, Opened), TableError> {
        let mut opened = Opened::default();
        let mut stores: Vec<Arc<dyn RowStore>> = Vec::with_capacity(schema.tables.len());
        for spec in &schema.tables {
            let table = open_shared(dir, spec, store)?;
            if table.shared {
                opened.shared += 1;
            } else {
                opened.read += 1;
            }
            opened.bytes += table.table.bytes().len() as u64;
            stores.push(table.table);
        }
        Ok((Self::new(schema, stores), opened))
    }

    /// Values in the pooled input per row: features times the pooled width.
    pub fn pooled_width(&self) -> usize {
        self.features.len() * self.dim
    }

    /// The per-table metrics, to register with the engine's.
    pub fn metrics(&self) -> &StageMetrics {
        &self.metrics
    }

    /// Pools every bag of `batch` into `pooled` (resized to
    /// `[batch.rows, pooled_width]`).
    pub fn pool(
        &self,
        batch: &KeyedBatch,
        scratch: &mut StageScratch,
        pooled: &mut Vec<f32>,
    ) -> Result<(), StageError> {
        let width = self.pooled_width();
        pooled.resize(batch.rows * width, 0.0);
        for table in &self.tables {
            self.pool_table(table, batch, scratch, pooled, width)?;
        }
        Ok(())
    }

    fn pool_table(
        &self,
        table: &StageTable,
        batch: &KeyedBatch,
        scratch: &mut StageScratch,
        pooled: &mut [f32],
        width: usize,
    ) -> Result<(), StageError> {
        let started = Instant::now();
        let faults_before = table.store.may_fault().then(thread_major_faults);
        let spec = &table.spec;
        let out_of_range =
            |f: usize, source| StageError::OutOfRange { feature: self.features[f].name.clone(), source };
        scratch.distinct.clear();
        for &f in &table.features {
            let ids = batch.feature_ids(f);
            if let Some(&id) = ids.iter().find(|&&id| id < 0 || id as u64 >= spec.rows) {
                return Err(out_of_range(f, OutOfRange { id, rows: spec.rows }));
            }
            scratch.distinct.add(ids);
        }
        let count = scratch.distinct.count();
        let local = table.store.local_rows();
        if local.is_none() {
            scratch.fetched.resize(count.distinct * spec.row_bytes, 0);
            table.store.fetch(scratch.distinct.distinct(), spec.row_bytes, &mut scratch.fetched).map_err(
                |source| StageError::Fetch { table: spec.name.clone(), store: table.store.kind(), source },
            )?;
        }
        let mut slot_start = 0;
        for &f in &table.features {
            let feature = &self.features[f];
            let ids = batch.feature_ids(f);
            let weights = (feature.weighted && !batch.weights.is_empty())
                .then(|| &batch.weights[batch.feature_offsets[f]..batch.feature_offsets[f + 1]]);
            let (rows, ids) = match local {
                Some(rows) => (rows, ids),
                None => (&scratch.fetched[..], &scratch.distinct.slots()[slot_start..slot_start + ids.len()]),
            };
            slot_start += ids.len();
            let pooling = Pooling { mode: feature.pooling, weights };
            pool_rows(
                spec.storage,
                rows,
                spec.row_bytes,
                spec.dim,
                batch.feature_lengths(f),
                ids,
                pooling,
                &mut pooled[f * self.dim..],
                width,
            )
            .map_err(|source| out_of_range(f, source))?;
        }
        let counters = &table.counters;
        counters.ids.inc_by(count.looked_up as u64);
        counters.distinct_ids.inc_by(count.distinct as u64);
        counters.rows_fetched.inc_by(count.distinct as u64);
        if let Some(before) = faults_before {
            counters.major_faults.inc_by(thread_major_faults().saturating_sub(before));
        }
        counters.fetch_seconds.observe(started.elapsed().as_secs_f64());
        Ok(())
    }
}

/// Major page faults taken by the calling thread so far.
fn thread_major_faults() -> u64 {
    // SAFETY: getrusage writes one rusage into memory we own.
    unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_THREAD, &mut usage) != 0 {
            return 0;
        }
        usage.ru_majflt as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::pool_int8;
    use crate::schema::{FeatureSpec, Storage};
    use crate::table::Table;
    use narsil_core::{assemble, RequestSamples};

    /// The same rows, fetched by copy instead of read in place.
    struct Fetching(Table);

    impl RowStore for Fetching {
        fn kind(&self) -> &'static str {
            "fetching"
        }
        fn local_rows(&self) -> Option<&[u8]> {
            None
        }
        fn fetch(&self, ids: &[i64], row_bytes: usize, out: &mut [u8]) -> Result<(), FetchError> {
            self.0.fetch(ids, row_bytes, out)
        }
        fn may_fault(&self) -> bool {
            false
        }
    }

    fn schema() -> SplitSchema {
        let table = |name: &str, rows| TableSpec {
            name: name.into(),
            rows,
            dim: 8,
            storage: Storage::Int8Rowwise,
            row_bytes: 16,
            file: format!("tables/{name}.bin").into(),
            sha256: String::new(),
        };
        let feature = |name: &str, table: &str, pooling, weighted| FeatureSpec {
            name: name.into(),
            table: table.into(),
            pooling,
            weighted,
        };
        SplitSchema {
            format: crate::schema::SPLIT_FORMAT.into(),
            name: "m".into(),
            version: "1".into(),
            num_dense: 1,
            tables: vec![table("shared", 50), table("own", 10)],
            features: vec![
                feature("a", "shared", PoolingMode::Sum, false),
                feature("b", "own", PoolingMode::Mean, false),
                feature("c", "shared", PoolingMode::Sum, true),
            ],
            outputs: vec!["default".into()],
            dense_network: "dense.pt".into(),
            dense_weights: None,
        }
    }

    fn rows(spec: &TableSpec, seed: u8) -> Table {
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

    fn batch() -> KeyedBatch {
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

    #[test]
    fn features_sharing_a_table_pool_their_own_bags_and_their_ids_are_counted_once() {
        let schema = schema();
        let tables: Vec<Table> =
            schema.tables.iter().enumerate().map(|(i, t)| rows(t, 3 + i as u8)).collect();
        let batch = batch();
        let mut expected = vec![0.0f32; batch.rows * 24];
        for (f, feature) in schema.features.iter().enumerate() {
            let table = &tables[if feature.table == "shared" { 0 } else { 1 }];
            let weights = feature
                .weighted
                .then(|| &batch.weights[batch.feature_offsets[f]..batch.feature_offsets[f + 1]]);
            let pooling = Pooling { mode: feature.pooling, weights };
            pool_int8(
                table.bytes(),
                16,
                8,
                batch.feature_lengths(f),
                batch.feature_ids(f),
                pooling,
                &mut expected[f * 8..],
                24,
            )
            .unwrap();
        }
        let local: Vec<Arc<dyn RowStore>> =
            tables.into_iter().map(|t| Arc::new(t) as Arc<dyn RowStore>).collect();
        let fetching: Vec<Arc<dyn RowStore>> = schema
            .tables
            .iter()
            .enumerate()
            .map(|(i, t)| Arc::new(Fetching(rows(t, 3 + i as u8))) as Arc<dyn RowStore>)
            .collect();
        for stores in [local, fetching] {
            let stage = EmbeddingStage::new(&schema, stores);
            let (mut scratch, mut pooled) = (StageScratch::default(), Vec::new());
            stage.pool(&batch, &mut scratch, &mut pooled).unwrap();
            assert_eq!(pooled, expected);
            let shared = stage.metrics().table("shared");
            // a: 4 4, 9 4; c: 3 40, 0 9.
            assert_eq!((shared.ids.get(), shared.distinct_ids.get()), (8, 5));
            assert_eq!(shared.rows_fetched.get(), 5);
            // b: 9, 4 9 9, 4, 4 4 4.
            let own = stage.metrics().table("own");
            assert_eq!((own.ids.get(), own.distinct_ids.get()), (8, 2));
        }
        // The weighted feature's weights matter, and mean pooling divides.
        assert_ne!(expected[16..24], expected[..8]);
    }

    #[test]
    fn an_id_outside_its_table_names_the_feature() {
        let schema = schema();
        let stores = schema.tables.iter().map(|t| Arc::new(rows(t, 1)) as Arc<dyn RowStore>).collect();
        let stage = EmbeddingStage::new(&schema, stores);
        let mut batch = batch();
        let b = batch.feature_offsets[1];
        batch.ids[b] = 10;
        let error =
            stage.pool(&batch, &mut StageScratch::default(), &mut Vec::new()).unwrap_err().to_string();
        assert!(error.contains("\"b\"") && error.contains("id 10") && error.contains("10 rows"), "{error}");
    }
}
