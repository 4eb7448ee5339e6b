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
//! `mmap` and `disk` keep the index in memory (compact: [`SlotIndex`]) and
//! read row `slot(id)`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Bytes per id in a slot index.
pub const SLOT_BYTES: u64 = 4;

/// Where each id's row is in a table file laid out in popularity order.
///
/// A log names a small part of a table's ids (52k of 1M per table in a
/// Zipf 1.05 log of 200k samples), and the rest follow in id order, so the
/// index keeps only what it must: a bit per id (is it among the first
/// `hot` slots), a count of set bits per 512 ids (rank in one cache line),
/// and the slots of the hot ids in id order. An id's slot is then its hot
/// slot, or `hot + (id - hot ids below it)`. About 0.2 bytes per row plus
/// 4 per hot id, against 4 per row for the file's full permutation (26 x
/// 1M rows: 10 MiB instead of 104, which a memory limit of a few hundred
/// MiB notices).
pub struct SlotIndex {
    /// Bit `id % 64` of word `id / 64`: whether `id` is hot.
    hot_bits: Vec<u64>,
    /// Hot ids below each block of [`RANK_BLOCK_WORDS`] words.
    block_ranks: Vec<u32>,
    /// The hot ids' slots, in id order.
    hot_slots: Vec<u32>,
    rows: u64,
}

/// Words of hot bits per rank count: 512 ids, one cache line.
const RANK_BLOCK_WORDS: usize = 8;

impl std::fmt::Debug for SlotIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotIndex").field("rows", &self.rows).field("hot", &self.hot_slots.len()).finish()
    }
}

impl SlotIndex {
    /// The index in a slot index file's bytes (`rows` little-endian u32s,
    /// a permutation of the rows), or why they are not one.
    pub fn from_file_bytes(bytes: &[u8], rows: u64) -> Result<Self, String> {
        if bytes.len() as u64 != rows * SLOT_BYTES {
            return Err(format!(
                "a slot index of {rows} rows takes {} bytes, the file holds {} (truncated, or not this table's index)",
                rows * SLOT_BYTES,
                bytes.len()
            ));
        }
        Self::new(bytes.chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes"))).collect())
    }

    /// An index over `slots` (slot of id `i` at `i`), which must be a
    /// permutation of `0..slots.len()`.
    pub fn new(slots: Vec<u32>) -> Result<Self, String> {
        let rows = slots.len();
        // Slot -> id; u32::MAX: no id yet.
        let mut ids = vec![u32::MAX; rows];
        for (id, &slot) in slots.iter().enumerate() {
            match ids.get_mut(slot as usize) {
                None => return Err(format!("id {id} has slot {slot}, past the table's {rows} rows")),
                Some(taken) if *taken != u32::MAX => {
                    return Err(format!("id {id} has slot {slot}, which another id has too"))
                }
                Some(free) => *free = id as u32,
            }
        }
        // The hot slots: all but the longest tail of slots whose ids rise.
        let mut hot = rows;
        while hot > 0 && (hot == rows || ids[hot - 1] < ids[hot]) {
            hot -= 1;
        }
        let mut hot_bits = vec![0u64; rows.div_ceil(64)];
        for &id in &ids[..hot] {
            hot_bits[id as usize / 64] |= 1 << (id % 64);
        }
        let block_ranks = hot_bits
            .chunks(RANK_BLOCK_WORDS)
            .scan(0u32, |below, block| {
                let rank = *below;
                *below += block.iter().map(|w| w.count_ones()).sum::<u32>();
                Some(rank)
            })
            .collect();
        let hot_slots =
            (0..rows).filter(|&id| hot_bits[id / 64] >> (id % 64) & 1 == 1).map(|id| slots[id]).collect();
        Ok(Self { hot_bits, block_ranks, hot_slots, rows: rows as u64 })
    }

    /// The slot of row `id` (a valid id).
    pub fn slot(&self, id: i64) -> i64 {
        let (id, word) = (id as u64, id as usize / 64);
        let block = word / RANK_BLOCK_WORDS;
        let below: u32 = self.hot_bits[block * RANK_BLOCK_WORDS..word].iter().map(|w| w.count_ones()).sum();
        let bits = self.hot_bits[word];
        let rank = u64::from(self.block_ranks[block] + below)
            + u64::from((bits & ((1 << (id % 64)) - 1)).count_ones());
        if bits >> (id % 64) & 1 == 1 {
            i64::from(self.hot_slots[rank as usize])
        } else {
            (self.hot_slots.len() as u64 + id - rank) as i64
        }
    }

    /// Bytes it holds in memory.
    pub fn bytes(&self) -> u64 {
        (self.hot_bits.len() * 8 + self.block_ranks.len() * 4 + self.hot_slots.len() * 4) as u64
    }

    /// `ordered` (rows of `row_bytes` in slot order) in id order.
    pub fn in_id_order(&self, ordered: &[u8], row_bytes: usize) -> Vec<u8> {
        let mut rows = vec![0u8; ordered.len()];
        for (id, row) in rows.chunks_exact_mut(row_bytes).enumerate() {
            let at = self.slot(id as i64) as usize * row_bytes;
            row.copy_from_slice(&ordered[at..at + row_bytes]);
        }
        rows
    }
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
    fn the_compact_index_finds_every_ids_slot_of_any_permutation() {
        // Fisher-Yates on a xorshift generator.
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut shuffle = |v: &mut [u32]| {
            for i in (1..v.len()).rev() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                v.swap(i, (state % (i as u64 + 1)) as usize);
            }
        };
        for rows in [1usize, 63, 64, 65, 511, 512, 513, 3_000] {
            for hot in [0, 1, rows / 10, rows / 2, rows] {
                // `hot` ids at random first, the rest in id order; and a
                // permutation with no order at all.
                let mut ids: Vec<u32> = (0..rows as u32).collect();
                shuffle(&mut ids);
                let (first, rest) = ids.split_at_mut(hot.min(rows));
                rest.sort_unstable();
                let chosen: Vec<u32> = first.iter().chain(rest.iter()).copied().collect();
                let scrambled: Vec<u32> = {
                    let mut s: Vec<u32> = (0..rows as u32).collect();
                    shuffle(&mut s);
                    s
                };
                for order in [chosen, scrambled] {
                    let mut slots = vec![0u32; rows];
                    for (slot, &id) in order.iter().enumerate() {
                        slots[id as usize] = slot as u32;
                    }
                    let index = SlotIndex::new(slots.clone()).unwrap();
                    for (id, &slot) in slots.iter().enumerate() {
                        assert_eq!(index.slot(id as i64), i64::from(slot), "{rows} rows, {hot} hot, id {id}");
                    }
                }
            }
        }
        let mut log = Popularity::default();
        (0..50_000).step_by(7).for_each(|id| log.add(id));
        let index = SlotIndex::new(log.slots(1_000_000)).unwrap();
        assert!(index.bytes() < 300_000, "{} bytes for 1M rows with 7,143 hot", index.bytes());
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
