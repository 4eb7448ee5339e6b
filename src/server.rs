//! The serving process: bind, start the engine, report health, serve until
//! asked to stop, then drain.
//!
//! Health (`grpc.health.v1`) says NOT_SERVING until every lane has loaded and
//! warmed up its model, then SERVING; at shutdown it turns NOT_SERVING again
//! before the listener closes. Shutdown stops accepting connections, waits
//! for every in-flight call to be answered, then stops the engine.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use narsil_core::BackendFactory;
use narsil_engine::{Engine, EngineConfig, EngineHandle};
use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;

use crate::cli::ServeArgs;
use crate::grpc::torchrec::TorchRecService;
use crate::grpc::PredictorService;
use crate::proto::predictor_server::PredictorServer;
use crate::torchrec_proto::predictor_server::PredictorServer as TorchRecPredictorServer;

/// A bound listener and a started engine, ready to serve.
pub struct Server {
    listener: TcpListener,
    engine: Engine,
    max_message_bytes: usize,
}

impl Server {
    /// Binds `addr` and starts the engine over `factory`. Lanes load in the
    /// background; health turns SERVING once they are warm.
    pub async fn start(
        addr: SocketAddr,
        factory: Arc<dyn BackendFactory>,
        config: EngineConfig,
        max_message_bytes: usize,
    ) -> anyhow::Result<Self> {
        let listener = TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        let engine = Engine::start(factory, config).map_err(anyhow::Error::msg)?;
        Ok(Self { listener, engine, max_message_bytes })
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("bound listener has an address")
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

        let (load_failed_tx, load_failed) = tokio::sync::oneshot::channel::<String>();
        let readiness = {
            let health = health.clone();
            let handle = handle.clone();
            tokio::spawn(async move {
                match handle.wait_ready().await {
                    Ok(()) => {
                        set_health(&health, ServingStatus::Serving).await;
                        tracing::info!("all lanes warmed up; SERVING");
                    }
                    Err(message) => {
                        let _ = load_failed_tx.send(message);
                    }
                }
            })
        };
        let failure = Arc::new(std::sync::Mutex::new(None::<String>));
        let stop = {
            let failure = Arc::clone(&failure);
            let health = health.clone();
            async move {
                tokio::select! {
                    _ = shutdown => {}
                    Ok(message) = load_failed => {
                        *failure.lock().expect("failure lock") = Some(message);
                    }
                }
                set_health(&health, ServingStatus::NotServing).await;
            }
        };
        let addr = self.local_addr();
        tracing::info!(%addr, "listening");
        let incoming = TcpIncoming::from(self.listener).with_nodelay(Some(true));
        let served = tonic::transport::Server::builder()
            .add_service(health_service)
            .add_service(reflection)
            .add_service(predictor)
            .add_service(torchrec)
            .serve_with_incoming_shutdown(incoming, stop)
            .await;
        readiness.abort();
        self.engine.shutdown().await;
        served.context("gRPC server failed")?;
        let failure = failure.lock().expect("failure lock").take();
        match failure {
            Some(message) => anyhow::bail!("model failed to load: {message}"),
            None => {
                tracing::info!("drained; bye");
                Ok(())
            }
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
    tracing::info!(backend = args.backend.kind.name(), mode = ?config.mode, lanes = config.lanes,
        batch_size = config.max_batch_requests, "starting");
    let factory = args.backend.build()?;
    let server = Server::start(args.addr, factory, config, args.max_message_bytes).await?;
    server.run(crate::shutdown::signal()).await
}
