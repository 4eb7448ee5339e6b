//! The models a server serves: for each, its versions and their states
//! (loading, ready, failed), the operator's load/unload marks, and where a
//! request goes.
//!
//! Every ready version is an [`Engine`] of its own (queue, admission, lanes),
//! so requests of different models, or of two versions, never share a
//! forward. A request holds its version's [`LiveVersion`] from routing to
//! its answer; a retired version leaves the routing table at once and is
//! shut down (its lanes joined, its model's memory released) by the
//! [`super::reaper`] when the last request holding it drops it. Nothing here
//! loads models:
//! [`super::watcher`] does, and calls [`ModelRegistry::install`].

mod metrics;
mod versions;

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use narsil_core::{InputField, InvalidInput, ModelSchema};
use narsil_engine::{Engine, EngineError};
use tokio::sync::watch;

use super::reaper::Reaper;
use super::repository::Fingerprint;
use metrics::{labels, RegistryMetrics};
pub use versions::{LiveVersion, ModelStatus, OperatorMarks, VersionState, VersionStatus};
use versions::{ModelSlot, VersionSlot};

/// The field a request names a version in, as [`ModelRegistry::find`]
/// refuses a version that is not served.
pub const VERSION_FIELD: InputField = InputField::Wire("model_version");

/// Every model the server serves.
pub struct ModelRegistry {
    models: RwLock<BTreeMap<String, ModelSlot>>,
    default_model: Option<String>,
    changed: Arc<watch::Sender<u64>>,
    reaper: Reaper,
    metrics: RegistryMetrics,
}

impl ModelRegistry {
    /// An empty registry; requests naming no model go to `default_model`.
    /// Must be called inside a tokio runtime (it starts the reaper).
    pub fn new(default_model: Option<String>) -> Arc<Self> {
        Arc::new(Self {
            models: RwLock::default(),
            default_model,
            changed: Arc::new(watch::Sender::new(0)),
            reaper: Reaper::start(),
            metrics: RegistryMetrics::new(),
        })
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, ModelSlot>> {
        self.models.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, ModelSlot>> {
        self.models.write().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n += 1);
    }

    /// Follows changes of any model's versions or health.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// The version a request goes to: `model` (empty: the default model) at
    /// `version` (empty: its highest ready version), as every protocol sends
    /// them. Refusals are counted.
    pub fn route(&self, model: &str, version: &str) -> Result<Arc<LiveVersion>, EngineError> {
        let routed = self.find(model, version);
        if let Err(error) = &routed {
            let outcome = if matches!(error, EngineError::Invalid(_)) { "invalid" } else { "unavailable" };
            self.count_unrouted(outcome);
        }
        routed
    }

    /// [`Self::route`] without counting a refusal (readiness and metadata
    /// lookups).
    pub fn find(&self, model: &str, version: &str) -> Result<Arc<LiveVersion>, EngineError> {
        let models = self.read();
        let (name, slot) = self.slot(&models, model)?;
        let mut ready = slot.versions.values().rev().filter_map(|v| match v {
            VersionSlot::Ready(live) => Some(live),
            _ => None,
        });
        let found = match version {
            "" => ready.next().ok_or(EngineError::NoServingVersion(name.into()))?,
            wanted => ready.find(|live| live.engine.schema().version == wanted).ok_or_else(|| {
                let message = format!("version {wanted:?} of model {name:?} is not served");
                InvalidInput::new(VERSION_FIELD, message)
            })?,
        };
        Ok(Arc::clone(found))
    }

    /// Every ready version of `model`, lowest first: none for a model not
    /// served (what an id push reaches).
    pub fn live_versions(&self, model: &str) -> Vec<Arc<LiveVersion>> {
        let models = self.read();
        let Some(slot) = models.get(model) else { return Vec::new() };
        slot.versions
            .values()
            .filter_map(|v| match v {
                VersionSlot::Ready(live) => Some(Arc::clone(live)),
                _ => None,
            })
            .collect()
    }

    /// `model` (empty: the default model) and its slot, or why there is none.
    fn slot<'a>(
        &'a self,
        models: &'a BTreeMap<String, ModelSlot>,
        model: &'a str,
    ) -> Result<(&'a str, &'a ModelSlot), InvalidInput> {
        let served = || models.keys().cloned().collect::<Vec<_>>();
        let name = match (model, &self.default_model) {
            ("", Some(default)) => default.as_str(),
            ("", None) => {
                let message =
                    format!("is required: this server has no default model; it serves {:?}", served());
                return Err(InvalidInput::new(InputField::Model, message));
            }
            (name, _) => name,
        };
        match models.get(name) {
            Some(slot) => Ok((name, slot)),
            None => Err(InvalidInput::new(
                InputField::Model,
                format!("unknown model {name:?}; this server serves {:?}", served()),
            )),
        }
    }

    /// `model` (empty: the default model): its status and the version
    /// requests naming no version go to, if one is ready.
    pub fn describe(&self, model: &str) -> Result<(ModelStatus, Option<Arc<LiveVersion>>), EngineError> {
        let name = {
            let models = self.read();
            self.slot(&models, model).map_err(|e| self.refuse(e))?.0.to_string()
        };
        let status = self.list().into_iter().find(|m| m.name == name);
        let status = status.ok_or(EngineError::NoServingVersion(name.clone()))?;
        Ok((status, self.find(&name, "").ok()))
    }

    /// Counts a request refused before it could be routed (undecodable,
    /// too large) and returns the error.
    pub fn refuse(&self, invalid: InvalidInput) -> EngineError {
        self.count_unrouted("invalid");
        EngineError::Invalid(invalid)
    }

    /// Counts a request refused before it could be routed because the
    /// memory budget could not take its message, and returns the error.
    pub fn refuse_overloaded(&self, full: narsil_engine::QueueFull) -> EngineError {
        self.count_unrouted("rejected");
        EngineError::Overloaded(full)
    }

    fn count_unrouted(&self, outcome: &str) {
        self.metrics.unrouted.get_or_create(&labels(&[("outcome", outcome)])).inc();
    }

    /// The schema requests to `model` are validated against today (its
    /// highest ready version's), which a new version must match.
    pub fn serving_schema(&self, model: &str) -> Option<ModelSchema> {
        self.find(model, "").ok().map(|live| live.engine.schema().clone())
    }

    /// Marks `number` of `model` as loading (the model appears if new).
    pub fn set_loading(&self, model: &str, number: u64) {
        self.write().entry(model.into()).or_default().versions.insert(number, VersionSlot::Loading);
        self.bump();
    }

    /// Records that `number` of `model` failed to load (logged and counted).
    pub fn set_failed(&self, model: &str, number: u64, error: String, fingerprint: Fingerprint) {
        tracing::error!(model, version = number, %error, "version not served");
        self.metrics.loads.get_or_create(&labels(&[("model", model), ("outcome", "failed")])).inc();
        self.write()
            .entry(model.into())
            .or_default()
            .versions
            .insert(number, VersionSlot::Failed { error, fingerprint });
        self.bump();
    }

    /// Makes `engine` version `number` of `model`; the highest ready version
    /// takes requests that name none. Health follows its readiness and
    /// backend from now on.
    pub fn install(&self, model: &str, number: u64, engine: Engine) {
        let handle = engine.handle();
        let live = Arc::new(LiveVersion {
            number,
            engine: handle.clone(),
            model: model.into(),
            owner: Some(engine),
            reaper: self.reaper.sender(),
        });
        self.metrics.loads.get_or_create(&labels(&[("model", model), ("outcome", "ok")])).inc();
        {
            let mut models = self.write();
            let slot = models.entry(model.into()).or_default();
            slot.versions.insert(number, VersionSlot::Ready(live));
            slot.should_serve = true;
        }
        let changed = Arc::clone(&self.changed);
        tokio::spawn(async move {
            let _ = handle.wait_ready().await;
            changed.send_modify(|n| *n += 1);
            let mut health = handle.backend_health();
            drop(handle);
            while health.changed().await.is_ok() {
                changed.send_modify(|n| *n += 1);
            }
        });
        self.bump();
    }

    /// Takes version `number` of `model` out of routing; the reaper shuts
    /// it down once the requests holding it are answered. Forgets it if it
    /// failed.
    pub fn retire(&self, model: &str, number: u64) {
        let removed = self.write().get_mut(model).and_then(|slot| slot.versions.remove(&number));
        if let Some(VersionSlot::Ready(_)) = removed {
            tracing::info!(model, version = number, "version retired; draining");
        }
        self.bump();
    }

    /// The state of each version of `model`, by number.
    pub fn states(&self, model: &str) -> BTreeMap<u64, VersionState> {
        let models = self.read();
        let Some(slot) = models.get(model) else { return BTreeMap::new() };
        slot.versions.iter().map(|(&number, state)| (number, state.state())).collect()
    }

    /// The names of every model.
    pub fn model_names(&self) -> Vec<String> {
        self.read().keys().cloned().collect()
    }

    /// The operator's marks on `model`, changed by `edit` (the model appears
    /// if new, so call it for models the repository holds).
    pub fn edit_marks<T>(&self, model: &str, edit: impl FnOnce(&mut OperatorMarks) -> T) -> T {
        edit(&mut self.write().entry(model.into()).or_default().marks)
    }

    /// Sets whether `model` should have a warm version; a model that should
    /// not and has no versions left is forgotten.
    pub fn set_should_serve(&self, model: &str, should: bool) {
        let mut models = self.write();
        if let Some(slot) = models.get_mut(model) {
            slot.should_serve = should;
            let marked =
                slot.marks.model_unloaded || !slot.marks.unloaded.is_empty() || !slot.marks.pinned.is_empty();
            if !should && slot.versions.is_empty() && !marked {
                models.remove(model);
            }
        }
        drop(models);
        self.bump();
    }

    /// Every model and its versions.
    pub fn list(&self) -> Vec<ModelStatus> {
        let models = self.read();
        models
            .iter()
            .map(|(name, slot)| ModelStatus {
                name: name.clone(),
                default: self.default_model.as_deref() == Some(name),
                serving: serving(slot),
                versions: slot
                    .versions
                    .iter()
                    .map(|(&number, slot)| {
                        let (version, error) = match slot {
                            VersionSlot::Ready(live) => (live.engine.schema().version.clone(), None),
                            VersionSlot::Failed { error, .. } => (number.to_string(), Some(error.clone())),
                            VersionSlot::Loading => (number.to_string(), None),
                        };
                        VersionStatus { version, state: slot.state().name(), error }
                    })
                    .collect(),
            })
            .collect()
    }

    /// Whether the server as a whole should take traffic (every model that
    /// should serve has a warm, healthy version, and at least one does), and
    /// whether each model has one.
    pub fn health(&self) -> (bool, Vec<(String, bool)>) {
        let models = self.read();
        let each: Vec<(String, bool)> =
            models.iter().map(|(name, slot)| (name.clone(), serving(slot))).collect();
        let every = models.values().zip(&each).all(|(slot, (_, serving))| !slot.should_serve || *serving);
        (every && each.iter().any(|(_, serving)| *serving), each)
    }

    /// The overall half of [`Self::health`].
    pub fn ready(&self) -> bool {
        self.health().0
    }

    /// Counts a model-control call refused for its token: `reason` is
    /// `missing` (401) or `wrong` (403).
    pub fn count_control_unauthorized(&self, reason: &'static str) {
        self.metrics.control_unauthorized.get_or_create(&labels(&[("reason", reason)])).inc();
    }

    /// Every ready version's metrics, labelled by model and version, and the
    /// registry's own, as one OpenMetrics exposition.
    pub fn metrics_text(&self) -> String {
        let mut texts = Vec::new();
        self.metrics.versions.clear();
        for (name, slot) in self.read().iter() {
            for version in slot.versions.values() {
                if let VersionSlot::Ready(live) = version {
                    texts.push(live.engine.metrics_text());
                }
                let state = version.state().name().to_ascii_lowercase();
                self.metrics.versions.get_or_create(&labels(&[("model", name), ("state", &state)])).inc();
            }
        }
        let held = narsil_embedding::held();
        self.metrics.tables_held.set(held.tables as i64);
        self.metrics.table_bytes_held.set(held.bytes as i64);
        let mut own = String::new();
        prometheus_client::encoding::text::encode(&mut own, &self.metrics.registry)
            .expect("writing to a String cannot fail");
        texts.push(own);
        narsil_engine::merge_expositions(texts.iter().map(String::as_str))
    }

    /// Retires every version and waits until each has drained and shut down.
    pub async fn shutdown(&self) {
        let all: Vec<(String, u64)> = self
            .read()
            .iter()
            .flat_map(|(name, slot)| slot.versions.keys().map(move |&n| (name.clone(), n)))
            .collect();
        for (model, number) in all {
            self.retire(&model, number);
        }
        self.reaper.finish().await;
    }
}

fn serving(slot: &ModelSlot) -> bool {
    slot.versions.values().any(|v| match v {
        VersionSlot::Ready(live) => live.engine.is_ready() && live.engine.is_healthy(),
        _ => false,
    })
}
