//! Serving and draining: [`Server::run`] serves the three protocols and the
//! admin address until a stop is asked for, then drains (health
//! NOT_SERVING, the grace period, every call in flight answered) and stops
//! the models.

use std::future::Future;
use std::sync::Arc;

use anyhow::Context;
use tonic::transport::server::TcpIncoming;

use super::drain::Drain;
use super::health::Health;
use super::tls::{AdminListener, ServerTls};
use super::{admin_http, token_in_clear, Served, Server};
use crate::lifecycle::control::ModelControl;
use crate::lifecycle::pushes::PushBook;
use crate::protocols::infer::Infer;
use crate::protocols::memory_layer::MemoryLayer;
use crate::protocols::{self, message_limit};

impl Server {
    /// Serves until `shutdown` resolves, then drains: every accepted call is
    /// answered before this returns. A server of one fixed model fails if
    /// its model cannot load.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
        let addr = self.local_addr();
        let models = Arc::clone(&self.models);
        let drain = Drain::default();
        let routes = protocols::services(&Infer::new(Arc::clone(&models)), self.max_message_bytes);
        let names: Vec<&str> = protocols::PROTOCOLS.iter().map(|protocol| protocol.service).collect();
        let (reporter, health_service) = tonic_health::server::health_reporter();
        let health = Health::new(reporter, &names).await;
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()
            .context("cannot build the reflection service")?;

        // What asks for a stop: the signal, or the fixed model failing to load.
        tokio::spawn({
            let drain = drain.clone();
            async move {
                tokio::select! {
                    () = shutdown => drain.begin(None),
                    () = drain.draining() => {}
                }
            }
        });
        let mut control = ModelControl {
            registry: Arc::clone(&models),
            rescan: None,
            enabled: false,
            token: None,
            // A fixed --model takes no pushes (no --model-control).
            pushes: Arc::new(PushBook::new(u64::MAX)),
        };
        let watcher_task = match self.served {
            Served::Fixed(handle) => {
                let drain = drain.clone();
                tokio::spawn(async move {
                    if let Err(failure) = handle.wait_ready().await {
                        drain.begin(Some(failure));
                    }
                });
                None
            }
            Served::Repository { watcher, poll, control: enabled, control_token } => {
                control.pushes = watcher.pushes();
                let (rescan, task) = watcher.spawn(poll, drain.draining());
                control.rescan = Some(rescan);
                control.enabled = enabled;
                control.token = control_token;
                Some(task)
            }
        };
        let following = health.follow(Arc::clone(&models));
        let stop_listening = {
            let (drain, health, models) = (drain.clone(), health.clone(), Arc::clone(&models));
            let grace = self.drain_grace;
            async move {
                drain.draining().await;
                health.drain(&models).await;
                if !grace.is_zero() && drain.failure().is_none() {
                    // Load balancers see NOT_SERVING and stop sending; what
                    // still arrives meanwhile is served.
                    let grace_ms = grace.as_millis() as u64;
                    tracing::info!(grace_ms, "NOT_SERVING; still serving through the drain grace period");
                    tokio::time::sleep(grace).await;
                }
            }
        };
        let describe = |admin: bool| self.tls.as_ref().map_or("off", |tls| tls.describe(admin));
        tracing::info!(%addr, tls = describe(false), "listening");
        let admin = match self.metrics_listener {
            None => None,
            Some(listener) => {
                let admin = listener.local_addr().context("the admin listener has no address")?;
                if let Some(risk) = token_in_clear(&control, admin, describe(true) == "off") {
                    tracing::warn!(addr = %admin, "{risk}");
                }
                tracing::info!(addr = %admin, tls = describe(true), "serving /metrics, /healthz and /v1/models");
                let (serving, drained) = (health.serving(), drain.drained());
                let listener = match &self.tls {
                    Some(tls) => {
                        tls.admin_listener(listener).context("cannot serve TLS on --metrics-addr")?
                    }
                    None => AdminListener::Plain(listener),
                };
                let tls_metrics = self.tls.as_ref().map(ServerTls::metrics);
                Some(match listener {
                    AdminListener::Plain(listener) => {
                        tokio::spawn(admin_http::serve(listener, control, tls_metrics, serving, drained))
                    }
                    AdminListener::Tls(listener) => {
                        tokio::spawn(admin_http::serve(listener, control, tls_metrics, serving, drained))
                    }
                })
            }
        };
        let mut builder = tonic::transport::Server::builder();
        if let Some(age) = self.tls.as_ref().and_then(ServerTls::connection_age) {
            // A GOAWAY at the age; the TLS stream closes at age + grace.
            builder = builder.max_connection_age(age.max);
        }
        let router = builder
            .layer(message_limit::layer(Arc::clone(&models)))
            .layer(MemoryLayer::new(self.memory.clone(), Arc::clone(&models), &protocols::PROTOCOLS))
            .add_routes(routes)
            .add_service(health_service)
            .add_service(reflection);
        let served = match &self.tls {
            Some(tls) => {
                let incoming = tls.grpc_incoming(self.listener).context("cannot serve TLS on --addr")?;
                router.serve_with_incoming_shutdown(incoming, stop_listening).await
            }
            None => {
                let incoming = TcpIncoming::from(self.listener).with_nodelay(Some(true));
                router.serve_with_incoming_shutdown(incoming, stop_listening).await
            }
        };
        following.abort();
        drain.begin(None);
        if let Some(task) = watcher_task {
            if let Err(e) = task.await {
                tracing::error!(error = %e, "the repository watcher ended abnormally");
            }
        }
        models.shutdown().await;
        drain.finish();
        if let Some(admin) = admin {
            match admin.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::error!(error = %e, "metrics endpoint failed"),
                Err(e) => tracing::error!(error = %e, "metrics endpoint ended abnormally"),
            }
        }
        served.context("gRPC server failed")?;
        match drain.failure() {
            Some(lane_failure) => Err(anyhow::Error::new(lane_failure).context("model failed to load")),
            None => {
                tracing::info!("drained; bye");
                Ok(())
            }
        }
    }
}
