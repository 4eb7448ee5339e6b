//! Model control over HTTP on the admin (`--metrics-addr`) address:
//!
//! * `GET  /v1/models`: every model, its versions and their states (always on).
//! * `POST /v1/repository/scan`: look at the repository now.
//! * `POST /v1/models/{model}/load`: serve the model again after an unload
//!   (its versions per the version policy).
//! * `POST /v1/models/{model}/versions/{version}/load`: serve this version
//!   too, whatever the policy says.
//! * `POST /v1/models/{model}/unload`: stop serving every version of it.
//! * `POST /v1/models/{model}/versions/{version}/unload`: stop serving this
//!   version, even the last one.
//!
//! The POST calls change what is served, so they answer 403 unless the
//! server runs with `--model-control`, and 409 for a server of one fixed
//! `--model`. Each answers once the repository has been reconciled, with the
//! model's status as JSON: 200 when the call's goal was reached, 422 (with
//! the failure in the version's `error`) when a load failed.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{header::CONTENT_TYPE, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

use super::registry::{ModelRegistry, ModelStatus};
use super::watcher::RescanHandle;

/// What the control routes act on.
#[derive(Clone)]
pub struct ModelControl {
    /// The served models.
    pub registry: Arc<ModelRegistry>,
    /// The repository watcher; none for a fixed `--model`.
    pub rescan: Option<RescanHandle>,
    /// `--model-control`: whether the POST calls may change anything.
    pub enabled: bool,
}

/// The control routes.
pub fn routes(control: ModelControl) -> Router {
    Router::new()
        .route("/v1/models", get(list))
        .route("/v1/repository/scan", post(scan))
        .route("/v1/models/{model}/load", post(load_model))
        .route("/v1/models/{model}/unload", post(unload_model))
        .route("/v1/models/{model}/versions/{version}/load", post(load_version))
        .route("/v1/models/{model}/versions/{version}/unload", post(unload_version))
        .with_state(control)
}

fn json(status: StatusCode, body: &impl serde::Serialize) -> Response {
    let text = serde_json::to_string_pretty(body).expect("plain data serializes");
    (status, [(CONTENT_TYPE, "application/json")], text + "\n").into_response()
}

fn error(status: StatusCode, message: String) -> Response {
    json(status, &serde_json::json!({ "error": message }))
}

async fn list(State(control): State<ModelControl>) -> Response {
    json(StatusCode::OK, &serde_json::json!({ "models": control.registry.list() }))
}

impl ModelControl {
    /// Checks the call may run, applies `mark`, reconciles, and returns the
    /// model's status after it.
    async fn act(
        &self,
        model: &str,
        mark: impl FnOnce(&ModelRegistry),
    ) -> Result<Option<ModelStatus>, Response> {
        if !self.enabled {
            return Err(error(
                StatusCode::FORBIDDEN,
                "model control is off; start `narsil serve` with --model-control to load and unload models"
                    .into(),
            ));
        }
        let Some(rescan) = &self.rescan else {
            return Err(error(
                StatusCode::CONFLICT,
                "this server serves one fixed --model; loading and unloading needs --model-repository".into(),
            ));
        };
        let stopped = || error(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down".into());
        let known = |registry: &ModelRegistry| registry.model_names().iter().any(|m| m == model);
        if !model.is_empty() && !known(&self.registry) {
            // Perhaps published since the last scan.
            if !rescan.rescan().await {
                return Err(stopped());
            }
            if !known(&self.registry) {
                return Err(error(StatusCode::NOT_FOUND, format!("no model {model:?} in the repository")));
            }
        }
        mark(&self.registry);
        if !rescan.rescan().await {
            return Err(stopped());
        }
        Ok(self.registry.list().into_iter().find(|m| m.name == model))
    }
}

async fn scan(State(control): State<ModelControl>) -> Response {
    match control.act("", |_| {}).await {
        Ok(_) => json(StatusCode::OK, &serde_json::json!({ "models": control.registry.list() })),
        Err(response) => response,
    }
}

async fn load_model(State(control): State<ModelControl>, Path(model): Path<String>) -> Response {
    let result = control
        .act(&model, |r| {
            r.edit_marks(&model, |m| {
                m.model_unloaded = false;
                m.unloaded.clear();
            })
        })
        .await;
    match result {
        Err(response) => response,
        Ok(None) => error(StatusCode::NOT_FOUND, format!("no model {model:?} in the repository")),
        Ok(Some(status)) if status.versions.iter().any(|v| v.state == "READY") => {
            json(StatusCode::OK, &status)
        }
        Ok(Some(status)) => json(StatusCode::UNPROCESSABLE_ENTITY, &status),
    }
}

async fn unload_model(State(control): State<ModelControl>, Path(model): Path<String>) -> Response {
    let result = control
        .act(&model, |r| {
            r.edit_marks(&model, |m| {
                m.model_unloaded = true;
                m.pinned.clear();
            })
        })
        .await;
    match result {
        Err(response) => response,
        Ok(status) => json(StatusCode::OK, &status),
    }
}

async fn load_version(
    State(control): State<ModelControl>,
    Path((model, version)): Path<(String, u64)>,
) -> Response {
    let result = control
        .act(&model, |r| {
            r.edit_marks(&model, |m| {
                m.unloaded.remove(&version);
                m.pinned.insert(version);
            })
        })
        .await;
    let label = version.to_string();
    match result {
        Err(response) => response,
        Ok(Some(status)) => match status.versions.iter().find(|v| v.version == label) {
            Some(v) if v.state == "READY" => json(StatusCode::OK, &status),
            Some(_) => json(StatusCode::UNPROCESSABLE_ENTITY, &status),
            None => error(
                StatusCode::NOT_FOUND,
                format!("no version {version} of model {model:?} in the repository"),
            ),
        },
        Ok(None) => error(StatusCode::NOT_FOUND, format!("no model {model:?} in the repository")),
    }
}

async fn unload_version(
    State(control): State<ModelControl>,
    Path((model, version)): Path<(String, u64)>,
) -> Response {
    let result = control
        .act(&model, |r| {
            r.edit_marks(&model, |m| {
                m.pinned.remove(&version);
                m.unloaded.insert(version);
            })
        })
        .await;
    match result {
        Err(response) => response,
        Ok(status) => json(StatusCode::OK, &status),
    }
}
