//! Keeps the registry in step with the repository: finds versions (by
//! polling, on SIGHUP, or when a control call asks), loads and warms each new
//! one beside the serving one, switches to it once it is warm, and retires
//! what the version policy no longer serves.
//!
//! A version that fails to load, to warm up, or whose inputs and outputs
//! differ from the version serving is marked failed and never switched to;
//! it is tried again only once its files change. A version whose directory
//! disappears is retired, except the last one serving a model: only an
//! explicit unload takes that away.

mod interface;
mod loading;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use narsil_core::BackendFactory;
use narsil_engine::{Engine, EngineConfig, StartError};
use tokio::sync::{mpsc, oneshot};

use super::loader::LoadOptions;
use super::pushes::{ModelPushes, PushBook, Replayed};
use super::registry::{ModelRegistry, OperatorMarks, VersionState};
use super::repository::{RepositorySource, VersionDir, VersionPolicy, MODEL_FILES};
pub use interface::same_interface;
use loading::{on_loader_thread, VersionedFactory};

/// Where versions come from and how each is served.
#[derive(Clone)]
pub struct Repository {
    /// Where the models and their versions are.
    pub source: Arc<dyn RepositorySource>,
    /// Which versions of each model are served.
    pub policy: VersionPolicy,
    /// Device, threads and precision for every version (the model file,
    /// and so the backend, come from the version directory).
    pub load: LoadOptions,
    /// Lanes, batching and queue limits of every version's engine.
    pub engine: EngineConfig,
    /// Request-level features named at serve time, by model
    /// (`--request-level MODEL:NAMES`), each replacing what that model
    /// declares; a model not here keeps its own declaration.
    pub request_level: BTreeMap<String, Vec<String>>,
    /// Most bytes the ids pushed to one table of a version may hold
    /// (`--max-pushed-bytes`).
    pub max_pushed_bytes: u64,
}

/// Asks the watcher to look at the repository now; resolves once it has.
#[derive(Clone)]
pub struct RescanHandle {
    requests: mpsc::Sender<oneshot::Sender<()>>,
}

impl RescanHandle {
    /// Rescans and reconciles; false if the watcher has stopped.
    pub async fn rescan(&self) -> bool {
        let (done, finished) = oneshot::channel();
        self.requests.send(done).await.is_ok() && finished.await.is_ok()
    }
}

/// What a model should serve.
struct Plan {
    desired: BTreeSet<u64>,
    marks: OperatorMarks,
}

/// The repository watcher.
pub struct Watcher {
    source: Repository,
    registry: Arc<ModelRegistry>,
    pushes: Arc<PushBook>,
}

impl Watcher {
    /// A watcher feeding `registry` from `source`.
    pub fn new(source: Repository, registry: Arc<ModelRegistry>) -> Self {
        let pushes = Arc::new(PushBook::new(source.max_pushed_bytes));
        Self { source, registry, pushes }
    }

    /// The models' pushes, whose logs every version loaded replays.
    pub fn pushes(&self) -> Arc<PushBook> {
        Arc::clone(&self.pushes)
    }

    /// Reconciles at once, then again every `poll` (if any), on SIGHUP and
    /// on each rescan request, until `stop` resolves. A reconcile under way
    /// finishes first.
    pub fn spawn(
        self,
        poll: Option<Duration>,
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> (RescanHandle, tokio::task::JoinHandle<()>) {
        let (requests, mut incoming) = mpsc::channel::<oneshot::Sender<()>>(16);
        let task = tokio::spawn(async move {
            tokio::pin!(stop);
            let mut hangup = hangup_signal();
            self.reconcile().await;
            loop {
                let poll_wait = async {
                    match poll {
                        Some(every) => tokio::time::sleep(every).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    biased;
                    () = &mut stop => return,
                    Some(done) = incoming.recv() => {
                        self.reconcile().await;
                        let _ = done.send(());
                    }
                    () = next_hangup(&mut hangup) => {
                        tracing::info!("SIGHUP received; rescanning the model repository");
                        self.reconcile().await;
                    }
                    () = poll_wait => self.reconcile().await,
                }
            }
        });
        (RescanHandle { requests }, task)
    }

    /// Brings every model in step with the repository once.
    pub async fn reconcile(&self) {
        let source = Arc::clone(&self.source.source);
        let scan = match tokio::task::spawn_blocking(move || source.scan()).await {
            Ok(Ok(scan)) => scan,
            Ok(Err(e)) => {
                let repository = self.source.source.describe();
                tracing::error!(%repository, error = %e, "cannot read the model repository");
                return;
            }
            Err(e) => {
                tracing::error!(error = %e, "repository scan ended abnormally");
                return;
            }
        };
        let mut names: BTreeSet<String> = scan.keys().cloned().collect();
        names.extend(self.registry.model_names());
        let empty = BTreeMap::new();
        // Every model's goal first, so health never counts a model as done
        // while another still waits for its first version.
        let plans: Vec<(String, &BTreeMap<u64, VersionDir>, Plan)> = names
            .into_iter()
            .map(|model| {
                let on_disk = scan.get(&model).unwrap_or(&empty);
                let plan = self.plan(&model, on_disk);
                self.registry.set_should_serve(&model, !plan.desired.is_empty());
                (model, on_disk, plan)
            })
            .collect();
        for (model, on_disk, plan) in plans {
            self.reconcile_model(&model, on_disk, &plan).await;
        }
    }

    /// The versions of `model` to serve, from the policy and the operator's marks.
    fn plan(&self, model: &str, on_disk: &BTreeMap<u64, VersionDir>) -> Plan {
        let marks = self.registry.edit_marks(model, |m| m.clone());
        let desired: BTreeSet<u64> = if marks.model_unloaded {
            BTreeSet::new()
        } else {
            let candidates = on_disk.keys().copied().filter(|v| !marks.unloaded.contains(v));
            let mut desired: BTreeSet<u64> = self.source.policy.select(candidates).into_iter().collect();
            desired.extend(marks.pinned.iter().filter(|v| on_disk.contains_key(v)));
            desired
        };
        Plan { desired, marks }
    }

    async fn reconcile_model(&self, model: &str, on_disk: &BTreeMap<u64, VersionDir>, plan: &Plan) {
        let Plan { desired, marks } = plan;
        let before = self.registry.states(model);
        for &number in desired {
            let dir = &on_disk[&number];
            match before.get(&number) {
                Some(VersionState::Loading | VersionState::Ready) => {}
                Some(VersionState::Failed(seen)) if *seen == dir.fingerprint => {}
                _ => self.load(model, number, dir).await,
            }
        }
        let states = self.registry.states(model);
        let desired_ready = desired.iter().any(|v| states.get(v) == Some(&VersionState::Ready));
        // With no wanted version ready, the highest ready one keeps serving
        // unless the operator unloaded it.
        let fallback = (!desired_ready && !marks.model_unloaded)
            .then(|| {
                states.iter().rev().find(|(v, s)| **s == VersionState::Ready && !marks.unloaded.contains(v))
            })
            .flatten()
            .map(|(v, _)| *v);
        for (number, state) in states {
            let retire = match state {
                _ if desired.contains(&number) => false,
                VersionState::Ready => fallback != Some(number),
                VersionState::Failed(_) => true,
                VersionState::Loading => false,
            };
            if retire {
                self.registry.retire(model, number);
            } else if fallback == Some(number) && !on_disk.contains_key(&number) {
                tracing::warn!(
                    model,
                    version = number,
                    "version no longer in the repository; kept serving \
                    as the model's last ready version (unload it explicitly to stop it)"
                );
            }
        }
        // Again after the retirements: a model left with no versions and no
        // goal is forgotten.
        self.registry.set_should_serve(model, !desired.is_empty());
    }

    /// Loads, checks and warms up one version, gives it the model's logged
    /// pushes ([`super::pushes`]); installs it if all went well.
    async fn load(&self, model: &str, number: u64, dir: &VersionDir) {
        let started = Instant::now();
        tracing::info!(model, version = number, dir = %dir.path.display(), "loading version");
        self.registry.set_loading(model, number);
        let pushes = self.pushes.model(model, dir.path.parent());
        let engine = match self.start_engine(model, number, dir, &pushes).await {
            Ok(started) => started,
            Err(error) => return self.registry.set_failed(model, number, error, dir.fingerprint),
        };
        let (engine, mut replayed) = engine;
        // No push lands between the last replay and the version's turning
        // ready: each is answered before it (and replayed) or after (and
        // pushed to it).
        let _no_push_meanwhile = pushes.lock().await;
        let handle = engine.handle();
        let caught = {
            let pushes = Arc::clone(&pushes);
            tokio::task::spawn_blocking(move || {
                let push = move |push: &narsil_core::IdPush<'_>| handle.push_ids(push);
                pushes.catch_up(number, &mut replayed, &push)
            })
            .await
            .unwrap_or_else(|_| Err("replaying the push log panicked".into()))
        };
        if let Err(error) = caught {
            engine.shutdown().await;
            return self.registry.set_failed(model, number, error, dir.fingerprint);
        }
        self.registry.install(model, number, engine);
        tracing::info!(
            model,
            version = number,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "version loaded and warm; serving"
        );
    }

    async fn start_engine(
        &self,
        model: &str,
        number: u64,
        dir: &VersionDir,
        pushes: &Arc<ModelPushes>,
    ) -> Result<(Engine, Replayed), String> {
        let no_model_file =
            format!("{} holds no model file ({})", dir.path.display(), MODEL_FILES.join(" or "));
        if dir.model_file.is_none() {
            return Err(no_model_file);
        }
        let (source, version, load) =
            (Arc::clone(&self.source.source), dir.clone(), self.source.load.clone());
        let built = on_loader_thread(move || {
            let files = source
                .localize(&version)
                .map_err(|e| format!("cannot localize {}: {e}", version.path.display()))?;
            let file = files.model_file().ok_or(no_model_file)?;
            Ok::<_, String>((load.load_file(&file).map_err(|e| format!("{e:#}"))?, files))
        })
        .await?;
        let (inner, files) = built?;
        let mut schema = inner.schema().clone();
        schema.name = model.into();
        schema.version = number.to_string();
        if let Some(serving) = self.registry.serving_schema(model) {
            same_interface(&serving, &schema)
                .map_err(|difference| format!("does not match the served schema: {difference}"))?;
        }
        let mut config = self.source.engine.clone();
        config.request_level = self.source.request_level.get(model).cloned();
        let factory = Arc::new(VersionedFactory { inner, schema, _files: files });
        // The logged pushes, before the lanes start: most of them now, the
        // rest (logged meanwhile) once warm, under the push lock.
        let replayed = {
            let (factory, pushes) = (Arc::clone(&factory), Arc::clone(pushes));
            on_loader_thread(move || {
                let push = |push: &narsil_core::IdPush<'_>| factory.push_ids(push);
                pushes.replay(number, &factory.id_map_tables(), &push)
            })
            .await??
        };
        // The engine applies this model's --request-level form (refusing
        // names it lacks, or a sequence's channels split): said with the form.
        let form = config.request_level.clone();
        let engine = Engine::start(factory, config).map_err(|e| match (e, &form) {
            (StartError::RequestLevel(e), Some(names)) => {
                format!("--request-level {model}:{}: for model {model}, {e}", names.join(","))
            }
            (e, _) => format!("{e:#}"),
        })?;
        if let Err(failure) = engine.handle().wait_ready().await {
            engine.shutdown().await;
            return Err(narsil_core::error_chain(&failure));
        }
        Ok((engine, replayed))
    }
}

/// SIGHUP, when it can be listened for.
fn hangup_signal() -> Option<tokio::signal::unix::Signal> {
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .inspect_err(|e| {
            tracing::error!(error = %e, "cannot listen for SIGHUP; rescans come from polling and control calls");
        })
        .ok()
}

/// Resolves at the next SIGHUP (never without a listener).
async fn next_hangup(signal: &mut Option<tokio::signal::unix::Signal>) {
    match signal {
        Some(signal) => {
            signal.recv().await;
        }
        None => std::future::pending().await,
    }
}
