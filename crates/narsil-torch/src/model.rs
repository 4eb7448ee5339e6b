//! The TorchScript model, loaded once per process and shared by every lane.
//!
//! Models written by `models/export_dlrm.py` take
//! `forward(dense: f32[B, D], lengths: i32[T*B] key-major, ids: i64[N] key-major) -> f32[B]`
//! (probabilities) and describe their own inputs through an exported method
//! `narsil_schema() -> str` (JSON), so a model file is self-contained.
//!
//! The module is frozen at load ([`crate::script_module`]): its weights
//! become constants the graph optimizer folds, which is also when the dense
//! precision is applied.

use std::path::Path;

use narsil_core::{BackendError, ModelSchema, SparseFeature};
use serde::Deserialize;
use tch::Device;

use crate::precision::DensePrecision;
use crate::script_module::ScriptModule;

/// The JSON returned by the model's `narsil_schema()` method.
#[derive(Debug, Deserialize)]
struct SchemaJson {
    name: String,
    version: String,
    num_dense: usize,
    sparse: Vec<SparseJson>,
    /// Written by exports since the bf16 option; older ones lack it.
    #[serde(default)]
    mlp_flops_per_sample: Option<f64>,
}

#[derive(Debug, Deserialize)]
struct SparseJson {
    name: String,
    num_rows: u64,
}

/// A loaded TorchScript model. TorchScript modules may run forwards from
/// several threads at once, so lanes share one copy of the weights.
pub struct TorchModel {
    pub(crate) module: ScriptModule,
    schema: ModelSchema,
    device: Device,
    mlp_flops_per_sample: Option<f64>,
}

impl TorchModel {
    /// Loads `path` onto `device` in `precision` and reads its schema.
    /// FBGEMM's operators must already be registered
    /// ([`crate::fbgemm::load_fbgemm_ops`]).
    pub fn load(
        path: &Path,
        device: Device,
        device_name: &str,
        precision: DensePrecision,
    ) -> Result<Self, BackendError> {
        if !path.is_file() {
            return Err(BackendError::load(path, "no such file; export one with models/export_dlrm.py"));
        }
        let loaded = ScriptModule::load(path, device, precision).map_err(|e| {
            BackendError::load(path, "not a TorchScript model libtorch can load").caused_by(e)
        })?;
        let Some(json) = loaded.schema_json else {
            return Err(BackendError::load(
                path,
                "no narsil_schema() method returning a string; export it with models/export_dlrm.py",
            ));
        };
        if precision == DensePrecision::Bf16 {
            tracing::info!(int8_lookups_in_bf16 = loaded.bf16_lookups, "dense arithmetic in bf16");
        }
        let (schema, mlp_flops_per_sample) = parse_schema(&json, path, device_name)?;
        Ok(Self { module: loaded.module, schema, device, mlp_flops_per_sample })
    }

    /// The MLPs' FLOPs per sample, as the export states them.
    pub fn mlp_flops_per_sample(&self) -> Option<f64> {
        self.mlp_flops_per_sample
    }

    /// The model's input schema.
    pub fn schema(&self) -> &ModelSchema {
        &self.schema
    }

    /// The device the weights live on.
    pub fn device(&self) -> Device {
        self.device
    }
}

fn parse_schema(json: &str, path: &Path, device: &str) -> Result<(ModelSchema, Option<f64>), BackendError> {
    let parsed: SchemaJson = serde_json::from_str(json)
        .map_err(|e| BackendError::load(path, "narsil_schema() is not valid").caused_by(e))?;
    if parsed.sparse.is_empty() || parsed.sparse.iter().any(|f| f.num_rows == 0) {
        return Err(BackendError::load(path, "the schema needs at least one sparse feature, each with rows"));
    }
    let schema = ModelSchema {
        name: parsed.name,
        version: parsed.version,
        backend: "torch".into(),
        device: device.into(),
        num_dense: parsed.num_dense,
        sparse: parsed
            .sparse
            .into_iter()
            .map(|f| SparseFeature { name: f.name, num_rows: f.num_rows })
            .collect(),
    };
    Ok((schema, parsed.mlp_flops_per_sample))
}
