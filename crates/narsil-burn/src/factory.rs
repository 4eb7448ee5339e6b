//! The Burn [`BackendFactory`]: one immutable model shared by every lane.
//!
//! Two sources: `weights_fp32.safetensors` (tables and layers in one file;
//! the tables become FP32 tables of Narsil's embedding stage), or a split
//! model directory whose schema names `dense_weights` (its tables in any of
//! the stage's storages and stores, shared across versions like the libtorch
//! backend's).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use narsil_core::{BackendError, BackendFactory, KeyedBatch, ModelBackend, ModelSchema};
use narsil_embedding::{
    EmbeddingStage, RowStore, SplitSchema, StageScratch, Storage, Table, TableSpec, TableStore,
};

use crate::model::BurnDlrm;
use crate::weights::{load_dense_network, DlrmShape, DlrmWeights};

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

    /// Wraps weights already in memory: each table becomes an FP32 table
    /// of the embedding stage, one per feature.
    pub fn from_weights(weights: DlrmWeights) -> Self {
        let DlrmWeights { schema, dim, tables, dense, over } = weights;
        let specs: Vec<TableSpec> = schema
            .sparse
            .iter()
            .map(|f| TableSpec {
                name: f.name.clone(),
                rows: f.num_rows,
                dim,
                storage: Storage::Fp32,
                row_bytes: Storage::Fp32.row_bytes(dim),
                file: Default::default(),
                sha256: String::new(),
                redis: None,
                layout: None,
                ids: Default::default(),
            })
            .collect();
        let stores: Vec<Arc<dyn RowStore>> = specs
            .iter()
            .zip(tables)
            .map(|(spec, values)| {
                let bytes = values.into_iter().flat_map(f32::to_le_bytes).collect();
                Arc::new(Table::from_rows(spec, bytes)) as Arc<dyn RowStore>
            })
            .collect();
        let split = SplitSchema::one_table_per_feature(
            &schema.name,
            &schema.version,
            schema.num_dense,
            specs,
            schema.outputs.clone(),
        );
        let stage = EmbeddingStage::new(&split, stores);
        let model = BurnDlrm::new(&dense, &over, stage, schema.num_sparse(), dim);
        Self { model: Arc::new(model), schema }
    }

    /// Loads the split model in directory `dir`: its tables in `store`
    /// through the embedding stage, its DLRM dense and over arch from the
    /// schema's `dense_weights`.
    pub fn load_split(dir: &Path, store: TableStore) -> Result<Self, BackendError> {
        let started = Instant::now();
        let load_error = |e: &dyn std::fmt::Display| BackendError::load(dir, e.to_string());
        let split = SplitSchema::read(dir).map_err(|e| load_error(&e))?;
        let Some(weights) = &split.dense_weights else {
            return Err(BackendError::load(
                dir,
                "the schema names no dense_weights (a DLRM dense network in safetensors): \
                 serve it with --backend torch, or export it with models/export_dlrm.py --split",
            ));
        };
        if split.takes_unpooled_inputs() {
            return Err(load_error(
                &"the model has sequence features or raw inputs: the Burn backend serves DLRM's pooled \
                  features only (serve it with --backend torch)",
            ));
        }
        if let Some(weighted) = split.features.iter().find(|f| f.weighted) {
            return Err(load_error(&format!(
                "feature {:?} is weighted: the Burn backend serves unweighted features only",
                weighted.name
            )));
        }
        let (dim, features) = (split.pooled_dim(), split.features.len());
        let (dense, over) =
            load_dense_network(&dir.join(weights), split.num_dense, features, dim, split.outputs.len())?;
        let (stage, opened) = EmbeddingStage::open(dir, &split, &store).map_err(|e| load_error(&e))?;
        let schema = split.model_schema("burn", "cpu");
        tracing::info!(
            model = %dir.display(),
            tables_read = opened.read,
            tables_shared = opened.shared,
            %store,
            table_mib = opened.bytes >> 20,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "Burn split model loaded"
        );
        Ok(Self { model: Arc::new(BurnDlrm::new(&dense, &over, stage, features, dim)), schema })
    }
}

impl BackendFactory for BurnFactory {
    fn schema(&self) -> &ModelSchema {
        &self.schema
    }

    fn create_lane(&self, _lane: usize) -> Result<Box<dyn ModelBackend>, BackendError> {
        Ok(Box::new(BurnLane {
            model: Arc::clone(&self.model),
            scratch: StageScratch::default(),
            pooled: Vec::new(),
        }))
    }

    fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        self.model.stage().metrics().register(registry);
    }

    fn watch_dependencies(&self, watcher: narsil_core::DependencyWatcher) {
        self.model.stage().watch_store(watcher);
    }
}

/// A lane's handle on the shared model, and its embedding-stage buffers.
struct BurnLane {
    model: Arc<BurnDlrm>,
    scratch: StageScratch,
    pooled: Vec<f32>,
}

impl ModelBackend for BurnLane {
    fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
        self.model.forward(batch, &mut self.scratch, &mut self.pooled)
    }
}
