//! The admin endpoint on `--metrics-addr`: `GET /metrics` answers every
//! served model's metrics, and with TLS the door's ([`super::tls::metrics`]),
//! as OpenMetrics text; `GET /healthz` answers 200
//! while grpc.health's overall status is SERVING and 503 otherwise (for
//! balancers that check over HTTP, like HAProxy); `/v1/models…` lists and
//! controls models ([`crate::lifecycle::control`], whose calls that change
//! what is served pass its token check first). It serves on any
//! [`Listener`]: a plain TCP one, or a TLS one ([`super::tls`]).

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::http::header::CONTENT_TYPE;
use axum::http::StatusCode;
use axum::routing::get;
use axum::serve::Listener;
use axum::Router;

use super::tls::TlsMetrics;
use crate::lifecycle::control::{self, ModelControl};

/// OpenMetrics' content type, which Prometheus scrapes natively.
pub const CONTENT_TYPE_OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Serves `/metrics` (the models', and `tls`'s if any), `/healthz` and the
/// model routes on `listener` until `shutdown` resolves.
pub async fn serve<L>(
    listener: L,
    models: ModelControl,
    tls: Option<Arc<TlsMetrics>>,
    serving: Arc<AtomicBool>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()>
where
    L: Listener,
    L::Addr: std::fmt::Debug,
{
    let registry = Arc::clone(&models.registry);
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let mut text = registry.metrics_text();
                if let Some(tls) = &tls {
                    text = narsil_engine::merge_expositions([text.as_str(), tls.text().as_str()]);
                }
                async move { ([(CONTENT_TYPE, CONTENT_TYPE_OPENMETRICS)], text) }
            }),
        )
        .route(
            "/healthz",
            get(move || {
                let answer = match serving.load(Ordering::Relaxed) {
                    true => (StatusCode::OK, "SERVING\n"),
                    false => (StatusCode::SERVICE_UNAVAILABLE, "NOT_SERVING\n"),
                };
                async move { answer }
            }),
        )
        .merge(control::routes(models));
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}
