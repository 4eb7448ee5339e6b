//! Admission control: a request enters the queue only while the queued
//! request count, row count and decoded bytes are all under their limits;
//! otherwise it is rejected at once, never parked. A [`Permit`] holds the
//! request's place until its forward starts.
//!
//! Bytes bound memory: rows alone do not, since a bag may hold any number of
//! ids (one 1-sample request can carry millions). A request's bytes stay
//! with its request count, released when its last part starts.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::config::Setting;

/// One of the queue's three limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueLimit {
    /// Requests queued.
    Requests,
    /// Rows (samples) queued.
    Rows,
    /// Decoded bytes queued.
    Bytes,
}

impl QueueLimit {
    /// The engine setting that sets this limit.
    pub fn setting(self) -> Setting {
        match self {
            Self::Requests => Setting::MaxQueueRequests,
            Self::Rows => Setting::MaxQueueRows,
            Self::Bytes => Setting::MaxQueueBytes,
        }
    }

    /// What the limit counts, as a plural noun.
    pub fn unit(self) -> &'static str {
        match self {
            Self::Requests => "requests",
            Self::Rows => "rows",
            Self::Bytes => "decoded bytes",
        }
    }
}

/// A request refused because a queue limit is reached. The frontend names
/// the setting behind `limit` ([`QueueLimit::setting`]) its own way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("queue holds {queued} of at most {max} {}; request has {needed}", .limit.unit())]
pub struct QueueFull {
    /// The limit that refused.
    pub limit: QueueLimit,
    /// What the queue held.
    pub queued: usize,
    /// The limit's value.
    pub max: usize,
    /// What the request needed (1 request, its rows or its bytes).
    pub needed: usize,
}

/// Queue limits and the current occupancy.
#[derive(Debug)]
pub struct Admission {
    max_requests: usize,
    max_rows: usize,
    max_bytes: usize,
    requests: AtomicUsize,
    rows: AtomicUsize,
    bytes: AtomicUsize,
    peak_bytes: AtomicUsize,
}

/// A request's place in the queue; dropping it frees the place.
#[derive(Debug)]
pub struct Permit {
    admission: Arc<Admission>,
    requests: usize,
    rows: usize,
    bytes: usize,
}

impl Permit {
    /// Splits off `rows` of this permit's rows into a permit of their own
    /// (for one part of a split request); the request count stays here.
    pub fn split_off(&mut self, rows: usize) -> Permit {
        let rows = rows.min(self.rows);
        self.rows -= rows;
        Permit { admission: Arc::clone(&self.admission), requests: 0, rows, bytes: 0 }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.admission.requests.fetch_sub(self.requests, Ordering::AcqRel);
        self.admission.rows.fetch_sub(self.rows, Ordering::AcqRel);
        self.admission.bytes.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

fn reserve(counter: &AtomicUsize, amount: usize, limit: usize) -> bool {
    counter
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |current| {
            (current + amount <= limit).then_some(current + amount)
        })
        .is_ok()
}

impl Admission {
    /// An empty queue with these limits.
    pub fn new(max_requests: usize, max_rows: usize, max_bytes: usize) -> Arc<Self> {
        Arc::new(Self {
            max_requests,
            max_rows,
            max_bytes,
            requests: AtomicUsize::new(0),
            rows: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
            peak_bytes: AtomicUsize::new(0),
        })
    }

    /// Takes a place for a request of `rows` rows and `bytes` decoded bytes,
    /// or says which limit is full.
    pub fn try_admit(self: &Arc<Self>, rows: usize, bytes: usize) -> Result<Permit, QueueFull> {
        let full = |limit, counter: &AtomicUsize, max, needed| QueueFull {
            limit,
            queued: counter.load(Ordering::Acquire),
            max,
            needed,
        };
        if !reserve(&self.requests, 1, self.max_requests) {
            return Err(full(QueueLimit::Requests, &self.requests, self.max_requests, 1));
        }
        if !reserve(&self.rows, rows, self.max_rows) {
            self.requests.fetch_sub(1, Ordering::AcqRel);
            return Err(full(QueueLimit::Rows, &self.rows, self.max_rows, rows));
        }
        if !reserve(&self.bytes, bytes, self.max_bytes) {
            self.requests.fetch_sub(1, Ordering::AcqRel);
            self.rows.fetch_sub(rows, Ordering::AcqRel);
            return Err(full(QueueLimit::Bytes, &self.bytes, self.max_bytes, bytes));
        }
        self.peak_bytes.fetch_max(self.bytes.load(Ordering::Acquire), Ordering::AcqRel);
        Ok(Permit { admission: Arc::clone(self), requests: 1, rows, bytes })
    }

    /// Decoded bytes currently queued.
    pub fn queued_bytes(&self) -> usize {
        self.bytes.load(Ordering::Acquire)
    }

    /// The most decoded bytes queued at once so far.
    pub fn peak_bytes(&self) -> usize {
        self.peak_bytes.load(Ordering::Acquire)
    }

    /// The most decoded bytes the queue may hold.
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// Requests currently queued.
    pub fn queued_requests(&self) -> usize {
        self.requests.load(Ordering::Acquire)
    }

    /// Rows currently queued.
    pub fn queued_rows(&self) -> usize {
        self.rows.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_limit_rejects_and_frees_on_drop() {
        let admission = Admission::new(2, 100, usize::MAX);
        let a = admission.try_admit(1, 0).unwrap();
        let _b = admission.try_admit(1, 0).unwrap();
        let err = admission.try_admit(1, 0).unwrap_err();
        assert_eq!(err, QueueFull { limit: QueueLimit::Requests, queued: 2, max: 2, needed: 1 });
        assert_eq!(err.to_string(), "queue holds 2 of at most 2 requests; request has 1");
        drop(a);
        assert!(admission.try_admit(1, 0).is_ok());
    }

    #[test]
    fn row_limit_rejects_without_leaking_a_request_slot() {
        let admission = Admission::new(10, 100, usize::MAX);
        let _a = admission.try_admit(60, 0).unwrap();
        let err = admission.try_admit(50, 0).unwrap_err();
        assert_eq!(err, QueueFull { limit: QueueLimit::Rows, queued: 60, max: 100, needed: 50 });
        assert_eq!(admission.queued_requests(), 1);
        assert_eq!(admission.queued_rows(), 60);
        assert!(admission.try_admit(40, 0).is_ok());
    }

    #[test]
    fn byte_limit_rejects_without_leaking_rows_or_a_request_slot_and_frees_on_drop() {
        let admission = Admission::new(10, 100, 1000);
        let a = admission.try_admit(1, 800).unwrap();
        let err = admission.try_admit(1, 300).unwrap_err();
        assert_eq!(err, QueueFull { limit: QueueLimit::Bytes, queued: 800, max: 1000, needed: 300 });
        assert_eq!((admission.queued_requests(), admission.queued_rows()), (1, 1));
        let mut b = admission.try_admit(4, 200).unwrap();
        drop(b.split_off(2));
        assert!(admission.try_admit(1, 1).is_err(), "bytes stay with the request until its last part");
        drop(b);
        drop(a);
        assert!(admission.try_admit(1, 1000).is_ok());
    }

    #[test]
    fn split_permits_free_their_own_rows_and_the_last_frees_the_request() {
        let admission = Admission::new(10, 100, usize::MAX);
        let mut whole = admission.try_admit(70, 0).unwrap();
        let first = whole.split_off(30);
        drop(first);
        assert_eq!((admission.queued_requests(), admission.queued_rows()), (1, 40));
        drop(whole);
        assert_eq!((admission.queued_requests(), admission.queued_rows()), (0, 0));
    }

    #[test]
    fn concurrent_admission_never_exceeds_the_limit() {
        let admission = Admission::new(8, 1000, usize::MAX);
        let held: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..32).map(|_| s.spawn(|| admission.try_admit(1, 0).ok())).collect();
            handles.into_iter().filter_map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(held.len(), 8);
        assert_eq!(admission.queued_requests(), 8);
    }
}
