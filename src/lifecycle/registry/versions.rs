//! A model's versions as the registry holds them: each version's slot
//! (loading, ready, failed), the [`LiveVersion`] a request holds, the
//! operator's marks, and the statuses `GET /v1/models` and ModelInfo report.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use narsil_engine::{Engine, EngineHandle};
use serde::Serialize;

use crate::lifecycle::reaper::{ReaperSender, Retired};
use crate::lifecycle::repository::Fingerprint;

/// A version that serves: its engine, and the engine's owner. Dropped by
/// its last holder once retired, it hands the engine to the [`Reaper`].
pub struct LiveVersion {
    /// The version number (0 for a `--model` served without a repository).
    pub number: u64,
    /// Where its requests go.
    pub engine: EngineHandle,
    pub(super) model: String,
    pub(super) owner: Option<Engine>,
    pub(super) reaper: Option<ReaperSender>,
}

impl Drop for LiveVersion {
    fn drop(&mut self) {
        let Some(engine) = self.owner.take() else { return };
        let retired = Retired { model: std::mem::take(&mut self.model), number: self.number, engine };
        match &self.reaper {
            Some(reaper) => {
                if let Err(refused) = reaper.send(retired) {
                    refused.0.stop_detached();
                }
            }
            None => retired.stop_detached(),
        }
    }
}

pub(super) enum VersionSlot {
    Loading,
    Ready(Arc<LiveVersion>),
    Failed { error: String, fingerprint: Fingerprint },
}

impl VersionSlot {
    pub(super) fn state(&self) -> VersionState {
        match self {
            Self::Loading => VersionState::Loading,
            Self::Ready(_) => VersionState::Ready,
            Self::Failed { fingerprint, .. } => VersionState::Failed(*fingerprint),
        }
    }
}

/// A version's state, as the repository watcher sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VersionState {
    /// Being loaded and warmed up.
    Loading,
    /// Taking requests.
    Ready,
    /// Failed to load from files with this fingerprint.
    Failed(Fingerprint),
}

impl VersionState {
    /// `LOADING`, `READY` or `FAILED`, as listed and in ModelInfo.
    pub fn name(self) -> &'static str {
        match self {
            Self::Loading => "LOADING",
            Self::Ready => "READY",
            Self::Failed(_) => "FAILED",
        }
    }
}

/// What the operator asked for through the control calls; the repository's
/// contents never override it.
#[derive(Debug, Default, Clone)]
pub struct OperatorMarks {
    /// Every version unloaded, until the model is loaded again.
    pub model_unloaded: bool,
    /// Versions unloaded, even if the policy would serve them.
    pub unloaded: BTreeSet<u64>,
    /// Versions loaded beside the policy's.
    pub pinned: BTreeSet<u64>,
}

#[derive(Default)]
pub(super) struct ModelSlot {
    pub(super) versions: BTreeMap<u64, VersionSlot>,
    pub(super) marks: OperatorMarks,
    /// Whether the model should have a warm version (health counts it).
    pub(super) should_serve: bool,
}

/// A model and its versions, as `GET /v1/models` and ModelInfo report them.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ModelStatus {
    /// Model name.
    pub name: String,
    /// Requests that name no model go to it.
    pub default: bool,
    /// Has a warm, healthy version.
    pub serving: bool,
    /// Every version loaded, loading or failed, lowest first.
    pub versions: Vec<VersionStatus>,
}

/// One version's state.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct VersionStatus {
    /// Version number (or the model's own version string for a `--model`).
    pub version: String,
    /// `LOADING`, `READY` (loaded; serving once warm and healthy) or `FAILED`.
    pub state: &'static str,
    /// Why it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}
