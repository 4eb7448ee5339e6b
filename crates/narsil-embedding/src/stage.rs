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
//! pooled from the fetched copies through each id's slot. Tables whose
//! stores fetch many tables at once ([`crate::stores::batch`]: a Redis
//! Cluster's, the disk's) are handed to their store together, before any is
//! pooled, not one table after another.
//!
//! Once lookups of a memory-mapped table wait on the disk (the last batch
//! took major faults), the next batch's distinct rows are read ahead by
//! [`READERS`] threads at once before pooling: page reads in flight
//! together instead of one synchronous fault at a time on the lane.
//!
//! One stage serves every lane of a model version (its tables and metrics
//! are shared); each lane brings its own [`StageScratch`].

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use narsil_core::KeyedBatch;

use crate::dedup::DistinctIds;
use crate::metrics::{StageMetrics, TableCounters};
use crate::pool::{pool_rows, OutOfRange, Pooling};
use crate::schema::{PoolingMode, SplitSchema, TableSpec};
use crate::stores::batch::{group_tables, FetchPart};
use crate::stores::config::{OpenedTables, TableStore};
use crate::stores::local::table::TableError;
use crate::stores::row_store::{FetchError, Fetched, RowStore};

struct StageTable {
    spec: TableSpec,
    store: Arc<dyn RowStore>,
    /// The features that index it, in schema order.
    features: Vec<usize>,
    counters: TableCounters,
    /// Whether a batch's ids are deduplicated: for stores that fetch rows
    /// (each distinct row once) and mapped files (each distinct row read
    /// ahead once). A table in process memory is read in place, one row per
    /// id: a hash per id would cost more than the reads it saves (6% of
    /// the default DLRM's INT8 forward at 1,600 rows), so its ids are
    /// counted, not deduplicated.
    deduplicates: bool,
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
    /// Every caller of the batch stopped waiting (their deadlines passed)
    /// before the store delivered its rows: the batch is abandoned, not
    /// failed.
    #[error("table {table:?}: the {store} store's fetch was given up: {source}")]
    Abandoned {
        /// The table.
        table: String,
        /// Which store.
        store: &'static str,
        /// Where it stopped.
        source: FetchError,
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

impl From<StageError> for narsil_core::BackendError {
    /// A store that could not deliver rows makes the requests
    /// `Unavailable` (a retry may succeed: the cluster fails over); a fetch
    /// given up at the batch's deadline, `Abandoned` (not the backend's
    /// failure); any other stage error is a failed forward.
    fn from(error: StageError) -> Self {
        match error {
            StageError::Fetch { .. } => Self::Unavailable { reason: error.to_string(), source: None },
            StageError::Abandoned { .. } => Self::Abandoned { reason: error.to_string() },
            StageError::OutOfRange { .. } => Self::forward("the embedding stage").caused_by(error),
        }
    }
}

/// A lane's buffers, reused from batch to batch.
#[derive(Default)]
pub struct StageScratch {
    /// Per table: the batch's distinct ids.
    distinct: Vec<DistinctIds>,
    /// Per table whose store fetches: the rows of its distinct ids.
    fetched: Vec<Vec<u8>>,
    /// A feature's ids as their rows in the file, for local rows laid out
    /// in popularity order.
    file_rows: Vec<i64>,
}

/// A split model's embedding stage.
pub struct EmbeddingStage {
    tables: Vec<StageTable>,
    features: Vec<FeatureLookup>,
    dim: usize,
    metrics: StageMetrics,
    /// Whether the last batch's lookups waited on the disk: the next one
    /// reads its mapped rows ahead first ([`READERS`] threads).
    faulting: AtomicBool,
}

/// Threads that read a batch's mapped rows ahead, in parallel, once lookups
/// wait on the disk: that many page reads in flight instead of one.
const READERS: usize = 16;

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
                deduplicates: store.local_rows().is_none() || store.may_fault(),
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
        Self { tables, features, dim: schema.pooled_dim(), metrics, faulting: AtomicBool::new(false) }
    }

    /// Opens every table of the split model in `dir` in `store` (how each
    /// kind opens them: [`crate::stores::config::StoreConfig::open`]; the
    /// local stores share the tables a live model version already holds,
    /// the `redis` store checks each table is loaded on the cluster).
    pub fn open(
        dir: &Path,
        schema: &SplitSchema,
        store: &TableStore,
    ) -> Result<(Self, OpenedTables), TableError> {
        let (stores, opened) = store.open(dir, schema)?;
        Ok((Self::new(schema, stores), opened))
    }

    /// Values in the pooled input per row: features times the pooled width.
    pub fn pooled_width(&self) -> usize {
        self.features.len() * self.dim
    }

    /// Tells `watcher` whether the store its tables are on answers (see
    /// [`narsil_core::BackendFactory::watch_dependencies`]); tables in this
    /// process always do, and never call it.
    pub fn watch_store(&self, watcher: narsil_core::DependencyWatcher) {
        // Every table of a model is in the one store it was opened in: the
        // first that takes the watcher watches them all.
        let mut watcher = Some(watcher);
        for table in &self.tables {
            let Some(unwatched) = watcher.take() else { break };
            watcher = table.store.watch_reachability(unwatched);
        }
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
        scratch.distinct.resize_with(self.tables.len(), DistinctIds::default);
        for (table, distinct) in self.tables.iter().zip(&mut scratch.distinct) {
            self.collect(table, batch, distinct)?;
        }
        let mut faults = 0;
        if self.faulting.load(Ordering::Relaxed) {
            faults += self.read_ahead(&scratch.distinct);
        }
        self.fetch(batch, scratch)?;
        for ((table, distinct), fetched) in self.tables.iter().zip(&scratch.distinct).zip(&scratch.fetched) {
            faults +=
                self.pool_table(table, batch, distinct, fetched, &mut scratch.file_rows, pooled, width)?;
        }
        self.faulting.store(faults > 0, Ordering::Relaxed);
        Ok(())
    }

    /// Range-checks the ids of `table`'s features and, where the table
    /// deduplicates ([`StageTable::deduplicates`]), deduplicates them.
    fn collect(
        &self,
        table: &StageTable,
        batch: &KeyedBatch,
        distinct: &mut DistinctIds,
    ) -> Result<(), StageError> {
        distinct.clear();
        let rows = table.spec.rows;
        let mut looked_up = 0;
        for &f in &table.features {
            let ids = batch.feature_ids(f);
            if let Some(&id) = ids.iter().find(|&&id| id < 0 || id as u64 >= rows) {
                let source = OutOfRange { id, rows };
                return Err(StageError::OutOfRange { feature: self.features[f].name.clone(), source });
            }
            looked_up += ids.len();
            if table.deduplicates {
                distinct.add(ids);
            }
        }
        table.counters.ids.inc_by(looked_up as u64);
        if table.deduplicates {
            table.counters.distinct_ids.inc_by(distinct.count().distinct as u64);
        }
        Ok(())
    }

    /// Touches every distinct row of the tables whose reads can wait on the
    /// disk, from [`READERS`] threads at once, so that their page reads are
    /// in flight together; returns the major faults taken (counted per
    /// table).
    fn read_ahead(&self, distinct: &[DistinctIds]) -> u64 {
        let started = Instant::now();
        let work: Vec<(usize, &StageTable, &[i64])> = self
            .tables
            .iter()
            .zip(distinct)
            .enumerate()
            .filter(|(_, (table, _))| table.store.may_fault() && table.store.local_rows().is_some())
            .map(|(t, (table, ids))| (t, table, ids.distinct()))
            .collect();
        let mut faults = vec![0u64; self.tables.len()];
        std::thread::scope(|scope| {
            let readers: Vec<_> = (0..READERS)
                .map(|reader| {
                    let work = &work;
                    scope.spawn(move || {
                        let mut faults = vec![0u64; work.len()];
                        for (w, &(_, table, ids)) in work.iter().enumerate() {
                            let rows = table.store.local_rows().unwrap_or_default();
                            let (row_bytes, slots) = (table.spec.row_bytes, table.store.slots());
                            let before = thread_major_faults();
                            for &id in ids.iter().skip(reader).step_by(READERS) {
                                let at = slots.map_or(id, |index| index.slot(id));
                                // A row can span two pages: its first and last byte.
                                let start = at as usize * row_bytes;
                                std::hint::black_box((rows[start], rows[start + row_bytes - 1]));
                            }
                            faults[w] = thread_major_faults().saturating_sub(before);
                        }
                        faults
                    })
                })
                .collect();
            for reader in readers {
                let taken = reader.join().expect("a read-ahead thread only reads");
                for (w, n) in taken.into_iter().enumerate() {
                    faults[work[w].0] += n;
                }
            }
        });
        for (table, &n) in self.tables.iter().zip(&faults) {
            table.counters.major_faults.inc_by(n);
        }
        self.metrics.read_ahead_seconds().observe(started.elapsed().as_secs_f64());
        faults.iter().sum()
    }

    /// Copies the distinct rows of every table whose store fetches into
    /// `scratch.fetched`: the tables of a store that fetches many at once
    /// in one call per [`crate::stores::batch::BatchGroup`], the others one
    /// by one.
    fn fetch(&self, batch: &KeyedBatch, scratch: &mut StageScratch) -> Result<(), StageError> {
        scratch.fetched.resize_with(self.tables.len(), Vec::new);
        for ((table, distinct), out) in self.tables.iter().zip(&scratch.distinct).zip(&mut scratch.fetched) {
            if table.store.local_rows().is_none() {
                out.resize(distinct.distinct().len() * table.spec.row_bytes, 0);
            }
        }
        let fetching = self.tables.iter().enumerate().filter(|(_, table)| table.store.local_rows().is_none());
        for (group, tables) in group_tables(fetching.map(|(t, table)| (t, table.store.as_ref()))) {
            let Some(batcher) = group.and_then(|_| self.tables[tables[0]].store.batch_fetch()) else {
                for t in tables {
                    let (table, ids) = (&self.tables[t], scratch.distinct[t].distinct());
                    let fetched =
                        table.store.fetch(ids, table.spec.row_bytes, &mut scratch.fetched[t], batch.deadline);
                    self.count_fetch(t, ids.len(), fetched)?;
                }
                continue;
            };
            let mut outs: Vec<Option<&mut Vec<u8>>> = scratch.fetched.iter_mut().map(Some).collect();
            let mut parts: Vec<FetchPart<'_>> = tables
                .iter()
                .map(|&t| FetchPart {
                    store: self.tables[t].store.as_ref(),
                    ids: scratch.distinct[t].distinct(),
                    row_bytes: self.tables[t].spec.row_bytes,
                    out: outs[t].take().expect("a table is in one group"),
                    counters: &self.tables[t].counters,
                })
                .collect();
            let started = Instant::now();
            let fetched = batcher.fetch_parts(&mut parts, batch.deadline);
            self.metrics.remote_fetch_seconds().observe(started.elapsed().as_secs_f64());
            match fetched {
                Ok(fetched) => {
                    for ((&t, part), fetched) in tables.iter().zip(&parts).zip(fetched) {
                        self.count_fetch(t, part.ids.len(), Ok(fetched))?;
                    }
                }
                Err((failed, error)) => {
                    // The batch's fetch of every table of the group failed.
                    for (p, &t) in tables.iter().enumerate() {
                        if p != failed && !error.abandoned {
                            self.tables[t].counters.store_errors.inc();
                        }
                    }
                    self.count_fetch(tables[failed.min(tables.len() - 1)], 0, Err(error))?;
                }
            }
        }
        Ok(())
    }

    /// Counts table `t`'s fetch of `distinct` rows, or its failure (a fetch
    /// given up at the batch's deadline is not the store's failure).
    fn count_fetch(
        &self,
        t: usize,
        distinct: usize,
        fetched: Result<Fetched, FetchError>,
    ) -> Result<(), StageError> {
        let table = &self.tables[t];
        let fetched = fetched.map_err(|source| {
            let (table_name, store) = (table.spec.name.clone(), table.store.kind());
            if source.abandoned {
                return StageError::Abandoned { table: table_name, store, source };
            }
            table.counters.store_errors.inc();
            StageError::Fetch { table: table_name, store, source }
        })?;
        table.counters.cache_hits.inc_by(fetched.cached as u64);
        table.counters.missing_rows.inc_by(fetched.zeroed as u64);
        table.counters.rows_fetched.inc_by((distinct - fetched.cached) as u64);
        Ok(())
    }

    /// Pools `table`'s bags (its ids deduplicated in `distinct`, the rows
    /// of a fetching store in `fetched`; `file_rows` holds a feature's ids
    /// as rows of a local file in popularity order); returns the major
    /// faults the lookups took.
    #[allow(clippy::too_many_arguments)]
    fn pool_table(
        &self,
        table: &StageTable,
        batch: &KeyedBatch,
        distinct: &DistinctIds,
        fetched: &[u8],
        file_rows: &mut Vec<i64>,
        pooled: &mut [f32],
        width: usize,
    ) -> Result<u64, StageError> {
        let started = Instant::now();
        let faults_before = table.store.may_fault().then(thread_major_faults);
        let spec = &table.spec;
        let local = table.store.local_rows();
        if local.is_some() {
            // Each distinct row read once, or each id's row in place.
            let read = match table.deduplicates {
                true => distinct.distinct().len(),
                false => table.features.iter().map(|&f| batch.feature_ids(f).len()).sum(),
            };
            table.counters.rows_fetched.inc_by(read as u64);
        }
        let mut slot_start = 0;
        for &f in &table.features {
            let feature = &self.features[f];
            let ids = batch.feature_ids(f);
            let weights = (feature.weighted && !batch.weights.is_empty())
                .then(|| &batch.weights[batch.feature_offsets[f]..batch.feature_offsets[f + 1]]);
            let (rows, ids) = match (local, table.store.slots()) {
                (Some(rows), None) => (rows, ids),
                (Some(rows), Some(index)) => {
                    file_rows.clear();
                    file_rows.extend(ids.iter().map(|&id| index.slot(id)));
                    (rows, &file_rows[..])
                }
                (None, _) => (fetched, &distinct.slots()[slot_start..slot_start + ids.len()]),
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
            .map_err(|source| StageError::OutOfRange { feature: feature.name.clone(), source })?;
        }
        let faults = faults_before.map_or(0, |before| thread_major_faults().saturating_sub(before));
        table.counters.major_faults.inc_by(faults);
        table.counters.fetch_seconds.observe(started.elapsed().as_secs_f64());
        Ok(faults)
    }
}

/// Major page faults taken by the calling thread so far.
fn thread_major_faults() -> u64 {
    // SAFETY: all zeros is a valid `rusage` (integers and `timeval`s), and
    // getrusage writes one rusage into memory we own.
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
    use crate::pool::pool_rows;
    use crate::schema::{FeatureSpec, Storage};
    use crate::stores::batch::FetchPart;
    use crate::stores::local::table::{LocalRows, Table};
    use narsil_core::{assemble, RequestSamples};

    /// The same rows, fetched by copy instead of read in place.
    struct Fetching(Table);

    impl RowStore for Fetching {
        fn kind(&self) -> &'static str {
            "fetching"
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
        fn local_rows(&self) -> Option<&[u8]> {
            None
        }
        fn fetch(
            &self,
            ids: &[i64],
            row_bytes: usize,
            out: &mut [u8],
            deadline: Option<Instant>,
        ) -> Result<Fetched, FetchError> {
            self.0.fetch(ids, row_bytes, out, deadline)
        }
        fn may_fault(&self) -> bool {
            false
        }
    }

    /// Rows fetched by a store of its own that batches: every table of a
    /// batch in one call, which it counts; or, once told to, a fetch given
    /// up at the deadline.
    struct Batching {
        rows: Table,
        calls: Arc<std::sync::atomic::AtomicUsize>,
        abandon: bool,
    }

    impl RowStore for Batching {
        fn kind(&self) -> &'static str {
            "batching"
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
        fn local_rows(&self) -> Option<&[u8]> {
            None
        }
        fn fetch(
            &self,
            _: &[i64],
            _: usize,
            _: &mut [u8],
            _: Option<Instant>,
        ) -> Result<Fetched, FetchError> {
            panic!("a batching store's tables are fetched together")
        }
        fn may_fault(&self) -> bool {
            false
        }
        fn batch_fetch(&self) -> Option<&dyn crate::stores::BatchFetch> {
            Some(self)
        }
    }

    impl crate::stores::BatchFetch for Batching {
        fn group(&self) -> crate::stores::batch::BatchGroup {
            crate::stores::batch::BatchGroup { kind: "batching", instance: 0 }
        }
        fn fetch_parts(
            &self,
            parts: &mut [FetchPart<'_>],
            deadline: Option<Instant>,
        ) -> Result<Vec<Fetched>, (usize, FetchError)> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            if self.abandon {
                assert!(deadline.is_some());
                return Err((1, FetchError::abandoned("every caller's deadline passed")));
            }
            let mut fetched = Vec::new();
            for part in parts.iter_mut() {
                let rows = &part.store.as_any().downcast_ref::<Batching>().unwrap().rows;
                fetched.push(rows.fetch(part.ids, part.row_bytes, part.out, deadline).unwrap());
            }
            Ok(fetched)
        }
    }

    #[test]
    fn a_store_that_batches_gets_every_table_of_a_batch_in_one_call_and_pools_the_same_bags() {
        let schema = schema();
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let local: Vec<Arc<dyn RowStore>> =
            schema.tables.iter().enumerate().map(|(i, t)| Arc::new(rows(t, 3 + i as u8)) as _).collect();
        let batching: Vec<Arc<dyn RowStore>> = schema
            .tables
            .iter()
            .enumerate()
            .map(|(i, t)| {
                Arc::new(Batching { rows: rows(t, 3 + i as u8), calls: calls.clone(), abandon: false }) as _
            })
            .collect();
        let batch = batch();
        let pooled = |stores| {
            let (mut scratch, mut pooled) = (StageScratch::default(), Vec::new());
            EmbeddingStage::new(&schema, stores).pool(&batch, &mut scratch, &mut pooled).unwrap();
            pooled
        };
        assert_eq!(pooled(batching), pooled(local));
        assert_eq!(calls.load(Ordering::Relaxed), 1, "both tables in one call");
    }

    #[test]
    fn a_fetch_given_up_at_the_deadline_abandons_the_batch_without_counting_a_store_error() {
        let schema = schema();
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let stores: Vec<Arc<dyn RowStore>> = schema
            .tables
            .iter()
            .map(|t| Arc::new(Batching { rows: rows(t, 1), calls: calls.clone(), abandon: true }) as _)
            .collect();
        let stage = EmbeddingStage::new(&schema, stores);
        let mut batch = batch();
        batch.deadline = Some(Instant::now());
        let error = stage.pool(&batch, &mut StageScratch::default(), &mut Vec::new()).unwrap_err();
        assert!(matches!(error, StageError::Abandoned { .. }), "{error}");
        for table in ["shared", "own"] {
            assert_eq!(stage.metrics().table(table).store_errors.get(), 0, "{table}");
        }
        let backend = narsil_core::BackendError::from(error);
        assert!(matches!(backend, narsil_core::BackendError::Abandoned { .. }), "{backend}");
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
            redis: None,
            layout: None,
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
    fn features_sharing_a_table_pool_their_own_bags_and_a_fetching_store_reads_each_row_once() {
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
            pool_rows(
                Storage::Int8Rowwise,
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
        // In-memory tables are read in place, one row per id: counted, not
        // deduplicated. A fetching store gets each distinct row once.
        for (stores, deduplicates) in [(local, false), (fetching, true)] {
            let stage = EmbeddingStage::new(&schema, stores);
            let (mut scratch, mut pooled) = (StageScratch::default(), Vec::new());
            stage.pool(&batch, &mut scratch, &mut pooled).unwrap();
            assert_eq!(pooled, expected);
            let shared = stage.metrics().table("shared");
            let own = stage.metrics().table("own");
            if deduplicates {
                // a: 4 4, 9 4; c: 3 40, 0 9.
                assert_eq!(
                    (shared.ids.get(), shared.distinct_ids.get(), shared.rows_fetched.get()),
                    (8, 5, 5)
                );
                // b: 9, 4 9 9, 4, 4 4 4.
                assert_eq!((own.ids.get(), own.distinct_ids.get(), own.rows_fetched.get()), (8, 2, 2));
            } else {
                assert_eq!(
                    (shared.ids.get(), shared.distinct_ids.get(), shared.rows_fetched.get()),
                    (8, 0, 8)
                );
                assert_eq!((own.ids.get(), own.distinct_ids.get(), own.rows_fetched.get()), (8, 0, 8));
            }
        }
        // The weighted feature's weights matter, and mean pooling divides.
        assert_ne!(expected[16..24], expected[..8]);
    }

    #[test]
    fn reading_mapped_rows_ahead_pools_the_same_bags() {
        let schema = schema();
        let dir = tempfile_dir("narsil-stage-read-ahead");
        std::fs::create_dir_all(dir.join("tables")).unwrap();
        let stores: Vec<Arc<dyn RowStore>> = schema
            .tables
            .iter()
            .enumerate()
            .map(|(i, spec)| {
                std::fs::write(dir.join(&spec.file), rows(spec, 3 + i as u8).bytes()).unwrap();
                Arc::new(Table::load(&dir, spec, LocalRows::Mmap).unwrap()) as Arc<dyn RowStore>
            })
            .collect();
        let stage = EmbeddingStage::new(&schema, stores);
        let batch = batch();
        let (mut scratch, mut plain, mut ahead) = (StageScratch::default(), Vec::new(), Vec::new());
        stage.pool(&batch, &mut scratch, &mut plain).unwrap();
        stage.faulting.store(true, Ordering::Relaxed);
        stage.pool(&batch, &mut scratch, &mut ahead).unwrap();
        assert_eq!(plain, ahead);
        let mut registry = prometheus_client::registry::Registry::with_prefix("narsil");
        stage.metrics().register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(text.contains("narsil_table_read_ahead_seconds_count 1\n"), "{text}");
        // The rows were cached: no fault, so the next batch does not read ahead.
        assert!(!stage.faulting.load(Ordering::Relaxed));
        std::fs::remove_dir_all(dir).unwrap();
    }

    fn tempfile_dir(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("{name}-{}", std::process::id()))
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
    /// Rows whose store can stop answering: it keeps the watchers it takes.
    struct Watched(Table, Arc<std::sync::Mutex<usize>>);

    impl RowStore for Watched {
        fn kind(&self) -> &'static str {
            "watched"
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
        fn local_rows(&self) -> Option<&[u8]> {
            self.0.local_rows()
        }
        fn fetch(
            &self,
            _: &[i64],
            _: usize,
            _: &mut [u8],
            _: Option<Instant>,
        ) -> Result<Fetched, FetchError> {
            unreachable!("local rows")
        }
        fn may_fault(&self) -> bool {
            false
        }
        fn watch_reachability(
            &self,
            watcher: narsil_core::DependencyWatcher,
        ) -> Option<narsil_core::DependencyWatcher> {
            watcher(true);
            *self.1.lock().unwrap() += 1;
            None
        }
    }

    #[test]
    fn the_store_is_watched_through_the_first_table_that_takes_the_watcher_and_only_once() {
        let schema = schema();
        let watched = Arc::new(std::sync::Mutex::new(0));
        let stores: Vec<Arc<dyn RowStore>> = vec![
            Arc::new(rows(&schema.tables[0], 1)),
            Arc::new(Watched(rows(&schema.tables[1], 1), watched.clone())),
        ];
        let heard = Arc::new(std::sync::Mutex::new(Vec::new()));
        let h = heard.clone();
        EmbeddingStage::new(&schema, stores).watch_store(Box::new(move |answers| {
            h.lock().unwrap().push(answers);
            true
        }));
        assert_eq!((*watched.lock().unwrap(), heard.lock().unwrap().clone()), (1, vec![true]));
        // Tables in this process only: nobody is told anything.
        let local = schema.tables.iter().map(|t| Arc::new(rows(t, 1)) as Arc<dyn RowStore>).collect();
        EmbeddingStage::new(&schema, local).watch_store(Box::new(|_| panic!("no store to watch")));
    }
}
