//! The queued requests the collector's tests share.

use std::sync::Arc;
use std::time::{Duration, Instant};

use narsil_core::RequestSamples;
use tokio::sync::oneshot;

use super::BatchQueue;
use crate::admission::Admission;
use crate::error::EngineError;
use crate::flush::ContinuousBatching;
use crate::job::{Entry, Job, Ticket};
use crate::memory::MemoryBudget;

pub(super) type Rx = oneshot::Receiver<Result<crate::job::Prediction, EngineError>>;

/// A queued request of `b` samples whose values carry `tag`, and its
/// samples.
pub(super) fn entry(
    admission: &Arc<Admission>,
    b: usize,
    tag: i64,
    at: Instant,
) -> (Entry, RequestSamples, Rx) {
    let (reply, rx) = oneshot::channel();
    let request = RequestSamples {
        num_samples: b,
        dense: vec![tag as f32; b],
        lengths: vec![1; b * 2],
        ids: (0..b as i64 * 2).map(|i| tag * 100 + i).collect(),
        ..Default::default()
    };
    let permit = admission.try_admit(b, 0).unwrap();
    let lease = MemoryBudget::new(usize::MAX).try_reserve(0).unwrap();
    let entry = Entry {
        id: 0,
        rows: b,
        tokens: b,
        lease,
        units: Vec::new(),
        working: None,
        reply,
        admitted: at,
        expires: None,
        deadline: None,
        ticket: Ticket::new(),
        permit,
    };
    (entry, request, rx)
}

/// [`BatchQueue::next_due`], the batch made into its job.
pub(super) fn due(q: &mut BatchQueue, now: Instant) -> (Option<Job>, usize) {
    let (batch, removed) = q.next_due(now, false);
    (batch.map(|b| b.into_job(1)), removed)
}

pub(super) fn queue(max_requests: usize, max_rows: usize, timeout_ms: u64) -> BatchQueue {
    let policy = ContinuousBatching {
        max_requests,
        max_rows,
        max_tokens: usize::MAX,
        timeout: Duration::from_millis(timeout_ms),
    };
    BatchQueue::new(Arc::new(policy), 1, 2)
}
