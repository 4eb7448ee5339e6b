//! Building a table's popularity layout offline, for `narsil tables order`
//! (serving needs only the index, [`super`]): how often
//! an id log names each id ([`Popularity`]), the order of the rows that
//! follows ([`SlotOrder`]), and writing a table's rows and its slot index
//! in that order, streaming: the rows go through one bounded buffer, read
//! from the source file by offset ([`write_rows_in_order`]), so a table
//! larger than RAM is ordered within a few tens of MiB.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::SlotIndex;
use crate::sha256::hex;

/// How often each id was looked up, per table, from an id log: 12 bytes
/// per distinct id in a hash map (~25 with its spare room).
#[derive(Debug, Default)]
pub struct Popularity {
    /// Per id: lookups, and the line where it was first seen (ties), each
    /// saturating at 2^32 - 1.
    counts: HashMap<u32, (u32, u32)>,
    lines: u64,
}

impl Popularity {
    /// Counts one lookup of `id`.
    pub fn add(&mut self, id: u32) {
        let line = u32::try_from(self.lines).unwrap_or(u32::MAX);
        self.lines += 1;
        let (count, _) = self.counts.entry(id).or_insert((0, line));
        *count = count.saturating_add(1);
    }

    /// Ids seen.
    pub fn distinct(&self) -> usize {
        self.counts.len()
    }

    /// The logged ids of a table of `rows` ids (at most 2^32), slot by slot:
    /// most looked up first (ties in the order first seen: a list naming
    /// each id once is taken as given). 4 bytes per id, where the counts
    /// took ~25.
    pub fn ranked(self, rows: u64) -> Vec<u32> {
        let mut seen: Vec<(u32, u32, u32)> = self
            .counts
            .into_iter()
            .filter(|&(id, _)| u64::from(id) < rows)
            .map(|(id, (count, first))| (id, count, first))
            .collect();
        // Ids that tie on both (past 2^32 lines) in id order.
        seen.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.2.cmp(&b.2)).then(a.0.cmp(&b.0)));
        seen.iter().map(|&(id, _, _)| id).collect()
    }
}

/// A table's rows in popularity order: the logged ids first, as
/// [`Popularity::ranked`] ranks them, then every other id in id order. Holds
/// a bit per row and 4 bytes per logged id.
#[derive(Debug)]
pub struct SlotOrder {
    rows: u64,
    /// The logged ids, slot by slot.
    hot: Vec<u32>,
    /// Bit `id % 64` of word `id / 64`: whether `id` is logged.
    logged: Vec<u64>,
}

impl SlotOrder {
    /// The order of a table of `rows` ids whose logged ids are `hot`, slot
    /// by slot ([`Popularity::ranked`]); the others follow in id order.
    pub fn new(rows: u64, hot: Vec<u32>) -> Self {
        let mut logged = vec![0u64; rows.div_ceil(64) as usize];
        for &id in &hot {
            logged[id as usize / 64] |= 1 << (id % 64);
        }
        Self { rows, hot, logged }
    }

    fn is_logged(&self, id: u64) -> bool {
        self.logged[id as usize / 64] >> (id % 64) & 1 == 1
    }

    /// The id whose row goes in each slot, slot by slot.
    pub fn ids(&self) -> impl Iterator<Item = u64> + '_ {
        let rest = (0..self.rows).filter(|&id| !self.is_logged(id));
        self.hot.iter().map(|&id| u64::from(id)).chain(rest)
    }

    /// Each id's slot, id by id: the slot index file's values. Takes 8
    /// bytes per logged id while it runs.
    pub fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        let mut by_id: Vec<(u32, u32)> =
            self.hot.iter().enumerate().map(|(slot, &id)| (id, slot as u32)).collect();
        by_id.sort_unstable();
        let hot = self.hot.len() as u64;
        let mut logged_below = 0u64;
        (0..self.rows).map(move |id| {
            if self.is_logged(id) {
                let slot = by_id[logged_below as usize].1;
                logged_below += 1;
                slot
            } else {
                (hot + id - logged_below) as u32
            }
        })
    }

    /// Ids logged.
    pub fn logged(&self) -> usize {
        self.hot.len()
    }
}

/// Writes the rows of a table file (`source`, rows of `row_bytes` in id
/// order, or in the order `source_slots` indexes) to `out` in `order`,
/// holding at most `buffer_bytes` of rows (at least one row) at once: the
/// slots are taken a buffer at a time, the rows they want are read from
/// `source` by offset in file order (rows next to each other in both files
/// in one read), and the buffer is written. Returns the SHA-256 (hex) of
/// what it wrote.
///
/// Peak memory: the buffer, 8 bytes per row it holds (the reads to make),
/// and `order` (a bit per row, 4 bytes per logged id); the page cache holds
/// what the kernel keeps of both files, which it can reclaim.
pub fn write_rows_in_order(
    source: &File,
    source_slots: Option<&SlotIndex>,
    row_bytes: usize,
    order: &SlotOrder,
    buffer_bytes: usize,
    out: &mut impl Write,
) -> std::io::Result<String> {
    let chunk_rows = (buffer_bytes / row_bytes).clamp(1, u32::MAX as usize);
    let mut buffer = vec![0u8; chunk_rows * row_bytes];
    // Each row to read: its row in the source file (below 2^32) in the
    // high half, its row in the buffer in the low half, so that sorting
    // them sorts by source row.
    let mut reads: Vec<u64> = Vec::with_capacity(chunk_rows);
    let mut sha = Sha256::new();
    let mut ids = order.ids();
    loop {
        reads.clear();
        for (at, id) in ids.by_ref().take(chunk_rows).enumerate() {
            let from = source_slots.map_or(id, |index| index.slot(id as i64) as u64);
            reads.push(from << 32 | at as u64);
        }
        if reads.is_empty() {
            break;
        }
        reads.sort_unstable();
        let mut next = 0;
        while next < reads.len() {
            // A run: the next rows of both files.
            let first = reads[next];
            let run = 1 + reads[next + 1..]
                .iter()
                .zip(1..)
                .take_while(|&(&r, step)| r == first + step * ((1 << 32) + 1))
                .count();
            let (from, at) = (first >> 32, (first & u64::from(u32::MAX)) as usize);
            let (at, run_bytes) = (at * row_bytes, run * row_bytes);
            source.read_exact_at(&mut buffer[at..at + run_bytes], from * row_bytes as u64)?;
            next += run;
        }
        let filled = &buffer[..reads.len() * row_bytes];
        sha.update(filled);
        out.write_all(filled)?;
    }
    Ok(hex(sha.finalize()))
}

/// Writes `order`'s slot index (each id's slot, a little-endian u32, id by
/// id) to `out`, through a 1 MiB buffer; returns its SHA-256 (hex).
pub fn write_slot_index(order: &SlotOrder, out: impl Write) -> std::io::Result<String> {
    let mut out = std::io::BufWriter::with_capacity(1 << 20, out);
    let mut sha = Sha256::new();
    for slot in order.slots() {
        let bytes = slot.to_le_bytes();
        sha.update(bytes);
        out.write_all(&bytes)?;
    }
    out.flush()?;
    Ok(hex(sha.finalize()))
}

/// The file a table's slot index is written to, beside its rows.
pub fn slots_file(table_file: &Path) -> PathBuf {
    table_file.with_extension("slots")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slots as `tables order` computed them before it streamed: the
    /// whole permutation, from the counts.
    fn reference_slots(log: &Popularity, rows: u64) -> Vec<u32> {
        let mut seen: Vec<(u32, u32, u32)> =
            log.counts.iter().map(|(&id, &(count, first))| (id, count, first)).collect();
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

    /// `rows` (in id order) laid out by `slots`, in memory.
    fn in_slot_order(rows: &[u8], row_bytes: usize, slots: &[u32]) -> Vec<u8> {
        let mut ordered = vec![0u8; rows.len()];
        for (row, &slot) in rows.chunks_exact(row_bytes).zip(slots) {
            ordered[slot as usize * row_bytes..][..row_bytes].copy_from_slice(row);
        }
        ordered
    }

    fn sha(bytes: &[u8]) -> String {
        let mut sha = Sha256::new();
        sha.update(bytes);
        hex(sha.finalize())
    }

    #[test]
    fn ids_seen_most_come_first_ties_by_first_sight_unseen_after_in_id_order() {
        let mut log = Popularity::default();
        for id in [7, 3, 7, 5, 3, 7, 9] {
            log.add(id);
        }
        // 7: three times, 3: twice, then 5 and 9 once each (5 seen first);
        // 0, 1, 2, 4, 6, 8 never.
        let reference = reference_slots(&log, 10);
        let order = SlotOrder::new(10, log.ranked(10));
        assert_eq!(order.ids().collect::<Vec<_>>(), vec![7, 3, 5, 9, 0, 1, 2, 4, 6, 8]);
        let slots: Vec<u32> = order.slots().collect();
        assert_eq!(slots, vec![4, 5, 6, 1, 7, 2, 8, 0, 9, 3]);
        assert_eq!(slots, reference);
        assert!(SlotIndex::from_slots(&slots).is_ok());
    }

    #[test]
    fn rows_written_through_a_buffer_of_a_few_rows_are_the_in_memory_reference() {
        const ROWS: u64 = 1_000;
        const ROW_BYTES: usize = 16;
        let dir = tempfile::tempdir().unwrap();
        let rows: Vec<u8> = (0..ROWS as usize * ROW_BYTES).map(|i| (i * 131 % 251) as u8).collect();
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut zipf_ish = |log: &mut Popularity, n: usize| {
            for _ in 0..n {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                // Small ids often, any id now and then.
                let id = if state.is_multiple_of(3) { state % ROWS } else { state % 40 * 13 % ROWS };
                log.add(id as u32);
            }
        };
        // A: in id order. B: A ordered by one log. C: B ordered by another.
        std::fs::write(dir.path().join("a.bin"), &rows).unwrap();
        let (mut first, mut second) = (Popularity::default(), Popularity::default());
        zipf_ish(&mut first, 400);
        zipf_ish(&mut second, 700);
        let mut source_slots = None;
        let mut source = dir.path().join("a.bin");
        for (name, log) in [("b", first), ("c", second)] {
            let slots = reference_slots(&log, ROWS);
            let order = SlotOrder::new(ROWS, log.ranked(ROWS));
            assert_eq!(order.slots().collect::<Vec<_>>(), slots, "{name}: the slots");
            let want = in_slot_order(&rows, ROW_BYTES, &slots);
            for buffer_bytes in [0, ROW_BYTES, 3 * ROW_BYTES + 5, 64 * ROW_BYTES, 1 << 20] {
                let mut written = Vec::new();
                let file = File::open(&source).unwrap();
                let hash = write_rows_in_order(
                    &file,
                    source_slots.as_ref(),
                    ROW_BYTES,
                    &order,
                    buffer_bytes,
                    &mut written,
                )
                .unwrap();
                assert!(written == want, "{name}, a buffer of {buffer_bytes} bytes: not the reference");
                assert_eq!(hash, sha(&want));
            }
            let mut index = Vec::new();
            let hash = write_slot_index(&order, &mut index).unwrap();
            let want_index: Vec<u8> = slots.iter().flat_map(|s| s.to_le_bytes()).collect();
            assert_eq!(index, want_index);
            assert_eq!(hash, sha(&index));
            // What serving checks the index against is this hash.
            let (read, served_hash) = SlotIndex::read(|| Ok(index.as_slice()), ROWS).unwrap();
            assert_eq!(served_hash, hash);
            source = dir.path().join(format!("{name}.bin"));
            std::fs::write(&source, &want).unwrap();
            source_slots = Some(read);
        }
    }
}
