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
//! ahead). Before its forward a staged batch loses the requests whose
//! caller stopped waiting meanwhile (DEADLINE_EXCEEDED for those whose
//! deadline passed), rows and all; with none left the forward is skipped.
//!
//! A failing forward fails only its own batch; a panicking backend is caught
//! and the lane keeps serving. Every forward's outcome goes to the shared
//! [`BackendHealth`]; while it says unhealthy, an idle lane probes the
//! backend with a one-row forward every probe interval, so that a recovered
//! backend turns healthy again without traffic (which load balancers stop
//! sending once health says NOT_SERVING).

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

/// A batch taken at `taken`, and what its stage made of it.
struct StagedJob {
    job: Job,
    taken: Instant,
    staged: Result<StagedBatch, BackendError>,
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
                    self.run_job(backend, job, taken, None);
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
                        let StagedJob { job, taken, staged } = *staged;
                        self.run_job(backend, job, taken, Some(staged));
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
                    Staged::Job(Box::new(StagedJob { job, taken, staged }))
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
                tracing::error!(lane = self.lane, "backend unhealthy: too many failed forwards in a row");
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
    /// the lane (or its stage thread) took it from the collector.
    fn run_job(
        &self,
        backend: &mut dyn ModelBackend,
        job: Job,
        taken: Instant,
        staged: Option<Result<StagedBatch, BackendError>>,
    ) {
        self.stats.busy_lanes.inc();
        let bytes = job.waiters.iter().map(|w| w.lease.bytes()).sum();
        self.compute(backend, job, taken, staged);
        crate::memory::freed_batch(bytes);
        self.stats.busy_lanes.dec();
    }

    fn compute(
        &self,
        backend: &mut dyn ModelBackend,
        mut job: Job,
        taken: Instant,
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
        self.stats.forwards.inc();
        self.stats.rows_computed.inc_by(rows as u64);
        self.stats.requests_computed.inc_by(job.waiters.len() as u64);
        self.stats.compute_seconds.observe(compute_time.as_secs_f64());
        self.stats.batch_rows.observe(rows as f64);
        self.stats.batch_requests.observe(job.waiters.len() as f64);
        self.record_health(scores.is_ok());
        let scores = match scores {
            Ok(scores) => scores,
            Err(error) => {
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
                queue_time: taken.saturating_duration_since(waiter.admitted),
                compute_time,
                model_version: Arc::clone(&self.model_version),
            }));
        }
    }
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
