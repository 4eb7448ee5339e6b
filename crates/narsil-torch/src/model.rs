//! The TorchScript model, loaded once per process and shared by every lane.
//!
//! Models written by `models/export_dlrm.py` take
//! `forward(dense: f32[B, D], lengths: i32[T*B] key-major, ids: i64[N] key-major) -> f32[B]`
//! (probabilities) and describe their own inputs through an exported method
//! `narsil_schema() -> str` (JSON), so a model file is self-contained.

use std::path::Path;

use narsil_core::{BackendError, ModelSchema, SparseFeature};
use serde::Deserialize;
use tch::{CModule, Device, IValue};

/// The JSON returned by the model's `narsil_schema()` method.
#[derive(Debug, Deserialize)]
struct SchemaJson {
    name: String,
    version: String,
    num_dense: usize,
    sparse: Vec<SparseJson>,
}

#[derive(Debug, Deserialize)]
struct SparseJson {
    name: String,
    num_rows: u64,
}

/// A loaded TorchScript model. `CModule` is `Sync`: TorchScript modules may
/// run forwards from several threads at once, so lanes share one copy of the
/// weights.
pub struct TorchModel {
    pub(crate) module: CModule,
    schema: ModelSchema,
    device: Device,
}

impl TorchModel {
    /// Loads `path` onto `device` and reads its schema. FBGEMM's operators
    /// must already be registered ([`crate::fbgemm::load_fbgemm_ops`]).
    pub fn load(path: &Path, device: Device, device_name: &str) -> Result<Self, BackendError> {
        if !path.is_file() {
            return Err(BackendError(format!(
                "model file {} does not exist; export one with models/export_dlrm.py",
                path.display()
            )));
        }
        let mut module = CModule::load_on_device(path, device)
            .map_err(|e| BackendError(format!("cannot load TorchScript model {}: {e}", path.display())))?;
        module.set_eval();
        let schema = read_schema(&module, path, device_name)?;
        Ok(Self { module, schema, device })
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

fn read_schema(module: &CModule, path: &Path, device: &str) -> Result<ModelSchema, BackendError> {
    let json = match module.method_is::<IValue>("narsil_schema", &[]) {
        Ok(IValue::String(json)) => json,
        Ok(other) => {
            return Err(BackendError(format!(
                "{}: narsil_schema() returned {other:?}, not a string",
                path.display()
            )))
        }
        Err(e) => {
            return Err(BackendError(format!(
                "{} has no narsil_schema() method ({e}); export it with models/export_dlrm.py",
                path.display()
            )))
        }
    };
    let parsed: SchemaJson = serde_json::from_str(&json)
        .map_err(|e| BackendError(format!("{}: narsil_schema() is not valid: {e}", path.display())))?;
    if parsed.sparse.is_empty() || parsed.sparse.iter().any(|f| f.num_rows == 0) {
        return Err(BackendError(format!(
            "{}: the schema needs at least one sparse feature, each with rows",
            path.display()
        )));
    }
    Ok(ModelSchema {
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
    })
}
