//! A minimal perfect hash of a set of raw ids: each of the `n` ids it was
//! built from gets its own index in `0..n`, from a few bits per id that
//! stay in the caches (any other id gets some index too: the caller
//! checks). What lets a mapped table keep each id's row at the id's index
//! ([`super::slotted`]), so that a lookup's only miss is the row's own.
//!
//! PTHash's construction (Pibiri and Trani, 2021), in its simplest form:
//! an id hashes to one of `n / 4` buckets (60% of ids to the first 30%, so
//! that big buckets are placed while the slots are empty), each bucket
//! stores a 16-bit *pilot*, and an id's slot is a hash of its own hash and
//! its bucket's pilot over `n / 0.98` slots. Buckets are placed biggest
//! first, each with the first pilot that sends all its ids to free slots.
//! The 2% of slots past `n` that ids landed in are remapped to the free
//! slots below `n` through a small table. 4 bits per id (0.5 MB for 1M
//! ids) plus 4 bytes per remapped slot; a lookup is three multiplies, one
//! pilot read and rarely one remap read.
//!
//! One set of ids given in one order always gives the same hash (the seeds
//! are fixed): two model versions with the same map lay their tables out
//! alike.

use super::fmix64;
use crate::stores::local::huge_pages::{huge_pages_wanted, HugePageRows, HUGE_PAGE};

/// Ids per bucket, on average.
const IDS_PER_BUCKET: u64 = 4;
/// Slots per id: ids fill 98% of the slots before the remap.
const LOAD: f64 = 0.98;
/// Ids sent to the first [`DENSE_BUCKETS`] of the buckets: 60%.
const DENSE_IDS: u64 = (u64::MAX / 10) * 6;
/// The share of buckets that take [`DENSE_IDS`], in tenths.
const DENSE_BUCKETS: u64 = 3;
/// Seeds tried before giving up (each a fresh construction).
const ATTEMPTS: u64 = 4;
/// Pilots of at least this many bytes go on a huge page of their own: an
/// eighth of one (maps of about 500k ids and more; 1M ids have 0.5 MB).
/// There a lookup's pilot read would touch one of a hundred or more 4 KiB
/// pages, and the page's rounding (at most 1.75 MiB) is small beside the
/// table of as many rows. Smaller pilots sit in a few dozen 4 KiB pages
/// whose TLB entries stay warm: a whole 2 MiB page for them would cost
/// more than it brings.
const PILOTS_WORTH_A_HUGE_PAGE: usize = HUGE_PAGE / 8;

/// `x` scaled into `0..n` (Lemire's multiply-shift).
#[inline(always)]
fn reduce(x: u64, n: u64) -> u64 {
    ((u128::from(x) * u128::from(n)) >> 64) as u64
}

/// The pilots: on the heap, or on a huge page of their own (a lookup's
/// only read besides the row: a page walk would cost as much as the row).
enum Pilots {
    Heap(Vec<u16>),
    Huge(HugePageRows),
}

impl std::fmt::Debug for PerfectHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PerfectHash")
            .field("ids", &self.shape.ids)
            .field("pilots", &self.pilots.len())
            .finish()
    }
}

impl std::ops::Deref for Pilots {
    type Target = [u16];
    fn deref(&self) -> &[u16] {
        match self {
            Self::Heap(pilots) => pilots,
            // SAFETY: the mapping starts on a huge page (aligned for u16),
            // holds `len` initialised bytes (zeroed, then written as the
            // pilots' bytes) and lives as long as `self`.
            Self::Huge(bytes) => unsafe {
                std::slice::from_raw_parts(bytes.as_ptr().cast(), bytes.len() / 2)
            },
        }
    }
}

/// A minimal perfect hash over a set of raw ids (module docs).
pub struct PerfectHash {
    shape: Shape,
    pilots: Pilots,
    /// For each slot from `ids` on that holds an id: the free slot below
    /// `ids` it stands for.
    remap: Vec<u32>,
}

/// What a lookup computes with.
#[derive(Debug, Clone, Copy)]
struct Shape {
    seed: u64,
    ids: u64,
    slots: u64,
    dense_buckets: u64,
    sparse_buckets: u64,
}

impl Shape {
    /// One 128-bit multiply, its halves folded: every bit of the id
    /// reaches both halves of the hash.
    #[inline(always)]
    fn hash(&self, id: i64) -> u64 {
        let product = u128::from(id as u64 ^ self.seed) * u128::from(0x9e37_79b9_7f4a_7c15u64);
        (product as u64) ^ ((product >> 64) as u64)
    }

    /// Without a branch: whether an id is dense is a coin toss.
    #[inline(always)]
    fn bucket(&self, h: u64) -> usize {
        let dense = h < DENSE_IDS;
        let base = if dense { 0 } else { self.dense_buckets };
        let count = if dense { self.dense_buckets } else { self.sparse_buckets };
        (base + reduce(h.rotate_left(32), count)) as usize
    }

    #[inline(always)]
    fn slot(&self, h: u64, pilot: u16) -> u64 {
        // The pilot into the id's hash, multiplied so that every bit of
        // both reaches the high bits `reduce` reads (without it, two ids
        // that differ only in low bits share a slot for every pilot).
        reduce((h ^ u64::from(pilot)).wrapping_mul(0xc4ce_b9fe_1a85_ec53), self.slots)
    }
}

/// A hash's lookups over a stretch of ids: its shape, pilots and remap
/// borrowed once (see [`PerfectHash::lookup`]).
#[derive(Clone, Copy)]
pub struct Lookup<'a> {
    shape: Shape,
    pilots: &'a [u16],
    remap: &'a [u32],
}

impl Lookup<'_> {
    /// `id`'s hash, what [`Self::index_of`] takes.
    #[inline(always)]
    pub fn hash(&self, id: i64) -> u64 {
        self.shape.hash(id)
    }

    /// Asks the CPU for the pilot the id of hash `h` reads (a hint).
    #[inline(always)]
    pub fn prefetch(&self, h: u64) {
        let bucket = self.shape.bucket(h);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch changes no memory and never faults; the
        // address is inside `pilots` (bucket < buckets = its length).
        unsafe {
            std::arch::x86_64::_mm_prefetch(
                self.pilots.as_ptr().add(bucket).cast(),
                std::arch::x86_64::_MM_HINT_T0,
            )
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = bucket;
    }

    /// The index of the id of hash `h`: its own in `0..ids` for an id the
    /// hash was built from, some index in `0..ids` for any other.
    #[inline(always)]
    pub fn index_of(&self, h: u64) -> u64 {
        let s = self.shape.slot(h, self.pilots[self.shape.bucket(h)]);
        if s < self.shape.ids {
            s
        } else {
            u64::from(self.remap[(s - self.shape.ids) as usize])
        }
    }
}

impl PerfectHash {
    /// The hash of `ids` (distinct); `None` when no seed placed every id
    /// (an id given twice, or more ids than `u32` indexes).
    pub fn build(ids: &[i64]) -> Option<Self> {
        let n = ids.len() as u64;
        if n > u64::from(u32::MAX) {
            return None;
        }
        (1..=ATTEMPTS)
            .find_map(|attempt| Self::build_with(ids, fmix64(attempt.wrapping_mul(0x9e37_79b9_7f4a_7c15))))
    }

    fn build_with(ids: &[i64], seed: u64) -> Option<Self> {
        let n = ids.len() as u64;
        let buckets = n.div_ceil(IDS_PER_BUCKET).max(1);
        let slots = ((n as f64 / LOAD).ceil() as u64).max(n).max(1);
        // At least one sparse bucket (one bucket: every id in it).
        let dense_buckets = (buckets * DENSE_BUCKETS).div_ceil(10).min(buckets - 1);
        let hash = Shape { seed, ids: n, slots, dense_buckets, sparse_buckets: buckets - dense_buckets };
        // The ids' hashes grouped by bucket (a counting sort; each id
        // hashed twice rather than its hash kept: a table's layout holds
        // 8 bytes an id less at its peak).
        let mut starts = vec![0usize; buckets as usize + 1];
        for &id in ids {
            starts[hash.bucket(hash.hash(id)) + 1] += 1;
        }
        for b in 0..buckets as usize {
            starts[b + 1] += starts[b];
        }
        let mut grouped = vec![0u64; ids.len()];
        let mut next = starts.clone();
        for &id in ids {
            let h = hash.hash(id);
            let b = hash.bucket(h);
            grouped[next[b]] = h;
            next[b] += 1;
        }
        drop(next);
        // Buckets biggest first.
        let mut order: Vec<u32> = (0..buckets as u32).collect();
        order.sort_by_key(|&b| std::cmp::Reverse(starts[b as usize + 1] - starts[b as usize]));
        let mut taken = vec![0u64; slots.div_ceil(64) as usize];
        let is_taken = |taken: &[u64], s: u64| taken[(s / 64) as usize] >> (s % 64) & 1 == 1;
        let (mut placed, mut pilots) = (Vec::new(), vec![0u16; buckets as usize]);
        for b in order {
            let members = &grouped[starts[b as usize]..starts[b as usize + 1]];
            if members.is_empty() {
                break;
            }
            let pilot = (0..=u16::MAX).find(|&pilot| {
                placed.clear();
                for &h in members {
                    let s = hash.slot(h, pilot);
                    if is_taken(&taken, s) || placed.contains(&s) {
                        return false;
                    }
                    placed.push(s);
                }
                true
            })?;
            for &s in &placed {
                taken[(s / 64) as usize] |= 1 << (s % 64);
            }
            pilots[b as usize] = pilot;
        }
        // Slots from `n` on that hold an id stand for the free slots below.
        let mut free = (0..n).filter(|&s| !is_taken(&taken, s));
        let remap = (n..slots)
            .map(|s| {
                if is_taken(&taken, s) {
                    free.next().expect("one free slot below n per id past it") as u32
                } else {
                    0
                }
            })
            .collect();
        Some(Self { shape: hash, pilots: Pilots::Heap(pilots), remap })
    }

    /// This hash with its pilots on a huge page of their own, where huge
    /// pages are wanted and can be had ([`crate::stores::local::huge_pages`])
    /// and the pilots are worth one ([`PILOTS_WORTH_A_HUGE_PAGE`]: up to
    /// 2 MiB for a few hundred KiB of pilots, and a lookup then takes no
    /// page walk for them); else as it is.
    pub fn onto_huge_pages(mut self) -> Self {
        let worth = |pilots: &[u16]| huge_pages_wanted() && pilots.len() * 2 >= PILOTS_WORTH_A_HUGE_PAGE;
        if let Pilots::Heap(pilots) = &self.pilots {
            if !worth(pilots) {
                return self;
            }
            let bytes: Vec<u8> = pilots.iter().flat_map(|p| p.to_ne_bytes()).collect();
            if let Ok(huge) = HugePageRows::copy_of(&bytes) {
                self.pilots = Pilots::Huge(huge);
            }
        }
        self
    }

    /// Whether its pilots are on a huge page of their own.
    pub fn pilots_on_huge_pages(&self) -> bool {
        matches!(self.pilots, Pilots::Huge(_))
    }

    /// Ids it was built from (its indexes are `0..ids`).
    pub fn ids(&self) -> u64 {
        self.shape.ids
    }

    /// Bytes it holds (its pilots and remap).
    pub fn bytes(&self) -> u64 {
        (self.pilots.len() * 2 + self.remap.len() * 4) as u64
    }

    /// Its lookups (none when it was built from no id).
    #[inline(always)]
    pub fn lookup(&self) -> Option<Lookup<'_>> {
        (self.shape.ids > 0).then(|| Lookup { shape: self.shape, pilots: &self.pilots, remap: &self.remap })
    }

    /// The index of `id` ([`Lookup::index_of`]); none when it was built
    /// from no id.
    pub fn index(&self, id: i64) -> Option<u64> {
        self.lookup().map(|lookup| lookup.index_of(lookup.hash(id)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: u64) -> Vec<i64> {
        let mut ids: Vec<i64> = (0..n).map(|i| (i as i64).wrapping_mul(0x5851_f42d_4c95_7f2d) ^ 7).collect();
        ids.extend([i64::MIN, i64::MAX, -1, 0]);
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    #[test]
    fn every_id_it_was_built_from_gets_its_own_index_below_the_count() {
        for n in [0u64, 1, 2, 3, 17, 1000, 100_000] {
            let ids = ids(n);
            let hash = PerfectHash::build(&ids).unwrap();
            let mut seen = vec![false; ids.len()];
            for &id in &ids {
                let at = hash.index(id).unwrap() as usize;
                assert!(!std::mem::replace(&mut seen[at], true), "{n} ids: index {at} twice");
            }
            assert!(seen.iter().all(|&s| s));
            // Any other id lands below the count too (the caller checks it).
            assert!((1..1000).all(|k| hash.index(k * 31 + 5).is_some_and(|i| i < ids.len() as u64)));
            assert!(hash.bytes() <= ids.len() as u64 * 6 / 10 + 64, "{n}: {} bytes", hash.bytes());
        }
        assert_eq!(PerfectHash::build(&[]).unwrap().index(5), None);
    }

    #[test]
    fn the_same_ids_in_the_same_order_give_the_same_indexes_and_an_id_twice_gives_none() {
        let ids = ids(5000);
        let (a, b) = (PerfectHash::build(&ids).unwrap(), PerfectHash::build(&ids).unwrap());
        assert!(ids.iter().all(|&id| a.index(id) == b.index(id)));
        assert!(PerfectHash::build(&[5, 9, 5]).is_none());
    }

    #[test]
    fn pilots_of_a_small_map_stay_on_the_heap_and_a_large_maps_go_on_a_huge_page_where_wanted() {
        // A few hundred bytes of pilots never take a whole 2 MiB page.
        let small = PerfectHash::build(&ids(1000)).unwrap().onto_huge_pages();
        assert!(!small.pilots_on_huge_pages(), "{} bytes of pilots on a 2 MiB page", small.pilots.len() * 2);
        // A million ids' pilots (~0.5 MB) are worth one, where wanted and had.
        let large = PerfectHash::build(&ids(1 << 20)).unwrap();
        assert!(large.pilots.len() * 2 >= PILOTS_WORTH_A_HUGE_PAGE);
        let before: Vec<Option<u64>> = (0..64).map(|k| large.index(k * 7919)).collect();
        let large = large.onto_huge_pages();
        if huge_pages_wanted() {
            assert!(large.pilots_on_huge_pages(), "anonymous 2 MiB-aligned mappings can always be had");
        }
        let after: Vec<Option<u64>> = (0..64).map(|k| large.index(k * 7919)).collect();
        assert_eq!(before, after, "the same indexes wherever the pilots are");
    }
}
