//! Starting the lanes: one thread each, which loads and warms up its
//! backend, reports into the readiness it shares, then serves, staged
//! ([`LaneContext::serve_staged`]) when its backend has a stage and stage
//! ahead is on, plainly ([`LaneContext::serve`]) otherwise.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use narsil_core::backend::warmup_batch;
use narsil_core::{error_chain, BackendError, ModelBackend};

use super::{LaneContext, LaneShared};
use crate::error::LaneFailed;

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

    pub(super) fn load_and_warm_up(&self) -> Result<Box<dyn ModelBackend>, LaneFailed> {
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
}
