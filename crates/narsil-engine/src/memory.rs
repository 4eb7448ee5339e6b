//! The process-wide bound on request memory (`--max-queue-bytes`).
//!
//! Every request holds a [`Lease`] on one [`MemoryBudget`] shared by every
//! protocol and every model version, from the moment its message starts to
//! arrive until its forward has ended:
//!
//! 1. the gRPC layer reserves the most the message can grow to while it is
//!    received and decoded (its encoded size times the protocol's worst
//!    expansion, [`decode_reservation`]) before the message is buffered;
//! 2. once decoded into the engine's types, the lease shrinks to the
//!    request's decoded bytes ([`Lease::resize`]);
//! 3. the lease then stays with the request's rows, in the queue and in its
//!    fused batch, and is returned when the forward that computed it ends.
//!
//! A model with sequences also holds one lease for the working sets its
//! forwards allocate for them ([`crate::working_sets`]): sized for the
//! batches its lanes can run at once, not for each queued request.
//!
//! So decodes in flight, queued requests and batches being computed never
//! hold more than the budget between them; a reservation that does not fit
//! is refused at once (RESOURCE_EXHAUSTED), never parked.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use crate::admission::{QueueFull, QueueLimit};

/// A byte budget shared by every request of the process. Clones share it.
#[derive(Debug, Clone)]
pub struct MemoryBudget(Arc<Budget>);

#[derive(Debug)]
struct Budget {
    max: usize,
    used: AtomicUsize,
    peak: AtomicUsize,
}

impl MemoryBudget {
    /// A budget of `max` bytes.
    pub fn new(max: usize) -> Self {
        Self(Arc::new(Budget { max, used: AtomicUsize::new(0), peak: AtomicUsize::new(0) }))
    }

    /// The most bytes leases may hold together.
    pub fn max(&self) -> usize {
        self.0.max
    }

    /// Bytes held by leases now.
    pub fn used(&self) -> usize {
        self.0.used.load(Ordering::Acquire)
    }

    /// The most bytes held at once so far.
    pub fn peak(&self) -> usize {
        self.0.peak.load(Ordering::Acquire)
    }

    /// A lease on `bytes`, or the refusal naming what is held.
    pub fn try_reserve(&self, bytes: usize) -> Result<Lease, QueueFull> {
        self.take(bytes)?;
        Ok(Lease { budget: self.clone(), bytes })
    }

    fn take(&self, bytes: usize) -> Result<(), QueueFull> {
        let budget = &self.0;
        let before = budget
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes).filter(|&total| total <= budget.max)
            })
            .map_err(|used| QueueFull {
                limit: QueueLimit::Bytes,
                queued: used,
                max: budget.max,
                needed: bytes,
            })?;
        // Written only when it grows: every request reserves, and a write
        // each time would move the line between the cores that do.
        let held = before + bytes;
        if held > budget.peak.load(Ordering::Relaxed) {
            budget.peak.fetch_max(held, Ordering::AcqRel);
        }
        Ok(())
    }

    fn give_back(&self, bytes: usize) {
        self.0.used.fetch_sub(bytes, Ordering::AcqRel);
    }
}

/// Bytes held on a [`MemoryBudget`]; returned when dropped.
#[derive(Debug)]
pub struct Lease {
    budget: MemoryBudget,
    bytes: usize,
}

impl Lease {
    /// The bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Holds `bytes` instead: shrinking always succeeds; growing takes the
    /// difference from the budget, or fails leaving the lease as it was.
    pub fn resize(&mut self, bytes: usize) -> Result<(), QueueFull> {
        if bytes > self.bytes {
            self.budget.take(bytes - self.bytes)?;
        } else {
            self.budget.give_back(self.bytes - bytes);
        }
        self.bytes = bytes;
        Ok(())
    }

    /// Moves `bytes` of this lease (at most all of it) into a lease of its
    /// own, for one part of a split request.
    pub fn split_off(&mut self, bytes: usize) -> Lease {
        let bytes = bytes.min(self.bytes);
        self.bytes -= bytes;
        Lease { budget: self.budget.clone(), bytes }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.budget.give_back(self.bytes);
    }
}

/// The most memory an `encoded`-byte message of a protocol whose decoded
/// values can be `expansion` times their encoded size (see each protocol's
/// decoder) takes while it is received and decoded: its bytes as received,
/// plus its decoded values with the growth slack of a vector built value by
/// value (a doubling vector copies into one twice as large: up to 1.5 times
/// its final size is touched at once). Never more than the whole budget: a
/// message larger than that is still read when nothing else is in flight,
/// and refused by the queue limit if it decodes too large.
pub fn decode_reservation(encoded: usize, expansion: usize, budget: &MemoryBudget) -> usize {
    let decoded = encoded.saturating_mul(expansion);
    encoded.saturating_add(decoded.saturating_add(decoded / 2)).min(budget.max())
}

/// Batches at least this large hand their memory back to the OS once
/// their forward is over ([`on_freed_memory`]).
pub const LARGE_BATCH_BYTES: usize = 16 << 20;

static RELEASE: OnceLock<fn()> = OnceLock::new();

/// Sets how freed memory is handed back to the OS: after a batch of at least
/// [`LARGE_BATCH_BYTES`], and after a model version has stopped
/// ([`release_freed_memory`]). The process's allocators know how: `narsil`
/// asks mimalloc to purge the pages it keeps for reuse and glibc's malloc
/// (libtorch's) to return its free pages. Set once; later calls are
/// ignored.
pub fn on_freed_memory(release: fn()) {
    let _ = RELEASE.set(release);
}

/// Hands freed memory back to the OS, as [`on_freed_memory`] set (nothing
/// when it was not set).
pub fn release_freed_memory() {
    if let Some(release) = RELEASE.get() {
        release();
    }
}

/// Called once a batch of `bytes` has been freed.
pub(crate) fn freed_batch(bytes: usize) {
    if bytes >= LARGE_BATCH_BYTES {
        release_freed_memory();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reservation_that_does_not_fit_is_refused_and_leaves_nothing_held() {
        let budget = MemoryBudget::new(1000);
        let held = budget.try_reserve(800).unwrap();
        let refused = budget.try_reserve(300).unwrap_err();
        assert_eq!(refused, QueueFull { limit: QueueLimit::Bytes, queued: 800, max: 1000, needed: 300 });
        assert_eq!(budget.used(), 800);
        drop(held);
        assert_eq!(budget.used(), 0);
        assert_eq!(budget.peak(), 800);
    }

    #[test]
    fn a_lease_shrinks_to_what_was_decoded_and_grows_only_within_the_budget() {
        let budget = MemoryBudget::new(1000);
        let mut lease = budget.try_reserve(900).unwrap();
        lease.resize(100).unwrap();
        assert_eq!(budget.used(), 100);
        let other = budget.try_reserve(800).unwrap();
        assert!(lease.resize(300).is_err(), "only 100 bytes are left");
        assert_eq!((lease.bytes(), budget.used()), (100, 900));
        drop(other);
        lease.resize(200).unwrap();
        assert_eq!(budget.used(), 200);
        drop(lease);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn split_leases_return_their_own_bytes() {
        let budget = MemoryBudget::new(1000);
        let mut whole = budget.try_reserve(700).unwrap();
        let part = whole.split_off(300);
        assert_eq!((whole.bytes(), part.bytes()), (400, 300));
        drop(part);
        assert_eq!(budget.used(), 400);
        drop(whole);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn concurrent_reservations_never_exceed_the_budget() {
        let budget = MemoryBudget::new(8);
        let held: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..32).map(|_| s.spawn(|| budget.try_reserve(1).ok())).collect();
            handles.into_iter().filter_map(|h| h.join().unwrap()).collect()
        });
        assert_eq!((held.len(), budget.used()), (8, 8));
    }

    #[test]
    fn a_decode_reservation_covers_the_message_and_its_growth_up_to_the_budget() {
        let budget = MemoryBudget::new(1 << 30);
        assert_eq!(decode_reservation(1000, 8, &budget), 1000 + 8000 + 4000);
        assert_eq!(decode_reservation(1 << 30, 8, &budget), 1 << 30);
    }
}
