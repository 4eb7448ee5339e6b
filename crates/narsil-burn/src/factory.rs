//! The Burn [`BackendFactory`]: one immutable model shared by every lane.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use narsil_core::{BackendError, BackendFactory, KeyedBatch, ModelBackend, ModelSchema};

use crate::model::BurnDlrm;
use crate::weights::{DlrmShape, DlrmWeights};

/// Creates lanes over one shared [`BurnDlrm`].
pub struct BurnFactory {
    model: Arc<BurnDlrm>,
    schema: ModelSchema,
}

impl BurnFactory {
    /// Loads `weights_fp32.safetensors` (from `models/export_dlrm.py`).
    pub fn load(path: &Path) -> Result<Self, BackendError> {
        let started = Instant::now();
        let weights = DlrmWeights::load(path)?;
        tracing::info!(model = %path.display(), elapsed_ms = started.elapsed().as_millis() as u64, "Burn DLRM loaded");
        Ok(Self::from_weights(weights))
    }

    /// A seeded random DLRM of `shape`: serves a real model with no files.
    pub fn random(shape: &DlrmShape, seed: u64) -> Result<Self, BackendError> {
        let started = Instant::now();
        let weights = DlrmWeights::random(shape, seed)?;
        tracing::info!(seed, elapsed_ms = started.elapsed().as_millis() as u64, "random Burn DLRM generated");
        Ok(Self::from_weights(weights))
    }

    /// Wraps weights already in memory.
    pub fn from_weights(weights: DlrmWeights) -> Self {
        let schema = weights.schema.clone();
        Self { model: Arc::new(BurnDlrm::new(weights)), schema }
    }
}

impl BackendFactory for BurnFactory {
    fn schema(&self) -> &ModelSchema {
        &self.schema
    }

    fn create_lane(&self, _lane: usize) -> Result<Box<dyn ModelBackend>, BackendError> {
        Ok(Box::new(BurnLane { model: Arc::clone(&self.model) }))
    }
}

/// A lane's handle on the shared model.
struct BurnLane {
    model: Arc<BurnDlrm>,
}

impl ModelBackend for BurnLane {
    fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
        self.model.forward(batch)
    }
}
