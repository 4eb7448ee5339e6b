//! The collector: the queue between admission and the lanes. Each admitted
//! request is reordered into the open batch as it arrives (so the next batch
//! is assembled while lanes compute); a batch is sealed when it is full; a
//! free lane takes the next due batch.
//!
//! When a batch is full and when the open batch is due is the
//! [`FlushPolicy`]'s ([`crate::flush`]): a sealed (full) batch goes to the
//! next free lane; the open batch goes when a lane is free and the policy
//! says it is due. Under continuous batching with no timeout a lone request
//! on an idle server is therefore sent immediately, and requests that
//! arrive while every lane is busy form the next batch; worker mode is the
//! same loop with one request per batch.
//!
//! Requests whose client went away, or whose deadline passed, are removed
//! before their batch is sent and never computed.
//!
//! The queue itself, pure state with time passed in, is [`queue`]'s
//! ([`BatchQueue`]); this file is the lock around it that request handlers
//! and lanes share ([`Collector`]).

#[cfg(test)]
mod fixtures;
mod queue;

pub use self::queue::{BatchQueue, FusedWorkingSet, QueuedBatch};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use narsil_core::request::SparseLayout;
use narsil_core::RequestSamples;

use crate::error::EngineError;
use crate::job::{Entry, Job};
use crate::parallelism::forward_threads;
use crate::stats::Stats;

/// The shared queue: request handlers add to it, lanes take batches from it.
///
/// Lanes pull their next batch themselves as soon as they finish one, on
/// their own OS thread, so a freed lane never waits for an async task to be
/// scheduled behind request decoding. Handlers reorder their requests
/// key-major before taking the lock and hold it only to append them, so the
/// next batch is ready while the current one runs and the lock's work does
/// not grow with samples.
pub struct Collector {
    /// The model's sparse features (requests are reordered key-major for
    /// them before they are queued).
    num_sparse: usize,
    state: Mutex<CollectorState>,
    /// Cores a forward may use when it runs alone ([`forward_threads`]).
    cores: usize,
    work: Condvar,
    stats: Arc<Stats>,
    /// Set when a caller stopped waiting for a queued request (its timer
    /// fired, or it went away): only then can a sweep free anything, so a
    /// refusal under plain overload never walks the queue.
    stale: AtomicBool,
}

struct CollectorState {
    queue: BatchQueue,
    idle_lanes: usize,
    /// Lanes running a forward (taken a job, not yet finished it).
    busy_lanes: usize,
    closed: bool,
}

impl Collector {
    /// A collector over an empty `queue`, whose forwards may use up to
    /// `cores` threads when they run alone.
    pub fn new(queue: BatchQueue, cores: usize, stats: Arc<Stats>) -> Self {
        Self {
            num_sparse: queue.num_sparse,
            state: Mutex::new(CollectorState { queue, idle_lanes: 0, busy_lanes: 0, closed: false }),
            cores,
            work: Condvar::new(),
            stats,
            stale: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, CollectorState> {
        // Nothing panics while holding the lock; recover the data if it did.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Queues a request's parts, in order, and wakes idle lanes. Each part
    /// is reordered key-major first, on the calling thread before the lock
    /// is taken (the sample-major original is freed then), so that the
    /// lock is held for constant work per request, never per sample: with
    /// every core submitting, per-sample work under this lock was what
    /// capped throughput. Fails once the collector no longer takes requests
    /// (shutdown).
    pub fn submit(&self, parts: Vec<(Entry, RequestSamples)>) -> Result<(), EngineError> {
        let mut freed = 0;
        let parts: Vec<_> = parts
            .into_iter()
            .map(|(entry, samples)| {
                if samples.layout != SparseLayout::KeyMajor {
                    freed += samples.decoded_bytes();
                }
                (entry, samples.into_key_major(self.num_sparse))
            })
            .collect();
        crate::memory::freed_batch(freed);
        let count = parts.len();
        let mut state = self.lock();
        if state.closed {
            return Err(EngineError::ShuttingDown);
        }
        for (entry, samples) in parts {
            state.queue.add(entry, samples);
        }
        let wake = state.idle_lanes > 0;
        drop(state);
        if wake && count > 1 {
            self.work.notify_all();
        } else if wake {
            self.work.notify_one();
        }
        Ok(())
    }

    /// Notes that a caller stopped waiting for a queued request, so the
    /// next [`Collector::sweep`] has something to look for.
    pub fn mark_stale(&self) {
        self.stale.store(true, Ordering::Release);
    }

    /// Frees the queue places of requests whose caller went away or whose
    /// time ran out (see [`BatchQueue::sweep`]); returns how many. Walks the
    /// queue only when a caller has stopped waiting since the last sweep.
    pub fn sweep(&self) -> usize {
        if !self.stale.swap(false, Ordering::AcqRel) {
            return 0;
        }
        let removed = self.lock().queue.sweep(Instant::now());
        self.stats.requests_abandoned.inc_by(removed as u64);
        removed
    }

    /// Notes that a job taken with `finished_job: false` on the next call
    /// has finished (a lane whose stage thread takes its jobs: the stage
    /// takes the next one before the lane finishes the last).
    pub fn finished_job(&self) {
        self.lock().busy_lanes -= 1;
    }

    /// Threads for the forward of a job taken earlier by a lane's stage
    /// thread, now that the lane takes it (the hand-over): what
    /// [`Collector::next_job`] would choose at this moment, the job itself
    /// not counted among the busy lanes. At the take its lane was usually
    /// still busy with the previous batch, which made that choice 1.
    pub fn threads_at_handover(&self) -> usize {
        let state = self.lock();
        forward_threads(self.cores, state.busy_lanes.saturating_sub(1), state.queue.is_empty())
    }

    /// Stops taking requests; lanes finish what is queued, then stop.
    pub fn close(&self) {
        self.lock().closed = true;
        self.work.notify_all();
    }

    /// Blocks the calling lane until a batch is due, and returns it;
    /// [`NextJob::Closed`] once the collector is closed and empty;
    /// [`NextJob::Idle`] when `idle_limit` passes with nothing due (lanes ask
    /// for that while the backend is unhealthy, to probe it).
    ///
    /// `finished_job`: the calling lane comes back from running the job its
    /// previous call returned (it counts as busy until then).
    pub fn next_job(&self, idle_limit: Option<Duration>, finished_job: bool) -> NextJob {
        let give_up_at = idle_limit.map(|limit| Instant::now() + limit);
        let mut state = self.lock();
        if finished_job {
            state.busy_lanes -= 1;
        }
        loop {
            let now = Instant::now();
            let drain = state.closed;
            let (job, removed) = state.queue.next_due(now, drain);
            if removed > 0 {
                self.stats.requests_abandoned.inc_by(removed as u64);
            }
            if let Some(batch) = job {
                let threads = forward_threads(self.cores, state.busy_lanes, state.queue.is_empty());
                state.busy_lanes += 1;
                return NextJob::Job(Due { batch, threads });
            }
            if state.closed && state.queue.is_empty() {
                return NextJob::Closed;
            }
            if give_up_at.is_some_and(|at| now >= at) {
                return NextJob::Idle;
            }
            let wake_at = match (state.queue.open_flush_at(), give_up_at) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            state.idle_lanes += 1;
            state = match wake_at {
                Some(at) => {
                    let wait = at.saturating_duration_since(now);
                    self.work.wait_timeout(state, wait).unwrap_or_else(|p| p.into_inner()).0
                }
                None => self.work.wait(state).unwrap_or_else(|p| p.into_inner()),
            };
            state.idle_lanes -= 1;
        }
    }
}

/// A batch handed to a lane: [`Due::into_job`] finishes its reorder on
/// the lane's thread, after the collector's lock is released.
#[derive(Debug)]
pub struct Due {
    batch: QueuedBatch,
    threads: usize,
}

impl Due {
    /// The fused batch and its waiters, ready to run.
    pub fn into_job(self) -> Job {
        self.batch.into_job(self.threads)
    }
}

/// What a lane gets from [`Collector::next_job`].
#[derive(Debug)]
pub enum NextJob {
    /// A batch to run.
    Job(Due),
    /// Nothing was due within the idle limit.
    Idle,
    /// The collector is closed and empty: the lane ends.
    Closed,
}

#[cfg(test)]
mod tests {
    use super::fixtures::{entry, queue};
    use super::*;
    use crate::admission::Admission;

    #[test]
    fn sweep_walks_the_queue_only_after_a_caller_stopped_waiting() {
        let admission = Admission::new(100, 1000);
        let collector = Collector::new(queue(16, 100, 1000), 1, Arc::new(Stats::default()));
        let (a, a_samples, ra) = entry(&admission, 1, 1, Instant::now());
        let (b, b_samples, _rb) = entry(&admission, 1, 2, Instant::now());
        collector.submit(vec![(a, a_samples), (b, b_samples)]).unwrap();
        drop(ra);
        assert_eq!(collector.sweep(), 0, "nobody said a caller left");
        collector.mark_stale();
        assert_eq!(collector.sweep(), 1);
        assert_eq!(admission.queued_requests(), 1, "the place is free");
        collector.mark_stale();
        assert_eq!(collector.sweep(), 0, "nothing else to free");
    }

    #[test]
    fn a_staged_job_handed_over_to_an_idle_server_takes_the_free_cores() {
        let admission = Admission::new(100, 1000);
        let collector = Collector::new(queue(1, 100, 0), 4, Arc::new(Stats::default()));
        let mut receivers = Vec::new();
        for tag in 0..2 {
            let (e, samples, rx) = entry(&admission, 1, tag, Instant::now());
            collector.submit(vec![(e, samples)]).unwrap();
            receivers.push(rx);
        }
        // A stage thread takes the first job; the job itself never counts
        // against its own threads, but the second job is still queued.
        let NextJob::Job(first) = collector.next_job(None, false) else { panic!("a job is due") };
        assert_eq!(first.threads, 1, "at the take a second job was queued");
        assert_eq!(collector.threads_at_handover(), 1, "the second job is still queued");
        // Another lane takes the second: at the first's hand-over one other
        // lane is busy and nothing is queued.
        let NextJob::Job(_second) = collector.next_job(None, false) else { panic!("a job is due") };
        assert_eq!(collector.threads_at_handover(), 3, "4 cores less the other busy lane");
        collector.finished_job(); // the other lane's
        assert_eq!(collector.threads_at_handover(), 4, "the other lanes are idle");
    }
}
