//! Running one batch: its forward (the rest of it, after its stage, for a
//! staged batch), with panics caught and the backend held to its contract
//! of one score per row and output; its metrics; and the answer to every
//! request in it (its scores, or the forward's error). A batch abandoned by
//! every caller is answered and counted by `outcome.rs`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use narsil_core::{error_chain, BackendError, KeyedBatch, ModelBackend, StagedBatch};

use super::outcome::abandoned;
use super::LaneContext;
use crate::error::EngineError;
use crate::job::{Job, Prediction};

impl LaneContext {
    /// Runs `job`'s forward (the rest of it, given what its stage made of
    /// it, when `staged`) and answers every request in it. `taken`: when
    /// the lane (or its stage thread) took it from the collector;
    /// `handover`: how long a staged batch then waited for the lane once
    /// staged (queue time too).
    pub(super) fn run_job(
        &self,
        backend: &mut dyn ModelBackend,
        job: Job,
        taken: Instant,
        handover: Duration,
        staged: Option<Result<StagedBatch, BackendError>>,
    ) {
        self.stats.busy_lanes.inc();
        let bytes =
            job.waiters.iter().map(|w| w.lease.bytes() + w.working.as_ref().map_or(0, |s| s.bytes())).sum();
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
        if job.batch.request_blocks.is_some() && !backend.takes_request_level() {
            // A backend that takes only flat batches gets the request-level
            // bags copied into every row they belong to.
            job.batch = std::mem::take(&mut job.batch).into_flat();
        }
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
                self.answer_abandoned(job, taken, error);
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
            // Its bytes back on the budget before its caller hears: the
            // next wave of a request queued in waves finds them free.
            drop((waiter.lease, waiter.working));
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

    /// Runs one forward (`run`) with panics caught, and holds the backend
    /// to its contract of one score per row and output.
    pub(super) fn checked_forward(
        &self,
        backend: &mut dyn ModelBackend,
        batch: &KeyedBatch,
        during: &str,
        run: impl FnOnce(&mut dyn ModelBackend, &KeyedBatch) -> Result<Vec<f32>, BackendError>,
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
