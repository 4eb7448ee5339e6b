//! Raw ids pushed to a mapped table while it serves (`narsil tables
//! push-ids`, `POST /v1/models/{model}/tables/{table}/ids`), each with its
//! row: an overlay on the table's id map, for stores that hold their rows
//! in this process (`memory`, `mmap`).
//!
//! The overlay is copy-on-write: a push builds a new [`PushedIds`] (the
//! old one's ids and the new ones; the rows of earlier pushes are shared,
//! not copied) and swaps it in whole under a write lock held for the swap
//! only. A batch takes one snapshot of it per table ([`Overlay::snapshot`])
//! and maps, fetches and pools through that snapshot alone, so a batch sees
//! all of a push or none of it, and a row is complete before any lookup can
//! reach it: no torn rows, no half-applied push.
//!
//! How a push is checked and refused is `push.rs`'s.
//!
//! A pushed id's row is a *virtual row* `rows + k` of its table (`k`: its
//! place among the pushed ids): it deduplicates, range-checks and pools as
//! any row, read from the snapshot ([`PushedIds::row`]).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use crate::id_map::fmix64;
use crate::schema::Storage;

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

/// One table's pushed ids and their rows, as one snapshot: never changed
/// once built.
pub(super) struct PushedIds {
    /// Raw id -> its place `k` among the pushed ids.
    ids: RawIds,
    /// The rows, a part per push: `(k of its first row, its rows)`.
    parts: Vec<(u32, Arc<[u8]>)>,
    len: u32,
    row_bytes: usize,
}

impl PushedIds {
    fn empty(row_bytes: usize) -> Self {
        Self { ids: RawIds::default(), parts: Vec::new(), len: 0, row_bytes }
    }

    /// Ids pushed.
    pub(super) fn len(&self) -> u64 {
        u64::from(self.len)
    }

    /// The place of `raw` among the pushed ids, if pushed.
    #[inline]
    pub(super) fn get(&self, raw: i64) -> Option<u32> {
        self.ids.get(&raw).copied()
    }

    /// The row of pushed id `k`.
    pub(super) fn row(&self, k: u32) -> &[u8] {
        let part = self.parts.partition_point(|&(first, _)| first <= k) - 1;
        let (first, rows) = &self.parts[part];
        let at = (k - first) as usize * self.row_bytes;
        &rows[at..at + self.row_bytes]
    }

    /// A snapshot holding these ids and `raws` (new, distinct) with `rows`
    /// (theirs, in order): the earlier pushes' rows shared.
    pub(super) fn with(&self, raws: &[i64], rows: Vec<u8>) -> Self {
        debug_assert_eq!(rows.len(), raws.len() * self.row_bytes);
        let mut ids = self.ids.clone();
        ids.reserve(raws.len());
        for (i, &raw) in raws.iter().enumerate() {
            ids.insert(raw, self.len + i as u32);
        }
        let mut parts = self.parts.clone();
        parts.push((self.len, rows.into()));
        Self { ids, parts, len: self.len + raws.len() as u32, row_bytes: self.row_bytes }
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

    #[test]
    fn pushes_share_earlier_rows_and_a_snapshot_never_changes() {
        let overlay = Overlay::new(4);
        assert!(overlay.snapshot().is_none());
        let push = |raws: &[i64], first: u8| {
            overlay
                .push(|current| {
                    let rows: Vec<u8> = (0..raws.len() * 4).map(|i| first + i as u8).collect();
                    Ok::<_, ()>(((), Some(current.with(raws, rows))))
                })
                .unwrap()
        };
        push(&[10, -3], 0);
        let first = overlay.snapshot().unwrap();
        push(&[i64::MIN], 100);
        let second = overlay.snapshot().unwrap();
        assert_eq!((first.len(), second.len(), overlay.len()), (2, 3, 3));
        assert_eq!((first.get(-3), first.get(i64::MIN)), (Some(1), None));
        assert_eq!(second.get(i64::MIN), Some(2));
        assert_eq!(first.row(1), &[4, 5, 6, 7]);
        assert_eq!(second.row(1), &[4, 5, 6, 7]);
        assert_eq!(second.row(2), &[100, 101, 102, 103]);
        assert!(Arc::ptr_eq(&first.parts[0].1, &second.parts[0].1), "rows shared, not copied");
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
