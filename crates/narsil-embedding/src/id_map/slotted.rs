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
//! with 12): the stage lays such a table out when it loads
//! ([`crate::EmbeddingStage::lay_out_mapped_tables`]), moving its rows in
//! place (copying them where another stage holds the table too). Rows no
//! raw id maps to follow those that one does, in row order (the default row
//! among them, unless an id maps to it). The laid-out table replaces the
//! table and its map in the stage: the same bytes for the rows, a hash of
//! about 0.6 bytes per id instead of the map's 32 to 64.

use std::any::Any;
use std::sync::Arc;

use super::perfect_hash::{Lookup, PerfectHash};
use super::IdMap;
use crate::popularity_order::gather_rows_in_place;
use crate::schema::{Storage, TableSpec};
use crate::stores::local::table::{LocalRows, Table};
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
    /// Whether its rows were moved in place (else copied).
    moved_in_place: bool,
}

impl std::fmt::Debug for SlottedMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlottedMap").field("ids", &self.hash.ids()).field("table", &self.table).finish()
    }
}

impl SlottedMap {
    /// `spec`'s table (its rows in `store`, in id order) laid out by `map`,
    /// ids it does not hold getting what was row `default_row`; or why it
    /// cannot be, with `store` given back. Where `store` is the only hold
    /// on its table, its rows are moved in place (the table is held once
    /// while it is laid out, not twice); else they are copied.
    pub fn lay_out(
        spec: &TableSpec,
        store: Arc<dyn RowStore>,
        map: &IdMap,
        default_row: u64,
    ) -> Result<Self, (String, Arc<dyn RowStore>)> {
        if let Some(why) = Self::unsuited(spec, &*store) {
            return Err((why, store));
        }
        let plan = match Plan::of(spec, map, default_row) {
            Ok(plan) => plan,
            Err(why) => return Err((why, store)),
        };
        let row_bytes = spec.row_bytes;
        let any: Arc<dyn Any + Send + Sync> = store;
        let (table, moved_in_place) = match any.downcast::<Table>().map(Arc::try_unwrap) {
            Ok(Ok(mut table)) => {
                let bytes = table.bytes_mut().expect("checked: in memory");
                gather_rows_in_place(bytes, row_bytes, |row| plan.source[row] as usize);
                plan.write_raw_ids(map, bytes, row_bytes);
                (table, true)
            }
            // Held elsewhere too (another stage over the same table).
            Ok(Err(held)) => {
                let copy = Table::filled(spec, |bytes| {
                    let rows = held.bytes();
                    for (to, &from) in bytes.chunks_exact_mut(row_bytes).zip(&plan.source) {
                        let from = from as usize * row_bytes;
                        to.copy_from_slice(&rows[from..from + row_bytes]);
                    }
                    plan.write_raw_ids(map, bytes, row_bytes);
                });
                (copy, false)
            }
            Err(_) => unreachable!("checked: a table in memory"),
        };
        let Plan { hash, default_row, .. } = plan;
        let raw_at = row_bytes - RAW_BYTES;
        Ok(Self { hash, table: Arc::new(table), row_bytes, raw_at, default_row, moved_in_place })
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
        let in_memory = store.downcast_ref::<Table>().is_some_and(|t| t.store() == LocalRows::Memory)
            && store.slots().is_none();
        (!in_memory).then(|| {
            format!("its rows are not in this process's memory in row order (the {} store)", store.kind())
        })
    }

    /// The laid-out table: the rows lookups read.
    pub fn table(&self) -> Arc<Table> {
        self.table.clone()
    }

    /// Whether its rows were moved in place when it was laid out (the
    /// table held once meanwhile), not copied.
    pub fn moved_in_place(&self) -> bool {
        self.moved_in_place
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

/// Where a table's rows go when laid out by its map, worked out before
/// any row moves (so that a table that cannot be laid out is untouched).
struct Plan {
    hash: PerfectHash,
    /// `source[i]`: the row that goes to row `i`.
    source: Vec<u32>,
    /// The default row's new place.
    default_row: u64,
}

impl Plan {
    /// Holds at most ~13 bytes an id besides the map and the table (the
    /// map's raw ids while their hash is built).
    fn of(spec: &TableSpec, map: &IdMap, default_row: u64) -> Result<Self, String> {
        let rows = spec.rows as usize;
        if u32::try_from(rows).is_err() {
            return Err(format!("it has {rows} rows, more than a layout numbers (2^32)"));
        }
        let mut referenced = vec![0u64; rows.div_ceil(64)];
        for (raw, row) in map.iter() {
            let (word, bit) = (&mut referenced[row as usize / 64], 1u64 << (row % 64));
            if std::mem::replace(word, *word | bit) & bit != 0 {
                return Err(format!(
                    "its map gives row {row} to more than one raw id (raw id {raw} among them)"
                ));
            }
        }
        let raws: Vec<i64> = map.iter().map(|(raw, _)| raw).collect();
        let held = raws.len();
        let hash = PerfectHash::build(&raws).ok_or("no perfect hash of its map's raw ids was found")?;
        drop(raws);
        let hash = hash.onto_huge_pages();
        let mut source = vec![0u32; rows];
        for (raw, row) in map.iter() {
            source[hash.index(raw).expect("a hash of at least one id") as usize] = row as u32;
        }
        // The rows no raw id maps to follow, in row order.
        let unreferenced =
            (0..rows as u32).filter(|&row| referenced[row as usize / 64] >> (row % 64) & 1 == 0);
        for (to, row) in source[held..].iter_mut().zip(unreferenced) {
            *to = row;
        }
        let moved_to = source.iter().position(|&row| u64::from(row) == default_row);
        let default_row =
            moved_to.ok_or_else(|| format!("its default row {default_row} is past its {rows} rows"))?;
        Ok(Self { hash, source, default_row: default_row as u64 })
    }

    /// Writes each of `map`'s raw ids into its row's last bytes.
    fn write_raw_ids(&self, map: &IdMap, rows: &mut [u8], row_bytes: usize) {
        let raw_at = row_bytes - RAW_BYTES;
        for (raw, _) in map.iter() {
            let at = self.hash.index(raw).expect("a hash of at least one id") as usize * row_bytes + raw_at;
            rows[at..at + RAW_BYTES].copy_from_slice(&raw.to_le_bytes());
        }
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
        // Held by the layout only: its rows are moved in place.
        let laid_out =
            |store| SlottedMap::lay_out(&spec, store, &map, rows - 1).map_err(|(why, _)| why).unwrap();
        let slotted = laid_out(Arc::new(source));
        // Held elsewhere too: copied, the source left as it was.
        let held: Arc<dyn RowStore> = Arc::new(table(rows).1);
        let copied = laid_out(held.clone());
        assert!(slotted.moved_in_place() && !copied.moved_in_place());
        assert!(copied.table().bytes() == slotted.table().bytes(), "moved in place or copied, the same rows");
        assert_eq!(copied.default_row(), slotted.default_row());
        let held = held.downcast_ref::<Table>().unwrap();
        assert!((0..rows as i64).all(|r| value(held, r) == r as u64), "a copy's source is untouched");
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
        let source: Arc<dyn RowStore> = Arc::new(source);
        let twice = IdMap::from_bytes(build(&[(5, 1), (6, 1)], 10).unwrap(), 10).unwrap();
        let (error, given_back) = SlottedMap::lay_out(&spec, source, &twice, 0).unwrap_err();
        assert!(error.contains("row 1 to more than one raw id"), "{error}");
        let given_back = given_back.downcast_ref::<Table>().unwrap();
        assert!((0..10).all(|r| value(given_back, r) == r as u64), "a table it cannot lay out is untouched");
        let fp32 = TableSpec { storage: Storage::Fp32, row_bytes: 4 * spec.dim, ..spec.clone() };
        let one = IdMap::from_bytes(build(&[(5, 1)], 10).unwrap(), 10).unwrap();
        let (error, _) = SlottedMap::lay_out(&fp32, Arc::new(table(10).1), &one, 0).unwrap_err();
        assert!(error.contains("spare bytes"), "{error}");
    }
}
