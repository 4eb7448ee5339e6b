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

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use narsil_core::request::SparseLayout;
use narsil_core::{fuse, RequestSamples};

use crate::error::EngineError;
use crate::flush::{Fill, FlushPolicy};
use crate::job::{Entry, Fate, Job, Waiter};
use crate::parallelism::forward_threads;
use crate::stats::Stats;

/// Carries out an entry's fate: the entry back if it is kept; otherwise
/// `None`, after answering DEADLINE_EXCEEDED if it expired.
fn settle(entry: Entry, fate: Fate) -> Option<Entry> {
    match fate {
        Fate::Keep => Some(entry),
        Fate::Expire => {
            let _ = entry.reply.send(Err(EngineError::DeadlineExceeded));
            None
        }
        Fate::Drop => None,
    }
}

/// Requests being fused into one batch: the open batch, or a sealed one
/// waiting for a lane. Each request is held once, key-major, beside its
/// entry (its reply and places), so adding, removing or moving one is
/// constant work, whatever its samples: nothing per sample runs under the
/// collector's lock. The batch is laid out on the lane ([`Self::into_job`]).
#[derive(Debug)]
pub struct QueuedBatch {
    num_dense: usize,
    num_sparse: usize,
    rows: usize,
    /// Entries and their key-major samples, in arrival order.
    queued: Vec<(Entry, RequestSamples)>,
}

impl QueuedBatch {
    fn new(num_dense: usize, num_sparse: usize) -> Self {
        Self { num_dense, num_sparse, rows: 0, queued: Vec::new() }
    }

    fn push(&mut self, entry: Entry, samples: RequestSamples) {
        debug_assert_eq!(samples.layout, SparseLayout::KeyMajor);
        self.rows += samples.num_samples;
        self.queued.push((entry, samples));
    }

    /// Rows so far.
    pub fn rows(&self) -> usize {
        self.rows
    }

    fn fill(&self) -> Fill {
        Fill { requests: self.len(), rows: self.rows() }
    }

    /// Requests so far.
    pub fn len(&self) -> usize {
        self.queued.len()
    }

    /// True when no request was added.
    pub fn is_empty(&self) -> bool {
        self.queued.is_empty()
    }

    fn oldest(&self) -> Option<Instant> {
        self.queued.first().map(|(e, _)| e.admitted)
    }

    /// Applies [`Entry::fate`] to every entry: drops abandoned ones and
    /// answers expired ones. Returns how many were removed.
    fn retain(&mut self, now: Instant, start: bool) -> usize {
        let fates: Vec<Fate> = self.queued.iter().map(|(e, _)| e.fate(now, start)).collect();
        if fates.iter().all(|&f| f == Fate::Keep) {
            return 0;
        }
        let before = fates.len();
        self.queued = std::mem::take(&mut self.queued)
            .into_iter()
            .zip(fates)
            .filter_map(|((entry, samples), fate)| Some((settle(entry, fate)?, samples)))
            .collect();
        self.rows = self.queued.iter().map(|(_, s)| s.num_samples).sum();
        before - self.queued.len()
    }

    /// Lays the batch out (on the lane, outside the collector's lock) and
    /// releases the requests' queue places (their memory leases go with
    /// the job until its forward ends).
    pub fn into_job(self, threads: usize) -> Job {
        let (entries, samples): (Vec<Entry>, Vec<RequestSamples>) = self.queued.into_iter().unzip();
        let mut batch = fuse(self.num_dense, self.num_sparse, samples);
        // The latest deadline, if every fused request has one (a request
        // without one stops the fold with `None`).
        batch.deadline =
            entries.iter().try_fold(None, |latest, e| Some(latest.max(Some(e.deadline?)))).flatten();
        Job {
            threads,
            batch,
            waiters: entries
                .into_iter()
                .map(|e| Waiter {
                    id: e.id,
                    reply: e.reply,
                    admitted: e.admitted,
                    deadline: e.deadline,
                    lease: e.lease,
                })
                .collect(),
        }
    }
}

/// Sealed batches waiting for a lane, plus the one still accepting requests.
#[derive(Debug)]
pub struct BatchQueue {
    policy: Arc<dyn FlushPolicy>,
    num_dense: usize,
    num_sparse: usize,
    sealed: VecDeque<QueuedBatch>,
    open: QueuedBatch,
}

impl BatchQueue {
    /// An empty queue for a model with the given feature counts.
    pub fn new(policy: Arc<dyn FlushPolicy>, num_dense: usize, num_sparse: usize) -> Self {
        Self {
            policy,
            num_dense,
            num_sparse,
            sealed: VecDeque::new(),
            open: QueuedBatch::new(num_dense, num_sparse),
        }
    }

    /// Adds a request to the open batch, sealing batches at their limits.
    /// `samples` are reordered key-major first, unless they already are (as
    /// [`Collector::submit`] makes them, before it takes the lock).
    pub fn add(&mut self, entry: Entry, samples: RequestSamples) {
        if !self.open.is_empty() && !self.policy.fits(self.open.fill(), entry.rows) {
            self.seal();
        }
        self.open.push(entry, samples.into_key_major(self.num_sparse));
        if self.policy.is_full(self.open.fill()) {
            self.seal();
        }
    }

    fn seal(&mut self) {
        let open = std::mem::replace(&mut self.open, QueuedBatch::new(self.num_dense, self.num_sparse));
        self.sealed.push_back(open);
    }

    /// True when no request is queued.
    pub fn is_empty(&self) -> bool {
        self.sealed.is_empty() && self.open.is_empty()
    }

    /// Sealed batches waiting, and requests in the open batch.
    #[cfg(test)]
    pub fn depth(&self) -> (usize, usize) {
        (self.sealed.len(), self.open.len())
    }

    /// When the open batch may go out even though it is not full, if there
    /// is one and nothing sealed is ahead of it.
    pub fn open_flush_at(&self) -> Option<Instant> {
        if !self.sealed.is_empty() {
            return None;
        }
        self.open.oldest().map(|t| self.policy.due_at(t))
    }

    /// The next batch a free lane should run, if one is due at `now`
    /// (`drain`: send the open batch regardless of its timeout). Abandoned
    /// requests are removed first; the count removed is returned alongside.
    pub fn next_due(&mut self, now: Instant, drain: bool) -> (Option<QueuedBatch>, usize) {
        let mut removed = 0;
        loop {
            let mut batch = if let Some(batch) = self.sealed.pop_front() {
                batch
            } else if !self.open.is_empty() && (drain || self.open_flush_at().is_some_and(|t| t <= now)) {
                self.take_open()
            } else {
                return (None, removed);
            };
            let lost = batch.retain(now, true);
            removed += lost;
            if batch.is_empty() {
                continue;
            }
            if lost > 0 {
                removed += self.top_up(&mut batch, now);
            }
            return (Some(batch), removed);
        }
    }

    fn take_open(&mut self) -> QueuedBatch {
        std::mem::replace(&mut self.open, QueuedBatch::new(self.num_dense, self.num_sparse))
    }

    /// Fills a batch that lost cancelled or expired requests with the
    /// requests queued right behind it, in order, so that under overload
    /// forwards stay full. Returns how many abandoned entries it met (and
    /// removed) on the way.
    fn top_up(&mut self, batch: &mut QueuedBatch, now: Instant) -> usize {
        let policy = Arc::clone(&self.policy);
        let fits = |batch: &QueuedBatch, entry: &Entry| policy.fits(batch.fill(), entry.rows);
        let mut removed = 0;
        loop {
            let from_open = self.sealed.is_empty();
            let source = if from_open { &mut self.open } else { &mut self.sealed[0] };
            match source.queued.first() {
                Some((first, _)) if fits(batch, first) => {}
                _ => return removed,
            }
            let mut rest = Vec::new();
            for (entry, samples) in std::mem::take(&mut source.queued) {
                if !rest.is_empty() || !fits(batch, &entry) {
                    rest.push((entry, samples));
                    continue;
                }
                source.rows -= samples.num_samples;
                let fate = entry.fate(now, true);
                match settle(entry, fate) {
                    Some(entry) => batch.push(entry, samples),
                    None => removed += 1,
                }
            }
            if !rest.is_empty() {
                source.queued = rest;
                return removed;
            }
            if from_open {
                self.take_open();
            } else {
                self.sealed.pop_front();
            }
        }
    }

    /// Removes every entry whose caller went away or whose time ran out,
    /// from every queued batch, without starting anything: frees their
    /// queue places for new requests. Returns how many were removed.
    pub fn sweep(&mut self, now: Instant) -> usize {
        let mut removed = self.open.retain(now, false);
        for batch in &mut self.sealed {
            removed += batch.retain(now, false);
        }
        self.sealed.retain(|b| !b.is_empty());
        removed
    }
}

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
    use super::*;
    use crate::admission::Admission;
    use crate::flush::{ContinuousBatching, PerRequest};
    use crate::job::Ticket;
    use crate::memory::MemoryBudget;
    use narsil_core::{assemble, RequestSamples};
    use tokio::sync::oneshot;

    type Rx = oneshot::Receiver<Result<crate::job::Prediction, EngineError>>;

    /// A queued request of `b` samples whose values carry `tag`, and its
    /// samples.
    fn entry(admission: &Arc<Admission>, b: usize, tag: i64, at: Instant) -> (Entry, RequestSamples, Rx) {
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
            lease,
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
    fn due(q: &mut BatchQueue, now: Instant) -> (Option<Job>, usize) {
        let (batch, removed) = q.next_due(now, false);
        (batch.map(|b| b.into_job(1)), removed)
    }

    fn queue(max_requests: usize, max_rows: usize, timeout_ms: u64) -> BatchQueue {
        let policy =
            ContinuousBatching { max_requests, max_rows, timeout: Duration::from_millis(timeout_ms) };
        BatchQueue::new(Arc::new(policy), 1, 2)
    }

    #[test]
    fn full_batch_is_sealed_and_due_at_once() {
        let admission = Admission::new(100, 1000);
        let now = Instant::now();
        let mut q = queue(2, 100, 1000);
        let _rx: Vec<_> = (0..3)
            .map(|t| {
                let (e, e_samples, rx) = entry(&admission, 1, t, now);
                q.add(e, e_samples);
                rx
            })
            .collect();
        assert_eq!(q.depth(), (1, 1));
        let (job, _) = due(&mut q, now);
        assert_eq!(job.unwrap().waiters.len(), 2);
        assert!(due(&mut q, now).0.is_none(), "open batch waits for its timeout");
        assert_eq!(due(&mut q, now + Duration::from_secs(1)).0.unwrap().waiters.len(), 1);
    }

    #[test]
    fn batch_is_sealed_before_it_would_exceed_max_rows() {
        let admission = Admission::new(100, 1000);
        let now = Instant::now();
        let mut q = queue(16, 10, 0);
        let (a, a_samples, _ra) = entry(&admission, 6, 1, now);
        let (b, b_samples, _rb) = entry(&admission, 6, 2, now);
        q.add(a, a_samples);
        q.add(b, b_samples);
        assert_eq!(q.depth(), (1, 1));
        assert_eq!(due(&mut q, now).0.unwrap().batch.rows, 6);
    }

    #[test]
    fn zero_timeout_sends_a_lone_request_at_once() {
        let admission = Admission::new(100, 1000);
        let now = Instant::now();
        let mut q = queue(16, 100, 0);
        let (a, a_samples, _ra) = entry(&admission, 3, 1, now);
        q.add(a, a_samples);
        let job = due(&mut q, now).0.unwrap();
        assert_eq!((job.batch.rows, job.waiters.len()), (3, 1));
    }

    #[test]
    fn one_request_per_batch_in_worker_mode() {
        let admission = Admission::new(100, 1000);
        let now = Instant::now();
        let mut q = BatchQueue::new(Arc::new(PerRequest), 1, 2);
        let _rx: Vec<_> = (0..3)
            .map(|t| {
                let (e, e_samples, rx) = entry(&admission, 2, t, now);
                q.add(e, e_samples);
                rx
            })
            .collect();
        assert_eq!(q.depth(), (3, 0));
    }

    #[test]
    fn cancelled_request_is_removed_and_the_rest_refused() {
        let admission = Admission::new(100, 1000);
        let now = Instant::now();
        let mut q = queue(16, 100, 0);
        let (a, a_samples, _ra) = entry(&admission, 2, 1, now);
        let (b, b_samples, rb) = entry(&admission, 1, 2, now);
        let (c, c_samples, _rc) = entry(&admission, 3, 3, now);
        let kept = [a_samples.clone(), c_samples.clone()];
        q.add(a, a_samples);
        q.add(b, b_samples);
        q.add(c, c_samples);
        drop(rb);
        let (job, removed) = due(&mut q, now);
        let job = job.unwrap();
        assert_eq!(removed, 1);
        assert_eq!(job.batch, assemble(1, 2, &kept));
        assert_eq!(admission.queued_requests(), 0, "dispatch releases queue places");
    }

    #[test]
    fn expired_request_is_answered_with_deadline_exceeded_and_not_sent() {
        let admission = Admission::new(100, 1000);
        let now = Instant::now();
        let mut q = queue(16, 100, 0);
        let (mut a, a_samples, mut ra) = entry(&admission, 2, 1, now);
        a.expires = Some(now);
        q.add(a, a_samples);
        let (job, removed) = due(&mut q, now);
        assert!(job.is_none());
        assert_eq!(removed, 1);
        assert!(matches!(ra.try_recv().unwrap(), Err(EngineError::DeadlineExceeded)));
    }

    #[test]
    fn fused_batch_carries_the_latest_deadline_only_when_every_request_has_one() {
        let admission = Admission::new(100, 1000);
        let now = Instant::now();
        let fused_deadline = |deadlines: &[Option<Duration>]| {
            let mut q = queue(16, 100, 0);
            let mut receivers = Vec::new();
            for (tag, deadline) in deadlines.iter().enumerate() {
                let (mut e, samples, rx) = entry(&admission, 1, tag as i64, now);
                e.deadline = deadline.map(|d| now + d);
                q.add(e, samples);
                receivers.push(rx);
            }
            due(&mut q, now).0.unwrap().batch.deadline
        };
        let (short, long) = (Some(Duration::from_millis(50)), Some(Duration::from_millis(900)));
        assert_eq!(fused_deadline(&[short, long, short]), Some(now + Duration::from_millis(900)));
        assert_eq!(fused_deadline(&[short]), Some(now + Duration::from_millis(50)));
        assert_eq!(fused_deadline(&[short, None]), None, "one caller waits without a deadline");
    }

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

    #[test]
    fn request_abandoned_by_its_callers_timer_is_never_sent() {
        let admission = Admission::new(100, 1000);
        let now = Instant::now();
        let mut q = queue(16, 100, 0);
        let (a, a_samples, _ra) = entry(&admission, 2, 1, now);
        let (b, b_samples, _rb) = entry(&admission, 1, 2, now);
        let ticket = Arc::clone(&a.ticket);
        q.add(a, a_samples);
        q.add(b, b_samples);
        assert!(ticket.abandon(), "nothing started yet");
        let (job, removed) = due(&mut q, now);
        assert_eq!((job.unwrap().waiters.len(), removed), (1, 1));
    }

    #[test]
    fn started_request_is_not_expired_by_its_queue_timeout() {
        let admission = Admission::new(100, 1000);
        let now = Instant::now();
        let mut q = queue(1, 100, 0);
        let (mut first, first_samples, _r1) = entry(&admission, 1, 1, now);
        let (mut second, second_samples, _r2) = entry(&admission, 1, 1, now);
        // Two parts of one request; the second expires after the first started.
        second.ticket = Arc::clone(&first.ticket);
        first.expires = Some(now + Duration::from_millis(5));
        second.expires = first.expires;
        q.add(first, first_samples);
        q.add(second, second_samples);
        assert!(due(&mut q, now).0.is_some());
        let later = now + Duration::from_millis(10);
        let (job, removed) = due(&mut q, later);
        assert_eq!((job.is_some(), removed), (true, 0));
    }

    #[test]
    fn sweep_frees_places_of_gone_callers_without_starting_the_rest() {
        let admission = Admission::new(100, 1000);
        let now = Instant::now();
        let mut q = queue(2, 100, 1000);
        let (a, a_samples, ra) = entry(&admission, 2, 1, now);
        let (b, b_samples, _rb) = entry(&admission, 3, 2, now);
        let (c, c_samples, rc) = entry(&admission, 4, 3, now);
        let kept = Arc::clone(&b.ticket);
        q.add(a, a_samples);
        q.add(b, b_samples);
        q.add(c, c_samples);
        drop((ra, rc));
        assert_eq!(q.sweep(now), 2);
        assert_eq!((admission.queued_requests(), admission.queued_rows()), (1, 3));
        assert_eq!(q.depth(), (1, 0));
        assert!(kept.abandon(), "sweeping must not start a request");
    }

    #[test]
    fn batch_that_lost_requests_is_topped_up_from_the_queue_behind_it() {
        let admission = Admission::new(100, 1000);
        let now = Instant::now();
        let mut q = queue(2, 100, 0);
        let mut receivers = Vec::new();
        for tag in 0..5 {
            let (e, e_samples, rx) = entry(&admission, 1, tag, now);
            q.add(e, e_samples);
            receivers.push(rx);
        }
        assert_eq!(q.depth(), (2, 1));
        drop(receivers.remove(0)); // the first batch loses request 0
        let (job, removed) = due(&mut q, now);
        let job = job.unwrap();
        assert_eq!((job.waiters.len(), removed), (2, 1));
        let first_two: Vec<RequestSamples> = (1..3)
            .map(|tag| RequestSamples {
                num_samples: 1,
                dense: vec![tag as f32],
                lengths: vec![1; 2],
                ids: vec![tag * 100, tag * 100 + 1],
                ..Default::default()
            })
            .collect();
        assert_eq!(job.batch, assemble(1, 2, &first_two), "requests 1 and 2, in order");
        assert_eq!(q.depth(), (1, 1), "request 3 alone in a sealed batch, request 4 open");
        assert_eq!(due(&mut q, now).0.unwrap().waiters.len(), 1);
        assert_eq!(due(&mut q, now).0.unwrap().waiters.len(), 1);
    }
}
