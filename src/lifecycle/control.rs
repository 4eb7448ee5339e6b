//! Model control over HTTP on the admin (`--metrics-addr`) address:
//!
//! * `GET  /v1/models`: every model, its versions and their states (always
//!   on, never behind the token).
//! * `POST /v1/repository/scan`: look at the repository now.
//! * `POST /v1/models/{model}/load`: serve the model again after an unload
//!   (its versions per the version policy).
//! * `POST /v1/models/{model}/versions/{version}/load`: serve this version
//!   too, whatever the policy says.
//! * `POST /v1/models/{model}/unload`: stop serving every version of it.
//! * `POST /v1/models/{model}/versions/{version}/unload`: stop serving this
//!   version, even the last one.
//! * `POST /v1/models/{model}/tables/{table}/ids`: add raw ids, each with its
//!   row, to the id map of table `table` of every ready version of the model
//!   (a split model's mapped table in the `memory` or `mmap` store; `narsil
//!   tables push-ids` sends them). The body is entries back to back: the
//!   raw id (8 bytes, little-endian two's complement), then the table's
//!   `row_bytes` of its row in the table's storage format. Every ready
//!   version takes the whole body or none does ([`super::pushes`]: checked
//!   by each, written to the model's push log and fsynced, then applied);
//!   the answer lists, per version, the ids added, those it already held
//!   with the same row, its pushed ids and their bytes in all (200), or the
//!   versions that refused it and why (422, nothing pushed; past the bound
//!   on a table's pushed bytes too, naming it). Its body may hold
//!   [`MAX_PUSH_BODY_BYTES`].
//!
//! The POST calls change what is served, so they answer 403 unless the
//! server runs with `--model-control` (which needs `--model-repository`: a
//! server of one fixed `--model` always answers 403). Each answers once the
//! repository has been reconciled, with the model's status as JSON: 200
//! when the call's goal was reached, 422 (with the failure in the version's
//! `error`) when a load failed.
//!
//! Every POST passes the door (`door`) first, before any work and never
//! queued behind a scan or a load in progress: a body over
//! [`MAX_CONTROL_BODY_BYTES`] ([`MAX_PUSH_BODY_BYTES`] for an id push) is
//! refused with 413; with a token
//! (`--control-token-file`, [`ControlToken`]), a call without
//! `Authorization: Bearer <token>` gets 401 and one with another token 403,
//! both with the body `unauthorized` and nothing else, and both counted in
//! `narsil_control_unauthorized_total{reason}` (`missing`, `wrong`).

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::DefaultBodyLimit;
use axum::extract::{Path, Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, WWW_AUTHENTICATE};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

use super::control_token::ControlToken;
use super::pushes::{PushAnswer, PushBook};
use super::registry::{ModelRegistry, ModelStatus, OperatorMarks, VersionState};
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
    /// `--control-token-file`: the token every POST must present; none:
    /// open (allowed on a loopback admin address only).
    pub token: Option<Arc<ControlToken>>,
    /// The models' pushes: their locks and logs.
    pub pushes: Arc<PushBook>,
}

/// Largest body a control call may carry (they need none), bytes.
pub const MAX_CONTROL_BODY_BYTES: usize = 64 << 10;

/// Largest body an id push may carry, bytes: 16 MiB, about 190,000 ids
/// of the default DLRM's 80-byte rows. Large, because each push is a
/// record of the push log fsynced and a segment of the table's index of
/// pushed ids (merged with the newest as they grow); bounded, because the
/// door reads a body whole before its handler. The token is checked before
/// any of the body is read, so only a caller that holds it can send this
/// much.
pub const MAX_PUSH_BODY_BYTES: usize = 16 << 20;

/// The control routes.
pub fn routes(control: ModelControl) -> Router {
    let pushes = Router::new()
        .route("/v1/models/{model}/tables/{table}/ids", post(push_ids))
        .route_layer(middleware::from_fn_with_state(control.clone(), door::<MAX_PUSH_BODY_BYTES>))
        .layer(DefaultBodyLimit::max(MAX_PUSH_BODY_BYTES));
    Router::new()
        .route("/v1/repository/scan", post(scan))
        .route("/v1/models/{model}/load", post(load_model))
        .route("/v1/models/{model}/unload", post(unload_model))
        .route("/v1/models/{model}/versions/{version}/load", post(load_version))
        .route("/v1/models/{model}/versions/{version}/unload", post(unload_version))
        // Every route above, and none below, passes the door first.
        .route_layer(middleware::from_fn_with_state(control.clone(), door::<MAX_CONTROL_BODY_BYTES>))
        .merge(pushes)
        .route("/v1/models", get(list))
        .with_state(control)
}

/// The token a call presents: `Authorization: Bearer <token>` (the scheme
/// in any case); none for a missing header or another scheme.
fn presented(headers: &HeaderMap) -> Option<&[u8]> {
    let value = headers.get(AUTHORIZATION)?.as_bytes();
    let (scheme, token) = value.split_at_checked(7)?;
    scheme.eq_ignore_ascii_case(b"bearer ").then(|| token.trim_ascii())
}

fn unauthorized(status: StatusCode) -> Response {
    let mut response = (status, "unauthorized").into_response();
    if status == StatusCode::UNAUTHORIZED {
        response.headers_mut().insert(WWW_AUTHENTICATE, "Bearer".parse().expect("a valid header value"));
    }
    response
}

fn too_large(limit: usize) -> Response {
    let message = format!("a control call's body may hold at most {limit} bytes");
    error(StatusCode::PAYLOAD_TOO_LARGE, message)
}

/// What every POST passes before its handler: the body's size (at most
/// `LIMIT` bytes), then the token. Cheap (a header or two and one hash),
/// and run on the call's own connection task, so a refusal never waits for
/// a scan or a load.
async fn door<const LIMIT: usize>(
    State(control): State<ModelControl>,
    request: Request,
    next: Next,
) -> Response {
    let declared = request.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|bytes| bytes > LIMIT as u64) {
        return too_large(LIMIT);
    }
    if let Some(token) = &control.token {
        match presented(request.headers()) {
            None => {
                control.registry.count_control_unauthorized("missing");
                return unauthorized(StatusCode::UNAUTHORIZED);
            }
            Some(candidate) if !token.matches(candidate) => {
                control.registry.count_control_unauthorized("wrong");
                return unauthorized(StatusCode::FORBIDDEN);
            }
            Some(_) => {}
        }
    }
    if LIMIT > MAX_CONTROL_BODY_BYTES && !control.enabled {
        // Refused before its large body is read: with control off, the
        // admin address reads no more of a call than the other calls'.
        return control_off();
    }
    // A chunked body declares no length: read at most the limit of it.
    let (parts, body) = request.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, LIMIT).await else {
        return too_large(LIMIT);
    };
    next.run(Request::from_parts(parts, Body::from(bytes))).await
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

/// `--model-control` is off: nothing may change what is served.
fn control_off() -> Response {
    error(
        StatusCode::FORBIDDEN,
        "model control is off; start `narsil serve` with --model-control to load and unload models and push ids"
            .into(),
    )
}

impl ModelControl {
    /// Checks the call may run, applies `mark` to `model`'s marks (none for
    /// an empty name), reconciles, and returns the model's status after it.
    async fn act(
        &self,
        model: &str,
        mark: impl FnOnce(&mut OperatorMarks),
    ) -> Result<Option<ModelStatus>, Response> {
        if !self.enabled {
            return Err(control_off());
        }
        let Some(rescan) = &self.rescan else {
            // `--model-control` needs `--model-repository`; kept for embedders.
            return Err(error(
                StatusCode::CONFLICT,
                "this server serves one fixed --model; loading and unloading needs --model-repository".into(),
            ));
        };
        let stopped = || error(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down".into());
        let known = |registry: &ModelRegistry| registry.model_names().iter().any(|m| m == model);
        if !model.is_empty() {
            // Perhaps published since the last scan.
            if !known(&self.registry) && !rescan.rescan().await {
                return Err(stopped());
            }
            if !known(&self.registry) {
                return Err(error(StatusCode::NOT_FOUND, format!("no model {model:?} in the repository")));
            }
            self.registry.edit_marks(model, mark);
        }
        if !rescan.rescan().await {
            return Err(stopped());
        }
        Ok(self.registry.list().into_iter().find(|m| m.name == model))
    }
}

/// The model's status: 200 when `reached` says the call's goal was, else 422.
fn answer(result: Result<Option<ModelStatus>, Response>, reached: impl Fn(&ModelStatus) -> bool) -> Response {
    match result {
        Err(response) => response,
        Ok(Some(status)) if reached(&status) => json(StatusCode::OK, &status),
        Ok(Some(status)) => json(StatusCode::UNPROCESSABLE_ENTITY, &status),
        // Every version gone and the model forgotten.
        Ok(None) => json(StatusCode::OK, &serde_json::json!({})),
    }
}

fn has_ready(status: &ModelStatus, version: Option<&str>) -> bool {
    status
        .versions
        .iter()
        .any(|v| v.state == VersionState::Ready.name() && version.is_none_or(|wanted| v.version == wanted))
}

async fn scan(State(control): State<ModelControl>) -> Response {
    match control.act("", |_| {}).await {
        Ok(_) => json(StatusCode::OK, &serde_json::json!({ "models": control.registry.list() })),
        Err(response) => response,
    }
}

async fn load_model(State(control): State<ModelControl>, Path(model): Path<String>) -> Response {
    let result = control
        .act(&model, |m| {
            m.model_unloaded = false;
            m.unloaded.clear();
        })
        .await;
    answer(result, |status| has_ready(status, None))
}

async fn unload_model(State(control): State<ModelControl>, Path(model): Path<String>) -> Response {
    let result = control
        .act(&model, |m| {
            m.model_unloaded = true;
            m.pinned.clear();
        })
        .await;
    answer(result, |_| true)
}

async fn load_version(
    State(control): State<ModelControl>,
    Path((model, version)): Path<(String, u64)>,
) -> Response {
    let result = control
        .act(&model, |m| {
            m.unloaded.remove(&version);
            m.pinned.insert(version);
        })
        .await;
    let label = version.to_string();
    if let Ok(Some(status)) = &result {
        if !status.versions.iter().any(|v| v.version == label) {
            return error(
                StatusCode::NOT_FOUND,
                format!("no version {version} of model {model:?} in the repository"),
            );
        }
    }
    answer(result, |status| has_ready(status, Some(&label)))
}

async fn unload_version(
    State(control): State<ModelControl>,
    Path((model, version)): Path<(String, u64)>,
) -> Response {
    let result = control
        .act(&model, |m| {
            m.pinned.remove(&version);
            m.unloaded.insert(version);
        })
        .await;
    answer(result, |_| true)
}

async fn push_ids(
    State(control): State<ModelControl>,
    Path((model, table)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    if !control.enabled {
        return control_off();
    }
    let not_serving = || error(StatusCode::NOT_FOUND, format!("no version of model {model:?} is serving"));
    if control.registry.live_versions(&model).is_empty() {
        return not_serving();
    }
    let pushes = control.pushes.model(&model, None);
    // One push of a model at a time, and none while a version turns ready;
    // held by the push itself, which finishes even if its caller goes away.
    let one_at_a_time = pushes.lock().await;
    let versions = control.registry.live_versions(&model);
    if versions.is_empty() {
        return not_serving();
    }
    let pushing = table.clone();
    // Off the async threads: a push checks every entry on every version,
    // fsyncs the log and may merge the table's index.
    let answer = tokio::task::spawn_blocking(move || {
        let _one_at_a_time = one_at_a_time;
        pushes.push_to(&versions, &pushing, &body)
    })
    .await;
    let Ok(answer) = answer else {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "the push panicked; see the server's log".into());
    };
    let (status, outcomes, why) = match answer {
        PushAnswer::Pushed(outcomes) => (StatusCode::OK, outcomes, None),
        PushAnswer::Refused(refusals) => {
            let why = refusals.iter().find_map(|o| o.error.clone());
            (StatusCode::UNPROCESSABLE_ENTITY, refusals, why)
        }
        PushAnswer::Failed(outcomes, why) => (StatusCode::INTERNAL_SERVER_ERROR, outcomes, Some(why)),
    };
    for outcome in &outcomes {
        match (&outcome.pushed, &outcome.error) {
            (Some(pushed), _) => tracing::info!(
                model, version = %outcome.version, table, added = pushed.added,
                already_held = pushed.already_held, pushed = pushed.pushed, bytes = pushed.bytes, "ids pushed"
            ),
            (None, Some(why)) => {
                tracing::warn!(model, version = %outcome.version, table, reason = %why, "id push refused")
            }
            (None, None) => {}
        }
    }
    if let (Some(why), true) = (&why, status == StatusCode::INTERNAL_SERVER_ERROR) {
        tracing::error!(model, table, reason = %why, "id push failed");
    }
    let mut answer = serde_json::json!({ "model": model, "table": table, "versions": outcomes });
    if let Some(why) = why {
        answer["error"] = why.into();
    }
    json(status, &answer)
}
