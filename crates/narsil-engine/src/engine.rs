//! Startup, the request path, and shutdown of the engine.
//!
//! [`Engine::start`] creates the collector and spawns the lanes (which load
//! and warm up their models in the background). [`EngineHandle::predict`] validates a
//! request, admits it, queues it and waits for its answer or its deadline.
//! [`Engine::shutdown`] stops intake, lets every queued request finish and
//! joins the lanes.

use std::sync::Arc;
use std::time::Instant;

use narsil_core::request::RequestLimits;
use narsil_core::{BackendFactory, ModelSchema, SampleBatch};
use tokio::sync::{oneshot, watch};

use crate::admission::Admission;
use crate::collector::{BatchLimits, BatchQueue, Collector};
use crate::config::EngineConfig;
use crate::error::EngineError;
use crate::job::{Entry, Prediction};
use crate::lanes::{self, Readiness};
use crate::stats::{Stats, StatsSnapshot};

/// The running engine: owns the collector and the lane threads.
pub struct Engine {
    handle: EngineHandle,
    lane_threads: Vec<std::thread::JoinHandle<()>>,
}

/// A cheap, clonable handle for submitting requests.
#[derive(Clone)]
pub struct EngineHandle {
    shared: Arc<Shared>,
}

struct Shared {
    collector: Arc<Collector>,
    admission: Arc<Admission>,
    schema: ModelSchema,
    limits: RequestLimits,
    lanes: usize,
    stats: Arc<Stats>,
    readiness: watch::Receiver<Readiness>,
}

impl Engine {
    /// Starts lanes and collector. Returns at once; lanes load in the
    /// background (see [`EngineHandle::wait_ready`]). Must be called inside
    /// a tokio runtime.
    pub fn start(factory: Arc<dyn BackendFactory>, config: EngineConfig) -> Result<Self, String> {
        config.validate()?;
        let schema = factory.schema().clone();
        let stats = Arc::new(Stats::default());
        let (readiness_tx, readiness) = watch::channel(Readiness::default());
        let collector = Arc::new(Collector::new(
            BatchQueue::new(
                BatchLimits {
                    max_requests: config.requests_per_batch(),
                    max_rows: config.max_batch_rows,
                    timeout: config.batch_timeout,
                },
                schema.num_dense,
                schema.num_sparse(),
            ),
            Arc::clone(&stats),
        ));
        let lane_threads =
            lanes::spawn(factory, config.lanes, Arc::clone(&collector), Arc::clone(&stats), readiness_tx)
                .map_err(|e| format!("cannot start lane threads: {e}"))?;
        Ok(Self {
            handle: EngineHandle {
                shared: Arc::new(Shared {
                    collector,
                    admission: Admission::new(config.max_queue_requests, config.max_queue_rows),
                    schema,
                    limits: config.limits,
                    lanes: config.lanes,
                    stats,
                    readiness,
                }),
            },
            lane_threads,
        })
    }

    /// A handle for submitting requests.
    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }

    /// Stops taking requests, runs every queued one to completion, and joins
    /// the lanes.
    pub async fn shutdown(self) {
        self.handle.shared.collector.close();
        let threads = self.lane_threads;
        let joined = tokio::task::spawn_blocking(move || {
            threads.into_iter().map(|t| t.join()).filter(Result::is_err).count()
        })
        .await;
        if !matches!(joined, Ok(0)) {
            tracing::error!("a lane thread ended abnormally");
        }
    }
}

impl EngineHandle {
    /// The served model's schema.
    pub fn schema(&self) -> &ModelSchema {
        &self.shared.schema
    }

    /// Per-request limits.
    pub fn limits(&self) -> RequestLimits {
        self.shared.limits
    }

    /// True once every lane has loaded and warmed up.
    pub fn is_ready(&self) -> bool {
        self.shared.readiness.borrow().ready == self.shared.lanes
    }

    /// Waits until every lane is warmed up, or returns the first lane failure.
    pub async fn wait_ready(&self) -> Result<(), String> {
        let lanes = self.shared.lanes;
        let mut readiness = self.shared.readiness.clone();
        let state = readiness
            .wait_for(|r| r.ready == lanes || r.failed.is_some())
            .await
            .map_err(|_| "lanes stopped before becoming ready".to_string())?;
        match &state.failed {
            Some(message) => Err(message.clone()),
            None => Ok(()),
        }
    }

    /// Counters, for tests and observability.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot(self.shared.admission.queued_requests())
    }

    /// Validates, admits and queues a request, then waits for its scores.
    /// Past `deadline` the caller gets DeadlineExceeded at once, and the
    /// request is dropped before it reaches a forward.
    pub async fn predict(
        &self,
        mut request: SampleBatch,
        deadline: Option<Instant>,
    ) -> Result<Prediction, EngineError> {
        let shared = &self.shared;
        if !self.is_ready() {
            return Err(EngineError::NotReady);
        }
        request.validate(&shared.schema, shared.limits)?;
        let admitted = Instant::now();
        if deadline.is_some_and(|d| d <= admitted) {
            return Err(EngineError::DeadlineExceeded);
        }
        let permit = shared.admission.try_admit(request.batch_size).map_err(EngineError::Overloaded)?;
        let (reply, answer) = oneshot::channel();
        let entry = Entry { request, reply, admitted, deadline, permit };
        shared.collector.submit(entry)?;
        let answer = match deadline {
            Some(d) => {
                tokio::time::timeout_at(d.into(), answer).await.map_err(|_| EngineError::DeadlineExceeded)?
            }
            None => answer.await,
        };
        answer.unwrap_or(Err(EngineError::ShuttingDown))
    }
}
