//! Raw ids pushed to a mapped table while it serves (`narsil tables
//! push-ids`, `POST /v1/models/{model}/tables/{table}/ids`), each with its
//! row: an overlay on the table's id map, for stores that hold their rows
//! in this process (`memory`, `mmap`).
//!
//! The overlay is a list of immutable segments ([`PushedIds`]), oldest
//! first: a push adds a segment of its ids (raw id -> its place `k` among
//! the pushed ids, and its rows), and the newest segments are merged
//! whenever the older of the last two holds no more ids than the newer
//! (a binary counter: at most `log2(pushes) + 1` segments, each id's index
//! entry copied about `log2(pushes)` times in all, its row never), or
//! there are more than [`MAX_SEGMENTS`]. A push copies the list of
//! segments (a few `Arc`s) and the segments it merges, never the whole
//! index: 10M ids pushed in bodies of 47,000 copy about 8 index entries
//! each, not the index once per push.
//!
//! The new list is swapped in whole under a write lock held for the swap
//! only. A batch takes one snapshot of it per table ([`Overlay::snapshot`])
//! and maps, fetches and pools through that snapshot alone, so a batch sees
//! all of a push or none of it, and a row is complete before any lookup can
//! reach it: no torn rows, no half-applied push. A snapshot never changes:
//! merges build new segments and leave the old ones to the snapshots that
//! hold them.
//!
//! How a push is checked and refused is `push.rs`'s.
//!
//! A pushed id's row is a *virtual row* `rows + k` of its table (`k`: its
//! place among the pushed ids, kept through merges): it deduplicates,
//! range-checks and pools as any row, read from the snapshot
//! ([`PushedIds::row`]).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use crate::id_map::fmix64;
use crate::schema::Storage;

/// Most segments a table's pushed ids are kept in: past it the newest two
/// are merged whatever their sizes (a lookup of an id no push holds probes
/// every segment).
pub(super) const MAX_SEGMENTS: usize = 12;

/// Hashes a raw id with MurmurHash3's finalizer (one multiply-xor chain; the
/// ids are the operator's, not a client's).
#[derive(Default)]
pub(super) struct FmixHasher(u64);

impl Hasher for FmixHasher {
    fn finish(&self) -> u64 {
        fmix64(self.0)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) ^ u64::from(b);
        }
    }
    fn write_i64(&mut self, raw: i64) {
        self.0 = raw as u64;
    }
}

pub(super) type RawIds = HashMap<i64, u32, BuildHasherDefault<FmixHasher>>;

/// The ids of one push, or of adjacent pushes merged: places `first ..
/// first + len`. Never changed once built.
struct Segment {
    first: u32,
    len: u32,
    /// Raw id -> its place `k`.
    ids: RawIds,
    /// The rows, a part per push: `(k of its first row, its rows)`.
    parts: Vec<(u32, Arc<[u8]>)>,
}

impl Segment {
    /// `older` and `newer` (adjacent) as one: the larger index copied and
    /// the smaller's entries added, the rows shared.
    fn merged(older: &Segment, newer: &Segment) -> Segment {
        let (large, small) = if older.ids.len() >= newer.ids.len() { (older, newer) } else { (newer, older) };
        let mut ids = large.ids.clone();
        ids.reserve(small.ids.len());
        ids.extend(small.ids.iter().map(|(&raw, &k)| (raw, k)));
        let parts = older.parts.iter().chain(&newer.parts).cloned().collect();
        Segment { first: older.first, len: older.len + newer.len, ids, parts }
    }
}

/// One table's pushed ids and their rows, as one snapshot: never changed
/// once built.
pub(super) struct PushedIds {
    /// Oldest first; their places are `0..len`, in order.
    segments: Vec<Arc<Segment>>,
    len: u32,
    row_bytes: usize,
}

impl PushedIds {
    fn empty(row_bytes: usize) -> Self {
        Self { segments: Vec::new(), len: 0, row_bytes }
    }

    /// Ids pushed.
    pub(super) fn len(&self) -> u64 {
        u64::from(self.len)
    }

    /// The place of `raw` among the pushed ids, if pushed.
    #[inline]
    pub(super) fn get(&self, raw: i64) -> Option<u32> {
        // Newest first: a segment holds each id once, so any order finds it.
        self.segments.iter().rev().find_map(|segment| segment.ids.get(&raw).copied())
    }

    /// The row of pushed id `k`.
    pub(super) fn row(&self, k: u32) -> &[u8] {
        let segment = &self.segments[self.segments.partition_point(|s| s.first <= k) - 1];
        let part = segment.parts.partition_point(|&(first, _)| first <= k) - 1;
        let (first, rows) = &segment.parts[part];
        let at = (k - first) as usize * self.row_bytes;
        &rows[at..at + self.row_bytes]
    }

    /// Segments the ids are kept in.
    #[cfg(test)]
    pub(super) fn segments(&self) -> usize {
        self.segments.len()
    }

    /// A snapshot holding these ids and `raws` (new, distinct) with `rows`
    /// (theirs, in order): a segment added, the newest merged as the
    /// module says, the other segments and every row shared.
    pub(super) fn with(&self, raws: &[i64], rows: Vec<u8>) -> Self {
        debug_assert_eq!(rows.len(), raws.len() * self.row_bytes);
        let mut ids = RawIds::default();
        ids.reserve(raws.len());
        for (i, &raw) in raws.iter().enumerate() {
            ids.insert(raw, self.len + i as u32);
        }
        let added =
            Segment { first: self.len, len: raws.len() as u32, ids, parts: vec![(self.len, rows.into())] };
        let mut segments = self.segments.clone();
        segments.push(Arc::new(added));
        while let [.., older, newer] = segments.as_slice() {
            if older.len > newer.len && segments.len() <= MAX_SEGMENTS {
                break;
            }
            let merged = Segment::merged(older, newer);
            segments.truncate(segments.len() - 2);
            segments.push(Arc::new(merged));
        }
        Self { segments, len: self.len + raws.len() as u32, row_bytes: self.row_bytes }
    }
}

/// A table's overlay: the current snapshot, swapped whole by each push.
pub(super) struct Overlay {
    current: RwLock<Arc<PushedIds>>,
    /// Whether any id was pushed: until then a batch takes no snapshot.
    held: AtomicBool,
    /// One push at a time (each builds on the last).
    pushing: Mutex<()>,
}

impl Overlay {
    pub(super) fn new(row_bytes: usize) -> Self {
        Self {
            current: RwLock::new(Arc::new(PushedIds::empty(row_bytes))),
            held: AtomicBool::new(false),
            pushing: Mutex::new(()),
        }
    }

    /// The current pushed ids; none while nothing was ever pushed (no lock
    /// taken then).
    #[inline]
    pub(super) fn snapshot(&self) -> Option<Arc<PushedIds>> {
        if !self.held.load(Ordering::Acquire) {
            return None;
        }
        Some(Arc::clone(&self.current.read().unwrap_or_else(|e| e.into_inner())))
    }

    /// Ids pushed so far.
    pub(super) fn len(&self) -> u64 {
        self.current.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Runs `push` with the current pushed ids, one push at a time, and
    /// swaps in the snapshot it builds (if any).
    pub(super) fn push<T, E>(
        &self,
        push: impl FnOnce(&PushedIds) -> Result<(T, Option<PushedIds>), E>,
    ) -> Result<T, E> {
        let _one_at_a_time = self.pushing.lock().unwrap_or_else(|e| e.into_inner());
        let current = Arc::clone(&self.current.read().unwrap_or_else(|e| e.into_inner()));
        let (answer, next) = push(&current)?;
        if let Some(next) = next {
            let next = Arc::new(next);
            *self.current.write().unwrap_or_else(|e| e.into_inner()) = next;
            self.held.store(true, Ordering::Release);
        }
        Ok(answer)
    }
}

/// Why `row` cannot be a row of a table stored as `storage`, if it cannot:
/// its scale, bias or values are not finite numbers.
pub(super) fn invalid_row(storage: Storage, row: &[u8]) -> Option<&'static str> {
    match storage {
        Storage::Int8Rowwise => {
            let half = |at: usize| u16::from_le_bytes([row[at], row[at + 1]]);
            // An fp16 whose exponent bits are all ones: infinite or NaN.
            let finite = |h: u16| h & 0x7c00 != 0x7c00;
            (!(finite(half(0)) && finite(half(2)))).then_some("its fp16 scale or bias is not a finite number")
        }
        Storage::Fp32 => row
            .chunks_exact(4)
            .any(|v| !f32::from_le_bytes(v.try_into().expect("4 bytes")).is_finite())
            .then_some("a value is not a finite number"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pushes `raws` to `overlay`, row bytes `4`: raw id `r`'s row is
    /// `row_of(r)`.
    fn push(overlay: &Overlay, raws: &[i64]) {
        overlay
            .push(|current| {
                let rows: Vec<u8> = raws.iter().flat_map(|&r| row_of(r)).collect();
                Ok::<_, ()>(((), Some(current.with(raws, rows))))
            })
            .unwrap()
    }

    fn row_of(raw: i64) -> [u8; 4] {
        (raw as i32).wrapping_mul(2_654_435_761u32 as i32).to_le_bytes()
    }

    #[test]
    fn pushes_share_earlier_rows_and_a_snapshot_never_changes() {
        let overlay = Overlay::new(4);
        assert!(overlay.snapshot().is_none());
        push(&overlay, &[10, -3]);
        let first = overlay.snapshot().unwrap();
        push(&overlay, &[i64::MIN]);
        let second = overlay.snapshot().unwrap();
        assert_eq!((first.len(), second.len(), overlay.len()), (2, 3, 3));
        assert_eq!((first.get(-3), first.get(i64::MIN)), (Some(1), None));
        assert_eq!(second.get(i64::MIN), Some(2));
        assert_eq!(first.row(1), row_of(-3));
        assert_eq!(second.row(1), row_of(-3));
        assert_eq!(second.row(2), row_of(i64::MIN));
        let rows = |p: &PushedIds| -> Vec<*const u8> {
            p.segments.iter().flat_map(|s| s.parts.iter().map(|(_, rows)| rows.as_ptr())).collect()
        };
        assert_eq!(rows(&first)[0], rows(&second)[0], "rows shared, not copied");
    }

    #[test]
    fn a_snapshot_taken_before_a_push_never_sees_its_ids_even_once_segments_merge() {
        let overlay = Overlay::new(4);
        // Pushes of 1, 2, 3, ... ids: segments merge as they go.
        let (mut next, mut snapshots) = (0i64, Vec::new());
        for size in 1..=40 {
            let raws: Vec<i64> = (next..next + size).map(|n| n * 7919 - 500_000).collect();
            push(&overlay, &raws);
            next += size;
            snapshots.push((next, overlay.snapshot().unwrap()));
        }
        let raw = |n: i64| n * 7919 - 500_000;
        for (held, snapshot) in &snapshots {
            assert_eq!(snapshot.len(), *held as u64);
            // Every id pushed before it, at its place, with its row.
            for n in 0..*held {
                let k = snapshot.get(raw(n)).unwrap_or_else(|| panic!("id {n} of {held}"));
                assert_eq!(k, n as u32);
                assert_eq!(snapshot.row(k), row_of(raw(n)));
            }
            // No id of a later push.
            for n in *held..next {
                assert_eq!(snapshot.get(raw(n)), None, "snapshot of {held} ids sees id {n}");
            }
        }
        let last = &snapshots.last().unwrap().1;
        assert!(last.segments() <= 11, "{} segments for 40 pushes", last.segments());
    }

    #[test]
    fn many_small_pushes_are_kept_in_one_segment_per_bit_of_their_count() {
        let overlay = Overlay::new(4);
        let pushes = 5000;
        for n in 0..pushes {
            push(&overlay, &[n]);
        }
        let snapshot = overlay.snapshot().unwrap();
        // A binary counter: one segment per bit of 5000 (1001110001000).
        assert_eq!(snapshot.segments(), 5000u32.count_ones() as usize);
        assert!(snapshot.segments() <= MAX_SEGMENTS);
        assert_eq!(snapshot.get(4999), Some(4999));
        assert_eq!(snapshot.row(77), row_of(77));
    }

    #[test]
    fn rows_that_are_not_numbers_are_named() {
        let mut row = vec![0u8; 16];
        row[1] = 0x20;
        assert_eq!(invalid_row(Storage::Int8Rowwise, &row), None);
        row[3] = 0x7c; // bias +inf
        assert!(invalid_row(Storage::Int8Rowwise, &row).is_some());
        let floats: Vec<u8> = [1.0f32, f32::NAN].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert!(invalid_row(Storage::Fp32, &floats).is_some());
        assert_eq!(invalid_row(Storage::Fp32, &floats[..4]), None);
    }
}
