//! The Prometheus endpoint: `GET /metrics` on `--metrics-addr`, answering
//! the engine's metrics as OpenMetrics text.

use std::future::Future;

use axum::http::header::CONTENT_TYPE;
use axum::routing::get;
use axum::Router;
use narsil_engine::EngineHandle;
use tokio::net::TcpListener;

/// OpenMetrics' content type, which Prometheus scrapes natively.
pub const CONTENT_TYPE_OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Serves `/metrics` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    engine: EngineHandle,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new().route(
        "/metrics",
        get(move || {
            let text = engine.metrics_text();
            async move { ([(CONTENT_TYPE, CONTENT_TYPE_OPENMETRICS)], text) }
        }),
    );
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}
