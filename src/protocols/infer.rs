//! The one entry every protocol's prediction call goes through: route to a
//! model version, decode the message against that version's schema, hand it
//! to the engine with the memory its message reserved, and map any failure
//! to a status in the protocol's own field names. A protocol module keeps
//! only its decode, its encode and its field names.
//!
//! Every call is counted exactly once: a refusal before routing by the
//! registry (`narsil_requests_total` without model labels), a message that
//! does not decode by its version's engine (`invalid`), everything after by
//! the engine's own tally (`ok`, `rejected`, `deadline`, `cancelled`, ...).

use std::sync::Arc;
use std::time::Instant;

use narsil_core::{InvalidInput, ModelSchema, RequestSamples};
use narsil_engine::Prediction;
use tonic::Status;

use narsil_engine::EngineError;

use super::memory_layer;
use crate::lifecycle::{LiveVersion, ModelRegistry};

/// Which model and version a call names (empty: the default model, its
/// highest ready version), or why its names could not be read.
pub type Target<'a> = Result<(&'a str, &'a str), InvalidInput>;

/// A prediction and the version that computed it.
pub struct Served {
    /// The version the call was routed to (its schema names the outputs).
    pub live: Arc<LiveVersion>,
    /// The scores.
    pub prediction: Prediction,
}

/// Routes, decodes, predicts and counts, for every protocol.
#[derive(Clone)]
pub struct Infer {
    models: Arc<ModelRegistry>,
}

impl Infer {
    /// An entry over `models`.
    pub fn new(models: Arc<ModelRegistry>) -> Self {
        Self { models }
    }

    /// The served models (for the protocols' metadata calls).
    pub fn models(&self) -> &ModelRegistry {
        &self.models
    }

    /// One prediction call: `decode` turns the message into the engine's
    /// request for the schema of the version `target` routes to; errors
    /// become the protocol's statuses through `to_status`.
    pub async fn predict(
        &self,
        target: Target<'_>,
        deadline: Option<Instant>,
        to_status: fn(EngineError) -> Status,
        decode: impl FnOnce(&ModelSchema) -> Result<RequestSamples, InvalidInput>,
    ) -> Result<Served, Status> {
        let failed = |error| {
            let status = to_status(error);
            tracing::debug!(code = ?status.code(), message = status.message(), "predict failed");
            status
        };
        let (model, version) = target.map_err(|e| failed(self.models.refuse(e)))?;
        let live = self.models.route(model, version).map_err(failed)?;
        let lease = memory_layer::take_lease();
        let engine = &live.engine;
        let samples = decode(engine.schema()).map_err(|e| failed(engine.reject(e)))?;
        let prediction = engine.predict(samples, lease, deadline).await.map_err(failed)?;
        Ok(Served { live, prediction })
    }
}
