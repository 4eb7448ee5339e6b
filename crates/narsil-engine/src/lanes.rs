//! Executor lanes: OS threads that each own one model instance. A lane loads
//! its instance on its own thread, warms it up, reports ready, then takes
//! the collector's next due batch, runs it and answers every request in it.
//!
//! A failing forward fails only its own batch; a panicking backend is caught
//! and the lane keeps serving. Every forward's outcome goes to the shared
//! [`BackendHealth`]; while it says unhealthy, an idle lane probes the
//! backend with a one-row forward every probe interval, so that a recovered
//! backend turns healthy again without traffic (which load balancers stop
//! sending once health says NOT_SERVING).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use narsil_core::backend::warmup_batch;
use narsil_core::{BackendFactory, ModelBackend};
use tokio::sync::watch;

use crate::collector::{Collector, NextJob};
use crate::error::EngineError;
use crate::health::BackendHealth;
use crate::job::{Job, Prediction};
use crate::stats::Stats;

/// Startup progress of the lanes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Readiness {
    /// Lanes loaded and warmed up.
    pub ready: usize,
    /// The first lane failure, if any.
    pub failed: Option<String>,
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
            Err(message) => {
                tracing::error!(lane = self.lane, %message, "lane failed to start");
                self.readiness.send_modify(|r| {
                    r.failed.get_or_insert(format!("lane {}: {message}", self.lane));
                });
                return;
            }
        };
        tracing::info!(lane = self.lane, elapsed_ms = started.elapsed().as_millis() as u64, "lane ready");
        self.readiness.send_modify(|r| r.ready += 1);
        loop {
            let idle_limit = (!self.health.is_healthy()).then_some(self.probe_interval);
            match self.collector.next_job(idle_limit) {
                NextJob::Job(job) => {
                    self.stats.busy_lanes.inc();
                    self.run_job(backend.as_mut(), job);
                    self.stats.busy_lanes.dec();
                }
                NextJob::Idle => self.probe(backend.as_mut()),
                NextJob::Closed => return,
            }
        }
    }

    /// A one-row forward to see whether an unhealthy backend has recovered.
    fn probe(&self, backend: &mut dyn ModelBackend) {
        let batch = warmup_batch(self.factory.schema(), 1);
        let outcome = catch_unwind(AssertUnwindSafe(|| backend.forward(&batch)));
        let succeeded = matches!(&outcome, Ok(Ok(scores)) if scores.len() == 1);
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

    fn load_and_warm_up(&self) -> Result<Box<dyn ModelBackend>, String> {
        let mut backend = catch_unwind(AssertUnwindSafe(|| self.factory.create_lane(self.lane)))
            .map_err(|_| "backend panicked while loading".to_string())?
            .map_err(|e| e.to_string())?;
        for rows in self.factory.warmup_rows() {
            let batch = warmup_batch(self.factory.schema(), rows);
            let scores = catch_unwind(AssertUnwindSafe(|| backend.forward(&batch)))
                .map_err(|_| format!("backend panicked during warm-up ({rows} rows)"))?
                .map_err(|e| format!("warm-up forward of {rows} rows failed: {e}"))?;
            if scores.len() != rows {
                return Err(format!("warm-up forward of {rows} rows returned {} scores", scores.len()));
            }
        }
        Ok(backend)
    }

    fn run_job(&self, backend: &mut dyn ModelBackend, job: Job) {
        let start = Instant::now();
        for waiter in &job.waiters {
            self.stats.queue_seconds.observe(start.saturating_duration_since(waiter.admitted).as_secs_f64());
        }
        let outcome = catch_unwind(AssertUnwindSafe(|| backend.forward(&job.batch)));
        let compute_time = start.elapsed();
        let rows = job.batch.rows;
        let scores = match outcome {
            Ok(Ok(scores)) if scores.len() == rows => Ok(scores),
            Ok(Ok(scores)) => Err(format!("backend returned {} scores for {rows} rows", scores.len())),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("backend panicked during forward".to_string()),
        };
        self.stats.forwards.inc();
        self.stats.rows_computed.inc_by(rows as u64);
        self.stats.requests_computed.inc_by(job.waiters.len() as u64);
        self.stats.compute_seconds.observe(compute_time.as_secs_f64());
        self.stats.batch_rows.observe(rows as f64);
        self.stats.batch_requests.observe(job.waiters.len() as f64);
        self.record_health(scores.is_ok());
        let scores = match scores {
            Ok(scores) => scores,
            Err(message) => {
                tracing::error!(lane = self.lane, rows, %message, "forward failed");
                self.stats.backend_errors.inc();
                for waiter in job.waiters {
                    let _ = waiter.reply.send(Err(EngineError::Backend(message.clone())));
                }
                return;
            }
        };
        let fused_requests = job.waiters.len();
        for (waiter, part) in job.waiters.into_iter().zip(job.batch.split(&scores)) {
            let _ = waiter.reply.send(Ok(Prediction {
                scores: part.to_vec(),
                forwards: 1,
                fused_rows: rows,
                fused_requests,
                queue_time: start.saturating_duration_since(waiter.admitted),
                compute_time,
            }));
        }
    }
}
