//! A split model's `schema.json` (written by `models/export_dlrm.py
//! --split`): what the dense network takes and where each table's rows are.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The format this reader understands.
pub const SPLIT_FORMAT: &str = "narsil-split-1";

/// How a table's rows are stored in its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Storage {
    /// FBGEMM's row-wise INT8 inference layout: an fp16 scale and an fp16
    /// bias, then `dim` uint8 values, padded to a multiple of 16 bytes.
    Int8Rowwise,
    /// `dim` little-endian FP32 values.
    Fp32,
}

impl Storage {
    /// Bytes of one row of `dim` values.
    pub fn row_bytes(self, dim: usize) -> usize {
        match self {
            Self::Int8Rowwise => (4 + dim).div_ceil(16) * 16,
            Self::Fp32 => 4 * dim,
        }
    }
}

/// One table.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TableSpec {
    /// Its name (features name it).
    pub name: String,
    /// Rows (valid ids are `0..rows`).
    pub rows: u64,
    /// Values per row.
    pub dim: usize,
    /// How rows are stored.
    pub storage: Storage,
    /// Bytes per row in the file.
    pub row_bytes: usize,
    /// The file, relative to the model directory.
    pub file: PathBuf,
    /// SHA-256 of the file's contents, hex: a table's identity, so that two
    /// model versions with the same table share it.
    pub sha256: String,
    /// Where `narsil tables load` put the rows on a Redis Cluster (the
    /// `redis` store reads them there).
    #[serde(default)]
    pub redis: Option<RedisTableSpec>,
    /// Rows in popularity order, found through a slot index (`narsil
    /// tables order`); absent: row `id` is the file's row `id`.
    #[serde(default)]
    pub layout: Option<Layout>,
    /// How the ids requests send become its rows; absent: they are rows.
    #[serde(default)]
    pub ids: TableIds,
}

/// How a table's ids become rows (`"ids"` in a table of `schema.json`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TableIds {
    /// `"identity"` (the default): ids are rows, `0..rows`; others are
    /// refused (or wrapped, with `--id-policy modulo`).
    #[default]
    Identity,
    /// `"modulo"`: any 64-bit id, row `id.rem_euclid(rows)` (ids hashed
    /// into the table, collisions and all).
    Modulo,
    /// `{"map": {...}}`: any 64-bit id, through the table's id map; ids it
    /// does not hold get the default row.
    Map(IdMapSpec),
}

impl TableIds {
    /// Whether ids are raw 64-bit values that the stage maps to rows.
    pub fn are_raw(&self) -> bool {
        !matches!(self, Self::Identity)
    }
}

/// A table's id map ([`crate::id_map`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Deserialize, serde::Serialize)]
pub struct IdMapSpec {
    /// The map file, relative to the model directory.
    pub file: PathBuf,
    /// SHA-256 of the map file, hex (checked at load).
    pub sha256: String,
    /// The row ids the map does not hold are served from: a trained
    /// "unknown" row, or a row of zeros the table holds for them.
    pub default_row: u64,
}

/// A table's rows on a Redis Cluster (see [`crate::stores::redis`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Deserialize, serde::Serialize)]
pub struct RedisTableSpec {
    /// Every row key starts with it: `narsil/MODEL/VERSION/TABLE`.
    pub prefix: String,
    /// Hash-tag buckets the rows are spread over (`id % buckets`).
    pub buckets: u32,
}

impl RedisTableSpec {
    /// The bucket (the hash tag, so the hash slot) of row `id`: ids of one
    /// bucket can share one multi-key command.
    pub fn bucket(&self, id: u64) -> u64 {
        id % u64::from(self.buckets)
    }
}

/// A table's layout: its rows in popularity order, found through a slot
/// index ([`crate::layout`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Deserialize, serde::Serialize)]
pub struct Layout {
    /// The slot index's file, relative to the model directory.
    pub slots: PathBuf,
    /// SHA-256 of the index file, hex (with the table file's, the table's
    /// identity).
    pub sha256: String,
}

/// How a feature's bag of rows becomes one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolingMode {
    /// The sum of the rows (weighted by the ids' weights, if any).
    Sum,
    /// The sum divided by the bag's length (an empty bag pools to zeros).
    Mean,
}

/// One sparse feature.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct FeatureSpec {
    /// Its name, as requests send it (schema order).
    pub name: String,
    /// The table its ids index; several features may share one.
    pub table: String,
    /// How its bags are pooled.
    pub pooling: PoolingMode,
    /// Whether each id comes with a weight.
    pub weighted: bool,
}

/// A split model's schema.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct SplitSchema {
    /// [`SPLIT_FORMAT`].
    pub format: String,
    /// Model name.
    pub name: String,
    /// Model version.
    pub version: String,
    /// Dense features per sample.
    pub num_dense: usize,
    /// Every table.
    pub tables: Vec<TableSpec>,
    /// Every sparse feature, in the order requests send them and the dense
    /// network takes their pooled vectors.
    pub features: Vec<FeatureSpec>,
    /// Output names.
    pub outputs: Vec<String>,
    /// The dense network's file, relative to the model directory
    /// (TorchScript, for the libtorch backend).
    pub dense_network: PathBuf,
    /// The same dense network compiled ahead of time by AOTInductor (a
    /// `.pt2` package, FP32), for the libtorch backend; optional.
    #[serde(default)]
    pub dense_package: Option<PathBuf>,
    /// The same package compiled with bf16 weights and inputs (FP32
    /// scores), for `--dense-precision bf16`; optional.
    #[serde(default)]
    pub dense_package_bf16: Option<PathBuf>,
    /// The same network with INT8 GEMMs (PT2E static quantization, compiled
    /// with Inductor's x86 path; FP32 inputs and scores), for
    /// `--dense-precision int8` on CPUs with VNNI or AMX-INT8; optional
    /// (`models/export_dlrm.py --split --int8`).
    #[serde(default)]
    pub dense_package_int8: Option<PathBuf>,
    /// The same dense network's FP32 weights by name (safetensors, DLRM
    /// layout: `dense.{i}.*`, `over.{i}.*`), for the Burn backend; optional.
    #[serde(default)]
    pub dense_weights: Option<PathBuf>,
    /// The dense network's FLOPs per sample (its GEMMs and batched
    /// products, 2 per multiply-add), as the export counted them; optional
    /// (`narsil bench-forward` holds it against this core's peak).
    #[serde(default)]
    pub dense_flops_per_sample: Option<u64>,
    /// Each dense form timed at export on the exporting CPU, which
    /// `--dense-form auto` reads to serve the faster there; optional.
    #[serde(default)]
    pub dense_form_timings: Option<DenseFormTimings>,
    /// The features that are the same for every candidate of a ranking
    /// request, by name (`dense` for the dense features): requests may send
    /// them once ([`narsil_core::request_level`]); optional (none: flat
    /// requests only).
    #[serde(default)]
    pub request_level: Vec<String>,
    /// The dense network's part that sees only the dense features
    /// (TorchScript, `forward(dense) -> [rows, D]`), for ranking requests
    /// whose dense features are request-level; optional, with `dense_top`.
    #[serde(default)]
    pub dense_bottom: Option<PathBuf>,
    /// The rest of the dense network (TorchScript, `forward(dense
    /// embedding, pooled) -> scores`); optional, with `dense_bottom`.
    #[serde(default)]
    pub dense_top: Option<PathBuf>,
    /// `dense_top` as an AOTInductor package, FP32; optional.
    #[serde(default)]
    pub dense_top_package: Option<PathBuf>,
    /// `dense_top` as an AOTInductor package, bf16; optional.
    #[serde(default)]
    pub dense_top_package_bf16: Option<PathBuf>,
}

/// The dense network's forms (TorchScript, the `.pt2` package) timed at
/// export, one thread, per precision (`models/split_model.py`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct DenseFormTimings {
    /// The exporting CPU, `vendor family F model M` from /proc/cpuinfo
    /// (the model name alone says "AMD EPYC" for Zen 3, 4 and 5 alike).
    pub cpu: String,
    /// The rows of each timed forward.
    pub rows: Vec<u64>,
    /// FP32's forms, where both were timed.
    #[serde(default)]
    pub fp32: Option<FormTimes>,
    /// bf16's forms, where both were timed.
    #[serde(default)]
    pub bf16: Option<FormTimes>,
}

/// One precision's forward times (µs) at [`DenseFormTimings::rows`].
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct FormTimes {
    /// The TorchScript network's.
    pub torchscript_us: Vec<u64>,
    /// The `.pt2` package's.
    pub pt2_us: Vec<u64>,
}

impl FormTimes {
    /// Whether the TorchScript network costs less per sample than the
    /// package, summed over the timed `rows` (each size weighs the same);
    /// false where the times do not cover every size.
    pub fn torchscript_faster(&self, rows: &[u64]) -> bool {
        let per_sample = |times: &[u64]| -> Option<f64> {
            (times.len() == rows.len() && rows.iter().all(|&r| r > 0))
                .then(|| times.iter().zip(rows).map(|(&t, &r)| t as f64 / r as f64).sum())
        };
        match (per_sample(&self.torchscript_us), per_sample(&self.pt2_us)) {
            (Some(torchscript), Some(pt2)) => torchscript < pt2,
            _ => false,
        }
    }
}

/// Why a schema cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    /// The file cannot be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The schema file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a schema.
    #[error("{path} is not a split model schema: {source}")]
    Parse {
        /// The schema file.
        path: PathBuf,
        /// Why.
        source: serde_json::Error,
    },
    /// The schema contradicts itself.
    #[error("{path}: {message}")]
    Invalid {
        /// The schema file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

impl SplitSchema {
    /// A schema whose every table is one feature's own (named after it),
    /// sum-pooled and unweighted, with no files: for tables built in memory.
    pub fn one_table_per_feature(
        name: &str,
        version: &str,
        num_dense: usize,
        tables: Vec<TableSpec>,
        outputs: Vec<String>,
    ) -> Self {
        Self {
            format: SPLIT_FORMAT.into(),
            name: name.into(),
            version: version.into(),
            num_dense,
            features: tables
                .iter()
                .map(|t| FeatureSpec {
                    name: t.name.clone(),
                    table: t.name.clone(),
                    pooling: PoolingMode::Sum,
                    weighted: false,
                })
                .collect(),
            tables,
            outputs,
            dense_network: PathBuf::new(),
            dense_package: None,
            dense_package_bf16: None,
            dense_package_int8: None,
            dense_weights: None,
            dense_flops_per_sample: None,
            dense_form_timings: None,
            request_level: Vec::new(),
            dense_bottom: None,
            dense_top: None,
            dense_top_package: None,
            dense_top_package_bf16: None,
        }
    }

    /// Reads and checks `dir/schema.json`.
    pub fn read(dir: &Path) -> Result<Self, SchemaError> {
        let path = dir.join("schema.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|source| SchemaError::Read { path: path.clone(), source })?;
        let schema: Self = serde_json::from_str(&text)
            .map_err(|source| SchemaError::Parse { path: path.clone(), source })?;
        schema.check().map_err(|message| SchemaError::Invalid { path, message })?;
        Ok(schema)
    }

    /// The rules between the schema's parts.
    pub fn check(&self) -> Result<(), String> {
        if self.format != SPLIT_FORMAT {
            return Err(format!("format {:?}, this reader knows {SPLIT_FORMAT:?}", self.format));
        }
        for (i, table) in self.tables.iter().enumerate() {
            if self.tables[..i].iter().any(|t| t.name == table.name) {
                return Err(format!("table {:?} is listed twice", table.name));
            }
            if table.rows == 0 || table.dim == 0 {
                return Err(format!(
                    "table {:?} has {} rows of {} values",
                    table.name, table.rows, table.dim
                ));
            }
            let expected = table.storage.row_bytes(table.dim);
            if table.row_bytes != expected {
                return Err(format!(
                    "table {:?}: row_bytes {} but {:?} rows of {} values take {expected}",
                    table.name, table.row_bytes, table.storage, table.dim
                ));
            }
            if let TableIds::Map(map) = &table.ids {
                if !(map.sha256.len() == 64 && map.sha256.bytes().all(|b| b.is_ascii_hexdigit())) {
                    return Err(format!(
                        "table {:?}: its id map's sha256 {:?} is not a SHA-256 (64 hex digits): the map {} is checked against it at load",
                        table.name,
                        map.sha256,
                        map.file.display()
                    ));
                }
                if map.default_row >= table.rows {
                    return Err(format!(
                        "table {:?}: its id map's default_row {} is past its {} rows",
                        table.name, map.default_row, table.rows
                    ));
                }
            }
            if let Some(layout) = &table.layout {
                let hex = layout.sha256.len() == 64 && layout.sha256.bytes().all(|b| b.is_ascii_hexdigit());
                if !hex {
                    return Err(format!(
                        "table {:?}: its layout's sha256 {:?} is not a SHA-256 (64 hex digits): the slot index {} is checked against it at load",
                        table.name,
                        layout.sha256,
                        layout.slots.display()
                    ));
                }
            }
        }
        if self.features.is_empty() {
            return Err("no sparse features".into());
        }
        let dim = self.table(&self.features[0].table).map(|t| t.dim);
        for feature in &self.features {
            let Some(table) = self.table(&feature.table) else {
                return Err(format!(
                    "feature {:?} names table {:?}, which is not listed",
                    feature.name, feature.table
                ));
            };
            if Some(table.dim) != dim {
                return Err(format!(
                    "feature {:?} pools {} values, the first feature {:?}: every pooled vector must be as wide",
                    feature.name, table.dim, dim
                ));
            }
        }
        if let Some(i) = self.features.iter().position(|f| f.weighted) {
            if let Some(unweighted) = self.features[i..].iter().find(|f| !f.weighted) {
                return Err(format!(
                    "feature {:?} is unweighted but follows the weighted feature {:?}: list the weighted features last, as requests send them",
                    unweighted.name, self.features[i].name
                ));
            }
        }
        if self.outputs.is_empty() {
            return Err("no outputs".into());
        }
        let schema = self.model_schema("", "");
        narsil_core::RequestLevel::parse(self.request_level.iter().map(String::as_str), &schema)
            .map_err(|e| format!("request_level: {e}"))?;
        Ok(())
    }

    /// The table named `name`.
    pub fn table(&self, name: &str) -> Option<&TableSpec> {
        self.tables.iter().find(|t| t.name == name)
    }

    /// The schema a backend serving this model reports: its features in
    /// request order, each with its table's rows (every feature names a
    /// listed table: [`Self::check`]).
    pub fn model_schema(&self, backend: &str, device: &str) -> narsil_core::ModelSchema {
        let mut schema = narsil_core::ModelSchema {
            name: self.name.clone(),
            version: self.version.clone(),
            backend: backend.into(),
            device: device.into(),
            num_dense: self.num_dense,
            sparse: self
                .features
                .iter()
                .map(|f| narsil_core::SparseFeature {
                    weighted: f.weighted,
                    raw_ids: self.table(&f.table).is_some_and(|t| t.ids.are_raw()),
                    ..narsil_core::SparseFeature::new(
                        f.name.clone(),
                        self.table(&f.table).map_or(0, |t| t.rows),
                    )
                })
                .collect(),
            outputs: self.outputs.clone(),
            request_level: narsil_core::RequestLevel::default(),
        };
        // Checked at load ([`Self::check`]); a name it does not know
        // declares nothing.
        schema.request_level =
            narsil_core::RequestLevel::parse(self.request_level.iter().map(String::as_str), &schema)
                .unwrap_or_default();
        schema
    }

    /// Values in each pooled vector.
    pub fn pooled_dim(&self) -> usize {
        self.table(&self.features[0].table).map_or(0, |t| t.dim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema() -> SplitSchema {
        serde_json::from_str(
            r#"{"format": "narsil-split-1", "name": "m", "version": "1", "num_dense": 2,
                "tables": [{"name": "t", "rows": 10, "dim": 64, "storage": "int8_rowwise", "row_bytes": 80,
                            "file": "tables/t.bin", "sha256": "00"}],
                "features": [{"name": "a", "table": "t", "pooling": "sum", "weighted": false},
                             {"name": "b", "table": "t", "pooling": "mean", "weighted": true}],
                "outputs": ["default"], "dense_network": "dense.pt"}"#,
        )
        .unwrap()
    }

    #[test]
    fn a_valid_schema_lets_features_share_a_table() {
        let schema = schema();
        assert_eq!(schema.check(), Ok(()));
        assert_eq!(schema.pooled_dim(), 64);
        assert_eq!(Storage::Int8Rowwise.row_bytes(64), 80);
        assert_eq!(Storage::Int8Rowwise.row_bytes(8), 16);
        assert_eq!(Storage::Fp32.row_bytes(64), 256);
    }

    #[test]
    fn contradictions_are_named() {
        let mut bad = schema();
        bad.features[1].table = "u".into();
        assert!(bad.check().unwrap_err().contains("names table \"u\""));
        let mut bad = schema();
        bad.tables[0].row_bytes = 68;
        assert!(bad.check().unwrap_err().contains("row_bytes 68"));
        let mut bad = schema();
        bad.features[0].weighted = true;
        bad.features[1].weighted = false;
        assert!(bad.check().unwrap_err().contains("weighted features last"));
        let mut bad = schema();
        bad.format = "other".into();
        assert!(bad.check().unwrap_err().contains("narsil-split-1"));
        let mut ordered = schema();
        let layout = |sha256: &str| Some(Layout { slots: "tables/t.slots".into(), sha256: sha256.into() });
        ordered.tables[0].layout = layout(&"ab".repeat(32));
        assert_eq!(ordered.check(), Ok(()));
        for sha256 in ["", "00", &"xy".repeat(32)] {
            ordered.tables[0].layout = layout(sha256);
            let error = ordered.check().unwrap_err();
            assert!(
                error.contains("not a SHA-256") && error.contains("tables/t.slots"),
                "{sha256:?}: {error}"
            );
        }
    }

    #[test]
    fn the_form_faster_per_sample_over_the_timed_rows_is_chosen() {
        let times = |torchscript_us: Vec<u64>, pt2_us: Vec<u64>| FormTimes { torchscript_us, pt2_us };
        let rows = [100, 1600];
        // TorchScript slower at 100 rows, faster at 1,600: 2.0 + 1.0 < 1.0 + 2.5 µs a sample.
        assert!(times(vec![200, 1600], vec![100, 4000]).torchscript_faster(&rows));
        assert!(!times(vec![200, 4000], vec![100, 1600]).torchscript_faster(&rows));
        // Equal: the package stays (today's default).
        assert!(!times(vec![100, 1600], vec![100, 1600]).torchscript_faster(&rows));
        // Times that do not cover the rows say nothing.
        assert!(!times(vec![1], vec![100, 1600]).torchscript_faster(&rows));
        assert!(!times(vec![1, 1], vec![100, 1600]).torchscript_faster(&[0, 1600]));
    }

    #[test]
    fn a_schema_reads_its_form_timings_and_one_without_them_has_none() {
        let text = r#"{"format": "narsil-split-1", "name": "m", "version": "1", "num_dense": 1,
            "tables": [], "features": [], "outputs": ["s"], "dense_network": "dense.pt",
            "dense_form_timings": {"cpu": "AuthenticAMD family 26 model 2", "rows": [100, 1600],
                "fp32": {"torchscript_us": [190, 2900], "pt2_us": [210, 1500]}}}"#;
        let schema: SplitSchema = serde_json::from_str(text).unwrap();
        let timings = schema.dense_form_timings.unwrap();
        assert_eq!(timings.cpu, "AuthenticAMD family 26 model 2");
        assert!(!timings.fp32.unwrap().torchscript_faster(&timings.rows));
        assert!(timings.bf16.is_none());
        let without = text.replace("\"dense_form_timings\"", "\"unused\"");
        assert!(serde_json::from_str::<SplitSchema>(&without).unwrap().dense_form_timings.is_none());
    }
}
