//! The serving process: bind, start the models (one fixed `--model`, or a
//! repository and its watcher), report health, serve the three protocols
//! until asked to stop, then drain.
//!
//! The admin address (`--metrics-addr`) serves metrics, `/healthz` and the
//! model calls over HTTP until the drain is over.
//!
//! Health (`grpc.health.v1`, and `/healthz`) says NOT_SERVING until every
//! model that should serve has a warm version, then follows their backends
//! (NOT_SERVING after `--unhealthy-after-failures` failed forwards in a row,
//! SERVING again after a successful one); each model also has its own status
//! under its name. When a stop is asked for, health turns NOT_SERVING for
//! good at once; calls are still accepted for `--drain-grace-secs`; then the
//! listener closes, every call in flight is answered, and the models stop.

use std::collections::BTreeSet;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use narsil_core::BackendFactory;
use narsil_engine::{Engine, EngineConfig, EngineHandle, LaneFailed, MemoryBudget};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;

use crate::cli::ServeArgs;
use crate::grpc::infer::Infer;
use crate::grpc::kserve::KServeService;
use crate::grpc::memory_layer::MemoryLayer;
use crate::grpc::message_limit;
use crate::grpc::torchrec::TorchRecService;
use crate::grpc::PredictorService;
use crate::kserve_proto::grpc_inference_service_server::GrpcInferenceServiceServer;
use crate::models::control::ModelControl;
use crate::models::repository;
use crate::models::watcher::{RepositorySource, Watcher};
use crate::models::ModelRegistry;
use crate::proto::predictor_server::PredictorServer;
use crate::torchrec_proto::predictor_server::PredictorServer as TorchRecPredictorServer;

/// Where and how the server listens.
#[derive(Debug, Clone, Copy)]
pub struct Listen {
    /// gRPC address.
    pub addr: SocketAddr,
    /// Prometheus (and model control) address, if any.
    pub metrics_addr: Option<SocketAddr>,
    /// Largest gRPC message accepted, bytes.
    pub max_message_bytes: usize,
}

/// A model repository to serve, and how it is watched.
#[derive(Clone)]
pub struct RepositoryServe {
    /// The repository and how its versions are served.
    pub source: RepositorySource,
    /// The model requests naming none go to (default: the only model).
    pub default_model: Option<String>,
    /// How often the repository is rescanned; none: only on SIGHUP and
    /// control calls.
    pub poll: Option<Duration>,
    /// Whether the load/unload control calls are on.
    pub control: bool,
}

/// What the server serves.
enum Served {
    /// One fixed `--model`, whose engine started with the server; if it
    /// fails to load, the server stops.
    Fixed(EngineHandle),
    /// A repository, whose versions the watcher loads and switches.
    Repository { watcher: Box<Watcher>, poll: Option<Duration>, control: bool },
}

/// Bound listeners and started models, ready to serve.
pub struct Server {
    listener: TcpListener,
    metrics_listener: Option<TcpListener>,
    models: Arc<ModelRegistry>,
    served: Served,
    max_message_bytes: usize,
    /// The bound on request memory every engine shares.
    memory: MemoryBudget,
    drain_grace: Duration,
}

async fn bind(addr: SocketAddr, what: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr} ({what})"))
}

async fn bind_all(listen: Listen) -> anyhow::Result<(TcpListener, Option<TcpListener>)> {
    let listener = bind(listen.addr, "--addr").await?;
    let metrics_listener = match listen.metrics_addr {
        Some(addr) => Some(bind(addr, "--metrics-addr").await?),
        None => None,
    };
    Ok((listener, metrics_listener))
}

impl Server {
    /// Binds the addresses and starts the engine over `factory`: a
    /// repository of one model and one version. Lanes load in the
    /// background; health turns SERVING once they are warm.
    pub async fn start(
        listen: Listen,
        factory: Arc<dyn BackendFactory>,
        config: EngineConfig,
    ) -> anyhow::Result<Self> {
        let (listener, metrics_listener) = bind_all(listen).await?;
        let name = factory.schema().name.clone();
        let memory = config.memory.clone();
        let engine = Engine::start(factory, config)?;
        let handle = engine.handle();
        let models = ModelRegistry::new(Some(name.clone()));
        models.install(&name, 0, engine);
        Ok(Self {
            listener,
            metrics_listener,
            models,
            served: Served::Fixed(handle),
            max_message_bytes: listen.max_message_bytes,
            memory,
            drain_grace: Duration::ZERO,
        })
    }

    /// Binds the addresses and serves the models of a repository. Versions
    /// load in the background once [`Server::run`] starts; health turns
    /// SERVING once every model has a warm version.
    pub async fn start_repository(listen: Listen, repository: RepositoryServe) -> anyhow::Result<Self> {
        let dir = &repository.source.dir;
        let found = repository::scan(dir).with_context(|| {
            format!("cannot read the model repository {} (--model-repository)", dir.display())
        })?;
        let names: Vec<&String> = found.keys().collect();
        let default_model = match repository.default_model {
            Some(name) if found.contains_key(&name) => Some(name),
            Some(name) => anyhow::bail!(
                "--default-model {name:?} is not a model of {}; it holds {names:?}",
                dir.display()
            ),
            None if names.len() == 1 => Some(names[0].clone()),
            None => {
                tracing::info!(models = ?names, "no --default-model: requests must name their model");
                None
            }
        };
        let (listener, metrics_listener) = bind_all(listen).await?;
        let models = ModelRegistry::new(default_model);
        let memory = repository.source.engine.memory.clone();
        let watcher = Box::new(Watcher::new(repository.source, Arc::clone(&models)));
        Ok(Self {
            listener,
            metrics_listener,
            models,
            served: Served::Repository { watcher, poll: repository.poll, control: repository.control },
            max_message_bytes: listen.max_message_bytes,
            memory,
            drain_grace: Duration::ZERO,
        })
    }

    /// After a stop is asked for, health turns NOT_SERVING at once, but
    /// calls are still accepted and served for `grace` before the listener
    /// closes and the drain begins, so that load balancers stop sending first.
    pub fn with_drain_grace(mut self, grace: Duration) -> Self {
        self.drain_grace = grace;
        self
    }

    /// The gRPC address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("bound listener has an address")
    }

    /// The metrics address actually bound, if metrics are served.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_listener.as_ref().map(|l| l.local_addr().expect("bound listener has an address"))
    }

    /// The engine of a server of one fixed model (schema, readiness,
    /// counters); none for a repository.
    pub fn engine(&self) -> Option<EngineHandle> {
        match &self.served {
            Served::Fixed(handle) => Some(handle.clone()),
            Served::Repository { .. } => None,
        }
    }

    /// The served models.
    pub fn models(&self) -> Arc<ModelRegistry> {
        Arc::clone(&self.models)
    }

    /// Serves until `shutdown` resolves, then drains: every accepted call is
    /// answered before this returns. A server of one fixed model fails if
    /// its model cannot load.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> anyhow::Result<()> {
        let addr = self.local_addr();
        let models = Arc::clone(&self.models);
        let (reporter, health_service) = tonic_health::server::health_reporter();
        let health = Health { reporter, serving: Arc::new(AtomicBool::new(false)) };
        health.set(ServingStatus::NotServing).await;
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()
            .context("cannot build the reflection service")?;
        let infer = Infer::new(Arc::clone(&models));
        let predictor = PredictorServer::new(PredictorService::new(infer.clone()))
            .max_decoding_message_size(self.max_message_bytes)
            .max_encoding_message_size(self.max_message_bytes);
        let torchrec = TorchRecPredictorServer::new(TorchRecService::new(infer.clone()))
            .max_decoding_message_size(self.max_message_bytes)
            .max_encoding_message_size(self.max_message_bytes);
        let kserve = GrpcInferenceServiceServer::new(KServeService::new(infer))
            .max_decoding_message_size(self.max_message_bytes)
            .max_encoding_message_size(self.max_message_bytes);

        let (load_failed_tx, load_failed) = tokio::sync::oneshot::channel::<LaneFailed>();
        if let Served::Fixed(handle) = &self.served {
            let handle = handle.clone();
            tokio::spawn(async move {
                if let Err(failure) = handle.wait_ready().await {
                    let _ = load_failed_tx.send(failure);
                }
            });
        }
        let (stop_watching, watching_stopped) = watch::channel(false);
        let (control, watcher_task) = match self.served {
            Served::Fixed(_) => {
                (ModelControl { registry: Arc::clone(&models), rescan: None, enabled: false }, None)
            }
            Served::Repository { watcher, poll, control } => {
                let (rescan, task) = watcher.spawn(poll, watching_stopped);
                (
                    ModelControl { registry: Arc::clone(&models), rescan: Some(rescan), enabled: control },
                    Some(task),
                )
            }
        };
        // Set once draining begins; health changes hold it, so a model's
        // recovery can never turn a draining server SERVING again.
        let draining = Arc::new(tokio::sync::Mutex::new(false));
        let following =
            tokio::spawn(follow_models(health.clone(), Arc::clone(&models), Arc::clone(&draining)));
        let failure = Arc::new(std::sync::Mutex::new(None::<LaneFailed>));
        let drain_grace = self.drain_grace;
        let stop = {
            let failure = Arc::clone(&failure);
            let health = health.clone();
            let models = Arc::clone(&models);
            async move {
                tokio::select! {
                    _ = shutdown => {}
                    Ok(lane_failure) = load_failed => {
                        *failure.lock().expect("failure lock") = Some(lane_failure);
                    }
                }
                let mut draining = draining.lock().await;
                *draining = true;
                health.set(ServingStatus::NotServing).await;
                for (model, _) in models.health().1 {
                    health.set_model(&model, ServingStatus::NotServing).await;
                }
                drop(draining);
                let failed = failure.lock().expect("failure lock").is_some();
                if !drain_grace.is_zero() && !failed {
                    // Load balancers see NOT_SERVING and stop sending; what
                    // still arrives meanwhile is served.
                    let grace_ms = drain_grace.as_millis() as u64;
                    tracing::info!(grace_ms, "NOT_SERVING; still serving through the drain grace period");
                    tokio::time::sleep(drain_grace).await;
                }
            }
        };
        tracing::info!(%addr, "listening");
        let (metrics_stop, metrics_stopped) = tokio::sync::oneshot::channel::<()>();
        let metrics = self.metrics_listener.map(|listener| {
            let admin = listener.local_addr().expect("bound");
            tracing::info!(addr = %admin, "serving /metrics, /healthz and /v1/models");
            tokio::spawn(crate::metrics_http::serve(listener, control, Arc::clone(&health.serving), async {
                let _ = metrics_stopped.await;
            }))
        });
        let incoming = TcpIncoming::from(self.listener).with_nodelay(Some(true));
        let served = tonic::transport::Server::builder()
            .layer(message_limit::layer(Arc::clone(&models)))
            .layer(MemoryLayer::new(self.memory.clone(), Arc::clone(&models)))
            .add_service(health_service)
            .add_service(reflection)
            .add_service(predictor)
            .add_service(torchrec)
            .add_service(kserve)
            .serve_with_incoming_shutdown(incoming, stop)
            .await;
        following.abort();
        let _ = stop_watching.send(true);
        if let Some(task) = watcher_task {
            if let Err(e) = task.await {
                tracing::error!(error = %e, "the repository watcher ended abnormally");
            }
        }
        models.shutdown().await;
        let _ = metrics_stop.send(());
        if let Some(metrics) = metrics {
            match metrics.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::error!(error = %e, "metrics endpoint failed"),
                Err(e) => tracing::error!(error = %e, "metrics endpoint ended abnormally"),
            }
        }
        served.context("gRPC server failed")?;
        let failure = failure.lock().expect("failure lock").take();
        match failure {
            Some(lane_failure) => Err(anyhow::Error::new(lane_failure).context("model failed to load")),
            None => {
                tracing::info!("drained; bye");
                Ok(())
            }
        }
    }
}

/// Overall SERVING while every model that should serve has a warm, healthy
/// version (and at least one model does); each model's own status under its
/// name. Follows every change until draining begins.
async fn follow_models(health: Health, models: Arc<ModelRegistry>, draining: Arc<tokio::sync::Mutex<bool>>) {
    let mut changed = models.subscribe();
    let mut reported = BTreeSet::new();
    let mut was_serving = None;
    loop {
        changed.borrow_and_update();
        let (overall, each) = models.health();
        {
            let draining = draining.lock().await;
            if *draining {
                return;
            }
            if was_serving != Some(overall) {
                if overall {
                    tracing::info!("every model has a warm version; SERVING");
                }
                health.set(if overall { ServingStatus::Serving } else { ServingStatus::NotServing }).await;
                was_serving = Some(overall);
            }
            let now: BTreeSet<String> = each.iter().map(|(model, _)| model.clone()).collect();
            for gone in reported.difference(&now) {
                health.set_model(gone, ServingStatus::NotServing).await;
            }
            for (model, serving) in each {
                let status = if serving { ServingStatus::Serving } else { ServingStatus::NotServing };
                health.set_model(&model, status).await;
            }
            reported = now;
        }
        if changed.changed().await.is_err() {
            return;
        }
    }
}

/// grpc.health's reporter, and whether the server as a whole is SERVING
/// (also answered over HTTP as `/healthz` on the admin address).
#[derive(Clone)]
struct Health {
    reporter: tonic_health::server::HealthReporter,
    serving: Arc<AtomicBool>,
}

impl Health {
    /// The overall status: `""` and every protocol's service name.
    async fn set(&self, status: ServingStatus) {
        self.serving.store(status == ServingStatus::Serving, Ordering::Relaxed);
        let reporter = &self.reporter;
        reporter.set_service_status("", status).await;
        reporter
            .set_service_status(
                <PredictorServer<PredictorService> as tonic::server::NamedService>::NAME,
                status,
            )
            .await;
        reporter
            .set_service_status(
                <TorchRecPredictorServer<TorchRecService> as tonic::server::NamedService>::NAME,
                status,
            )
            .await;
        reporter
            .set_service_status(
                <GrpcInferenceServiceServer<KServeService> as tonic::server::NamedService>::NAME,
                status,
            )
            .await;
    }

    /// One model's status, under its name.
    async fn set_model(&self, model: &str, status: ServingStatus) {
        self.reporter.set_service_status(model, status).await;
    }
}

/// `narsil serve`: build the backend (or watch the repository), serve,
/// drain on SIGINT/SIGTERM.
pub async fn serve_until_signal(args: ServeArgs) -> anyhow::Result<()> {
    let config = args.engine_config()?;
    let drain_grace = args.drain_grace()?;
    let listen = Listen {
        addr: args.addr,
        metrics_addr: args.metrics_addr,
        max_message_bytes: args.max_message_bytes,
    };
    let server = match args.repository(config.clone())? {
        Some(repository) => {
            tracing::info!(repository = %repository.source.dir.display(), mode = ?config.mode,
                lanes = config.lanes, "starting");
            Server::start_repository(listen, repository).await?
        }
        None => {
            tracing::info!(backend = args.backend.kind().name(), mode = ?config.mode, lanes = config.lanes,
                batch_size = config.max_batch_requests, "starting");
            Server::start(listen, args.backend.build()?, config).await?
        }
    };
    server.with_drain_grace(drain_grace).run(crate::shutdown::signal()).await
}
