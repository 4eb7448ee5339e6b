//! The first step of a batch, per table: range-checking the ids of every
//! feature that indexes the table and, where the table deduplicates,
//! collecting its distinct ids; counts the ids looked up and the distinct
//! ones, and for a table in this process the rows pooling will read. A
//! table whose batch found pushed ids takes its virtual rows too (`rows..
//! rows + pushed`), and is deduplicated for that batch: it is pooled from
//! copies of its distinct rows.

use narsil_core::KeyedBatch;

use super::PushedIds;
use super::{EmbeddingStage, StageError, StageTable};
use crate::dedup::DistinctIds;
use crate::pool::OutOfRange;

impl EmbeddingStage {
    /// Range-checks the ids of `table`'s features and, where the table
    /// deduplicates ([`StageTable::deduplicates`]) or the batch found ids
    /// in `pushed` (its snapshot of the table's pushed ids), deduplicates
    /// them.
    pub(super) fn collect(
        &self,
        table: &StageTable,
        batch: &KeyedBatch,
        distinct: &mut DistinctIds,
        pushed: Option<&PushedIds>,
    ) -> Result<(), StageError> {
        distinct.clear();
        let rows = table.spec.rows + pushed.map_or(0, PushedIds::len);
        let deduplicates = table.deduplicates || pushed.is_some();
        let mut looked_up = 0;
        let blocks = batch.request_blocks.as_ref();
        // A table laid out by its id map is pooled from raw ids (any
        // 64-bit value), each mapped to a row as it is read.
        let raw = pushed.is_none() && table.laid_out().is_some();
        for &f in &table.features {
            // The feature's own bags, then its request-level units' (the
            // order `pool_table` reads their slots in).
            let units = blocks.and_then(|b| b.unit_ids(f));
            for ids in std::iter::once(batch.feature_ids(f)).chain(units) {
                if let Some(&id) = ids.iter().find(|&&id| !raw && (id < 0 || id as u64 >= rows)) {
                    let source = OutOfRange { id, rows };
                    return Err(StageError::OutOfRange { feature: self.features[f].name.clone(), source });
                }
                looked_up += ids.len();
                if deduplicates {
                    distinct.add(ids);
                }
            }
        }
        table.counters.ids.inc_by(looked_up as u64);
        if deduplicates {
            table.counters.distinct_ids.inc_by(distinct.count().distinct as u64);
        }
        if table.store.local_rows().is_some() {
            // Pooling reads each distinct row once, or each id's row in
            // place (a store that fetches counts its own fetches).
            let read = if deduplicates { distinct.count().distinct } else { looked_up };
            table.counters.rows_fetched.inc_by(read as u64);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::fixtures::{batch, rows, schema};
    use super::super::{EmbeddingStage, StageScratch};
    use crate::stores::row_store::RowStore;

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
