//! The serving process: bind, start the engine, report health, serve until
//! asked to stop, then drain.
//!
//! Metrics, when `--metrics-addr` is set, are served over HTTP until the
//! drain is over.
//!
//! Health (`grpc.health.v1`) says NOT_SERVING until every lane has loaded and
//! warmed up its model, then follows the backend (NOT_SERVING after
//! `--unhealthy-after-failures` failed forwards in a row, SERVING again after
//! a successful one); at shutdown it turns NOT_SERVING for good before the
//! listener closes. Shutdown stops accepting connections, waits
//! for every in-flight call to be answered, then stops the engine.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use narsil_core::BackendFactory;
use narsil_engine::{Engine, EngineConfig, EngineHandle, LaneFailed};
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;

use crate::cli::ServeArgs;
use crate::grpc::message_limit;
use crate::grpc::torchrec::TorchRecService;
use crate::grpc::PredictorService;
use crate::proto::predictor_server::PredictorServer;
use crate::torchrec_proto::predictor_server::PredictorServer as TorchRecPredictorServer;

/// Where and how the server listens.
#[derive(Debug, Clone, Copy)]
pub struct Listen {
    /// gRPC address.
    pub addr: SocketAddr,
    /// Prometheus address, if any.
    pub metrics_addr: Option<SocketAddr>,
    /// Largest gRPC message accepted, bytes.
    pub max_message_bytes: usize,
}

/// Bound listeners and a started engine, ready to serve.
pub struct Server {
    listener: TcpListener,
    metrics_listener: Option<TcpListener>,
    engine: Engine,
    max_message_bytes: usize,
}

async fn bind(addr: SocketAddr, what: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr} ({what})"))
}

impl Server {
    /// Binds the addresses and starts the engine over `factory`. Lanes load
    /// in the background; health turns SERVING once they are warm.
    pub async fn start(
        listen: Listen,
        factory: Arc<dyn BackendFactory>,
        config: EngineConfig,
    ) -> anyhow::Result<Self> {
        let listener = bind(listen.addr, "--addr").await?;
        let metrics_listener = match listen.metrics_addr {
            Some(addr) => Some(bind(addr, "--metrics-addr").await?),
            None => None,
        };
        let engine = Engine::start(factory, config)?;
        Ok(Self { listener, metrics_listener, engine, max_message_bytes: listen.max_message_bytes })
    }

    /// The gRPC address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("bound listener has an address")
    }

    /// The metrics address actually bound, if metrics are served.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_listener.as_ref().map(|l| l.local_addr().expect("bound listener has an address"))
    }

    /// A handle to the engine (schema, readiness, counters).
    pub fn engine(&self) -> EngineHandle {
        self.engine.handle()
    }

    /// Serves until `shutdown` resolves, then drains: every accepted call is
    /// answered before this returns. Fails if a lane cannot load its model.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> anyhow::Result<()> {
        let handle = self.engine.handle();
        let (health, health_service) = tonic_health::server::health_reporter();
        set_health(&health, ServingStatus::NotServing).await;
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()
            .context("cannot build the reflection service")?;
        let predictor = PredictorServer::new(PredictorService::new(handle.clone()))
            .max_decoding_message_size(self.max_message_bytes)
            .max_encoding_message_size(self.max_message_bytes);
        let torchrec = TorchRecPredictorServer::new(TorchRecService::new(handle.clone()))
            .max_decoding_message_size(self.max_message_bytes)
            .max_encoding_message_size(self.max_message_bytes);

        let (load_failed_tx, load_failed) = tokio::sync::oneshot::channel::<LaneFailed>();
        // Set once draining begins; health changes hold it, so the backend's
        // recovery can never turn a draining server SERVING again.
        let draining = Arc::new(tokio::sync::Mutex::new(false));
        let readiness = {
            let health = health.clone();
            let handle = handle.clone();
            let draining = Arc::clone(&draining);
            tokio::spawn(async move {
                match handle.wait_ready().await {
                    Ok(()) => {
                        tracing::info!("all lanes warmed up; SERVING");
                        follow_backend_health(&health, handle.backend_health(), &draining).await;
                    }
                    Err(failure) => {
                        let _ = load_failed_tx.send(failure);
                    }
                }
            })
        };
        let failure = Arc::new(std::sync::Mutex::new(None::<LaneFailed>));
        let stop = {
            let failure = Arc::clone(&failure);
            let health = health.clone();
            async move {
                tokio::select! {
                    _ = shutdown => {}
                    Ok(lane_failure) = load_failed => {
                        *failure.lock().expect("failure lock") = Some(lane_failure);
                    }
                }
                let mut draining = draining.lock().await;
                *draining = true;
                set_health(&health, ServingStatus::NotServing).await;
            }
        };
        let addr = self.local_addr();
        tracing::info!(%addr, "listening");
        let (metrics_stop, metrics_stopped) = tokio::sync::oneshot::channel::<()>();
        let metrics = self.metrics_listener.map(|listener| {
            tracing::info!(addr = %listener.local_addr().expect("bound"), "serving metrics at /metrics");
            tokio::spawn(crate::metrics_http::serve(listener, handle.clone(), async {
                let _ = metrics_stopped.await;
            }))
        });
        let incoming = TcpIncoming::from(self.listener).with_nodelay(Some(true));
        let served = tonic::transport::Server::builder()
            .layer(message_limit::layer(handle.clone()))
            .add_service(health_service)
            .add_service(reflection)
            .add_service(predictor)
            .add_service(torchrec)
            .serve_with_incoming_shutdown(incoming, stop)
            .await;
        readiness.abort();
        self.engine.shutdown().await;
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

/// SERVING while the backend is healthy and NOT_SERVING while it is not,
/// until draining begins.
async fn follow_backend_health(
    health: &tonic_health::server::HealthReporter,
    mut healthy: tokio::sync::watch::Receiver<bool>,
    draining: &tokio::sync::Mutex<bool>,
) {
    loop {
        let serving = *healthy.borrow_and_update();
        {
            let draining = draining.lock().await;
            if *draining {
                return;
            }
            let status = if serving { ServingStatus::Serving } else { ServingStatus::NotServing };
            set_health(health, status).await;
        }
        if healthy.changed().await.is_err() {
            return;
        }
    }
}

async fn set_health(health: &tonic_health::server::HealthReporter, status: ServingStatus) {
    health.set_service_status("", status).await;
    health
        .set_service_status(<PredictorServer<PredictorService> as tonic::server::NamedService>::NAME, status)
        .await;
    health
        .set_service_status(
            <TorchRecPredictorServer<TorchRecService> as tonic::server::NamedService>::NAME,
            status,
        )
        .await;
}

/// `narsil serve`: build the backend, serve, drain on SIGINT/SIGTERM.
pub async fn serve_until_signal(args: ServeArgs) -> anyhow::Result<()> {
    let config = args.engine_config()?;
    tracing::info!(backend = args.backend.kind().name(), mode = ?config.mode, lanes = config.lanes,
        batch_size = config.max_batch_requests, "starting");
    let factory = args.backend.build()?;
    let listen = Listen {
        addr: args.addr,
        metrics_addr: args.metrics_addr,
        max_message_bytes: args.max_message_bytes,
    };
    let server = Server::start(listen, factory, config).await?;
    server.run(crate::shutdown::signal()).await
}
