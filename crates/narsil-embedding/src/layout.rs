//! A table laid out in popularity order: its file holds the rows hottest
//! first, so the rows a skewed workload reads share blocks and pages, and a
//! slot index (`tables/NAME.slots`, one little-endian `u32` per id) says
//! where each id's row is. `narsil tables order` writes both; the schema
//! names the index in the table's `layout`.
//!
//! Why: hot ids are scattered over a table (ids are hashes, or items added
//! over years), so in id order a 4 KiB page of 51 rows holds about one hot
//! row, and a page cache or a block read brings in 50 cold rows with it.
//! Ordered, the hot rows are packed: the mapped store's hot pages fit a
//! fraction of the memory, and the disk store's block reads of a batch's
//! misses hit rows that the next batches want too.
//!
//! Stores read both layouts with the same scores: `memory` puts the rows
//! back in id order as it reads the file (the layout buys nothing there);
//! `mmap` and `disk` keep the index in memory (4 bytes per row) and read
//! row `slot(id)`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::schema::TableSpec;
use crate::table::TableError;

/// Bytes per id in a slot index.
pub const SLOT_BYTES: u64 = 4;

/// Where each id's row is in a table file laid out in popularity order.
pub struct SlotIndex {
    slots: Vec<u32>,
}

impl std::fmt::Debug for SlotIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotIndex").field("rows", &self.slots.len()).finish()
    }
}

impl SlotIndex {
    /// Reads the index `spec`'s layout names in model directory `dir`
    /// (`None` for a table in id order), checked to be a permutation of the
    /// table's rows: a file of the wrong size, or one that sends two ids to
    /// one slot, fails naming the table and the file.
    pub fn load(dir: &Path, spec: &TableSpec) -> Result<Option<Self>, TableError> {
        let Some(layout) = &spec.layout else { return Ok(None) };
        let path = dir.join(&layout.slots);
        let bad = |why: String| TableError::Read {
            table: spec.name.clone(),
            path: path.clone(),
            source: std::io::Error::other(why),
        };
        let bytes = std::fs::read(&path).map_err(|source| TableError::Read {
            table: spec.name.clone(),
            path: path.clone(),
            source,
        })?;
        if bytes.len() as u64 != spec.rows * SLOT_BYTES {
            return Err(bad(format!(
                "a slot index of {} rows takes {} bytes, the file holds {} (truncated, or not this table's index)",
                spec.rows,
                spec.rows * SLOT_BYTES,
                bytes.len()
            )));
        }
        let slots: Vec<u32> =
            bytes.chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes"))).collect();
        let index = Self::new(slots).map_err(bad)?;
        Ok(Some(index))
    }

    /// An index over `slots` (slot of id `i` at `i`), which must be a
    /// permutation of `0..slots.len()`.
    pub fn new(slots: Vec<u32>) -> Result<Self, String> {
        let mut taken = vec![false; slots.len()];
        for (id, &slot) in slots.iter().enumerate() {
            match taken.get_mut(slot as usize) {
                None => {
                    return Err(format!("id {id} has slot {slot}, past the table's {} rows", slots.len()))
                }
                Some(true) => return Err(format!("id {id} has slot {slot}, which another id has too")),
                Some(free) => *free = true,
            }
        }
        Ok(Self { slots })
    }

    /// The slot of row `id` (a valid id).
    pub fn slot(&self, id: i64) -> i64 {
        i64::from(self.slots[id as usize])
    }

    /// Bytes it holds in memory.
    pub fn bytes(&self) -> u64 {
        self.slots.len() as u64 * SLOT_BYTES
    }

    /// `ordered` (rows of `row_bytes` in slot order) in id order.
    pub fn in_id_order(&self, ordered: &[u8], row_bytes: usize) -> Vec<u8> {
        let mut rows = vec![0u8; ordered.len()];
        for (row, &slot) in rows.chunks_exact_mut(row_bytes).zip(&self.slots) {
            let at = slot as usize * row_bytes;
            row.copy_from_slice(&ordered[at..at + row_bytes]);
        }
        rows
    }
}

/// A table's layout in the schema: its rows in popularity order, found
/// through a slot index.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Deserialize, serde::Serialize)]
pub struct Layout {
    /// The slot index's file, relative to the model directory.
    pub slots: PathBuf,
    /// SHA-256 of the index file, hex (with the table file's, the table's
    /// identity).
    pub sha256: String,
}

/// How often each id was looked up, per table, from an id log.
#[derive(Debug, Default)]
pub struct Popularity {
    /// Per id: lookups, and the line where it was first seen (ties).
    counts: HashMap<u64, (u64, u64)>,
    lines: u64,
}

impl Popularity {
    /// Counts one lookup of `id`.
    pub fn add(&mut self, id: u64) {
        let line = self.lines;
        self.lines += 1;
        self.counts.entry(id).or_insert((0, line)).0 += 1;
    }

    /// Ids seen.
    pub fn distinct(&self) -> usize {
        self.counts.len()
    }

    /// The slot of each of `rows` ids: the ids seen, most looked up first
    /// (ties in the order first seen: a list naming each id once is taken
    /// as given), then the ids never seen, in id order.
    pub fn slots(&self, rows: u64) -> Vec<u32> {
        let mut seen: Vec<(u64, u64, u64)> = self
            .counts
            .iter()
            .filter(|(&id, _)| id < rows)
            .map(|(&id, &(count, first))| (id, count, first))
            .collect();
        seen.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.2.cmp(&b.2)));
        let mut slots = vec![u32::MAX; rows as usize];
        for (slot, &(id, _, _)) in seen.iter().enumerate() {
            slots[id as usize] = slot as u32;
        }
        let unseen = slots.iter_mut().filter(|s| **s == u32::MAX);
        for (next, slot) in (seen.len() as u32..).zip(unseen) {
            *slot = next;
        }
        slots
    }
}

/// `rows` (in id order, `row_bytes` each) laid out by `slots`.
pub fn in_slot_order(rows: &[u8], row_bytes: usize, slots: &[u32]) -> Vec<u8> {
    let mut ordered = vec![0u8; rows.len()];
    for (row, &slot) in rows.chunks_exact(row_bytes).zip(slots) {
        let at = slot as usize * row_bytes;
        ordered[at..at + row_bytes].copy_from_slice(row);
    }
    ordered
}

/// The file a table's slot index is written to, beside its rows.
pub fn slots_file(table_file: &Path) -> PathBuf {
    table_file.with_extension("slots")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_seen_most_come_first_ties_by_first_sight_unseen_after_in_id_order() {
        let mut log = Popularity::default();
        for id in [7, 3, 7, 5, 3, 7, 9] {
            log.add(id);
        }
        // 7: three times, 3: twice, then 5 and 9 once each (5 seen first);
        // 0, 1, 2, 4, 6, 8 never.
        let slots = log.slots(10);
        assert_eq!(slots, vec![4, 5, 6, 1, 7, 2, 8, 0, 9, 3]);
        assert!(SlotIndex::new(slots).is_ok());
    }

    #[test]
    fn rows_laid_out_by_popularity_come_back_in_id_order() {
        let rows: Vec<u8> = (0..6 * 4).map(|b| b as u8).collect();
        let slots = vec![3, 0, 5, 1, 4, 2];
        let ordered = in_slot_order(&rows, 4, &slots);
        assert_eq!(&ordered[0..4], &rows[4..8], "slot 0 holds id 1");
        let index = SlotIndex::new(slots).unwrap();
        assert_eq!(index.slot(2), 5);
        assert_eq!(index.in_id_order(&ordered, 4), rows);
    }

    #[test]
    fn an_index_that_is_not_a_permutation_is_refused() {
        assert!(SlotIndex::new(vec![0, 2, 1]).is_ok());
        let twice = SlotIndex::new(vec![0, 1, 1]).unwrap_err();
        assert!(twice.contains("id 2 has slot 1") && twice.contains("another id"), "{twice}");
        let past = SlotIndex::new(vec![0, 3, 1]).unwrap_err();
        assert!(past.contains("past the table's 3 rows"), "{past}");
    }
}
