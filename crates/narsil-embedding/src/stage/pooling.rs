//! Pooling one table's bags: for each feature that indexes the table, its
//! bags (sum or mean, weighted where the feature is) from the table's rows
//! in place (through the slot index where the file is laid out in
//! popularity order) or from a fetching store's copies (through each id's
//! slot among the distinct ids; a table whose batch found pushed ids too),
//! into the feature's columns of the pooled input; counts the major faults
//! taken and the time.

use std::time::Instant;

use narsil_core::KeyedBatch;

use super::pool_laid_out::LaidOut;
use super::pushed_ids::PushedIds;
use super::read_ahead::thread_major_faults;
use super::{EmbeddingStage, FeatureLookup, Outputs, StageError, StageTable};
use crate::dedup::DistinctIds;
use crate::pool::{pool_rows, Pooling};
use crate::pooled_value::PooledValue;

impl EmbeddingStage {
    /// Pools `table`'s bags (its ids deduplicated in `distinct`; `fetched`:
    /// the copies of their rows, where it is pooled from copies; `lookups`:
    /// buffers, and a laid-out table's pushed ids), the
    /// request-level units' bags into `unit_pooled` (`[units, request-level
    /// features * dim]`); returns the major faults the lookups took.
    pub(super) fn pool_table<T: PooledValue>(
        &self,
        table: &StageTable,
        batch: &KeyedBatch,
        distinct: &DistinctIds,
        fetched: Option<&[u8]>,
        lookups: Lookups<'_>,
        out: Outputs<'_, T>,
    ) -> Result<u64, StageError> {
        let Outputs { pooled, width, unit_pooled, sequences, ones, own_rows } = out;
        let started = Instant::now();
        let faults_before = table.store.may_fault().then(thread_major_faults);
        let blocks = batch.request_blocks.as_ref();
        let Lookups { file_rows, bag_rows, pushed } = lookups;
        // Pooled from raw ids, unless the batch's rows are copies.
        let laid_out = table.laid_out().filter(|_| fetched.is_none()).map(|map| LaidOut {
            map,
            spec: &table.spec,
            counters: &table.counters,
            pushed,
        });
        let mut slot_start = 0;
        for &f in &table.features {
            let feature = &self.features[f];
            let weights = (feature.weighted && !batch.weights.is_empty())
                .then(|| &batch.weights[batch.feature_offsets[f]..batch.feature_offsets[f + 1]]);
            let mut bags = Bags {
                table,
                distinct,
                fetched,
                file_rows: &mut *file_rows,
                bag_rows: &mut *bag_rows,
                laid_out: laid_out.as_ref(),
                slot_start,
            };
            let units = blocks.and_then(|b| Some((b, b.position(f)?)));
            if let Some(channel) = feature.channel {
                // A sequence's channel: each id's row once, its rows' own
                // positions then its units'.
                let sequence = &mut sequences[channel.sequence];
                let (w, own) = (sequence.width, batch.feature_ids(f));
                let unit_ids = units.map_or(&[][..], |(b, k)| b.feature_ids(k));
                if ones.len() < own.len().max(unit_ids.len()) {
                    ones.resize(own.len().max(unit_ids.len()), 1);
                }
                // Each position's vector starts `column` values into its row.
                let at = |position: usize| position * w + channel.column;
                if !own.is_empty() {
                    bags.pool(feature, &ones[..own.len()], own, None, &mut sequence.values[at(0)..], w)?;
                }
                if !unit_ids.is_empty() {
                    let units = &mut sequence.values[at(own.len())..];
                    bags.pool(feature, &ones[..unit_ids.len()], unit_ids, None, units, w)?;
                }
                slot_start = bags.slot_start;
                continue;
            }
            let column = feature.column.expect("a feature is pooled or a sequence's channel");
            let (lengths, ids) = (batch.feature_lengths(f), batch.feature_ids(f));
            let Some((blocks, k)) = units else {
                bags.pool(feature, lengths, ids, weights, &mut pooled[column * self.dim..], width)?;
                slot_start = bags.slot_start;
                continue;
            };
            // A request-level feature: only the rows that take no unit's
            // bags pool their own (a grouped row's are empty, and the
            // broadcast writes its columns).
            let ids_of = |rows: std::ops::Range<usize>| -> usize {
                lengths[rows].iter().map(|&len| len.max(0) as usize).sum()
            };
            let (mut row, mut first) = (0, 0);
            for rows in own_rows {
                let skipped = ids_of(row..rows.start);
                let (start, end) = (first + skipped, first + skipped + ids_of(rows.clone()));
                bags.slot_start += skipped;
                let out = &mut pooled[column * self.dim + rows.start * width..];
                let weights = weights.map(|w| &w[start..end]);
                bags.pool(feature, &lengths[rows.clone()], &ids[start..end], weights, out, width)?;
                (row, first) = (rows.end, end);
            }
            bags.slot_start += ids.len() - first;
            // Its units: each pooled once, into the units' block (broadcast
            // to their rows once every table is pooled).
            let stride = blocks.features.len() * self.dim;
            let weights = blocks.feature_weights(k).filter(|_| feature.weighted);
            let out = &mut unit_pooled[k * self.dim..];
            bags.pool(feature, blocks.feature_lengths(k), blocks.feature_ids(k), weights, out, stride)?;
            slot_start = bags.slot_start;
        }
        let faults = faults_before.map_or(0, |before| thread_major_faults().saturating_sub(before));
        table.counters.major_faults.inc_by(faults);
        table.counters.fetch_seconds.observe(started.elapsed().as_secs_f64());
        Ok(faults)
    }
}

/// A table's lookups' buffers, and the batch's snapshot of its pushed ids
/// where it is laid out by its id map.
pub(super) struct Lookups<'a> {
    pub(super) file_rows: &'a mut Vec<i64>,
    pub(super) bag_rows: &'a mut Vec<u8>,
    pub(super) pushed: Option<&'a PushedIds>,
}

/// Where one table's bags read their rows, feature after feature: in
/// place, through the popularity-order slot index, through its id map's
/// layout from raw ids, or from a fetching store's copies through each
/// id's slot among the distinct ids (taken in the order
/// [`EmbeddingStage::collect`] added them).
struct Bags<'a> {
    table: &'a StageTable,
    distinct: &'a DistinctIds,
    /// The copies of the distinct ids' rows, where the bags read those.
    fetched: Option<&'a [u8]>,
    file_rows: &'a mut Vec<i64>,
    bag_rows: &'a mut Vec<u8>,
    /// Where the table is laid out by its id map (and not pooled from
    /// copies): its ids are raw.
    laid_out: Option<&'a LaidOut<'a>>,
    /// The next bag's first id among the distinct ids' slots.
    slot_start: usize,
}

impl Bags<'_> {
    /// Pools the bags `lengths` of `ids` into `out` (one bag each `stride`
    /// values).
    fn pool<T: PooledValue>(
        &mut self,
        feature: &FeatureLookup,
        lengths: &[i32],
        ids: &[i64],
        weights: Option<&[f32]>,
        out: &mut [T],
        stride: usize,
    ) -> Result<(), StageError> {
        let spec = &self.table.spec;
        let out_of_range = |source| StageError::OutOfRange { feature: feature.name.clone(), source };
        if let Some(laid_out) = self.laid_out {
            self.slot_start += ids.len();
            let pooling = Pooling { mode: feature.pooling, weights };
            return laid_out
                .pool(lengths, ids, pooling, out, stride, self.file_rows, self.bag_rows)
                .map_err(out_of_range);
        }
        let (rows, ids) = match (self.fetched, self.table.store.local_rows(), self.table.store.slots()) {
            (Some(fetched), _, _) => {
                (fetched, &self.distinct.slots()[self.slot_start..self.slot_start + ids.len()])
            }
            (None, Some(rows), None) => (rows, ids),
            (None, Some(rows), Some(index)) => {
                self.file_rows.clear();
                self.file_rows.extend(ids.iter().map(|&id| index.slot(id)));
                (rows, &self.file_rows[..])
            }
            (None, None, _) => unreachable!("a table whose store fetches is pooled from its copies"),
        };
        self.slot_start += ids.len();
        let pooling = Pooling { mode: feature.pooling, weights };
        pool_rows(spec.storage, rows, spec.row_bytes, spec.dim, lengths, ids, pooling, out, stride)
            .map_err(out_of_range)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::sync::Arc;
    use std::time::Instant;

    use super::super::fixtures::{batch, pooled_bits_both_ways, rows, schema};
    use super::super::{EmbeddingStage, StageScratch};
    use crate::pool::{pool_rows, Pooling};
    use crate::schema::Storage;
    use crate::stores::local::table::Table;
    use crate::stores::row_store::{FetchError, Fetched, RowStore};

    /// The same rows, fetched by copy instead of read in place.
    pub(in crate::stage) struct Fetching(pub(in crate::stage) Table);

    impl RowStore for Fetching {
        fn kind(&self) -> &'static str {
            "fetching"
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
            let bits: Vec<u32> = expected.iter().map(|v| v.to_bits()).collect();
            assert_eq!(pooled_bits_both_ways(&stage, &batch), bits);
        }
        // The weighted feature's weights matter, and mean pooling divides.
        assert_ne!(expected[16..24], expected[..8]);
    }
}
