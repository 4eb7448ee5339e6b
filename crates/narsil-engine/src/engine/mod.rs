//! Startup and shutdown of the engine, and the handle the RPC layer holds.
//!
//! [`Engine::start`] creates the collector and spawns the lanes (which load
//! and warm up their models in the background); the request path
//! ([`EngineHandle::predict`]) is [`predict`]'s. [`Engine::shutdown`] stops
//! intake, lets every queued request finish and joins the lanes.

mod predict;
mod waves;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use narsil_core::request::RequestLimits;
use narsil_core::working_set::Unit;
use narsil_core::{BackendFactory, InvalidInput, ModelSchema};
use tokio::sync::{oneshot, watch};

use crate::admission::Admission;
use crate::collector::{BatchQueue, Collector, FusedWorkingSet};
use crate::config::EngineConfig;
use crate::error::{EngineError, LaneFailed, StartError};
use crate::health::BackendHealth;
use crate::lanes::{self, LaneShared, Readiness};
use crate::memory::MemoryBudget;
use crate::stats::{Outcome, Stats, StatsSnapshot};
use crate::working_sets::WorkingSets;

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
    memory: MemoryBudget,
    /// For a model with sequences: what its forwards hold for them.
    working_sets: Option<WorkingSets>,
    schema: ModelSchema,
    limits: RequestLimits,
    /// The lanes take only flat batches: a grouped request's block is
    /// copied into each of its rows ([`RequestSamples::fused_growth_bytes`]).
    flat_only: bool,
    max_batch_rows: usize,
    /// Most tokens a part of a request holds where it can be cut so
    /// (`usize::MAX` for a model without sequences: tokens are rows).
    max_batch_tokens: usize,
    queue_timeout: Option<Duration>,
    lanes: usize,
    stats: Arc<Stats>,
    readiness: watch::Receiver<Readiness>,
    health: Arc<BackendHealth>,
    next_request_id: RequestIds,
    /// The model, for what it can change while it serves (pushed ids).
    factory: Arc<dyn BackendFactory>,
}

/// The next request id, on a cache line of its own: every request bumps it,
/// and the fields beside it are read by every request on every core.
#[repr(align(128))]
struct RequestIds(AtomicU64);

impl Engine {
    /// Starts lanes and collector. Returns at once; lanes load in the
    /// background (see [`EngineHandle::wait_ready`]). Must be called inside
    /// a tokio runtime.
    pub fn start(factory: Arc<dyn BackendFactory>, config: EngineConfig) -> Result<Self, StartError> {
        config.validate()?;
        // The override, applied here once: requests are validated against
        // this schema, and their blocks tell the backend's stage which
        // features (sequences whole) arrive once per request.
        let mut schema = factory.schema().clone();
        if let Some(names) = &config.request_level {
            let level = narsil_core::RequestLevel::parse(names.iter().map(String::as_str), &schema)
                .map_err(StartError::RequestLevel)?;
            schema.set_request_level(level).map_err(StartError::RequestLevel)?;
        }
        let mut stats = Stats::labelled(&[("model", &schema.name), ("version", &schema.version)]);
        factory.register_metrics(stats.registry_mut());
        let stats = Arc::new(stats);
        let (readiness_tx, readiness) = watch::channel(Readiness::default());
        let policy = config.mode.flush_policy(&config, !schema.sequences.is_empty());
        let limits = policy.limits();
        let mut queue = BatchQueue::new(policy, schema.num_dense, schema.num_sparse());
        let kinds: Vec<_> = schema.sequences.iter().map(|s| s.working_set()).collect();
        let working_sets = (!kinds.is_empty()).then(|| {
            let gauge = stats.working_set_bytes.clone();
            WorkingSets::new(kinds.clone(), config.lanes, limits, &config.memory, gauge)
        });
        if working_sets.is_some() {
            queue = queue.with_working_set(FusedWorkingSet(Arc::new(move |units: &[Vec<Unit>]| {
                narsil_core::working_set::summed(kinds.iter().copied(), units)
            })));
        }
        let collector = Arc::new(Collector::new(queue, config.max_forward_threads, Arc::clone(&stats)));
        let health = Arc::new(BackendHealth::new(config.unhealthy_after_failures));
        factory.watch_dependencies(dependency_watcher(&health, &stats));
        let model = Arc::clone(&factory);
        let max_batch_tokens = if schema.sequences.is_empty() { usize::MAX } else { config.max_batch_tokens };
        let lane_threads = lanes::spawn(
            config.lanes,
            LaneShared {
                model_version: Arc::from(schema.version.as_str()),
                factory,
                collector: Arc::clone(&collector),
                stats: Arc::clone(&stats),
                readiness: readiness_tx,
                health: Arc::clone(&health),
                probe_interval: config.health_probe_interval,
                stage_ahead: config.stage_ahead,
            },
        )
        .map_err(StartError::Threads)?;
        Ok(Self {
            handle: EngineHandle {
                shared: Arc::new(Shared {
                    collector,
                    admission: Admission::new(config.max_queue_requests, config.max_queue_rows),
                    memory: config.memory.clone(),
                    working_sets,
                    schema,
                    limits: config.limits,
                    flat_only: !model.takes_request_level(),
                    max_batch_rows: config.max_batch_rows,
                    max_batch_tokens,
                    queue_timeout: config.queue_timeout,
                    lanes: config.lanes,
                    stats,
                    readiness,
                    health,
                    next_request_id: RequestIds(AtomicU64::new(1)),
                    factory: model,
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
    /// the lanes, waiting at most [`LANE_STOP_LIMIT`] for them.
    pub async fn shutdown(self) {
        self.shutdown_within(LANE_STOP_LIMIT).await;
    }

    /// [`Engine::shutdown`] waiting at most `limit` for the lanes to finish
    /// the queued work and stop. Lanes still running then (stuck in a
    /// forward: a hung device, a store that never answers) are logged and
    /// left behind, so that the process can still exit. True when every lane
    /// stopped in time.
    pub async fn shutdown_within(self, limit: Duration) -> bool {
        self.handle.shared.collector.close();
        let threads = self.lane_threads;
        let lanes = threads.len();
        let (joined, all_joined) = oneshot::channel();
        // A thread of its own, not `spawn_blocking`: a runtime waits for its
        // blocking tasks when it drops, so a stuck lane joined there would
        // keep the process from exiting after all.
        let joiner = std::thread::Builder::new().name("narsil-lane-join".into()).spawn(move || {
            let failed = threads.into_iter().map(|t| t.join()).filter(Result::is_err).count();
            let _ = joined.send(failed);
        });
        if let Err(e) = joiner {
            tracing::error!(error = %e, "cannot start the thread that joins the lanes: not waiting for them");
            return false;
        }
        match tokio::time::timeout(limit, all_joined).await {
            Ok(Ok(0)) => true,
            Ok(_) => {
                tracing::error!("a lane thread ended abnormally");
                true
            }
            Err(_) => {
                tracing::error!(
                    lanes,
                    limit_s = limit.as_secs_f64(),
                    "the lanes did not stop within the limit (a forward that never returns?): left behind"
                );
                false
            }
        }
    }
}

/// How long [`Engine::shutdown`] waits for the lanes to finish the queued
/// work and stop. Forwards take milliseconds and the queue is bounded, so a
/// lane still busy after a minute is stuck.
pub const LANE_STOP_LIMIT: Duration = Duration::from_secs(60);

/// Turns the backend unhealthy while its outside dependencies do not
/// answer, for as long as this engine lives.
fn dependency_watcher(health: &Arc<BackendHealth>, stats: &Arc<Stats>) -> narsil_core::DependencyWatcher {
    let (health, stats) = (Arc::downgrade(health), Arc::downgrade(stats));
    let answered = std::sync::atomic::AtomicBool::new(true);
    Box::new(move |answer| {
        let (Some(health), Some(stats)) = (health.upgrade(), stats.upgrade()) else { return false };
        if let Some(healthy) = health.set_dependencies(answer) {
            stats.backend_healthy.set(i64::from(healthy));
        }
        if answered.swap(answer, Ordering::Relaxed) != answer {
            if answer {
                tracing::info!("the backend's table store answers again");
            } else {
                tracing::error!("the backend's table store does not answer: unhealthy until it does");
            }
        }
        true
    })
}

impl EngineHandle {
    /// The served model's schema.
    pub fn schema(&self) -> &ModelSchema {
        &self.shared.schema
    }

    /// Adds raw ids with their rows to a table's id map of the served model
    /// ([`BackendFactory::push_ids`]); blocking (it checks every entry and
    /// may merge the table's index of pushed ids): call it off the async
    /// threads.
    pub fn push_ids(&self, push: &narsil_core::IdPush<'_>) -> Result<narsil_core::IdsPushed, String> {
        self.shared.factory.push_ids(push)
    }

    /// The served model's tables that declare an id map
    /// ([`BackendFactory::id_map_tables`]).
    pub fn id_map_tables(&self) -> Vec<narsil_core::IdMapTable> {
        self.shared.factory.id_map_tables()
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
    pub async fn wait_ready(&self) -> Result<(), LaneFailed> {
        let lanes = self.shared.lanes;
        let mut readiness = self.shared.readiness.clone();
        let state = readiness
            .wait_for(|r| r.ready == lanes || r.failed.is_some())
            .await
            .map_err(|_| LaneFailed::Stopped)?;
        match &state.failed {
            Some(failure) => Err(failure.clone()),
            None => Ok(()),
        }
    }

    /// Follows whether the backend is fit for traffic (true: healthy); see
    /// [`crate::health`].
    pub fn backend_health(&self) -> watch::Receiver<bool> {
        self.shared.health.subscribe()
    }

    /// Whether the backend is fit for traffic now (see [`crate::health`]).
    pub fn is_healthy(&self) -> bool {
        self.shared.health.is_healthy()
    }

    /// Counters, for tests and observability.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot(self.shared.admission.queued_requests())
    }

    /// Every metric as Prometheus text.
    pub fn metrics_text(&self) -> String {
        let admission = &self.shared.admission;
        self.shared.stats.encode(
            admission.queued_requests(),
            admission.queued_rows(),
            admission.queued_bytes(),
        )
    }

    /// Counts a request refused by the RPC layer before it reached the
    /// engine (undecodable, wrong model, too large) and returns the error.
    pub fn reject(&self, invalid: InvalidInput) -> EngineError {
        self.shared.stats.record(Outcome::Invalid);
        EngineError::Invalid(invalid)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use narsil_core::{BackendError, KeyedBatch, ModelBackend, RequestSamples};

    use super::*;
    use crate::lanes::fixtures::config;

    static HUNG: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

    /// Answers every forward at once, except a 3-row batch, which it never
    /// finishes (a hung device).
    struct HangsOnThreeRows;

    impl ModelBackend for HangsOnThreeRows {
        fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
            if batch.rows == 3 {
                HUNG.store(true, Ordering::SeqCst);
                std::thread::sleep(Duration::from_secs(3600));
            }
            Ok(vec![0.5; batch.rows])
        }
    }

    struct Factory(ModelSchema);

    impl BackendFactory for Factory {
        fn schema(&self) -> &ModelSchema {
            &self.0
        }

        fn create_lane(&self, _lane: usize) -> Result<Box<dyn ModelBackend>, BackendError> {
            Ok(Box::new(HangsOnThreeRows))
        }
    }

    fn samples(schema: &ModelSchema, rows: usize) -> RequestSamples {
        RequestSamples {
            num_samples: rows,
            dense: vec![0.5; rows * schema.num_dense],
            lengths: vec![1; rows * schema.num_sparse()],
            ids: vec![0; rows * schema.num_sparse()],
            ..Default::default()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shutdown_leaves_a_lane_stuck_in_its_forward_behind_at_its_limit() {
        let schema = ModelSchema::dlrm("test", "cpu", 1000);
        let engine = Engine::start(Arc::new(Factory(schema.clone())), config(false)).unwrap();
        let handle = engine.handle();
        handle.wait_ready().await.unwrap();
        let answer = handle.predict(samples(&schema, 1), None, None).await;
        assert!(answer.is_ok(), "{answer:?}");
        let stuck = tokio::spawn({
            let handle = handle.clone();
            let request = samples(&schema, 3);
            async move { handle.predict(request, None, None).await }
        });
        let give_up = Instant::now() + Duration::from_secs(20);
        while !HUNG.load(Ordering::SeqCst) {
            assert!(Instant::now() < give_up, "the 3-row forward never started");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let started = Instant::now();
        assert!(!engine.shutdown_within(Duration::from_millis(200)).await, "a stuck lane cannot stop");
        let waited = started.elapsed();
        assert!(waited < Duration::from_secs(10), "shutdown waited {waited:?} past its 200 ms limit");
        assert!(!stuck.is_finished(), "the stuck request was answered");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_override_naming_some_of_a_sequences_channels_is_refused_at_start() {
        // History h: cat_2 and cat_3, per row as declared.
        let mut schema = ModelSchema::dlrm("test", "cpu", 1000);
        let channels = ["cat_2".to_string(), "cat_3".to_string()];
        let h =
            narsil_core::SequenceFeature::new("h", &channels, 8, Default::default(), &schema, &[]).unwrap();
        schema.sequences = vec![h];
        let start = |names: &[&str]| {
            let config = EngineConfig {
                request_level: Some(names.iter().map(|n| n.to_string()).collect()),
                ..config(false)
            };
            Engine::start(Arc::new(Factory(schema.clone())), config)
        };
        let Err(StartError::RequestLevel(e)) = start(&["cat_0", "cat_2", "dense"]) else {
            panic!("a mixed override started")
        };
        assert!(
            e.contains("sequence \"h\" (channels cat_2, cat_3) is request-level in cat_2 but not in cat_3"),
            "{e}"
        );
        // All of its channels: the history arrives once per request.
        let engine = start(&["cat_0", "cat_2", "cat_3", "dense"]).unwrap();
        let served = engine.handle().schema().clone();
        assert!(served.sequences[0].is_request_level(&served));
        assert!(engine.shutdown_within(Duration::from_secs(20)).await);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shutdown_of_idle_lanes_joins_them_within_its_limit() {
        let schema = ModelSchema::dlrm("test", "cpu", 1000);
        let engine = Engine::start(Arc::new(Factory(schema)), config(false)).unwrap();
        engine.handle().wait_ready().await.unwrap();
        assert!(engine.shutdown_within(Duration::from_secs(20)).await);
    }
}
