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
//! [`READERS`](read_ahead::READERS) threads at once before pooling: page
//! reads in flight together instead of one synchronous fault at a time on
//! the lane.
//!
//! One stage serves every lane of a model version (its tables and metrics
//! are shared); each lane brings its own [`StageScratch`].
//!
//! This file holds the stage, how it is built and the order of a batch's
//! steps ([`EmbeddingStage::pool`]); each step is a file of its own:
//!
//! * `map_ids.rs`: for tables whose ids are raw 64-bit values, a copy of
//!   the batch whose ids are rows (through the table's id map, or modulo);
//! * `id_map_layout.rs`: mapped tables in memory laid out by their maps at load,
//!   so that a raw id's lookup reads its row and no map slot;
//! * `pushed_ids.rs`: raw ids pushed to a mapped table while it serves,
//!   with their rows (a copy-on-write overlay on its map; a batch reads one
//!   snapshot of it);
//! * `push.rs`: a push of raw ids and rows to a mapped table, how it is
//!   checked and why one is refused;
//! * `error.rs`: why a batch cannot be pooled ([`StageError`]) and what
//!   that makes of its requests;
//! * `collect.rs`: range-checking each table's ids and deduplicating them;
//! * `read_ahead.rs`: reading mapped rows ahead from many threads once
//!   lookups wait on the disk, and counting the major faults taken;
//! * `fetch.rs`: fetching the distinct rows of the tables whose stores
//!   fetch, grouped per store that fetches many tables at once, and
//!   counting each fetch; copying the distinct rows of a table whose batch
//!   found pushed ids (its rows and the pushed ones);
//! * `pooling.rs`: pooling each feature's bags of one table into the pooled
//!   input, and the request-level units' bags of ranking requests once each;
//! * `pool_laid_out.rs`: pooling a table laid out by its id map straight
//!   from raw ids, each id checked against the row it read;
//! * `broadcast.rs`: copying each unit's pooled bags into its requests'
//!   candidate rows;
//! * `sequences.rs`: sequence features looked up unpooled, once per unit,
//!   as jagged values with per-unit offsets and each row's unit;
//! * `raw_inputs.rs`: raw integer inputs (never looked up) laid out as the
//!   dense network takes them: a sequence's raw channels and its units'
//!   request rows, the rows' own raw inputs;
//! * `scratch.rs`: a lane's buffers ([`StageScratch`]).

mod broadcast;
mod collect;
mod error;
mod fetch;
mod id_map_layout;
mod map_ids;
mod pool_laid_out;
mod pooling;
mod push;
mod pushed_ids;
mod raw_inputs;
mod read_ahead;
mod scratch;
mod sequences;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use narsil_core::KeyedBatch;

use crate::dedup::DistinctIds;
use crate::id_map::IdMap;
use crate::metrics::{StageMetrics, TableCounters};
use crate::pooled_value::PooledValue;
use crate::schema::{PoolingMode, SplitSchema, TableSpec};
use crate::stores::row_store::RowStore;
use crate::stores::table_error::TableError;
use crate::stores::table_store::{OpenedTables, TableStore};
use broadcast::own_rows;
use map_ids::{open_id_maps, IdMapping};
use pooling::Lookups;

pub use error::StageError;
pub use id_map_layout::{held, Held};
pub use push::MAX_PUSHED_IDS;
use pushed_ids::PushedIds;
pub use scratch::StageScratch;
pub use sequences::SequenceValues;
use sequences::{Channel, StageSequence};

struct StageTable {
    spec: TableSpec,
    store: Arc<dyn RowStore>,
    /// The features that index it, in schema order.
    features: Vec<usize>,
    /// How its ids become rows.
    mapping: IdMapping,
    counters: TableCounters,
    /// Whether a batch's ids are deduplicated: for stores that fetch rows
    /// (each distinct row once) and mapped files (each distinct row read
    /// ahead once). A table in process memory is read in place, one row per
    /// id: a hash per id would cost more than the reads it saves (6% of
    /// the default DLRM's INT8 forward at 1,600 rows), so its ids are
    /// counted, not deduplicated.
    deduplicates: bool,
}

impl StageTable {
    /// Its layout by its id map, where it has one: the stage then pools its
    /// batches' raw ids as they are ([`pool_laid_out`]).
    fn laid_out(&self) -> Option<&crate::id_map::SlottedMap> {
        match &self.mapping {
            IdMapping::Map { map: map_ids::MapLookup::Slotted(map), .. } => Some(map),
            _ => None,
        }
    }
}

struct FeatureLookup {
    name: String,
    pooling: PoolingMode,
    weighted: bool,
    /// Its column in the pooled block, for a pooled feature (none for a
    /// sequence's channel or a raw input).
    column: Option<usize>,
    /// Where its positions go, for a sequence's channel.
    channel: Option<Channel>,
}

/// A split model's embedding stage.
pub struct EmbeddingStage {
    tables: Vec<StageTable>,
    features: Vec<FeatureLookup>,
    sequences: Vec<StageSequence>,
    /// The raw inputs outside any sequence, in schema order (the dense
    /// network's `raw i64[R, K]`).
    row_raw: Vec<usize>,
    /// Pooled features (the pooled block's columns).
    pooled: usize,
    dim: usize,
    metrics: StageMetrics,
    /// Whether the last batch's lookups waited on the disk: the next one
    /// reads its mapped rows ahead first ([`READERS`](read_ahead::READERS)
    /// threads).
    faulting: AtomicBool,
    /// Why pushes are refused, for a stage whose tables are looked up
    /// elsewhere ([`Self::refuse_pushes`]).
    push_refusal: Option<String>,
}

impl EmbeddingStage {
    /// A stage over `schema` whose table `i` is `stores[i]` (no table of
    /// which declares an id map).
    pub fn new(schema: &SplitSchema, stores: Vec<Arc<dyn RowStore>>) -> Self {
        let maps = vec![None; schema.tables.len()];
        Self::with_id_maps(schema, stores, maps)
    }

    /// A stage over `schema` whose table `i` is `stores[i]`, with its id
    /// map `maps[i]` where it declares one.
    pub fn with_id_maps(
        schema: &SplitSchema,
        stores: Vec<Arc<dyn RowStore>>,
        maps: Vec<Option<Arc<IdMap>>>,
    ) -> Self {
        assert_eq!(stores.len(), schema.tables.len(), "one store per table");
        assert_eq!(maps.len(), schema.tables.len(), "one map or none per table");
        let metrics = StageMetrics::default();
        let tables = schema
            .tables
            .iter()
            .zip(stores)
            .zip(maps)
            .map(|((spec, store), map)| StageTable {
                mapping: IdMapping::of(spec, map),
                spec: spec.clone(),
                deduplicates: store.local_rows().is_none() || store.may_fault(),
                store,
                features: (0..schema.features.len())
                    .filter(|&f| {
                        schema.features[f].pooling != PoolingMode::Raw
                            && schema.features[f].table == spec.name
                    })
                    .collect(),
                counters: metrics.table(&spec.name),
            })
            .collect();
        let model = schema.model_schema("", "");
        let mut pooled = 0;
        let features = schema
            .features
            .iter()
            .enumerate()
            .map(|(f, spec)| {
                // A raw input is looked up nowhere: no channel, no column.
                let looked_up = spec.pooling != PoolingMode::Raw;
                let channel = model.sequences.iter().enumerate().find_map(|(s, sequence)| {
                    let c = sequence.features.iter().position(|&g| g == f)?;
                    let column = sequence.features[..c].iter().map(|&g| schema.feature_dim(g)).sum();
                    Some(Channel { sequence: s, column })
                });
                let channel = channel.filter(|_| looked_up);
                let column = spec.pooling.is_pooled().then(|| {
                    pooled += 1;
                    pooled - 1
                });
                FeatureLookup {
                    name: spec.name.clone(),
                    pooling: spec.pooling,
                    weighted: spec.weighted,
                    column,
                    channel,
                }
            })
            .collect();
        let sequences = model
            .sequences
            .iter()
            .map(|sequence| StageSequence {
                first: sequence.features[0],
                width: sequence.width,
                raw: sequence.features.iter().copied().filter(|&f| model.sparse[f].raw_input).collect(),
                request_rows: sequence.request_rows,
            })
            .collect();
        let row_raw = model.row_raw_inputs();
        Self {
            tables,
            features,
            sequences,
            row_raw,
            pooled,
            dim: schema.pooled_dim(),
            metrics,
            faulting: AtomicBool::new(false),
            push_refusal: None,
        }
    }

    /// Opens every table of the split model in `dir` in `store` (how each
    /// kind opens them: [`crate::stores::table_store::StoreConfig::open`]; the
    /// local stores share the tables a live model version already holds,
    /// the `redis` store checks each table is loaded on the cluster).
    pub fn open(
        dir: &Path,
        schema: &SplitSchema,
        store: &TableStore,
    ) -> Result<(Self, OpenedTables), TableError> {
        let (stores, opened) = store.open(dir, schema)?;
        let mut stage = Self::over_stores(dir, schema, stores)?;
        stage.lay_out_mapped_tables();
        stage.hashed_maps_onto_huge_pages();
        Ok((stage, opened))
    }

    /// A stage over the split model in `dir` whose table `i` is
    /// `stores[i]` (opened already), its id maps opened from `dir`.
    pub fn over_stores(
        dir: &Path,
        schema: &SplitSchema,
        stores: Vec<Arc<dyn RowStore>>,
    ) -> Result<Self, TableError> {
        let maps = open_id_maps(dir, schema)?;
        Ok(Self::with_id_maps(schema, stores, maps))
    }

    /// Values in the pooled input per row: features times the pooled width.
    pub fn pooled_width(&self) -> usize {
        self.pooled * self.dim
    }

    /// Whether the model has sequence features (its dense network takes
    /// their values after the pooled block: [`StageScratch::sequences`]).
    pub fn has_sequences(&self) -> bool {
        !self.sequences.is_empty()
    }

    /// Whether its dense network takes more than the dense and pooled
    /// blocks (sequences, raw inputs outside them: [`StageScratch::sequences`],
    /// [`StageScratch::row_raw`]), laid out by the stage per batch, so never
    /// staged ahead as a block alone.
    pub fn takes_unpooled_inputs(&self) -> bool {
        !self.sequences.is_empty() || !self.row_raw.is_empty()
    }

    /// Raw inputs outside any sequence (the width of `raw i64[R, K]`; 0:
    /// the dense network takes no `raw`).
    pub fn row_raw_width(&self) -> usize {
        self.row_raw.len()
    }

    /// Tells `watcher` whether the store its tables are on answers (see
    /// [`narsil_core::BackendFactory::watch_dependencies`]): a Redis
    /// cluster's pings, the disk store's probe reads; tables in memory or
    /// mapped files always answer and never call it.
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
    /// `[batch.rows, pooled_width]`), its raw ids mapped to rows first
    /// where its tables' are raw (and through the ids pushed to them).
    pub fn pool(
        &self,
        batch: &KeyedBatch,
        scratch: &mut StageScratch,
        pooled: &mut Vec<f32>,
    ) -> Result<(), StageError> {
        self.pool_into(batch, scratch, pooled)
    }

    /// [`Self::pool`] into a block of FP32 or bf16 values ([`PooledValue`]:
    /// bf16 for a dense network in bf16, each bag rounded as it is pooled).
    pub fn pool_into<T: PooledValue>(
        &self,
        batch: &KeyedBatch,
        scratch: &mut StageScratch,
        pooled: &mut Vec<T>,
    ) -> Result<(), StageError> {
        if !self.maps_ids() {
            scratch.pushed.clear();
            scratch.laid_out_pushed.clear();
            return self.pool_rows(batch, scratch, pooled);
        }
        let mut mapped = std::mem::take(&mut scratch.mapped);
        let pushes = Some((&mut scratch.pushed, &mut scratch.laid_out_pushed));
        let result = self.pool_rows(self.map_batch(batch, &mut mapped, pushes), scratch, pooled);
        scratch.mapped = mapped;
        result
    }

    /// [`Self::pool`] of a batch whose ids are rows.
    fn pool_rows<T: PooledValue>(
        &self,
        batch: &KeyedBatch,
        scratch: &mut StageScratch,
        pooled: &mut Vec<T>,
    ) -> Result<(), StageError> {
        let width = self.pooled_width();
        pooled.resize(batch.rows * width, T::default());
        scratch.distinct.resize_with(self.tables.len(), DistinctIds::default);
        scratch.pushed.resize(self.tables.len(), None);
        for ((table, distinct), pushed) in self.tables.iter().zip(&mut scratch.distinct).zip(&scratch.pushed)
        {
            self.collect(table, batch, distinct, pushed.as_deref())?;
        }
        let mut faults = 0;
        if self.faulting.load(Ordering::Relaxed) {
            faults += self.read_ahead(&scratch.distinct);
        }
        self.fetch(batch, scratch)?;
        let units = batch.request_blocks.as_ref().map_or(0, |b| b.unit_count * b.features.len() * self.dim);
        scratch.unit_pooled.clear();
        scratch.unit_pooled.resize(units, 0.0);
        self.lay_out_row_raw(batch, &mut scratch.row_raw);
        self.lay_out_sequences(batch, &scratch.row_raw, &mut scratch.sequences);
        own_rows(batch, &mut scratch.own_rows);
        for (t, table) in self.tables.iter().enumerate() {
            let distinct = &scratch.distinct[t];
            // Pooled from copies of its distinct rows: a store that
            // fetches, or a table whose batch found pushed ids.
            let copies = scratch.pushed[t].is_some() || table.store.local_rows().is_none();
            let fetched = copies.then_some(&scratch.fetched[t][..]);
            let out = Outputs {
                pooled,
                width,
                unit_pooled: &mut scratch.unit_pooled[..],
                sequences: &mut scratch.sequences[..],
                ones: &mut scratch.ones,
                own_rows: &scratch.own_rows,
            };
            let lookups = Lookups {
                file_rows: &mut scratch.file_rows,
                bag_rows: &mut scratch.bag_rows,
                pushed: scratch.laid_out_pushed.get(t).and_then(Option::as_deref),
            };
            faults += self.pool_table(table, batch, distinct, fetched, lookups, out)?;
        }
        self.faulting.store(faults > 0, Ordering::Relaxed);
        self.broadcast(batch, &scratch.unit_pooled, pooled, width);
        scratch.sequences.iter_mut().for_each(SequenceValues::drop_unattended_empty_units);
        Ok(())
    }
}

/// Where a table's lookups go: the pooled block (`[rows, width]`), the
/// request-level units' pooled bags, the sequences' values.
pub(super) struct Outputs<'a, T> {
    pooled: &'a mut [T],
    width: usize,
    unit_pooled: &'a mut [f32],
    sequences: &'a mut [SequenceValues],
    ones: &'a mut Vec<i32>,
    /// The rows that pool their own request-level bags ([`own_rows`]).
    own_rows: &'a [std::ops::Range<usize>],
}

#[cfg(test)]
mod fixtures;

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::fixtures::{rows, schema, LocalRows};
    use super::EmbeddingStage;
    use crate::stores::row_store::RowStore;

    #[test]
    fn the_store_is_watched_through_the_first_table_that_takes_the_watcher_and_only_once() {
        let schema = schema();
        let watched = Arc::new(std::sync::Mutex::new(0));
        let stores: Vec<Arc<dyn RowStore>> = vec![
            Arc::new(rows(&schema.tables[0], 1)),
            Arc::new(LocalRows::watched(&rows(&schema.tables[1], 1), watched.clone())),
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
