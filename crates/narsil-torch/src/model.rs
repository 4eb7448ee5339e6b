//! The TorchScript model, loaded once per process and shared by every lane.
//!
//! Two signatures are served:
//! * Narsil's (`models/export_dlrm.py`):
//!   `forward(dense: f32[B, D], lengths: i32[T*B] key-major, ids: i64[N] key-major) -> f32[B]`
//!   (probabilities), describing its own inputs through an exported method
//!   `narsil_schema() -> str` (JSON), so a model file is self-contained.
//! * TorchRec's inference signature (what TorchRec's packager and C++ server
//!   use): `forward(batch: Dict[str, Tensor]) -> Dict[str, Tensor]`. Its
//!   schema comes from `narsil_schema()` when the module has one, else from
//!   a `model.json` ([`narsil_core::model_config`]) beside the model or
//!   named by `--model-config`. A probe forward at load checks the module
//!   against that schema, so a mismatch fails at start-up, naming the file;
//!   a TorchRec managed-collision model whose config marks no feature
//!   `raw_ids` is refused before it, naming the fix.
//!
//! The module is frozen at load ([`crate::script_module`]): its weights
//! become constants the graph optimizer folds, which is also when the dense
//! precision is applied.

use std::ffi::CString;
use std::path::{Path, PathBuf};

use narsil_core::schema::DEFAULT_OUTPUT;
use narsil_core::{model_config, BackendError, ModelSchema, SparseFeature};
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
    /// The dense arithmetic's FLOPs per sample. Exports before the
    /// roofline counted the MLPs only, under the older name; the oldest lack
    /// it.
    #[serde(default, alias = "mlp_flops_per_sample")]
    dense_flops_per_sample: Option<f64>,
    /// The features that are the same for every candidate of a ranking
    /// request (`dense` for the dense features); older exports lack it.
    #[serde(default)]
    request_level: Vec<String>,
    /// Its sequence features; older exports lack it.
    #[serde(default)]
    sequences: Vec<narsil_core::sequence::SequenceJson>,
}

/// A feature of `narsil_schema()`: `{"name", "num_rows"}`, or `{"name",
/// "pooling": "raw"}` for a raw integer input (no rows).
#[derive(Debug, Deserialize)]
struct SparseJson {
    name: String,
    #[serde(default)]
    num_rows: u64,
    #[serde(default)]
    pooling: Option<String>,
}

impl SparseJson {
    fn feature(self) -> Result<SparseFeature, String> {
        match (self.pooling.as_deref(), self.num_rows) {
            (Some("raw"), 0) => Ok(SparseFeature::raw(self.name)),
            (Some("raw"), rows) => Err(format!(
                "feature {:?}: a raw input (pooling \"raw\") has no table, but {rows} rows",
                self.name
            )),
            (Some(other), _) => Err(format!(
                "feature {:?}: pooling {other:?}; narsil_schema() takes only \"raw\" (a raw integer input)",
                self.name
            )),
            (None, 0) => {
                Err(format!("feature {:?} has no rows (a raw input says \"pooling\": \"raw\")", self.name))
            }
            (None, rows) => Ok(SparseFeature::new(self.name, rows)),
        }
    }
}

/// A loaded TorchScript model. TorchScript modules may run forwards from
/// several threads at once, so lanes share one copy of the weights.
pub struct TorchModel {
    pub(crate) module: ScriptModule,
    schema: ModelSchema,
    device: Device,
    dense_flops_per_sample: Option<f64>,
    dict_signature: bool,
    output_names: Vec<CString>,
    schema_source: Option<PathBuf>,
}

impl TorchModel {
    /// Loads `path` onto `device` in `precision` and reads its schema.
    /// FBGEMM's operators must already be registered
    /// ([`crate::fbgemm::load_fbgemm_ops`]).
    /// `config` is the `model.json` to read a TorchRec-signature model's
    /// schema from (default: the one beside the model).
    pub fn load(
        path: &Path,
        config: Option<&Path>,
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
        if precision == DensePrecision::Bf16 {
            tracing::info!(int8_lookups_in_bf16 = loaded.bf16_lookups, "dense arithmetic in bf16");
        }
        let mut schema_source = None;
        let (schema, dense_flops_per_sample) = match (&loaded.schema_json, loaded.dict_signature) {
            (Some(json), _) if config.is_none() => parse_schema(json, path, device_name)?,
            (_, true) => {
                let (schema, source) = config_schema(path, config, device_name)?;
                managed_collision_takes_raw_ids(path, &source, &schema, &loaded.managed_collision_tables)?;
                schema_source = Some(source);
                (schema, None)
            }
            (None, false) => {
                return Err(BackendError::load(
                    path,
                    "no narsil_schema() method returning a string, and forward does not take TorchRec's \
                     Dict[str, Tensor]; export it with models/export_dlrm.py or models/export_torchrec.py",
                ))
            }
            (Some(_), false) => {
                return Err(BackendError::load(
                    path,
                    "--model-config is for TorchRec-signature models; this one states its schema",
                ))
            }
        };
        let output_names = schema
            .outputs
            .iter()
            .map(|name| CString::new(name.as_str()))
            .collect::<Result<_, _>>()
            .map_err(|_| BackendError::load(path, "an output name holds a NUL byte"))?;
        if loaded.dict_signature {
            tracing::info!(outputs = ?schema.outputs, "TorchRec inference signature");
        }
        Ok(Self {
            module: loaded.module,
            schema,
            device,
            dense_flops_per_sample,
            dict_signature: loaded.dict_signature,
            output_names,
            schema_source,
        })
    }

    /// The `model.json` the schema was read from, if it was.
    pub fn schema_source(&self) -> Option<&Path> {
        self.schema_source.as_deref()
    }

    /// Whether forward takes TorchRec's `Dict[str, Tensor]`.
    pub fn dict_signature(&self) -> bool {
        self.dict_signature
    }

    /// The outputs a forward returns, as C strings for the shim.
    pub(crate) fn output_names(&self) -> &[CString] {
        &self.output_names
    }

    /// The dense arithmetic's FLOPs per sample, as the export counted them.
    pub fn dense_flops_per_sample(&self) -> Option<f64> {
        self.dense_flops_per_sample
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
    if parsed.sparse.is_empty() {
        return Err(BackendError::load(path, "the schema needs at least one sparse feature"));
    }
    let sparse = parsed
        .sparse
        .into_iter()
        .map(SparseJson::feature)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| BackendError::load(path, format!("narsil_schema(): {e}")))?;
    let mut schema = ModelSchema {
        request_level: Default::default(),
        name: parsed.name,
        version: parsed.version,
        backend: "torch".into(),
        device: device.into(),
        num_dense: parsed.num_dense,
        sparse,
        outputs: vec![DEFAULT_OUTPUT.into()],
        sequences: Vec::new(),
    };
    schema.request_level =
        narsil_core::RequestLevel::parse(parsed.request_level.iter().map(String::as_str), &schema)
            .map_err(|e| BackendError::load(path, format!("narsil_schema()'s request_level: {e}")))?;
    schema.sequences = narsil_core::sequence::declare(&parsed.sequences, &schema)
        .map_err(|e| BackendError::load(path, format!("narsil_schema()'s sequences: {e}")))?;
    Ok((schema, parsed.dense_flops_per_sample))
}

/// A TorchRec managed-collision model (`tables`: its MCH modules' tables)
/// remaps raw 64-bit ids to rows inside itself, so it takes its ids whole,
/// as int64: refused when its config marks no feature `raw_ids`, naming the
/// fix (fed int32 ids, TorchRec's remapping fails with "Index put requires
/// the source and destination dtypes match"). Not served with raw ids by
/// default: which features the tables serve cannot be read from the module
/// (a table may serve several, and other collections may not remap), and a
/// `raw_ids` feature skips the check of its ids against the table's rows.
fn managed_collision_takes_raw_ids(
    model: &Path,
    config: &Path,
    schema: &ModelSchema,
    tables: &[String],
) -> Result<(), BackendError> {
    if tables.is_empty() || schema.takes_raw_ids() {
        return Ok(());
    }
    Err(BackendError::load(
        model,
        format!(
            "a TorchRec managed-collision model (its MCH modules remap raw ids to rows for tables {}) takes raw \
             64-bit ids, and {} marks no feature \"raw_ids\": true; add \"raw_ids\": true to each sparse \
             feature those tables serve (docs/guide/production-ids.md)",
            tables.join(", "),
            config.display()
        ),
    ))
}

/// A TorchRec-signature model's schema from its config file: `config`, or
/// `model.json` beside the model.
fn config_schema(
    model: &Path,
    config: Option<&Path>,
    device: &str,
) -> Result<(ModelSchema, PathBuf), BackendError> {
    let beside = || model.parent().unwrap_or(Path::new(".")).join(model_config::FILE_NAME);
    let path: PathBuf = config.map_or_else(beside, Path::to_path_buf);
    if !path.is_file() {
        return Err(BackendError::load(
            model,
            format!(
                "a TorchRec-signature model needs its schema: no {} (write one, see models/README.md, or pass --model-config)",
                path.display()
            ),
        ));
    }
    let directory = model.parent().and_then(Path::file_name).and_then(|n| n.to_str()).unwrap_or("model");
    let schema = model_config::read(&path, directory, "torch", device)
        .map_err(|reason| BackendError::load(model, reason))?;
    Ok((schema, path))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::parse_schema;

    #[test]
    fn narsil_schema_declares_a_raw_input_by_pooling_raw_without_rows_and_names_bad_ones() {
        let json = |sparse: &str| {
            format!(
                r#"{{"name": "m", "version": "1", "num_dense": 1, "sparse": [{sparse}],
                    "sequences": [{{"name": "h", "features": ["h_ts"], "max_len": 4, "request_rows": true}}],
                    "request_level": ["h_ts"]}}"#
            )
        };
        let path = Path::new("m.pt");
        let good = r#"{"name": "item", "num_rows": 10}, {"name": "qt", "pooling": "raw"}, {"name": "h_ts", "pooling": "raw"}"#;
        let (schema, _) = parse_schema(&json(good), path, "cpu").unwrap();
        let raw: Vec<(bool, u64)> = schema.sparse.iter().map(|f| (f.raw_input, f.num_rows)).collect();
        assert_eq!(raw, [(false, 10), (true, 0), (true, 0)]);
        assert_eq!(schema.row_raw_inputs(), [1]);
        assert!(schema.sequences[0].request_rows && schema.sequences[0].raw_channels == 1);
        for (sparse, named) in [
            (
                r#"{"name": "qt", "pooling": "raw", "num_rows": 5}, {"name": "h_ts", "pooling": "raw"}"#,
                "\"qt\": a raw input",
            ),
            (r#"{"name": "qt"}, {"name": "h_ts", "pooling": "raw"}"#, "\"qt\" has no rows"),
            (
                r#"{"name": "qt", "pooling": "mean", "num_rows": 3}, {"name": "h_ts", "pooling": "raw"}"#,
                "pooling \"mean\"",
            ),
        ] {
            let error = parse_schema(&json(sparse), path, "cpu").unwrap_err().to_string();
            assert!(error.contains(named), "{sparse}: {error}");
        }
    }
}
