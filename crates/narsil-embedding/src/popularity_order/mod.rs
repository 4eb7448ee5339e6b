//! A table laid out in popularity order: its file holds the rows hottest
//! first, so the rows a skewed workload reads share blocks and pages, and a
//! slot index (`tables/NAME.slots`, one little-endian `u32` per id) says
//! where each id's row is. `narsil tables order` writes both, with the
//! code in [`writer`] (the order an id log gives, the rows and the index
//! written in it); the schema names the index and its SHA-256 in the
//! table's `layout`. This module is what serving needs: the index, read
//! from its file.
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

use sha2::{Digest, Sha256};
use std::io::Read;

use crate::sha256::hex;

pub mod writer;
pub use writer::{slots_file, write_rows_in_order, write_slot_index, Popularity, SlotOrder};

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

/// Bytes of a slot index file read at a time.
const READ_BYTES: usize = 1 << 16;

impl std::fmt::Debug for SlotIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotIndex").field("rows", &self.rows).field("hot", &self.hot_slots.len()).finish()
    }
}

/// Why a slot index file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SlotIndexError {
    /// It cannot be read.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// Its size is not 4 bytes per row.
    #[error("a slot index of {rows} rows takes {expected} bytes, the file holds {actual} (truncated, or not this table's index)")]
    Size {
        /// The table's rows.
        rows: u64,
        /// Bytes it should hold.
        expected: u64,
        /// Bytes it holds.
        actual: u64,
    },
    /// It is not a permutation of the rows.
    #[error("{0}")]
    NotAPermutation(String),
}

impl SlotIndex {
    /// Reads a slot index file (`rows` little-endian u32s, a permutation of
    /// the rows) straight into the compact index, in two passes over
    /// `open()`'s bytes (opened twice): the first finds how many slots are
    /// hot (all but the longest tail of slots whose ids rise), the second
    /// keeps the hot ids' slots, checks every other id's, and hashes the
    /// bytes. Returns the index and the SHA-256 (hex) of the bytes it was
    /// built from, which the caller checks against the schema's.
    ///
    /// Peak memory: the index itself (a bit per row, 4 bytes per 512 rows,
    /// 4 bytes per hot id), a bit per hot id while it is read and a 64 KiB
    /// buffer: ~0.14 bytes per row + ~4.1 per hot id, where reading the
    /// file whole into the permutation and its inverse took 12 per row.
    pub fn read<R: Read>(
        mut open: impl FnMut() -> std::io::Result<R>,
        rows: u64,
    ) -> Result<(Self, String), SlotIndexError> {
        let expected = rows * SLOT_BYTES;
        let size_error = |actual| SlotIndexError::Size { rows, expected, actual };
        // Pass 1: the hot slots are 0..hot, `hot` one past the largest slot
        // that some earlier id's slot exceeds (a pair of slots out of id
        // order); every slot from `hot` on is in id order.
        let (mut hot, mut highest) = (0u64, None::<u32>);
        let read = scan(
            open()?,
            rows,
            |_| {},
            |_, slot| {
                if highest.is_some_and(|highest| slot < highest) {
                    hot = hot.max(u64::from(slot) + 1);
                }
                highest = highest.max(Some(slot));
                Ok(())
            },
        )?;
        if read != expected {
            return Err(size_error(read));
        }
        let hot = hot.min(rows);
        // Pass 2: the hot ids and their slots, each slot once; every other
        // id's slot must be the next after the hot ones in id order.
        let mut taken = vec![0u64; hot.div_ceil(64) as usize];
        let mut hot_bits = vec![0u64; rows.div_ceil(64) as usize];
        let mut hot_slots = Vec::with_capacity(hot as usize);
        let mut sha = Sha256::new();
        let read = scan(
            open()?,
            rows,
            |bytes| sha.update(bytes),
            |id, slot| {
                let at = u64::from(slot);
                let twice = || format!("id {id} has slot {slot}, which another id has too");
                if at >= rows {
                    return Err(format!("id {id} has slot {slot}, past the table's {rows} rows"));
                }
                if at < hot {
                    let (word, bit) = (at as usize / 64, 1u64 << (at % 64));
                    if taken[word] & bit != 0 {
                        return Err(twice());
                    }
                    taken[word] |= bit;
                    hot_bits[id as usize / 64] |= 1 << (id % 64);
                    hot_slots.push(slot);
                    return Ok(());
                }
                let next = hot + id - hot_slots.len() as u64;
                match at.cmp(&next) {
                    std::cmp::Ordering::Equal => Ok(()),
                    std::cmp::Ordering::Less => Err(twice()),
                    std::cmp::Ordering::Greater => {
                        Err(format!("id {id} has slot {slot}, but no id has slot {next}"))
                    }
                }
            },
        )?;
        if read != expected {
            return Err(size_error(read));
        }
        if hot_slots.len() as u64 != hot {
            // Only if the file changed between the passes.
            return Err(SlotIndexError::NotAPermutation(format!(
                "{} ids have the {hot} slots before those in id order",
                hot_slots.len()
            )));
        }
        drop(taken);
        let block_ranks = hot_bits
            .chunks(RANK_BLOCK_WORDS)
            .scan(0u32, |below, block| {
                let rank = *below;
                *below += block.iter().map(|w| w.count_ones()).sum::<u32>();
                Some(rank)
            })
            .collect();
        Ok((Self { hot_bits, block_ranks, hot_slots, rows }, hex(sha.finalize())))
    }

    /// An index over `slots` (slot of id `i` at `i`), which must be a
    /// permutation of `0..slots.len()`.
    pub fn from_slots(slots: &[u32]) -> Result<Self, String> {
        let bytes: Vec<u8> = slots.iter().flat_map(|slot| slot.to_le_bytes()).collect();
        Self::read(|| Ok(bytes.as_slice()), slots.len() as u64)
            .map(|(index, _)| index)
            .map_err(|e| e.to_string())
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

    /// Rows it indexes.
    pub fn rows(&self) -> u64 {
        self.rows
    }

    /// Bytes it holds in memory.
    pub fn bytes(&self) -> u64 {
        (self.hot_bits.len() * 8 + self.block_ranks.len() * 4 + self.hot_slots.len() * 4) as u64
    }

    /// Puts `rows` (the file's rows of `row_bytes`, in slot order) in id
    /// order, in place ([`gather_rows_in_place`]).
    pub fn to_id_order(&self, rows: &mut [u8], row_bytes: usize) {
        debug_assert_eq!((rows.len() / row_bytes) as u64, self.rows);
        gather_rows_in_place(rows, row_bytes, |id| self.slot(id as i64) as usize);
    }
}

/// Makes row `i` of `rows` (rows of `row_bytes`) what row `from(i)` was,
/// in place, where `from` is a permutation of the rows: each cycle of the
/// permutation is walked once, each row replaced by the next one's until
/// the cycle comes back, where the first row goes. Needs a bit per row
/// and one row besides the rows (not a second copy of them).
pub(crate) fn gather_rows_in_place(rows: &mut [u8], row_bytes: usize, from: impl Fn(usize) -> usize) {
    let count = rows.len() / row_bytes;
    let mut done = vec![0u64; count.div_ceil(64)];
    let mut first = vec![0u8; row_bytes];
    for start in 0..count {
        if done[start / 64] >> (start % 64) & 1 == 1 {
            continue;
        }
        first.copy_from_slice(&rows[start * row_bytes..(start + 1) * row_bytes]);
        let mut id = start;
        loop {
            done[id / 64] |= 1 << (id % 64);
            let next = from(id);
            if next == start {
                rows[id * row_bytes..(id + 1) * row_bytes].copy_from_slice(&first);
                break;
            }
            rows.copy_within(next * row_bytes..(next + 1) * row_bytes, id * row_bytes);
            id = next;
        }
    }
}

/// Reads `reader` to its end, giving `bytes` every byte and `slot` the
/// slot of each id below `rows` (one that says why not stops the read);
/// returns the bytes read.
fn scan<R: Read>(
    mut reader: R,
    rows: u64,
    mut bytes: impl FnMut(&[u8]),
    mut slot: impl FnMut(u64, u32) -> Result<(), String>,
) -> Result<u64, SlotIndexError> {
    let mut buffer = vec![0u8; READ_BYTES];
    // Bytes at the buffer's start not yet taken (less than a slot), and
    // bytes taken.
    let (mut filled, mut taken) = (0usize, 0u64);
    loop {
        let n = match reader.read(&mut buffer[filled..]) {
            Ok(0) => return Ok(taken + filled as u64),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e.into()),
        };
        bytes(&buffer[filled..filled + n]);
        filled += n;
        let whole = filled / 4 * 4;
        for word in buffer[..whole].chunks_exact(4) {
            let id = taken / SLOT_BYTES;
            taken += SLOT_BYTES;
            if id < rows {
                slot(id, u32::from_le_bytes(word.try_into().expect("4 bytes")))
                    .map_err(SlotIndexError::NotAPermutation)?;
            }
        }
        buffer.copy_within(whole..filled, 0);
        filled -= whole;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fisher-Yates on a xorshift generator.
    fn shuffler(mut state: u64) -> impl FnMut(&mut [u32]) {
        move |v: &mut [u32]| {
            for i in (1..v.len()).rev() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                v.swap(i, (state % (i as u64 + 1)) as usize);
            }
        }
    }

    /// The slot of each id when `order` lists the ids slot by slot.
    fn slots_of(order: &[u32]) -> Vec<u32> {
        let mut slots = vec![0u32; order.len()];
        for (slot, &id) in order.iter().enumerate() {
            slots[id as usize] = slot as u32;
        }
        slots
    }

    /// The hot slots as the index was built before it streamed: all but
    /// the longest tail of slots whose ids rise, from the inverse.
    fn reference_hot(order: &[u32]) -> usize {
        let mut hot = order.len();
        while hot > 0 && (hot == order.len() || order[hot - 1] < order[hot]) {
            hot -= 1;
        }
        hot
    }

    /// A reader that hands out a few bytes at a time (1 to 7), so slots
    /// straddle reads.
    struct Trickle<'a>(&'a [u8], usize);

    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.1 = self.1 % 7 + 1;
            let n = self.1.min(buf.len()).min(self.0.len());
            buf[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }

    fn file_bytes(slots: &[u32]) -> Vec<u8> {
        slots.iter().flat_map(|slot| slot.to_le_bytes()).collect()
    }

    #[test]
    fn rows_laid_out_by_popularity_come_back_in_id_order_in_place() {
        let rows: Vec<u8> = (0..6 * 4).map(|b| b as u8).collect();
        let slots = [3u32, 0, 5, 1, 4, 2];
        let mut ordered = vec![0u8; rows.len()];
        for (id, &slot) in slots.iter().enumerate() {
            ordered[slot as usize * 4..][..4].copy_from_slice(&rows[id * 4..][..4]);
        }
        assert_eq!(&ordered[0..4], &rows[4..8], "slot 0 holds id 1");
        let index = SlotIndex::from_slots(&slots).unwrap();
        assert_eq!(index.slot(2), 5);
        index.to_id_order(&mut ordered, 4);
        assert_eq!(ordered, rows);
        let mut shuffle = shuffler(0x9E37_79B9_7F4A_7C15);
        for count in [1usize, 2, 64, 1_000] {
            let mut order: Vec<u32> = (0..count as u32).collect();
            shuffle(&mut order);
            let slots = slots_of(&order);
            let rows: Vec<u8> = (0..count * 3).map(|b| (b * 31 % 251) as u8).collect();
            let mut file = vec![0u8; rows.len()];
            for (id, &slot) in slots.iter().enumerate() {
                file[slot as usize * 3..][..3].copy_from_slice(&rows[id * 3..][..3]);
            }
            SlotIndex::from_slots(&slots).unwrap().to_id_order(&mut file, 3);
            assert_eq!(file, rows, "{count} rows");
        }
    }

    #[test]
    fn the_streamed_index_finds_every_ids_slot_of_any_permutation_as_the_whole_file_did() {
        let mut shuffle = shuffler(0x2545_F491_4F6C_DD1D);
        for rows in [1usize, 63, 64, 65, 511, 512, 513, 3_000] {
            for hot in [0, 1, rows / 10, rows / 2, rows] {
                // `hot` ids at random first, the rest in id order; and a
                // permutation with no order at all.
                let mut ids: Vec<u32> = (0..rows as u32).collect();
                shuffle(&mut ids);
                let (first, rest) = ids.split_at_mut(hot.min(rows));
                rest.sort_unstable();
                let chosen: Vec<u32> = first.iter().chain(rest.iter()).copied().collect();
                let mut scrambled: Vec<u32> = (0..rows as u32).collect();
                shuffle(&mut scrambled);
                for order in [chosen, scrambled] {
                    let slots = slots_of(&order);
                    let bytes = file_bytes(&slots);
                    let (index, sha) = SlotIndex::read(|| Ok(Trickle(&bytes, 0)), rows as u64).unwrap();
                    let mut whole = Sha256::new();
                    whole.update(&bytes);
                    assert_eq!(sha, hex(whole.finalize()), "{rows} rows: the hash of the bytes read");
                    assert_eq!(index.hot_slots.len(), reference_hot(&order), "{rows} rows, {hot} hot");
                    for (id, &slot) in slots.iter().enumerate() {
                        assert_eq!(index.slot(id as i64), i64::from(slot), "{rows} rows, {hot} hot, id {id}");
                    }
                }
            }
        }
        // 7,143 logged ids first, the rest in id order.
        let logged: Vec<u32> = (0..50_000).step_by(7).collect();
        let rest = (0..1_000_000).filter(|id| id % 7 != 0 || *id >= 50_000);
        let order: Vec<u32> = logged.iter().copied().chain(rest).collect();
        let index = SlotIndex::from_slots(&slots_of(&order)).unwrap();
        assert_eq!(index.hot_slots.len(), 7_143);
        assert!(index.bytes() < 300_000, "{} bytes for 1M rows with 7,143 hot", index.bytes());
    }

    #[test]
    fn an_index_that_is_not_a_permutation_or_not_the_tables_size_is_refused() {
        assert!(SlotIndex::from_slots(&[0, 2, 1]).is_ok());
        for (slots, says) in [
            (&[0, 1, 1][..], "id 2 has slot 1, which another id has too"),
            (&[2, 1, 1], "id 2 has slot 1, which another id has too"),
            (&[0, 3, 1], "id 1 has slot 3, past the table's 3 rows"),
            (&[1, 1], "id 0 has slot 1, but no id has slot 0"),
            (&[0, 2, 2], "id 1 has slot 2, but no id has slot 1"),
        ] {
            let error = SlotIndex::from_slots(slots).unwrap_err();
            assert!(error.contains(says), "{slots:?}: {error}");
        }
        let bytes = file_bytes(&[0, 1, 2]);
        for (cut, holds) in [(&bytes[..8], "holds 8"), (&bytes[..11], "holds 11")] {
            let error = SlotIndex::read(|| Ok(cut), 3).unwrap_err().to_string();
            assert!(error.contains("takes 12 bytes") && error.contains(holds), "{error}");
        }
        let long = [bytes.as_slice(), &[0, 0]].concat();
        let error = SlotIndex::read(|| Ok(long.as_slice()), 3).unwrap_err().to_string();
        assert!(error.contains("holds 14"), "{error}");
    }
}
