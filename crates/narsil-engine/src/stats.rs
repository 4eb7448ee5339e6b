//! Counters the engine keeps about its own work, readable at any time.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Live counters, shared by the collector and the lanes.
#[derive(Debug, Default)]
pub struct Stats {
    pub(crate) forwards: AtomicU64,
    pub(crate) rows_computed: AtomicU64,
    pub(crate) requests_computed: AtomicU64,
    pub(crate) requests_abandoned: AtomicU64,
    pub(crate) backend_errors: AtomicU64,
    pub(crate) busy_lanes: AtomicUsize,
}

/// A copy of the counters at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StatsSnapshot {
    /// Forward passes run (warm-up excluded).
    pub forwards: u64,
    /// Rows those forwards computed.
    pub rows_computed: u64,
    /// Requests those forwards computed.
    pub requests_computed: u64,
    /// Requests dropped before assembly: cancelled or past their deadline.
    pub requests_abandoned: u64,
    /// Forwards that failed or panicked.
    pub backend_errors: u64,
    /// Lanes running a forward right now.
    pub busy_lanes: usize,
    /// Requests admitted and not yet started.
    pub queued_requests: usize,
}

impl Stats {
    pub(crate) fn snapshot(&self, queued_requests: usize) -> StatsSnapshot {
        StatsSnapshot {
            forwards: self.forwards.load(Ordering::Relaxed),
            rows_computed: self.rows_computed.load(Ordering::Relaxed),
            requests_computed: self.requests_computed.load(Ordering::Relaxed),
            requests_abandoned: self.requests_abandoned.load(Ordering::Relaxed),
            backend_errors: self.backend_errors.load(Ordering::Relaxed),
            busy_lanes: self.busy_lanes.load(Ordering::Relaxed),
            queued_requests,
        }
    }
}
