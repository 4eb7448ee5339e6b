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
//!
//! This file holds what every lane shares ([`LaneShared`], [`Readiness`])
//! and the lane itself (`LaneContext`); each of its jobs is a file of its
//! own, every one an `impl LaneContext` block:
//!
//! * `start.rs`: spawning the lanes ([`spawn`]), loading and warming up a
//!   lane's backend, reporting it ready and choosing how it serves;
//! * `serve.rs`: the plain serving loop, and taking a batch from the
//!   collector (the end of its requests' queue time);
//! * `staged.rs`: stage ahead, a stage thread staging the next batch while
//!   the lane runs a forward, and the hand-over between them;
//! * `run.rs`: running one batch's forward (panics caught, the backend held
//!   to its score count) and answering its requests;
//! * `outcome.rs`: what a forward's outcome makes of the backend's health,
//!   and batches abandoned by every caller (late in the queue, or stalled
//!   in their forward);
//! * `probe.rs`: how long an idle lane waits, and its probes of an
//!   unhealthy backend;
//! * `fixtures.rs`: (tests only) the schema, backends, lanes and jobs the
//!   lanes' tests share.

mod outcome;
mod probe;
mod run;
mod serve;
mod staged;
mod start;

use std::sync::Arc;
use std::time::Duration;

use narsil_core::BackendFactory;
use tokio::sync::watch;

use crate::collector::Collector;
use crate::error::LaneFailed;
use crate::health::BackendHealth;
use crate::stats::Stats;

pub use start::spawn;

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

/// One lane: its index and what it shares with the others.
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

#[cfg(test)]
pub(crate) mod fixtures;
