//! Executor lanes: OS threads that each own one model instance. A lane loads
//! its instance on its own thread, warms it up, reports ready, then takes
//! the collector's next due batch, runs it and answers every request in it.
//!
//! With stage ahead (`--stage-ahead`) and a backend that has a stage
//! ([`narsil_core::BatchStage`]: a split model's embedding stage), each
//! lane has a stage thread that takes the collector's batches and stages
//! them, one batch ahead: while the lane runs batch N's forward, batch
//! N+1 is staged (its rows fetched and pooled), then waits, handed over
//! once the lane is free (a rendezvous, so at most one batch is staged
//! ahead). Its wait there, from the end of its stage to the lane taking it,
//! is queue time for its requests (`narsil_stage_handover_seconds`), and
//! the lane chooses its forward's threads then, as the collector would for
//! a batch taken at that moment ([`Collector::threads_at_handover`]): at
//! the stage's take the lane was busy, which made that choice 1. Before
//! its forward a staged batch loses the requests whose caller stopped
//! waiting meanwhile (DEADLINE_EXCEEDED for those whose deadline passed),
//! rows and all; with none left the forward is skipped.
//!
//! A failing forward fails only its own batch; a panicking backend is caught
//! and the lane keeps serving. Every forward's outcome goes to the shared
//! [`BackendHealth`]; while it says unhealthy, an idle lane probes the
//! backend with a one-row forward every probe interval, so that a recovered
//! backend turns healthy again without traffic (which load balancers stop
//! sending once health says NOT_SERVING).
//!
//! A batch whose every caller stopped waiting before its forward could
//! finish ([`BackendError::Abandoned`]: its deadline, the latest of its
//! callers', passed and a table store stopped its reads) is not a failed
//! forward: its requests are answered DEADLINE_EXCEEDED and it is counted
//! as abandoned (`narsil_batches_abandoned_total`) and nowhere else (not in
//! forwards, rows or requests computed, nor in compute time). Whether
//! health is told depends on where the batch's time went
//! ([`stalled_in_forward`]):
//!
//! * into the queue (the lane, or its stage thread, took the batch with
//!   less than half of its time left): health is not told, so an
//!   overloaded replica whose callers give up does not take itself out of
//!   its load balancer;
//! * into the forward (taken with more than half of its time left, and
//!   still not done: a table store too slow to deliver, as a disk is on its
//!   way to dying): a *stalled* batch (`narsil_batches_stalled_total`,
//!   counted in `narsil_batches_abandoned_total` too), which counts toward
//!   `--unhealthy-after-failures` as a failed forward does, so a replica
//!   whose store stalls every batch turns NOT_SERVING instead of answering
//!   DEADLINE_EXCEEDED to everyone while it says SERVING.
//!
//! The lane honours the claim only once the batch's deadline has passed;
//! from a batch without one (warm-up, probes, a caller without a deadline)
//! it is a failure like any other.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use narsil_core::backend::warmup_batch;
use narsil_core::{error_chain, BackendError, BackendFactory, BatchStage, ModelBackend, StagedBatch};
use tokio::sync::watch;

use crate::collector::{Collector, Due, NextJob};
use crate::error::{EngineError, LaneFailed};
use crate::health::BackendHealth;
use crate::job::{Job, Prediction};
use crate::stats::Stats;

/// Startup progress of the lanes.
#[derive(Debug, Clone, Default)]
pub struct Readiness {
    /// Lanes loaded and warmed up.
    pub ready: usize,
    /// The first lane failure, if any.
    pub failed: Option<LaneFailed>,
}

/// What every lane shares.
pub struct LaneShared {
    pub factory: Arc<dyn BackendFactory>,
    pub collector: Arc<Collector>,
    pub stats: Arc<Stats>,
    pub readiness: watch::Sender<Readiness>,
    pub health: Arc<BackendHealth>,
    /// How often an idle lane probes an unhealthy backend.
    pub probe_interval: Duration,
    /// The schema's version, stamped on every answer.
    pub model_version: Arc<str>,
    /// Whether lanes whose backend has a stage run it one batch ahead, on a
    /// thread of their own.
    pub stage_ahead: bool,
}

/// What a lane's stage thread hands the lane.
enum Staged {
    /// A batch taken from the collector, and its stage's result.
    Job(Box<StagedJob>),
    /// Nothing was due within the idle limit: time to probe.
    Idle,
}

/// A batch taken at `taken`, and what its stage made of it by `ready`.
struct StagedJob {
    job: Job,
    taken: Instant,
    staged: Result<StagedBatch, BackendError>,
    /// When its stage finished: from then on it waits for the lane.
    ready: Instant,
}

/// Starts `count` lanes taking batches from the collector. Each reports into
/// `readiness` once warmed up; all return when the collector is closed and
/// empty.
pub fn spawn(count: usize, shared: LaneShared) -> std::io::Result<Vec<JoinHandle<()>>> {
    let shared = Arc::new(shared);
    (0..count)
        .map(|lane| {
            let lane_ctx = LaneContext { lane, shared: Arc::clone(&shared) };
            std::thread::Builder::new().name(format!("narsil-lane-{lane}")).spawn(move || lane_ctx.run())
        })
        .collect()
}

struct LaneContext {
    lane: usize,
    shared: Arc<LaneShared>,
}

impl std::ops::Deref for LaneContext {
    type Target = LaneShared;

    fn deref(&self) -> &LaneShared {
        &self.shared
    }
}

impl LaneContext {
    fn run(self) {
        let started = Instant::now();
        let mut backend = match self.load_and_warm_up() {
            Ok(backend) => backend,
            Err(failure) => {
                tracing::error!(error = %error_chain(&failure), "lane failed to start");
                self.readiness.send_modify(|r| {
                    r.failed.get_or_insert(failure);
                });
                return;
            }
        };
        tracing::info!(lane = self.lane, elapsed_ms = started.elapsed().as_millis() as u64, "lane ready");
        self.readiness.send_modify(|r| r.ready += 1);
        match backend.take_stage().filter(|_| self.stage_ahead) {
            Some(stage) => self.serve_staged(backend.as_mut(), stage),
            None => self.serve(backend.as_mut()),
        }
    }

    /// How long an idle lane waits before probing: only while unhealthy.
    fn idle_limit(&self) -> Option<Duration> {
        (!self.health.is_healthy()).then_some(self.probe_interval)
    }

    /// Takes batches from the collector and runs each whole.
    fn serve(&self, backend: &mut dyn ModelBackend) {
        let mut finished_job = false;
        loop {
            let next = self.collector.next_job(self.idle_limit(), finished_job);
            finished_job = matches!(next, NextJob::Job(_));
            match next {
                NextJob::Job(due) => {
                    let (job, taken) = self.take(due);
                    self.run_job(backend, job, taken, Duration::ZERO, None);
                }
                NextJob::Idle => self.probe(backend),
                NextJob::Closed => return,
            }
        }
    }

    /// Runs the forwards of batches a stage thread of this lane takes and
    /// stages, one batch ahead; falls back to [`Self::serve`] when that
    /// thread cannot be started.
    fn serve_staged(&self, backend: &mut dyn ModelBackend, stage: Box<dyn BatchStage>) {
        let (handover, staged) = sync_channel(0);
        let started = std::thread::scope(|scope| {
            let stager = std::thread::Builder::new()
                .name(format!("narsil-stage-{}", self.lane))
                .spawn_scoped(scope, move || self.stage_ahead(stage, handover));
            if let Err(error) = stager {
                tracing::error!(lane = self.lane, %error, "no stage thread; staging on the lane");
                return false;
            }
            for next in staged {
                match next {
                    Staged::Job(staged) => {
                        let StagedJob { mut job, taken, staged, ready } = *staged;
                        let handover = ready.elapsed();
                        job.threads = self.collector.threads_at_handover();
                        self.stats.batches_staged.inc();
                        self.stats.stage_handover_seconds.observe(handover.as_secs_f64());
                        self.run_job(backend, job, taken, handover, Some(staged));
                        self.collector.finished_job();
                    }
                    Staged::Idle => self.probe(backend),
                }
            }
            true
        });
        if !started {
            self.serve(backend);
        }
    }

    /// The stage thread: takes the collector's next batch, stages it and
    /// waits until the lane takes it; ends when the collector closes.
    fn stage_ahead(&self, mut stage: Box<dyn BatchStage>, lane: SyncSender<Staged>) {
        loop {
            let next = match self.collector.next_job(self.idle_limit(), false) {
                NextJob::Job(due) => {
                    let (job, taken) = self.take(due);
                    let staged = catch_unwind(AssertUnwindSafe(|| stage.stage(&job.batch)))
                        .unwrap_or_else(|_| Err(BackendError::Panicked { during: "staging".into() }));
                    Staged::Job(Box::new(StagedJob { job, taken, staged, ready: Instant::now() }))
                }
                NextJob::Idle => Staged::Idle,
                NextJob::Closed => return,
            };
            if lane.send(next).is_err() {
                return;
            }
        }
    }

    /// A one-row forward to see whether an unhealthy backend has recovered.
    fn probe(&self, backend: &mut dyn ModelBackend) {
        let batch = warmup_batch(self.factory.schema(), 1);
        let succeeded =
            self.checked_forward(backend, &batch, "probe forward", |b, batch| b.forward(batch)).is_ok();
        self.stats.probe_forwards.inc();
        self.record_health(succeeded);
    }

    fn record_health(&self, succeeded: bool) {
        if let Some(healthy) = self.health.record(succeeded) {
            self.stats.backend_healthy.set(i64::from(healthy));
            if healthy {
                tracing::info!(lane = self.lane, "backend healthy again after a successful forward");
            } else {
                tracing::error!(
                    lane = self.lane,
                    "backend unhealthy: too many failed (or stalled) forwards in a row"
                );
            }
        }
    }

    fn load_and_warm_up(&self) -> Result<Box<dyn ModelBackend>, LaneFailed> {
        let lane = self.lane;
        let mut backend = catch_unwind(AssertUnwindSafe(|| self.factory.create_lane(lane)))
            .unwrap_or_else(|_| Err(BackendError::Panicked { during: "loading".into() }))
            .map_err(|error| LaneFailed::Load { lane, error })?;
        for rows in self.factory.warmup_rows() {
            let batch = warmup_batch(self.factory.schema(), rows);
            self.checked_forward(backend.as_mut(), &batch, "warm-up", |b, batch| b.forward(batch))
                .map_err(|error| LaneFailed::WarmUp { lane, rows, error })?;
        }
        Ok(backend)
    }

    /// The job of a batch just taken from the collector, and when it was
    /// taken: the end of its requests' queue time.
    fn take(&self, due: Due) -> (Job, Instant) {
        let taken = Instant::now();
        let job = due.into_job();
        for waiter in &job.waiters {
            self.stats.queue_seconds.observe(taken.saturating_duration_since(waiter.admitted).as_secs_f64());
        }
        (job, taken)
    }

    /// Runs `job`'s forward (the rest of it, given what its stage made of
    /// it, when `staged`) and answers every request in it. `taken`: when
    /// the lane (or its stage thread) took it from the collector;
    /// `handover`: how long a staged batch then waited for the lane once
    /// staged (queue time too).
    fn run_job(
        &self,
        backend: &mut dyn ModelBackend,
        job: Job,
        taken: Instant,
        handover: Duration,
        staged: Option<Result<StagedBatch, BackendError>>,
    ) {
        self.stats.busy_lanes.inc();
        let bytes = job.waiters.iter().map(|w| w.lease.bytes()).sum();
        self.compute(backend, job, taken, handover, staged);
        crate::memory::freed_batch(bytes);
        self.stats.busy_lanes.dec();
    }

    fn compute(
        &self,
        backend: &mut dyn ModelBackend,
        mut job: Job,
        taken: Instant,
        handover: Duration,
        staged: Option<Result<StagedBatch, BackendError>>,
    ) {
        backend.set_threads(job.threads);
        let start = Instant::now();
        let (scores, staging) = match staged {
            None => (self.checked_forward(backend, &job.batch, "forward", |b, batch| b.forward(batch)), None),
            Some(Err(error)) => (Err(error), None),
            Some(Ok(mut staged)) => {
                let dropped = job.retain_waiting(start, &mut staged);
                self.stats.requests_abandoned.inc_by(dropped as u64);
                if job.waiters.is_empty() {
                    return;
                }
                let took = staged.took;
                let scores = self.checked_forward(backend, &job.batch, "forward", move |b, batch| {
                    b.forward_staged(batch, staged)
                });
                (scores, Some(took))
            }
        };
        // A staged batch's compute time includes its staging.
        let compute_time = start.elapsed() + staging.unwrap_or_default();
        let rows = job.batch.rows;
        if let Err(error) = &scores {
            if abandoned(error, &job.batch, Instant::now()) {
                // Counted as abandoned only: no forward computed it.
                let stalled = stalled_in_forward(&job, taken);
                let requests: Vec<u64> = job.waiters.iter().map(|w| w.id).collect();
                tracing::debug!(lane = self.lane, rows, ?requests, stalled, error = %error_chain(error), "batch abandoned");
                self.stats.batches_abandoned.inc();
                if stalled {
                    self.stats.batches_stalled.inc();
                    self.record_health(false);
                }
                for waiter in job.waiters {
                    let _ = waiter.reply.send(Err(EngineError::DeadlineExceeded));
                }
                return;
            }
        }
        self.stats.forwards.inc();
        self.stats.rows_computed.inc_by(rows as u64);
        self.stats.requests_computed.inc_by(job.waiters.len() as u64);
        self.stats.compute_seconds.observe(compute_time.as_secs_f64());
        self.stats.batch_rows.observe(rows as f64);
        self.stats.batch_requests.observe(job.waiters.len() as f64);
        let scores = match scores {
            Ok(scores) => {
                self.record_health(true);
                scores
            }
            Err(error) => {
                self.record_health(false);
                let requests: Vec<u64> = job.waiters.iter().map(|w| w.id).collect();
                tracing::error!(lane = self.lane, rows, ?requests, error = %error_chain(&error), "forward failed");
                self.stats.backend_errors.inc();
                for waiter in job.waiters {
                    let _ = waiter.reply.send(Err(EngineError::Backend(error.clone())));
                }
                return;
            }
        };
        let fused_requests = job.waiters.len();
        // A lone request with one output keeps the forward's buffer.
        let answers: Vec<Vec<Vec<f32>>> = if fused_requests == 1 && scores.len() == rows {
            vec![vec![scores]]
        } else {
            job.batch.split_outputs(&scores).collect()
        };
        for (waiter, outputs) in job.waiters.into_iter().zip(answers) {
            let _ = waiter.reply.send(Ok(Prediction {
                outputs,
                forwards: 1,
                fused_rows: rows,
                fused_requests,
                queue_time: taken.saturating_duration_since(waiter.admitted) + handover,
                compute_time,
                model_version: Arc::clone(&self.model_version),
            }));
        }
    }
}

/// Whether `error`, from the forward over `batch`, is the batch abandoned
/// by every caller ([`BackendError::Abandoned`]) rather than a failure: only
/// once the batch's deadline has passed at `now`. A batch without one
/// (warm-up, probes, a caller without a deadline) has a caller waiting, so
/// the claim is a failure there.
fn abandoned(error: &BackendError, batch: &narsil_core::KeyedBatch, now: Instant) -> bool {
    matches!(error, BackendError::Abandoned { .. }) && batch.deadline.is_some_and(|deadline| deadline <= now)
}

/// Whether an abandoned `job`, taken from the queue at `taken` (by its lane
/// or its lane's stage thread), spent its time in its forward rather than
/// in the queue: for the caller that stopped waiting last (whose deadline is
/// the batch's; of several, the one admitted first), the time from the take
/// to the deadline was longer than the time from admission to the take. Such
/// a batch was *stalled* by what its forward waited on (a table store too
/// slow to deliver) and counts toward the backend's health as a failure; a
/// batch taken with less than half of its time left was late because of the
/// queue (an overloaded replica) and does not.
fn stalled_in_forward(job: &Job, taken: Instant) -> bool {
    let last = job.waiters.iter().filter_map(|w| Some((w.deadline?, std::cmp::Reverse(w.admitted)))).max();
    last.is_some_and(|(deadline, std::cmp::Reverse(admitted))| {
        deadline.saturating_duration_since(taken) > taken.saturating_duration_since(admitted)
    })
}

impl LaneContext {
    /// Runs one forward (`run`) with panics caught, and holds the backend
    /// to its contract of one score per row and output.
    fn checked_forward(
        &self,
        backend: &mut dyn ModelBackend,
        batch: &narsil_core::KeyedBatch,
        during: &str,
        run: impl FnOnce(&mut dyn ModelBackend, &narsil_core::KeyedBatch) -> Result<Vec<f32>, BackendError>,
    ) -> Result<Vec<f32>, BackendError> {
        let expected = batch.rows * self.factory.schema().num_outputs();
        match catch_unwind(AssertUnwindSafe(|| run(backend, batch))) {
            Ok(Ok(scores)) if scores.len() == expected => Ok(scores),
            Ok(Ok(scores)) => Err(BackendError::WrongScoreCount { rows: batch.rows, got: scores.len() }),
            Ok(Err(error)) => Err(error),
            Err(_) => Err(BackendError::Panicked { during: during.into() }),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Mutex;

    use narsil_core::mock::mock_scores;
    use narsil_core::request::{IdPolicy, RequestLimits};
    use narsil_core::{assemble, KeyedBatch, ModelSchema, RequestSamples};
    use tokio::sync::oneshot;

    use super::*;
    use crate::collector::BatchQueue;
    use crate::config::{EngineConfig, ExecutionMode};
    use crate::engine::{Engine, EngineHandle};
    use crate::flush::PerRequest;
    use crate::job::Waiter;
    use crate::memory::MemoryBudget;

    type Answer = oneshot::Receiver<Result<Prediction, EngineError>>;

    fn schema() -> ModelSchema {
        ModelSchema::dlrm("test", "cpu", 1000)
    }

    /// A one-sample request, valid for [`schema`].
    fn one_sample() -> RequestSamples {
        let schema = schema();
        RequestSamples {
            num_samples: 1,
            dense: vec![0.5; schema.num_dense],
            lengths: vec![1; schema.num_sparse()],
            ids: (0..schema.num_sparse() as i64).collect(),
            ..Default::default()
        }
    }

    /// Creates each lane's backend with `lane`.
    struct Factory<B> {
        schema: ModelSchema,
        lane: Box<dyn Fn() -> B + Send + Sync>,
    }

    impl<B: ModelBackend + 'static> BackendFactory for Factory<B> {
        fn schema(&self) -> &ModelSchema {
            &self.schema
        }

        fn create_lane(&self, _lane: usize) -> Result<Box<dyn ModelBackend>, BackendError> {
            Ok(Box::new((self.lane)()))
        }
    }

    /// Forwards fail with the errors given, in order, then score.
    struct Scripted(VecDeque<BackendError>);

    impl ModelBackend for Scripted {
        fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
            self.0.pop_front().map_or_else(|| Ok(mock_scores(batch)), Err)
        }
    }

    /// A lane (not started) of one engine's shared state, whose backend
    /// turns unhealthy after `unhealthy_after` failures in a row.
    fn lane(unhealthy_after: u32) -> LaneContext {
        let stats = Arc::new(Stats::default());
        let schema = schema();
        let queue = BatchQueue::new(Arc::new(PerRequest), schema.num_dense, schema.num_sparse());
        let factory = Factory { schema, lane: Box::new(|| Scripted(VecDeque::new())) };
        LaneContext {
            lane: 0,
            shared: Arc::new(LaneShared {
                factory: Arc::new(factory),
                collector: Arc::new(Collector::new(queue, 2, Arc::clone(&stats))),
                stats,
                readiness: watch::channel(Readiness::default()).0,
                health: Arc::new(BackendHealth::new(unhealthy_after)),
                probe_interval: Duration::from_secs(1),
                model_version: Arc::from("1"),
                stage_ahead: false,
            }),
        }
    }

    /// A batch of `requests` one-sample requests whose callers all stop
    /// waiting at `deadline`, and their answers.
    fn job(requests: usize, deadline: Option<Instant>) -> (Job, Vec<Answer>) {
        let schema = schema();
        let request = one_sample();
        let mut batch =
            assemble(schema.num_dense, schema.num_sparse(), std::iter::repeat_n(&request, requests));
        batch.deadline = deadline;
        let budget = MemoryBudget::new(usize::MAX);
        let (waiters, answers) = (0..requests)
            .map(|id| {
                let (reply, answer) = oneshot::channel();
                let lease = budget.try_reserve(0).unwrap();
                let admitted = Instant::now();
                (Waiter { id: id as u64, reply, admitted, deadline, lease }, answer)
            })
            .unzip();
        (Job { threads: 1, batch, waiters }, answers)
    }

    /// Runs a batch of two requests whose deadline has passed on `backend`;
    /// their answers.
    fn run_late_batch(
        lane: &LaneContext,
        backend: &mut dyn ModelBackend,
    ) -> Vec<Result<Prediction, EngineError>> {
        let (job, answers) = job(2, Some(Instant::now()));
        lane.run_job(backend, job, Instant::now(), Duration::ZERO, None);
        answers.into_iter().map(|mut a| a.try_recv().expect("answered")).collect()
    }

    fn abandoned_error() -> BackendError {
        BackendError::abandoned("reading rows: every caller's deadline passed")
    }

    fn unavailable() -> BackendError {
        BackendError::Unavailable { reason: "the store is gone".into(), source: None }
    }

    #[test]
    fn ten_batches_whose_callers_all_left_leave_the_backend_healthy() {
        let lane = lane(5);
        let mut backend = Scripted((0..10).map(|_| abandoned_error()).collect());
        for batch in 0..10 {
            for answer in run_late_batch(&lane, &mut backend) {
                assert!(matches!(answer, Err(EngineError::DeadlineExceeded)), "batch {batch}: {answer:?}");
            }
        }
        let stats = lane.stats.snapshot(0);
        assert_eq!((stats.batches_abandoned, stats.batches_stalled, stats.backend_errors), (10, 0, 0));
        assert!(lane.health.is_healthy());
        assert_eq!(lane.stats.backend_healthy.get(), 1);
        let text = lane.stats.encode(0, 0, 0);
        assert!(text.contains("narsil_batches_abandoned_total 10"), "{text}");
        assert!(text.contains("narsil_forward_errors_total 0"), "{text}");
    }

    #[test]
    fn abandoned_batches_count_as_abandoned_only_not_as_forwards_rows_or_requests_computed() {
        let lane = lane(5);
        let mut backend = Scripted([abandoned_error(), abandoned_error()].into());
        run_late_batch(&lane, &mut backend);
        run_late_batch(&lane, &mut backend);
        let stats = lane.stats.snapshot(0);
        assert_eq!((stats.forwards, stats.rows_computed, stats.requests_computed), (0, 0, 0));
        assert_eq!(stats.batches_abandoned, 2);
        let text = lane.stats.encode(0, 0, 0);
        for empty in
            ["narsil_forwards_total 0", "narsil_compute_seconds_count 0", "narsil_batch_rows_count 0"]
        {
            assert!(text.contains(empty), "{empty}: {text}");
        }
        // A forward that fails ran: it counts, as one that succeeds does.
        run_late_batch(&lane, &mut Scripted([unavailable()].into()));
        run_late_batch(&lane, &mut backend);
        let stats = lane.stats.snapshot(0);
        assert_eq!((stats.forwards, stats.rows_computed, stats.requests_computed), (2, 4, 4));
        assert_eq!(metric(&lane.stats.encode(0, 0, 0), "narsil_compute_seconds_count"), 2.0);
    }

    /// A batch of two requests taken from the queue now, whose callers
    /// were admitted `queued` ago and stop waiting `left` from now, run on
    /// a backend that stops at the deadline; their answers are checked
    /// to be DEADLINE_EXCEEDED.
    fn run_abandoned_batch(lane: &LaneContext, queued: Duration, left: Duration) {
        let (mut job, answers) = job(2, Some(Instant::now() + left));
        for waiter in &mut job.waiters {
            waiter.admitted -= queued;
        }
        lane.run_job(&mut StopsAtTheDeadline, job, Instant::now(), Duration::ZERO, None);
        for mut answer in answers {
            let answer = answer.try_recv().expect("answered");
            assert!(matches!(answer, Err(EngineError::DeadlineExceeded)), "{answer:?}");
        }
    }

    #[test]
    fn consecutive_batches_stalled_in_their_forward_make_the_backend_unhealthy() {
        // Like a disk that has turned slow: every batch is taken at once,
        // with all of its time left, and its forward still waits on the
        // store until every caller has gone.
        let (queued, left) = (Duration::ZERO, Duration::from_millis(20));
        let lane = lane(3);
        run_abandoned_batch(&lane, queued, left);
        run_abandoned_batch(&lane, queued, left);
        assert!(lane.health.is_healthy(), "two stalled batches of three");
        // A batch late because of the queue (60 ms queued, 20 ms left)
        // neither counts nor starts the count again.
        run_abandoned_batch(&lane, Duration::from_millis(60), left);
        assert!(lane.health.is_healthy());
        run_abandoned_batch(&lane, queued, left);
        assert!(!lane.health.is_healthy(), "three stalled batches in a row");
        assert_eq!(lane.stats.backend_healthy.get(), 0);
        let stats = lane.stats.snapshot(0);
        assert_eq!((stats.batches_abandoned, stats.batches_stalled, stats.backend_errors), (4, 3, 0));
        assert_eq!(stats.forwards, 0, "abandoned batches are no forwards");
        let text = lane.stats.encode(0, 0, 0);
        assert_eq!(metric(&text, "narsil_batches_stalled_total"), 3.0);
        assert_eq!(metric(&text, "narsil_batches_abandoned_total"), 4.0);
        // Failures and stalls in a row count together (a disk slow, then
        // failing); a forward that succeeds makes it healthy again.
        let lane = self::lane(3);
        run_abandoned_batch(&lane, queued, left);
        run_late_batch(&lane, &mut Scripted([unavailable()].into()));
        run_abandoned_batch(&lane, queued, left);
        assert!(!lane.health.is_healthy());
        run_late_batch(&lane, &mut Scripted(VecDeque::new()));
        assert!(lane.health.is_healthy());
    }

    #[test]
    fn a_batch_is_stalled_when_taken_with_more_than_half_of_its_time_left() {
        let now = Instant::now();
        let at = |ms| now + Duration::from_millis(ms);
        let stalled = |admitted: &[(u64, u64)], taken| {
            let (mut job, _answers) = job(admitted.len(), None);
            for (waiter, &(admitted, deadline)) in job.waiters.iter_mut().zip(admitted) {
                (waiter.admitted, waiter.deadline) = (at(admitted), Some(at(deadline)));
            }
            stalled_in_forward(&job, at(taken))
        };
        assert!(stalled(&[(0, 100)], 40));
        assert!(!stalled(&[(0, 100)], 60));
        assert!(!stalled(&[(0, 100)], 100), "taken at its deadline");
        // The caller that left last decides; of two, the one queued longer.
        assert!(stalled(&[(0, 50), (30, 130)], 40), "90 ms left of the last caller's 100");
        assert!(!stalled(&[(30, 130), (0, 130)], 70), "60 of 130 left for the caller admitted first");
        assert!(!stalled_in_forward(&job(1, None).0, now), "no deadline");
    }

    #[test]
    fn failures_count_toward_unhealthy_across_abandoned_batches_in_between() {
        let lane = lane(5);
        let errors = [unavailable(), unavailable(), unavailable(), unavailable(), abandoned_error()];
        let mut backend = Scripted(errors.into_iter().chain([abandoned_error(), unavailable()]).collect());
        for _ in 0..4 {
            let answers = run_late_batch(&lane, &mut backend);
            assert!(answers
                .iter()
                .all(|a| matches!(a, Err(EngineError::Backend(BackendError::Unavailable { .. })))));
        }
        for _ in 0..2 {
            run_late_batch(&lane, &mut backend);
            assert!(lane.health.is_healthy(), "an abandoned batch is no failure");
        }
        run_late_batch(&lane, &mut backend);
        assert!(!lane.health.is_healthy(), "five failures in a row, abandoned batches aside");
        let stats = lane.stats.snapshot(0);
        assert_eq!((stats.batches_abandoned, stats.backend_errors), (2, 5));
        // Nor does an abandoned batch make it healthy again.
        let mut backend = Scripted([abandoned_error()].into());
        run_late_batch(&lane, &mut backend);
        assert!(!lane.health.is_healthy());
        run_late_batch(&lane, &mut backend);
        assert!(lane.health.is_healthy(), "a forward that succeeds does");
    }

    #[test]
    fn a_claim_of_abandonment_while_a_caller_still_waits_is_a_failure() {
        let lane = lane(1);
        // A caller without a deadline, and callers whose deadline is ahead.
        for deadline in [None, Some(Instant::now() + Duration::from_secs(3600))] {
            let (job, answers) = job(1, deadline);
            lane.run_job(
                &mut Scripted([abandoned_error()].into()),
                job,
                Instant::now(),
                Duration::ZERO,
                None,
            );
            for mut answer in answers {
                let answer = answer.try_recv().unwrap();
                assert!(
                    matches!(answer, Err(EngineError::Backend(BackendError::Abandoned { .. }))),
                    "{deadline:?}: {answer:?}"
                );
            }
        }
        let stats = lane.stats.snapshot(0);
        assert_eq!((stats.batches_abandoned, stats.backend_errors), (0, 2));
        assert!(!lane.health.is_healthy());
    }

    #[test]
    fn probes_and_warm_ups_never_take_a_claim_of_abandonment_for_success() {
        // Their batches carry no deadline.
        assert_eq!(warmup_batch(&schema(), 1).deadline, None);
        let lane = lane(1);
        lane.probe(&mut Scripted([abandoned_error()].into()));
        assert!(!lane.health.is_healthy(), "an abandoned probe is a failed probe");
        lane.probe(&mut Scripted(VecDeque::new()));
        assert!(lane.health.is_healthy());
        let failing = Factory { schema: schema(), lane: Box::new(|| Scripted([abandoned_error()].into())) };
        let lane = LaneContext {
            lane: 0,
            shared: Arc::new(LaneShared {
                factory: Arc::new(failing),
                ..Arc::into_inner(lane.shared).unwrap()
            }),
        };
        let failed = lane.load_and_warm_up().err().expect("warm-up fails");
        assert!(
            matches!(failed, LaneFailed::WarmUp { error: BackendError::Abandoned { .. }, .. }),
            "{failed:?}"
        );
    }

    fn config(stage_ahead: bool) -> EngineConfig {
        EngineConfig {
            mode: ExecutionMode::Batch,
            max_batch_requests: 16,
            max_batch_rows: 1024,
            batch_timeout: Duration::ZERO,
            lanes: 1,
            max_forward_threads: 2,
            max_queue_requests: 64,
            max_queue_rows: 1024,
            memory: MemoryBudget::new(1 << 30),
            queue_timeout: None,
            limits: RequestLimits { max_samples: 64, id_policy: IdPolicy::Reject },
            unhealthy_after_failures: 5,
            health_probe_interval: Duration::from_millis(50),
            stage_ahead,
        }
    }

    async fn wait_until(what: &str, done: impl Fn() -> bool) {
        let give_up = Instant::now() + Duration::from_secs(20);
        while !done() {
            assert!(Instant::now() < give_up, "gave up waiting for {what}");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// The value of the sample of `metric` in the exposition `text`.
    fn metric(text: &str, metric: &str) -> f64 {
        text.lines()
            .find(|line| line.strip_prefix(metric).is_some_and(|rest| rest.starts_with(['{', ' '])))
            .and_then(|line| line.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no {metric} in {text}"))
    }

    /// Like a table store whose reads stop once every caller left: a
    /// forward over a batch with a deadline runs past it, then stops.
    struct StopsAtTheDeadline;

    impl ModelBackend for StopsAtTheDeadline {
        fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
            let Some(deadline) = batch.deadline else { return Ok(mock_scores(batch)) };
            std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
            Err(abandoned_error())
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_of_batches_a_store_stalls_count_as_deadlines_and_take_the_replica_out() {
        let factory = Factory { schema: schema(), lane: Box::new(|| StopsAtTheDeadline) };
        // No probe in the test's time (a probe carries no deadline, and
        // would succeed here).
        let config = EngineConfig { health_probe_interval: Duration::from_secs(3600), ..config(false) };
        let engine = Engine::start(Arc::new(factory), config).unwrap();
        let handle = engine.handle();
        handle.wait_ready().await.unwrap();
        // Each request is taken at once, and its forward waits until its
        // caller has gone: a store too slow to deliver, not a queue.
        for sent in 1..=10 {
            let deadline = Instant::now() + Duration::from_millis(20);
            let answer = handle.predict(one_sample(), None, Some(deadline)).await;
            assert!(matches!(answer, Err(EngineError::DeadlineExceeded)), "{answer:?}");
            wait_until("the batch abandoned", || handle.stats().batches_abandoned == sent).await;
        }
        let stats = handle.stats();
        assert_eq!((stats.batches_stalled, stats.backend_errors, stats.forwards), (10, 0, 0));
        assert!(!*handle.backend_health().borrow(), "5 stalled batches in a row (the config's limit)");
        let text = handle.metrics_text();
        assert_eq!(
            metric(&text, r#"narsil_requests_total{model="dlrm",version="1",outcome="deadline"}"#),
            10.0
        );
        assert_eq!(metric(&text, "narsil_backend_healthy"), 0.0);
        engine.shutdown().await;
    }

    /// A staged backend whose forwards wait at a gate, recording the
    /// threads each staged forward was given.
    #[derive(Default)]
    struct Gate {
        open: AtomicBool,
        staged: AtomicUsize,
        threads: Mutex<Vec<usize>>,
    }

    struct Gated {
        gate: Arc<Gate>,
        threads: usize,
    }

    struct CountingStage(Arc<Gate>);

    impl BatchStage for CountingStage {
        fn stage(&mut self, batch: &KeyedBatch) -> Result<StagedBatch, BackendError> {
            self.0.staged.fetch_add(1, Ordering::SeqCst);
            Ok(StagedBatch { values: vec![0.0; batch.rows], width: 1, took: Duration::ZERO })
        }
    }

    impl ModelBackend for Gated {
        fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
            Ok(mock_scores(batch))
        }

        fn set_threads(&mut self, threads: usize) {
            self.threads = threads;
        }

        fn take_stage(&mut self) -> Option<Box<dyn BatchStage>> {
            Some(Box::new(CountingStage(Arc::clone(&self.gate))))
        }

        fn forward_staged(
            &mut self,
            batch: &KeyedBatch,
            _staged: StagedBatch,
        ) -> Result<Vec<f32>, BackendError> {
            self.gate.threads.lock().unwrap().push(self.threads);
            while !self.gate.open.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(mock_scores(batch))
        }
    }

    /// How long the staged batch B waits at the hand-over.
    const HELD: Duration = Duration::from_millis(100);

    /// One lane on two cores, staging ahead: A's forward waits at the gate
    /// while B is taken and staged, then B waits at the hand-over for
    /// [`HELD`] before the gate opens. Returns A's and B's answers, the
    /// engine's handle (engine stopped) and the gate.
    async fn staged_behind_a_busy_lane() -> (Prediction, Prediction, EngineHandle, Arc<Gate>) {
        let gate = Arc::new(Gate::default());
        let lanes_gate = Arc::clone(&gate);
        let lane = move || Gated { gate: Arc::clone(&lanes_gate), threads: 1 };
        let engine =
            Engine::start(Arc::new(Factory { schema: schema(), lane: Box::new(lane) }), config(true))
                .unwrap();
        let handle = engine.handle();
        handle.wait_ready().await.unwrap();
        let send = || {
            let handle = handle.clone();
            tokio::spawn(async move { handle.predict(one_sample(), None, None).await.unwrap() })
        };
        let a = send();
        wait_until("A in its forward", || gate.threads.lock().unwrap().len() == 1).await;
        let b = send();
        wait_until("B staged", || gate.staged.load(Ordering::SeqCst) == 2).await;
        tokio::time::sleep(HELD).await;
        gate.open.store(true, Ordering::SeqCst);
        let (a, b) = (a.await.unwrap(), b.await.unwrap());
        engine.shutdown().await;
        (a, b, handle, gate)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_staged_batch_s_wait_for_its_busy_lane_is_queue_time() {
        let (_, b, handle, _) = staged_behind_a_busy_lane().await;
        // B was taken at once: nearly all of its queue time is the
        // hand-over (about HELD; half of it leaves room for a slow stage
        // thread between counting B staged and finishing its stage).
        let at_least = HELD / 2;
        assert!(
            b.queue_time >= at_least,
            "B waited {HELD:?} at the hand-over; queue time {:?}",
            b.queue_time
        );
        let text = handle.metrics_text();
        assert_eq!(metric(&text, "narsil_stage_handover_seconds_count"), 2.0, "A's and B's");
        assert!(metric(&text, "narsil_stage_handover_seconds_sum") >= at_least.as_secs_f64(), "{text}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_staged_batch_s_threads_are_chosen_when_its_lane_takes_it() {
        let (_, _, _, gate) = staged_behind_a_busy_lane().await;
        // B was taken while A's forward ran (1 thread then); at the
        // hand-over the server is otherwise idle and nothing is queued.
        assert_eq!(*gate.threads.lock().unwrap(), vec![2, 2], "threads of A's and B's forwards");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn batches_run_through_the_staged_path_are_counted() {
        let (_, _, handle, _) = staged_behind_a_busy_lane().await;
        assert_eq!(handle.stats().batches_staged, 2);
        assert_eq!(metric(&handle.metrics_text(), "narsil_batches_staged_total"), 2.0);
        // Without stage ahead the same backend's batches are not staged.
        let gate = Arc::new(Gate { open: AtomicBool::new(true), ..Default::default() });
        let lane = move || Gated { gate: Arc::clone(&gate), threads: 1 };
        let engine =
            Engine::start(Arc::new(Factory { schema: schema(), lane: Box::new(lane) }), config(false))
                .unwrap();
        let handle = engine.handle();
        handle.wait_ready().await.unwrap();
        handle.predict(one_sample(), None, None).await.unwrap();
        assert_eq!((handle.stats().forwards, handle.stats().batches_staged), (1, 0));
        engine.shutdown().await;
    }
}
