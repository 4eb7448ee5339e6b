//! Pooling a table laid out by its id map ([`crate::id_map::SlottedMap`])
//! straight from a batch's raw ids: each id's candidate row from the
//! perfect hash (no row read), the bags pooled from those rows as from any
//! table, then each id checked against the raw id its row holds, reading
//! the rows just pooled. A bag with an id that is not its row's (an id the
//! map lacks: pushed since the model loaded, or never seen) is pooled
//! again from copies of its right rows: the pushed id's row from the
//! batch's snapshot, the default row for an id neither holds (counted in
//! `narsil_table_unmapped_ids_total`). Each bag is pooled on its own, so a
//! bag pooled again gets the bits it would have had.
//!
//! So a raw id costs its row's reads and a hash, and the batch is never
//! copied to map it ([`super::map_ids`] leaves such tables' ids raw).

use super::pushed_ids::PushedIds;
use crate::id_map::SlottedMap;
use crate::metrics::TableCounters;
use crate::pool::{pool_rows, OutOfRange, Pooling};
use crate::pooled_value::PooledValue;
use crate::schema::TableSpec;

/// A laid-out table's lookups of one batch.
pub(super) struct LaidOut<'a> {
    pub(super) map: &'a SlottedMap,
    pub(super) spec: &'a TableSpec,
    pub(super) counters: &'a TableCounters,
    /// The batch's snapshot of the table's pushed ids.
    pub(super) pushed: Option<&'a PushedIds>,
}

impl LaidOut<'_> {
    /// Pools the bags `lengths` of raw ids `raws` into `out` (one bag each
    /// `stride` values); `rows` and `copies` are buffers.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn pool<T: PooledValue>(
        &self,
        lengths: &[i32],
        raws: &[i64],
        pooling: Pooling<'_>,
        out: &mut [T],
        stride: usize,
        rows: &mut Vec<i64>,
        copies: &mut Vec<u8>,
    ) -> Result<(), OutOfRange> {
        let (spec, table) = (self.spec, self.map.rows());
        self.map.candidate_rows_into(raws, rows);
        let rows: &[i64] = rows;
        pool_rows(spec.storage, table, spec.row_bytes, spec.dim, lengths, rows, pooling, out, stride)?;
        let held = |i: usize| self.map.holds_in(table, raws[i], rows[i] as u64);
        if (0..raws.len()).all(held) {
            return Ok(());
        }
        let row_bytes = spec.row_bytes;
        // A bag pooled again reads its copies as rows 0, 1, ...: one list
        // for every such bag of the batch, as long as the longest bag.
        let mut local: Vec<i64> = Vec::new();
        let mut start = 0;
        for (bag, &len) in lengths.iter().enumerate() {
            let ids = start..start + len.max(0) as usize;
            start = ids.end;
            if ids.clone().all(held) {
                continue;
            }
            copies.clear();
            for i in ids.clone() {
                let row = match (held(i), self.pushed.and_then(|p| Some((p, p.get(raws[i])?)))) {
                    (true, _) => rows[i] as usize,
                    (false, Some((pushed, k))) => {
                        copies.extend_from_slice(pushed.row(k));
                        continue;
                    }
                    (false, None) => {
                        self.counters.unmapped_ids.inc();
                        self.map.default_row() as usize
                    }
                };
                copies.extend_from_slice(&table[row * row_bytes..(row + 1) * row_bytes]);
            }
            if local.is_empty() {
                local.extend(0..lengths.iter().copied().max().unwrap_or(0).max(0) as i64);
            }
            let pooling = Pooling { mode: pooling.mode, weights: pooling.weights.map(|w| &w[ids.clone()]) };
            let out = &mut out[bag * stride..];
            let length = [ids.len() as i32];
            pool_rows(
                spec.storage,
                copies,
                row_bytes,
                spec.dim,
                &length,
                &local[..ids.len()],
                pooling,
                out,
                stride,
            )?;
        }
        Ok(())
    }
}
