//! The collector's queue as pure state: the open batch each admitted
//! request is reordered into, the sealed batches waiting for a lane, and
//! which batch is due when ([`BatchQueue::next_due`], time passed in as
//! `now`), with the requests whose callers left or whose deadline passed
//! removed before their batch is sent.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use narsil_core::request::SparseLayout;
use narsil_core::working_set::Unit;
use narsil_core::{fuse, RequestSamples};

use crate::error::EngineError;
use crate::flush::{Fill, FlushPolicy};
use crate::job::{Entry, Fate, Job, Waiter};

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
    tokens: usize,
    /// Entries and their key-major samples, in arrival order.
    queued: Vec<(Entry, RequestSamples)>,
}

impl QueuedBatch {
    fn new(num_dense: usize, num_sparse: usize) -> Self {
        Self { num_dense, num_sparse, rows: 0, tokens: 0, queued: Vec::new() }
    }

    fn push(&mut self, entry: Entry, samples: RequestSamples) {
        debug_assert_eq!(samples.layout, SparseLayout::KeyMajor);
        self.rows += samples.num_samples;
        self.tokens += entry.tokens;
        self.queued.push((entry, samples));
    }

    /// Rows so far.
    pub fn rows(&self) -> usize {
        self.rows
    }

    fn fill(&self) -> Fill {
        Fill { requests: self.len(), rows: self.rows(), tokens: self.tokens }
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
        self.tokens = self.queued.iter().map(|(e, _)| e.tokens).sum();
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
                    working: e.working,
                })
                .collect(),
        }
    }
}

/// For a model with sequences: the working set a forward allocates for a
/// fused batch's units (each sequence's, [`narsil_core::working_set`]). Not
/// additive: a fused forward pads to its batch's longest unit, or lays
/// candidates out to the most rows a unit has, so a request joins a batch
/// only where its working share can also hold what fusing adds: the fused
/// units' working set beyond what the batch's requests and it hold already
/// (if the model's working-set lease cannot grow for it,
/// [`crate::working_sets`], the request starts a batch of its own).
#[derive(Clone)]
pub struct FusedWorkingSet(pub Arc<WorkingSetOf>);

/// The working set of a forward of these units, each sequence's.
pub type WorkingSetOf = dyn Fn(&[Vec<Unit>]) -> usize + Send + Sync;

impl std::fmt::Debug for FusedWorkingSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FusedWorkingSet")
    }
}

impl FusedWorkingSet {
    /// Whether `adding` may join `batch`: the fused units' working set is
    /// no more than what the batch's shares and its own hold for them,
    /// once its share has taken the difference.
    fn join(&self, batch: &QueuedBatch, adding: &mut Entry) -> bool {
        let Some(working) = adding.working.as_ref() else {
            return true;
        };
        let batch_entries = || batch.queued.iter().map(|(e, _)| e);
        let held = batch_entries().fold(working.bytes(), |a, e| a.saturating_add(e.working_bytes()));
        let fused: Vec<Vec<Unit>> = (0..adding.units.len())
            .map(|s| {
                batch_entries()
                    .chain([&*adding])
                    .flat_map(|e| e.units.get(s).into_iter().flatten().copied())
                    .collect()
            })
            .collect();
        let more = (self.0)(&fused).saturating_sub(held);
        more == 0 || adding.working.as_mut().is_some_and(|w| w.grow(more))
    }
}

/// Sealed batches waiting for a lane, plus the one still accepting requests.
#[derive(Debug)]
pub struct BatchQueue {
    policy: Arc<dyn FlushPolicy>,
    /// For a model with sequences ([`Self::with_working_set`]).
    working_set: Option<FusedWorkingSet>,
    num_dense: usize,
    /// The model's sparse features (the collector reorders requests
    /// key-major for them before it queues them).
    pub(super) num_sparse: usize,
    sealed: VecDeque<QueuedBatch>,
    open: QueuedBatch,
}

impl BatchQueue {
    /// An empty queue for a model with the given feature counts.
    pub fn new(policy: Arc<dyn FlushPolicy>, num_dense: usize, num_sparse: usize) -> Self {
        Self {
            policy,
            working_set: None,
            num_dense,
            num_sparse,
            sealed: VecDeque::new(),
            open: QueuedBatch::new(num_dense, num_sparse),
        }
    }

    /// This queue fusing a request only where the fused forward's working
    /// set (`working_set`) is no more than its requests were charged.
    pub fn with_working_set(mut self, working_set: FusedWorkingSet) -> Self {
        self.working_set = Some(working_set);
        self
    }

    /// Whether `entry` may join `batch` (non-empty): the policy's limits,
    /// and the fused working set (its lease taking what fusing adds).
    fn joins(
        policy: &dyn FlushPolicy,
        working_set: Option<&FusedWorkingSet>,
        batch: &QueuedBatch,
        entry: &mut Entry,
    ) -> bool {
        policy.fits(batch.fill(), entry.fill()) && working_set.is_none_or(|w| w.join(batch, entry))
    }

    /// Adds a request to the open batch, sealing batches at their limits.
    /// `samples` are reordered key-major first, unless they already are (as
    /// [`Collector::submit`] makes them, before it takes the lock).
    pub fn add(&mut self, mut entry: Entry, samples: RequestSamples) {
        if !self.open.is_empty()
            && !Self::joins(&*self.policy, self.working_set.as_ref(), &self.open, &mut entry)
        {
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
        let (policy, working_set) = (Arc::clone(&self.policy), self.working_set.clone());
        let joins = |batch: &QueuedBatch, entry: &mut Entry| {
            Self::joins(&*policy, working_set.as_ref(), batch, entry)
        };
        let mut removed = 0;
        loop {
            let from_open = self.sealed.is_empty();
            let source = if from_open { &mut self.open } else { &mut self.sealed[0] };
            match source.queued.first() {
                Some((first, _)) if policy.fits(batch.fill(), first.fill()) => {}
                _ => return removed,
            }
            let mut rest = Vec::new();
            for (mut entry, samples) in std::mem::take(&mut source.queued) {
                if !rest.is_empty() || !joins(batch, &mut entry) {
                    rest.push((entry, samples));
                    continue;
                }
                source.rows -= samples.num_samples;
                source.tokens -= entry.tokens;
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::fixtures::{due, entry, queue};
    use super::*;
    use crate::admission::Admission;
    use crate::flush::PerRequest;
    use crate::memory::MemoryBudget;
    use crate::working_sets::WorkingSets;
    use narsil_core::assemble;
    use narsil_core::working_set::WorkingSet;

    #[test]
    fn a_request_joins_a_batch_only_where_its_share_can_hold_what_fusing_adds() {
        // A gather that pads: every row of the batch by its longest unit.
        let gather = || {
            FusedWorkingSet(Arc::new(|units: &[Vec<Unit>]| {
                let rows: usize = units[0].iter().map(|u| u.rows).sum();
                rows * units[0].iter().map(|u| u.positions).max().unwrap_or(0)
            }))
        };
        let admission = Admission::new(100, 1000);
        let now = Instant::now();
        let mut rx = Vec::new();
        // Requests of flat rows with histories of `positions`, each holding
        // its own working set on `sets` (a gather of 1 value a position:
        // 13 bytes with its index and mask; one batch may take them all,
        // so the sum is held).
        let mut add = |q: &mut BatchQueue, sets: &WorkingSets, rows: usize, positions: usize| {
            let (mut e, samples, r) = entry(&admission, rows, 1, now);
            e.units = vec![vec![Unit { positions, rows: 1 }; rows]];
            e.working = Some(sets.hold(&e.units, e.fill(), rows * positions).unwrap());
            q.add(e, samples);
            rx.push(r);
        };
        let sets = |max: usize| {
            let (budget, kind) = (
                MemoryBudget::new(max),
                WorkingSet::Gather { width: 1, position_width: 0, bytes_per_value: 4 },
            );
            let unlimited = Fill { requests: usize::MAX, rows: usize::MAX, tokens: usize::MAX };
            (WorkingSets::new(vec![kind], 1, unlimited, &budget, Default::default()), budget)
        };
        let (tight, budget) = sets(200);
        let mut q = queue(16, 100, 1000).with_working_set(gather());
        // Histories of one length: fused, nothing more taken.
        add(&mut q, &tight, 2, 10);
        add(&mut q, &tight, 3, 10);
        assert_eq!((q.depth(), budget.used()), ((0, 2), 50));
        // A longer one would pad the batch's 5 rows to it: 6 x 50 = 300
        // against 100 held, and the budget lacks the 200 more: it starts a
        // batch of its own.
        add(&mut q, &tight, 1, 50);
        assert_eq!((q.depth(), budget.used()), ((1, 1), 100));
        // Where the budget has room, it joins, its share taking the 200.
        let (roomy, budget) = sets(1000);
        let mut q = queue(16, 100, 1000).with_working_set(gather());
        add(&mut q, &roomy, 2, 10);
        add(&mut q, &roomy, 3, 10);
        add(&mut q, &roomy, 1, 50);
        assert_eq!((q.depth(), budget.used()), ((0, 3), 300));
        // Requests without units (no sequences) fuse by the limits alone.
        let mut plain = queue(16, 100, 1000).with_working_set(gather());
        for t in 0..3 {
            let (e, samples, r) = entry(&admission, 1, t, now);
            plain.add(e, samples);
            rx.push(r);
        }
        assert_eq!(plain.depth(), (0, 3));
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
