//! Engine settings, checked once at startup.

use std::time::Duration;

use narsil_core::request::RequestLimits;

/// How queued requests become forward passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecutionMode {
    /// Fuse queued requests into one forward (continuous batching).
    Batch,
    /// One request per forward, on the next free lane.
    Worker,
}

/// Everything the engine needs to know besides the model.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Batch or worker execution.
    pub mode: ExecutionMode,
    /// Most requests fused into one forward (batch mode).
    pub max_batch_requests: usize,
    /// Most rows fused into one forward.
    pub max_batch_rows: usize,
    /// How long the oldest queued request may wait for company once a lane
    /// is free; zero sends at once.
    pub batch_timeout: Duration,
    /// Executor lanes (threads each owning a model instance).
    pub lanes: usize,
    /// Most requests admitted but not yet started.
    pub max_queue_requests: usize,
    /// Most rows admitted but not yet started.
    pub max_queue_rows: usize,
    /// Most decoded request bytes admitted but not yet started; a single
    /// request larger than this is refused as invalid.
    pub max_queue_bytes: usize,
    /// Longest a request may wait for its forward to start; past it the
    /// request gets DEADLINE_EXCEEDED and is never computed. `None`: only
    /// the caller's deadline applies.
    pub queue_timeout: Option<Duration>,
    /// Per-request limits checked before queueing.
    pub limits: RequestLimits,
    /// Failed forwards in a row after which the backend counts as unhealthy
    /// (health NOT_SERVING until a forward succeeds); 0: never.
    pub unhealthy_after_failures: u32,
    /// How often an idle lane probes an unhealthy backend.
    pub health_probe_interval: Duration,
}

impl EngineConfig {
    /// Requests one forward may carry in this mode.
    pub fn requests_per_batch(&self) -> usize {
        match self.mode {
            ExecutionMode::Batch => self.max_batch_requests,
            ExecutionMode::Worker => 1,
        }
    }

    /// Checks the settings against each other.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("lanes", self.lanes),
            ("batch-size", self.max_batch_requests),
            ("max-batch-rows", self.max_batch_rows),
            ("max-queue-requests", self.max_queue_requests),
            ("max-queue-rows", self.max_queue_rows),
            ("max-queue-bytes", self.max_queue_bytes),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("--{name} must be at least 1"));
        }
        if self.limits.max_batch_size > self.max_queue_rows {
            return Err(format!(
                "--max-request-samples ({}) must not exceed --max-queue-rows ({})",
                self.limits.max_batch_size, self.max_queue_rows
            ));
        }
        if self.queue_timeout.is_some_and(|t| t.is_zero()) {
            return Err("--queue-timeout-ms must be positive when set".into());
        }
        Ok(())
    }
}
