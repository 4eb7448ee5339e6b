//! Admission control: a request enters a model version's queue only while
//! its queued request and row counts are under their limits; otherwise it
//! is rejected at once, never parked. A [`Permit`] holds the request's place
//! until its forward starts.
//!
//! Memory is bounded by bytes, not rows (a bag may hold any number of ids):
//! that limit is the process-wide [`crate::MemoryBudget`], which a request
//! holds from its decode to the end of its forward. The queue counts the
//! decoded bytes it holds for its gauge; they stay with the request count,
//! released when the last part starts.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::setting::Setting;

/// One of the queue's three limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueLimit {
    /// Requests queued.
    Requests,
    /// Rows (samples) queued.
    Rows,
    /// Request bytes held (decoding, queued or in a forward), process-wide.
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
    requests: AtomicUsize,
    rows: AtomicUsize,
    bytes: AtomicUsize,
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
    pub fn new(max_requests: usize, max_rows: usize) -> Arc<Self> {
        Arc::new(Self {
            max_requests,
            max_rows,
            requests: AtomicUsize::new(0),
            rows: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
        })
    }

    /// Takes a place for a request of `rows` rows (holding `bytes` decoded
    /// bytes, counted, not limited, here), or says which limit is full.
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
        self.bytes.fetch_add(bytes, Ordering::AcqRel);
        Ok(Permit { admission: Arc::clone(self), requests: 1, rows, bytes })
    }

    /// Decoded bytes currently queued.
    pub fn queued_bytes(&self) -> usize {
        self.bytes.load(Ordering::Acquire)
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
        let admission = Admission::new(2, 100);
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
        let admission = Admission::new(10, 100);
        let _a = admission.try_admit(60, 0).unwrap();
        let err = admission.try_admit(50, 0).unwrap_err();
        assert_eq!(err, QueueFull { limit: QueueLimit::Rows, queued: 60, max: 100, needed: 50 });
        assert_eq!(admission.queued_requests(), 1);
        assert_eq!(admission.queued_rows(), 60);
        assert!(admission.try_admit(40, 0).is_ok());
    }

    #[test]
    fn split_permits_free_their_own_rows_and_the_last_frees_the_request() {
        let admission = Admission::new(10, 100);
        let mut whole = admission.try_admit(70, 0).unwrap();
        let first = whole.split_off(30);
        drop(first);
        assert_eq!((admission.queued_requests(), admission.queued_rows()), (1, 40));
        drop(whole);
        assert_eq!((admission.queued_requests(), admission.queued_rows()), (0, 0));
    }

    #[test]
    fn concurrent_admission_never_exceeds_the_limit() {
        let admission = Admission::new(8, 1000);
        let held: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..32).map(|_| s.spawn(|| admission.try_admit(1, 0).ok())).collect();
            handles.into_iter().filter_map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(held.len(), 8);
        assert_eq!(admission.queued_requests(), 8);
    }
}
