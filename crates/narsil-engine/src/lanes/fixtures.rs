//! The lanes' test fixtures, shared by the tests of their files: a DLRM
//! schema and a one-sample request for it, a factory of test backends, a
//! backend that fails as scripted, a lane (not started) of one engine's
//! shared state, an engine config, and waiting on and reading metrics.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use narsil_core::mock::mock_scores;
use narsil_core::request::{IdPolicy, RequestLimits};
use narsil_core::{BackendError, BackendFactory, KeyedBatch, ModelBackend, ModelSchema, RequestSamples};
use tokio::sync::watch;

use super::{LaneContext, LaneShared, Readiness};
use crate::collector::{BatchQueue, Collector};
use crate::config::{EngineConfig, ExecutionMode};
use crate::flush::PerRequest;
use crate::health::BackendHealth;
use crate::memory::MemoryBudget;
use crate::stats::Stats;

pub(super) fn schema() -> ModelSchema {
    ModelSchema::dlrm("test", "cpu", 1000)
}

/// A one-sample request, valid for [`schema`].
pub(super) fn one_sample() -> RequestSamples {
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
pub(super) struct Factory<B> {
    pub(super) schema: ModelSchema,
    pub(super) lane: Box<dyn Fn() -> B + Send + Sync>,
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
pub(super) struct Scripted(pub(super) VecDeque<BackendError>);

impl ModelBackend for Scripted {
    fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
        self.0.pop_front().map_or_else(|| Ok(mock_scores(batch)), Err)
    }
}

/// A lane (not started) of one engine's shared state, whose backend
/// turns unhealthy after `unhealthy_after` failures in a row.
pub(super) fn lane(unhealthy_after: u32) -> LaneContext {
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

pub(super) fn abandoned_error() -> BackendError {
    BackendError::abandoned("reading rows: every caller's deadline passed")
}

pub(crate) fn config(stage_ahead: bool) -> EngineConfig {
    EngineConfig {
        request_level: None,
        mode: ExecutionMode::Batch,
        max_batch_requests: 16,
        max_batch_rows: 1024,
        max_batch_tokens: 1 << 20,
        batch_timeout: Duration::ZERO,
        lanes: 1,
        max_forward_threads: 2,
        max_queue_requests: 64,
        max_queue_rows: 1024,
        memory: MemoryBudget::new(1 << 30),
        queue_timeout: None,
        limits: RequestLimits::new(64, IdPolicy::Reject),
        unhealthy_after_failures: 5,
        health_probe_interval: Duration::from_millis(50),
        stage_ahead,
    }
}

pub(super) async fn wait_until(what: &str, done: impl Fn() -> bool) {
    let give_up = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < give_up, "gave up waiting for {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// The value of the sample of `metric` in the exposition `text`.
pub(super) fn metric(text: &str, metric: &str) -> f64 {
    text.lines()
        .find(|line| line.strip_prefix(metric).is_some_and(|rest| rest.starts_with(['{', ' '])))
        .and_then(|line| line.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {metric} in {text}"))
}
