//! A table's id map: how raw 64-bit ids (user, item, ad ids, hashes of
//! strings) become rows of the table. A split model's table may declare one
//! (`schema.json`, the table's `ids`: [`crate::schema::TableIds`]); the
//! embedding stage maps every id of the table's features through it before
//! dedup and fetch ([`crate::stage`]), on every store, and an id the map
//! does not hold is served from the table's declared default row (and
//! counted in `narsil_table_unmapped_ids_total`).
//!
//! # The file (`tables/NAME.idmap`)
//!
//! An open-addressing hash table with linear probing, little-endian,
//! mapped read-only as it is:
//!
//! | bytes | what |
//! |---|---|
//! | 0..16 | magic `NARSIL-IDMAP-1\n\0` |
//! | 16..24 | `home_slots`: a power of two, at least 1 |
//! | 24..32 | `slots`: at least `home_slots` (the slots past `home_slots - 1` hold runs that spill past the last home slot; there is no wrap-around) |
//! | 32..40 | `entries`: the raw ids it holds |
//! | 40..48 | `rows`: the rows of its table (every entry's row is below it) |
//! | 48..64 | zero |
//! | 64.. | `slots` slots of 16 bytes: the raw id (`i64` as two's complement `u64`), then its row (`u64`); an empty slot has row `u64::MAX` and raw id 0 |
//!
//! A raw id's home slot is `fmix64(raw as u64) & (home_slots - 1)`, where
//! `fmix64` is MurmurHash3's 64-bit finalizer (`k ^= k >> 33; k *=
//! 0xff51afd7ed558ccd; k ^= k >> 33; k *= 0xc4ceb9fe1a85ec53; k ^= k >>
//! 33`, wrapping). A lookup reads slots from its home slot on until it finds
//! the raw id (its row) or an empty slot or the end (not held).
//!
//! The writers place entries in `(home slot, raw id)` order, each in the
//! first free slot at or after its home: entry `i` at `max(home_i, slot of
//! entry i-1 + 1)`. So one set of `(raw id, row)` pairs always gives the
//! same bytes (its SHA-256, named in the schema, is the map's identity),
//! and a writer never needs the whole table in memory: entries sorted by
//! home slot are written front to back (`narsil tables map` sorts them in
//! runs on disk: [`build`]). `home_slots` is the smallest power of two at
//! least twice the entries (a load of at most one half: short probes), so
//! a map takes 32 to 64 bytes per id (33.6 MB for 1M ids).
//!
//! Checked when opened, every byte (and hashed): the magic, the size
//! (`64 + 16 * slots`), `rows` equal to the table's, each entry's row below
//! it, each entry reachable from its home (no empty slot between), entries
//! of a run in strictly rising `(home, raw id)` order (no raw id twice), and
//! the count. A file that fails any of them fails the model's load naming
//! the file and what is wrong.

use std::path::Path;

use sha2::{Digest, Sha256};

use crate::sha256::hex;
use crate::stores::local::huge_pages::HugePageRows;

pub mod build;
mod perfect_hash;
mod slotted;
mod writer;
pub use perfect_hash::PerfectHash;
pub use slotted::SlottedMap;
pub use writer::{build, SortedWriter};

/// The first 16 bytes of every map file.
pub const MAGIC: &[u8; 16] = b"NARSIL-IDMAP-1\n\0";
/// Bytes before the first slot.
pub const HEADER_BYTES: usize = 64;
/// Bytes per slot: the raw id, then its row.
pub const SLOT_BYTES: usize = 16;
/// The row of an empty slot.
pub const EMPTY: u64 = u64::MAX;

/// MurmurHash3's 64-bit finalizer: a bijection of `u64` whose low bits
/// depend on every input bit.
pub fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

/// The home slot of `raw` in a map of `home_slots` home slots.
pub fn home(raw: i64, home_slots: u64) -> u64 {
    fmix64(raw as u64) & (home_slots - 1)
}

/// The home slots of a map holding `entries` ids: the smallest power of
/// two at least twice as many (at least 1).
pub fn home_slots_for(entries: u64) -> u64 {
    entries.saturating_mul(2).max(1).next_power_of_two()
}

/// Why a map file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum IdMapError {
    /// It cannot be read.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// Its bytes are not a map of this table (what is wrong).
    #[error("{0}")]
    Invalid(String),
}

fn invalid(message: impl Into<String>) -> IdMapError {
    IdMapError::Invalid(message.into())
}

/// The bytes of a map: in memory (on huge pages when at least one, as
/// memory-store tables are: [`crate::stores::local::huge_pages`]) or
/// mapped.
enum Bytes {
    Owned(Vec<u8>),
    Huge(HugePageRows),
    Mapped(memmap2::Mmap),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Self::Owned(bytes) => bytes,
            Self::Huge(bytes) => bytes,
            Self::Mapped(map) => map,
        }
    }
}

impl Bytes {
    /// A copy on huge pages when they are wanted and it is at least one,
    /// else itself.
    fn onto_huge_pages(self) -> Self {
        if matches!(self, Self::Huge(_)) {
            return self;
        }
        HugePageRows::copy_if_worth(&self).map_or(self, Self::Huge)
    }
}

/// A checked id map, ready for lookups.
pub struct IdMap {
    bytes: Bytes,
    home_slots: u64,
    slots: u64,
    entries: u64,
    rows: u64,
}

impl std::fmt::Debug for IdMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdMap")
            .field("entries", &self.entries)
            .field("slots", &self.slots)
            .field("rows", &self.rows)
            .finish()
    }
}

/// How far ahead [`IdMap::map_into`] asks for home slots, in ids.
const PREFETCH_IDS: usize = 32;

impl IdMap {
    /// Maps `path` read-only, checks it as a map of a table of `rows` rows
    /// (module docs) and hashes it: the map and its SHA-256 (hex), which
    /// the caller checks against the schema's.
    pub fn open(path: &Path, rows: u64) -> Result<(Self, String), IdMapError> {
        let file = std::fs::File::open(path)?;
        // SAFETY: memmap2 requires that the file is neither truncated nor
        // written while mapped: map files are published with their model
        // version and never changed in place (as table files:
        // crate::stores::local::table), and every slot read is bounds
        // checked against the length mapped.
        let map = unsafe { memmap2::MmapOptions::new().map_copy_read_only(&file)? };
        // Hashed and checked front to back (read ahead), then looked up at
        // random (no read-ahead: it would evict hot slots). Only hints.
        let _ = map.advise(memmap2::Advice::Sequential);
        let sha = hex(Sha256::digest(&map[..]));
        let map = Self::checked(Bytes::Mapped(map), rows)?;
        if let Bytes::Mapped(mapped) = &map.bytes {
            let _ = mapped.advise(memmap2::Advice::Random);
        }
        Ok((map, sha))
    }

    /// A map from its bytes (as [`build`] writes them), checked, held as
    /// a map of a memory-store table is ([`Self::onto_huge_pages`]).
    pub fn from_bytes(bytes: Vec<u8>, rows: u64) -> Result<Self, IdMapError> {
        Self::checked(Bytes::Owned(bytes).onto_huge_pages(), rows)
    }

    /// This map copied onto huge pages (at least 2 MiB of it; else, or
    /// when they cannot be had, as it is): the map of a table the `memory`
    /// store holds, whose lookups then pay no more page walks than its
    /// rows'. A mapped map's page-cache copy is left to the kernel.
    pub fn onto_huge_pages(self) -> Self {
        Self { bytes: self.bytes.onto_huge_pages(), ..self }
    }

    /// [`Self::onto_huge_pages`] in place: whether it is on huge pages now.
    pub fn move_onto_huge_pages(&mut self) -> bool {
        let bytes = std::mem::replace(&mut self.bytes, Bytes::Owned(Vec::new()));
        self.bytes = bytes.onto_huge_pages();
        self.on_huge_pages()
    }

    /// Whether its bytes are on huge pages of their own (else on the heap
    /// or mapped from its file).
    pub fn on_huge_pages(&self) -> bool {
        matches!(self.bytes, Bytes::Huge(_))
    }

    fn checked(bytes: Bytes, rows: u64) -> Result<Self, IdMapError> {
        if bytes.len() < HEADER_BYTES || &bytes[..16] != MAGIC {
            return Err(invalid("not a Narsil id map (its first bytes are not NARSIL-IDMAP-1)"));
        }
        let header = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        let (home_slots, slots, entries, map_rows) = (header(16), header(24), header(32), header(40));
        if !home_slots.is_power_of_two() || slots < home_slots {
            return Err(invalid(format!(
                "its header says {home_slots} home slots (a power of two) in {slots} slots"
            )));
        }
        let expected = slots.checked_mul(SLOT_BYTES as u64).and_then(|s| s.checked_add(HEADER_BYTES as u64));
        if expected != Some(bytes.len() as u64) {
            return Err(invalid(format!(
                "{slots} slots take {} bytes, the file holds {} (truncated, or not a whole map)",
                expected.map_or_else(|| "more than 2^64".into(), |e| e.to_string()),
                bytes.len()
            )));
        }
        if map_rows != rows {
            return Err(invalid(format!(
                "it maps ids to a table of {map_rows} rows, the schema's table has {rows} (not this table's map)"
            )));
        }
        let map = Self { bytes, home_slots, slots, entries, rows };
        map.check_slots()?;
        Ok(map)
    }

    /// Every slot, front to back (module docs: what is checked).
    fn check_slots(&self) -> Result<(), IdMapError> {
        let mut held = 0u64;
        // The last empty slot seen, and the last entry of the current run.
        let (mut last_empty, mut previous) = (None::<u64>, None::<(u64, i64)>);
        for slot in 0..self.slots {
            let (raw, row) = self.slot(slot);
            if row == EMPTY {
                (last_empty, previous) = (Some(slot), None);
                continue;
            }
            let home = home(raw, self.home_slots);
            if row >= self.rows {
                return Err(invalid(format!(
                    "raw id {raw} maps to row {row}, past the table's {} rows",
                    self.rows
                )));
            }
            if home > slot || last_empty.is_some_and(|empty| empty >= home) {
                return Err(invalid(format!(
                    "raw id {raw} is in slot {slot}, which a lookup from its home slot {home} does not reach"
                )));
            }
            if previous.is_some_and(|before| before >= (home, raw)) {
                return Err(invalid(format!(
                    "raw id {raw} (home slot {home}) follows {:?} in one run: entries are in rising (home, raw id) order and no raw id is held twice",
                    previous.map(|(_, raw)| raw).unwrap_or_default()
                )));
            }
            previous = Some((home, raw));
            held += 1;
        }
        if held != self.entries {
            return Err(invalid(format!(
                "its header counts {} entries, its slots hold {held}",
                self.entries
            )));
        }
        Ok(())
    }

    /// Slot `at`'s raw id and row.
    fn slot(&self, at: u64) -> (i64, u64) {
        let at = HEADER_BYTES + at as usize * SLOT_BYTES;
        let slot: &[u8; SLOT_BYTES] = self.bytes[at..at + SLOT_BYTES].try_into().expect("a whole slot");
        let (raw, row) = slot.split_at(8);
        (
            i64::from_le_bytes(raw.try_into().expect("8 bytes")),
            u64::from_le_bytes(row.try_into().expect("8 bytes")),
        )
    }

    /// The row of `raw`, if the map holds it.
    pub fn row(&self, raw: i64) -> Option<u64> {
        self.row_from(raw, home(raw, self.home_slots))
    }

    /// The row of `raw`, looked up from its home slot `at`.
    fn row_from(&self, raw: i64, mut at: u64) -> Option<u64> {
        while at < self.slots {
            match self.slot(at) {
                (_, EMPTY) => return None,
                (held, row) if held == raw => return Some(row),
                _ => at += 1,
            }
        }
        None
    }

    /// Writes each of `raws`' rows into `out` (as long), `default` for the
    /// ids the map does not hold; returns how many it did not hold. Home
    /// slots are asked for [`PREFETCH_IDS`] ids ahead: lookups land at
    /// random in a map larger than the caches.
    pub fn map_into(&self, raws: &[i64], out: &mut [i64], default: u64) -> u64 {
        self.map_into_or(raws, out, default, |_| None)
    }

    /// [`Self::map_into`], asking `elsewhere` for each id the map does not
    /// hold before giving it `default` (the ids pushed to a served table);
    /// returns how many neither held.
    #[inline]
    pub fn map_into_or(
        &self,
        raws: &[i64],
        out: &mut [i64],
        default: u64,
        mut elsewhere: impl FnMut(i64) -> Option<i64>,
    ) -> u64 {
        let mut unmapped = 0;
        // Each id hashed once: its home slot, found (and asked for)
        // PREFETCH_IDS ids ahead, waits in `homes` until its lookup.
        let mut homes = [0u64; PREFETCH_IDS];
        for (home, &raw) in homes.iter_mut().zip(raws) {
            *home = self.prefetch(raw);
        }
        for (i, (&raw, out)) in raws.iter().zip(out.iter_mut()).enumerate() {
            let at = homes[i % PREFETCH_IDS];
            if let Some(&ahead) = raws.get(i + PREFETCH_IDS) {
                homes[i % PREFETCH_IDS] = self.prefetch(ahead);
            }
            *out = match self.row_from(raw, at) {
                Some(row) => row as i64,
                None => elsewhere(raw).unwrap_or_else(|| {
                    unmapped += 1;
                    default as i64
                }),
            };
        }
        unmapped
    }

    /// Asks the CPU for `raw`'s home slot (a hint); returns the slot.
    fn prefetch(&self, raw: i64) -> u64 {
        let home = home(raw, self.home_slots);
        #[cfg(target_arch = "x86_64")]
        {
            let at = HEADER_BYTES + home as usize * SLOT_BYTES;
            // SAFETY: a prefetch changes no memory and never faults; the
            // address is inside the map (home < home_slots <= slots).
            unsafe {
                std::arch::x86_64::_mm_prefetch(
                    self.bytes.as_ptr().add(at).cast(),
                    std::arch::x86_64::_MM_HINT_T0,
                )
            };
        }
        home
    }

    /// The raw ids it holds.
    pub fn entries(&self) -> u64 {
        self.entries
    }

    /// Bytes it takes (mapped or in memory).
    pub fn bytes(&self) -> u64 {
        self.bytes.len() as u64
    }

    /// Every `(raw id, row)` it holds, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (i64, u64)> + '_ {
        (0..self.slots).map(|at| self.slot(at)).filter(|&(_, row)| row != EMPTY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(n: u64) -> Vec<(i64, u64)> {
        // Raw ids as production sends them: large, negative, the extremes.
        let mut pairs: Vec<(i64, u64)> =
            (0..n).map(|i| ((i as i64).wrapping_mul(0x9e37_79b9_7f4a_7c15u64 as i64), i % 97)).collect();
        pairs.extend([(i64::MIN, 1), (i64::MAX, 2), (-1, 3)]);
        pairs
    }

    #[test]
    fn every_raw_id_it_holds_finds_its_row_and_others_find_none() {
        let pairs = pairs(5000);
        let map = IdMap::from_bytes(build(&pairs, 97).unwrap(), 97).unwrap();
        assert_eq!(map.entries(), pairs.len() as u64);
        for &(raw, row) in &pairs {
            assert_eq!(map.row(raw), Some(row), "{raw}");
        }
        for raw in [1i64, 7, -2, 12345678901234] {
            assert_eq!(map.row(raw), None, "{raw}");
        }
        let raws: Vec<i64> = pairs.iter().map(|p| p.0).chain([5, 6]).collect();
        let mut out = vec![0; raws.len()];
        assert_eq!(map.map_into(&raws, &mut out, 96), 2);
        assert_eq!(&out[out.len() - 2..], &[96, 96]);
        assert!(out.iter().zip(&pairs).all(|(&o, &(_, row))| o as u64 == row));
    }

    #[test]
    fn one_set_of_pairs_always_gives_the_same_bytes_and_iterates_back() {
        let mut pairs = pairs(300);
        let a = build(&pairs, 97).unwrap();
        pairs.reverse();
        assert_eq!(build(&pairs, 97).unwrap(), a);
        let mut back: Vec<_> = IdMap::from_bytes(a, 97).unwrap().iter().collect();
        back.sort_unstable();
        pairs.sort_unstable();
        assert_eq!(back, pairs);
        // An empty map is a map: it holds nothing.
        let empty = IdMap::from_bytes(build(&[], 4).unwrap(), 4).unwrap();
        assert_eq!((empty.entries(), empty.row(0)), (0, None));
    }

    #[test]
    fn runs_that_spill_past_the_last_home_slot_are_found() {
        // Raw ids whose home is the last slot: each spills one further.
        let home_slots = home_slots_for(4);
        let last: Vec<i64> = (0i64..).filter(|&r| home(r, home_slots) == home_slots - 1).take(4).collect();
        let pairs: Vec<(i64, u64)> = last.iter().enumerate().map(|(i, &r)| (r, i as u64)).collect();
        let map = IdMap::from_bytes(build(&pairs, 4).unwrap(), 4).unwrap();
        assert_eq!(map.slots, home_slots + 3);
        assert!(pairs.iter().all(|&(raw, row)| map.row(raw) == Some(row)));
    }

    #[test]
    fn a_bad_map_is_refused_naming_what_is_wrong() {
        let good = build(&pairs(100), 97).unwrap();
        let refused = |bytes: Vec<u8>, rows: u64| IdMap::from_bytes(bytes, rows).unwrap_err().to_string();
        assert!(refused(good.clone(), 50).contains("table of 97 rows"));
        assert!(refused(good[..good.len() - 16].to_vec(), 97).contains("truncated"));
        assert!(refused(b"not a map".to_vec(), 97).contains("not a Narsil id map"));
        // A row past the table.
        let mut bad = good.clone();
        let first = (0..)
            .map(|s| HEADER_BYTES + s * SLOT_BYTES)
            .find(|&at| bad[at + 8..at + 16] != [0xff; 8])
            .unwrap();
        bad[first + 8..first + 16].copy_from_slice(&500u64.to_le_bytes());
        assert!(refused(bad, 97).contains("past the table's 97 rows"));
        // An entry moved where its lookup cannot reach it.
        let mut bad = good.clone();
        let entry = bad[first..first + 16].to_vec();
        bad[first..first + 16]
            .copy_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]);
        let empty = (0..)
            .map(|s| HEADER_BYTES + s * SLOT_BYTES)
            .find(|&at| at > first + 64 && bad[at + 8..at + 16] == [0xff; 8] && bad[at - 8..at] == [0xff; 8])
            .unwrap();
        bad[empty..empty + 16].copy_from_slice(&entry);
        let error = refused(bad, 97);
        assert!(error.contains("does not reach") || error.contains("order"), "{error}");
        // Writers refuse a raw id twice and rows past the table.
        assert!(build(&[(5, 1), (5, 2)], 97).unwrap_err().to_string().contains("twice"));
        assert!(build(&[(5, 100)], 97).unwrap_err().to_string().contains("past the table"));
    }

    #[test]
    fn a_mapped_file_is_hashed_as_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.idmap");
        let bytes = build(&pairs(10), 97).unwrap();
        std::fs::write(&path, &bytes).unwrap();
        let (map, sha) = IdMap::open(&path, 97).unwrap();
        assert_eq!(sha, hex(Sha256::digest(&bytes)));
        assert_eq!(map.bytes(), bytes.len() as u64);
    }
}
