//! A mapped table laid out by its id map: the row of the raw id a perfect
//! hash gives index `i` ([`super::perfect_hash`]) is the table's row `i`,
//! and that raw id is written into the row's last 8 bytes (padding of an
//! INT8 row, which pooling never reads). Looking a raw id up is then its
//! hash (a few bits per id, in the caches), the row it points at, and a
//! comparison of the id written there: the map's own dependent read of
//! DRAM (a slot of a 16-byte-per-slot hash table, as large as the table's
//! index) is gone, and the row's read is the one pooling needs next.
//!
//! For the `memory` store's INT8 tables whose map gives each row at most
//! one raw id and whose rows keep 8 spare bytes (64 values: 80-byte rows
//! with 12): the stage copies such a table into this layout when it loads
//! ([`crate::EmbeddingStage::lay_out_mapped_tables`]). Rows no raw id maps
//! to follow those that one does, in row order (the default row among
//! them, unless an id maps to it). The laid-out copy replaces the table
//! and its map in the stage: the same bytes for the rows, a hash of about
//! 0.6 bytes per id instead of the map's 32 to 64.

use std::sync::Arc;

use super::perfect_hash::{Lookup, PerfectHash};
use super::IdMap;
use crate::schema::{Storage, TableSpec};
use crate::stores::local::table::Table;
use crate::stores::row_store::RowStore;

/// How far ahead an id's pilot is asked for, in ids (its row is asked for
/// as soon as the pilot gives it).
const PREFETCH_IDS: usize = 64;

/// Bytes of a raw id in a row.
const RAW_BYTES: usize = 8;

/// A table laid out by its id map (module docs).
pub struct SlottedMap {
    hash: PerfectHash,
    table: Arc<Table>,
    row_bytes: usize,
    /// Where in a row its raw id is: its last 8 bytes.
    raw_at: usize,
    /// The row of ids it does not hold.
    default_row: u64,
}

impl std::fmt::Debug for SlottedMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlottedMap").field("ids", &self.hash.ids()).field("table", &self.table).finish()
    }
}

impl SlottedMap {
    /// `spec`'s table (its rows in `store`, in id order) laid out by `map`,
    /// ids it does not hold getting what was row `default_row`; or why it
    /// cannot be.
    pub fn lay_out(
        spec: &TableSpec,
        store: &dyn RowStore,
        map: &IdMap,
        default_row: u64,
    ) -> Result<Self, String> {
        if let Some(why) = Self::unsuited(spec, store) {
            return Err(why);
        }
        let (rows, row_bytes) = (spec.rows, spec.row_bytes);
        let source = store.local_rows().expect("checked: in memory");
        let pairs: Vec<(i64, u64)> = map.iter().collect();
        let mut referenced = vec![false; rows as usize];
        for &(raw, row) in &pairs {
            if std::mem::replace(&mut referenced[row as usize], true) {
                return Err(format!(
                    "its map gives row {row} to more than one raw id (raw id {raw} among them)"
                ));
            }
        }
        let raws: Vec<i64> = pairs.iter().map(|&(raw, _)| raw).collect();
        let hash = PerfectHash::build(&raws)
            .ok_or("no perfect hash of its map's raw ids was found")?
            .onto_huge_pages();
        let raw_at = row_bytes - RAW_BYTES;
        let mut new_default = None;
        let table = Table::filled(spec, |bytes| {
            for &(raw, row) in &pairs {
                let at = hash.index(raw).expect("a hash of at least one id") as usize * row_bytes;
                let from = row as usize * row_bytes;
                bytes[at..at + row_bytes].copy_from_slice(&source[from..from + row_bytes]);
                bytes[at + raw_at..at + row_bytes].copy_from_slice(&raw.to_le_bytes());
                if row == default_row {
                    new_default = Some((at / row_bytes) as u64);
                }
            }
            let unreferenced = (0..rows as usize).filter(|&row| !referenced[row]);
            for (at, row) in (pairs.len()..).zip(unreferenced) {
                bytes[at * row_bytes..(at + 1) * row_bytes]
                    .copy_from_slice(&source[row * row_bytes..(row + 1) * row_bytes]);
                if row as u64 == default_row {
                    new_default = Some(at as u64);
                }
            }
        });
        let default_row =
            new_default.ok_or_else(|| format!("its default row {default_row} is past its {rows} rows"))?;
        Ok(Self { hash, table: Arc::new(table), row_bytes, raw_at, default_row })
    }

    /// Why `spec`'s table, its rows in `store`, cannot be laid out by a
    /// map, if it cannot (whatever the map).
    pub fn unsuited(spec: &TableSpec, store: &dyn RowStore) -> Option<String> {
        let row_bytes = spec.row_bytes;
        if spec.storage != Storage::Int8Rowwise || row_bytes < spec.storage.value_bytes(spec.dim) + RAW_BYTES
        {
            return Some(format!(
                "its rows keep no {RAW_BYTES} spare bytes for a raw id ({:?} rows of {} values in {row_bytes} bytes)",
                spec.storage, spec.dim
            ));
        }
        let in_memory = store.local_rows().is_some() && store.kind() == "memory" && store.slots().is_none();
        (!in_memory).then(|| {
            format!("its rows are not in this process's memory in row order (the {} store)", store.kind())
        })
    }

    /// The laid-out table: the rows lookups read.
    pub fn table(&self) -> Arc<Table> {
        self.table.clone()
    }

    /// The row, in the laid-out table, of ids it does not hold.
    pub fn default_row(&self) -> u64 {
        self.default_row
    }

    /// Bytes its hash takes (the rows are the table's).
    pub fn hash_bytes(&self) -> u64 {
        self.hash.bytes()
    }

    /// The row of `raw` in the laid-out table, if it holds it.
    pub fn row(&self, raw: i64) -> Option<u64> {
        let row = self.hash.index(raw)?;
        self.holds(raw, row).then_some(row)
    }

    /// The laid-out table's rows, end to end.
    pub fn rows(&self) -> &[u8] {
        self.table.bytes()
    }

    /// Each of `raws`' rows if it is held (what [`Self::holds`] checks),
    /// into `out`, its pilot asked for [`PREFETCH_IDS`] ids ahead and the
    /// row itself asked for (not read: nothing waits on it, so the rows'
    /// reads overlap the hashing). For pooling straight from raw ids, which
    /// then reads the rows and checks each id against the row it read.
    pub fn candidate_rows_into(&self, raws: &[i64], out: &mut Vec<i64>) {
        out.clear();
        let Some(lookup) = self.hash.lookup() else {
            // Every id gets the default row, which holds none of them.
            out.resize(raws.len(), self.default_row as i64);
            return;
        };
        let mut hashes = [0u64; PREFETCH_IDS];
        for (h, &raw) in hashes.iter_mut().zip(raws) {
            *h = lookup.hash(raw);
            lookup.prefetch(*h);
        }
        out.resize(raws.len(), 0);
        let rows = self.table.bytes();
        for (i, out) in out.iter_mut().enumerate() {
            let h = hashes[i % PREFETCH_IDS];
            if let Some(&ahead) = raws.get(i + PREFETCH_IDS) {
                let next = lookup.hash(ahead);
                lookup.prefetch(next);
                hashes[i % PREFETCH_IDS] = next;
            }
            *out = self.locate(&lookup, rows, h) as i64;
        }
    }

    /// Whether row `row` of the laid-out table is `raw`'s.
    #[inline(always)]
    pub fn holds(&self, raw: i64, row: u64) -> bool {
        self.holds_in(self.table.bytes(), raw, row)
    }

    /// [`Self::holds`], the laid-out table's rows `rows` ([`Self::rows`])
    /// taken once for many ids.
    #[inline(always)]
    pub fn holds_in(&self, rows: &[u8], raw: i64, row: u64) -> bool {
        // Rows past the held ids' keep no raw id.
        let at = row as usize * self.row_bytes + self.raw_at;
        row < self.hash.ids()
            && u64::from_le_bytes(rows[at..at + RAW_BYTES].try_into().expect("8 bytes")) == raw as u64
    }

    /// The row the id of hash `h` would be in, asked for (both of its cache
    /// lines; a hint).
    #[inline(always)]
    fn locate(&self, lookup: &Lookup<'_>, rows: &[u8], h: u64) -> u64 {
        let row = lookup.index_of(h);
        #[cfg(target_arch = "x86_64")]
        {
            let at = row as usize * self.row_bytes;
            // SAFETY: a prefetch changes no memory and never faults; both
            // addresses are inside the table (row < ids <= rows).
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                _mm_prefetch(rows.as_ptr().add(at).cast(), _MM_HINT_T0);
                _mm_prefetch(rows.as_ptr().add(at + self.row_bytes - 1).cast(), _MM_HINT_T0);
            }
        }
        row
    }

    /// Writes each of `raws`' rows in the laid-out table into `out`, asking
    /// `elsewhere` for each id it does not hold before giving it the
    /// default row; returns how many neither held. For callers that look
    /// rows up elsewhere; the stage's own pooling reads each row once
    /// instead ([`Self::candidate_rows_into`], then [`Self::holds_in`]).
    pub fn map_into_or(
        &self,
        raws: &[i64],
        out: &mut [i64],
        mut elsewhere: impl FnMut(i64) -> Option<i64>,
    ) -> u64 {
        let mut candidates = Vec::new();
        self.candidate_rows_into(raws, &mut candidates);
        let (rows, mut unmapped) = (self.table.bytes(), 0);
        for ((out, &raw), &row) in out.iter_mut().zip(raws).zip(&candidates) {
            *out = if self.holds_in(rows, raw, row as u64) {
                row
            } else {
                elsewhere(raw).unwrap_or_else(|| {
                    unmapped += 1;
                    self.default_row as i64
                })
            };
        }
        unmapped
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::id_map::build;
    use crate::stores::local::table::tests::spec;

    /// A table of `rows` rows whose row `r` holds `r` in its values.
    fn table(rows: u64) -> (TableSpec, Table) {
        let spec = TableSpec { dim: 64, row_bytes: 80, ..spec(rows) };
        let data = (0..rows).flat_map(|r| {
            let mut row = vec![0u8; spec.row_bytes];
            row[4..12].copy_from_slice(&r.to_le_bytes());
            row
        });
        let table = Table::from_rows(&spec, data.collect());
        (spec, table)
    }

    fn value(table: &Table, row: i64) -> u64 {
        u64::from_le_bytes(table.bytes()[row as usize * 80 + 4..][..8].try_into().unwrap())
    }

    #[test]
    fn a_laid_out_table_gives_each_raw_id_its_rows_values_and_others_the_default_row() {
        let rows = 1000;
        let (spec, source) = table(rows);
        // Every row but the last two has a raw id; the default row is the last.
        let pairs: Vec<(i64, u64)> =
            (0..rows - 2).map(|r| ((r as i64 * 7919) ^ i64::MIN >> (r % 3), (r * 31) % (rows - 2))).collect();
        let map = IdMap::from_bytes(build(&pairs, rows).unwrap(), rows).unwrap();
        let slotted = SlottedMap::lay_out(&spec, &source, &map, rows - 1).unwrap();
        let table = slotted.table();
        assert_eq!(value(&table, slotted.default_row() as i64), rows - 1);
        let mut raws: Vec<i64> = pairs.iter().map(|p| p.0).collect();
        raws.extend([1, -5, 123_456_789]);
        let mut out = vec![0; raws.len()];
        let mut asked = Vec::new();
        let unmapped = slotted.map_into_or(&raws, &mut out, |raw| {
            asked.push(raw);
            (raw == -5).then_some(4242)
        });
        assert_eq!((unmapped, asked), (2, vec![1, -5, 123_456_789]));
        for (i, &(raw, row)) in pairs.iter().enumerate() {
            assert_eq!(value(&table, out[i]), row, "raw id {raw}");
            assert_eq!(slotted.row(raw), Some(out[i] as u64));
        }
        assert_eq!(out[pairs.len()..], [slotted.default_row() as i64, 4242, slotted.default_row() as i64]);
        // Every row is kept once, the unreferenced ones too.
        let mut values: Vec<u64> = (0..rows as i64).map(|r| value(&table, r)).collect();
        values.sort_unstable();
        assert_eq!(values, (0..rows).collect::<Vec<_>>());
    }

    #[test]
    fn a_table_it_cannot_lay_out_says_why() {
        let (spec, source) = table(10);
        let twice = IdMap::from_bytes(build(&[(5, 1), (6, 1)], 10).unwrap(), 10).unwrap();
        let error = SlottedMap::lay_out(&spec, &source, &twice, 0).unwrap_err();
        assert!(error.contains("row 1 to more than one raw id"), "{error}");
        let fp32 = TableSpec { storage: Storage::Fp32, row_bytes: 4 * spec.dim, ..spec.clone() };
        let one = IdMap::from_bytes(build(&[(5, 1)], 10).unwrap(), 10).unwrap();
        assert!(SlottedMap::lay_out(&fp32, &source, &one, 0).unwrap_err().contains("spare bytes"));
    }
}
