//! A split model's `schema.json` (written by `models/export_dlrm.py
//! --split`): what the dense network takes and where each table's rows are,
//! checked when read. Here the schema as a whole and the rules between its
//! parts; a table and the rules it keeps on its own in [`tables`], how its
//! ids become rows in [`ids`], the dense forms' export timings in
//! [`dense_timings`]; the commands' edits of the file, [`edit`].

mod dense_timings;
pub mod edit;
mod ids;
mod tables;

use std::path::{Path, PathBuf};

pub use dense_timings::{DenseFormTimings, FormTimes, PackageTimes};
pub use ids::{IdMapSpec, TableIds};
pub use narsil_core::ids::Modulo;
use serde::Deserialize;
pub use tables::{Layout, RedisTableSpec, Storage, TableSpec};

/// The format this reader understands.
pub const SPLIT_FORMAT: &str = "narsil-split-1";

/// How a feature's bag of rows becomes one vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolingMode {
    /// The sum of the rows (weighted by the ids' weights, if any).
    Sum,
    /// The sum divided by the bag's length (an empty bag pools to zeros).
    Mean,
    /// Not pooled: a sequence feature's channel, one vector per position
    /// (TorchRec's `EmbeddingCollection`), handed to the dense network as
    /// jagged values ([`SplitSchema::sequences`]).
    None,
    /// Not looked up at all: a raw integer input, no table, whose int64
    /// values reach the dense network as sent (a sequence's raw channel,
    /// `seq{i}_raw`, or one value per row, `raw`; `docs/guide/sequences.md`).
    Raw,
}

/// One sparse feature.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct FeatureSpec {
    /// Its name, as requests send it (schema order).
    pub name: String,
    /// The table its ids index; several features may share one. Empty
    /// (absent) for a raw input, which has none.
    #[serde(default)]
    pub table: String,
    /// How its bags are pooled.
    pub pooling: PoolingMode,
    /// Whether each id comes with a weight (absent: false).
    #[serde(default)]
    pub weighted: bool,
}

impl PoolingMode {
    /// Whether its bags are pooled into the pooled block (`sum`, `mean`).
    pub fn is_pooled(self) -> bool {
        matches!(self, Self::Sum | Self::Mean)
    }
}

/// A raw input's own rules: no table, no weights.
fn check_raw_input(feature: &FeatureSpec) -> Result<(), String> {
    if !feature.table.is_empty() {
        return Err(format!(
            "feature {:?} is a raw input (pooling \"raw\") but names table {:?}: a raw input's values reach \
             the dense network as sent, never looked up; drop its table",
            feature.name, feature.table
        ));
    }
    if feature.weighted {
        return Err(format!(
            "feature {:?} is a raw input (pooling \"raw\") and weighted: a raw input's values carry no weight",
            feature.name
        ));
    }
    Ok(())
}

/// A DLRM top cut for one set of request-level features
/// (`models/user_once.py`): the products among the user's vectors and their
/// share of the over arch's first layer once per unit, the rest per row.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct UserOnceSpec {
    /// TorchScript: `forward(dense embedding [U, D], pooled [R, F * D],
    /// row_unit i64[R], unit_row i64[U]) -> scores [R]`.
    pub network: PathBuf,
    /// The request-level features it was cut for, by name (`dense`
    /// among them).
    pub request_level: Vec<String>,
    /// `network` as an AOTInductor package, FP32; optional.
    #[serde(default)]
    pub package: Option<PathBuf>,
    /// `network` as an AOTInductor package, bf16; optional.
    #[serde(default)]
    pub package_bf16: Option<PathBuf>,
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
    /// `--dense-precision int8` on x86 CPUs with the instructions it was
    /// compiled for (VNNI or AMX-INT8; AVX2 with 7-bit activations); optional
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
    /// `dense_top` with the user's arithmetic done once per ranking request
    /// (`models/user_once.py`), for batches whose request-level features are
    /// those it was cut for; optional, with `dense_bottom`.
    #[serde(default)]
    pub dense_user_once: Option<UserOnceSpec>,
    /// The sequence features (`[{"name", "features", "max_len", "keep"}]`):
    /// every feature pooled `none` is a channel of exactly one; the dense
    /// network takes each sequence's values, offsets and rows' units after
    /// the pooled block, in this order (`docs/guide/sequences.md`);
    /// optional.
    #[serde(default)]
    pub sequences: Vec<narsil_core::sequence::SequenceJson>,
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
            dense_user_once: None,
            sequences: Vec::new(),
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
            table.check()?;
        }
        if self.features.is_empty() {
            return Err("no sparse features".into());
        }
        let dim = self.pooled_features().next().and_then(|f| self.table(&f.table)).map(|t| t.dim);
        for feature in &self.features {
            if feature.pooling == PoolingMode::Raw {
                check_raw_input(feature)?;
                continue;
            }
            if feature.table.is_empty() {
                return Err(format!(
                    "feature {:?} names no table: only a raw input (pooling \"raw\") has none",
                    feature.name
                ));
            }
            let Some(table) = self.table(&feature.table) else {
                return Err(format!(
                    "feature {:?} names table {:?}, which is not listed",
                    feature.name, feature.table
                ));
            };
            if feature.pooling != PoolingMode::None && Some(table.dim) != dim {
                return Err(format!(
                    "feature {:?} pools {} values, the first pooled feature {:?}: every pooled vector must be as wide",
                    feature.name, table.dim, dim
                ));
            }
            let in_sequence = self.sequences.iter().any(|s| s.features.contains(&feature.name));
            if (feature.pooling == PoolingMode::None) != in_sequence {
                return Err(format!(
                    "feature {:?} is pooled {:?} but {}: a feature with a table is unpooled (`none`) exactly \
                     when it is a sequence's channel (a raw input may be either)",
                    feature.name,
                    feature.pooling,
                    if in_sequence { "is a sequence's channel" } else { "in no sequence" }
                ));
            }
        }
        if !self.sequences.is_empty() && (self.dense_bottom.is_some() || self.dense_top.is_some()) {
            return Err(
                "a model with sequences has no dense_bottom/dense_top cut (its dense network takes the \
                        sequences whole)"
                    .into(),
            );
        }
        if let Some(raw) = self.features.iter().find(|f| f.pooling == PoolingMode::Raw) {
            if self.dense_bottom.is_some() || self.dense_top.is_some() || self.dense_user_once.is_some() {
                return Err(format!(
                    "feature {:?} is a raw input: a model with raw inputs has no dense_bottom/dense_top/\
                     dense_user_once cut (its dense network takes them whole)",
                    raw.name
                ));
            }
        }
        if let Some(cut) = &self.dense_user_once {
            if self.dense_bottom.is_none() || !cut.request_level.iter().any(|name| name == "dense") {
                return Err(
                    "dense_user_once needs dense_bottom and the dense features among its request_level"
                        .into(),
                );
            }
            if let Some(name) = cut
                .request_level
                .iter()
                .find(|&n| n != "dense" && !self.features.iter().any(|f| &f.name == n))
            {
                return Err(format!(
                    "dense_user_once's request_level names {name:?}, not a feature of the model"
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
        let mut schema = self.model_schema("", "");
        schema.request_level =
            narsil_core::RequestLevel::parse(self.request_level.iter().map(String::as_str), &schema)
                .map_err(|e| format!("request_level: {e}"))?;
        narsil_core::sequence::declare(&self.sequences, &schema).map_err(|e| format!("sequences: {e}"))?;
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
                .map(|f| match f.pooling {
                    PoolingMode::Raw => narsil_core::SparseFeature::raw(f.name.clone()),
                    _ => narsil_core::SparseFeature {
                        weighted: f.weighted,
                        raw_ids: self.table(&f.table).is_some_and(|t| t.ids.are_raw()),
                        ..narsil_core::SparseFeature::new(
                            f.name.clone(),
                            self.table(&f.table).map_or(0, |t| t.rows),
                        )
                    },
                })
                .collect(),
            outputs: self.outputs.clone(),
            request_level: narsil_core::RequestLevel::default(),
            sequences: Vec::new(),
        };
        // Checked at load ([`Self::check`]); a name it does not know
        // declares nothing.
        schema.request_level =
            narsil_core::RequestLevel::parse(self.request_level.iter().map(String::as_str), &schema)
                .unwrap_or_default();
        schema.sequences = narsil_core::sequence::declare(&self.sequences, &schema).unwrap_or_default();
        for (s, sequence) in schema.sequences.iter_mut().enumerate() {
            sequence.width = self.sequence_width(s);
        }
        schema
    }

    /// The pooled features (every one but the sequences' channels and
    /// the raw inputs), in schema order: the pooled block's columns.
    pub fn pooled_features(&self) -> impl Iterator<Item = &FeatureSpec> {
        self.features.iter().filter(|f| f.pooling.is_pooled())
    }

    /// Whether any feature is a raw input.
    pub fn has_raw_inputs(&self) -> bool {
        self.features.iter().any(|f| f.pooling == PoolingMode::Raw)
    }

    /// Whether its dense network takes more than the dense and pooled
    /// blocks (sequences, raw inputs): inputs whose shapes vary per batch
    /// and that the CPU stage lays out.
    pub fn takes_unpooled_inputs(&self) -> bool {
        !self.sequences.is_empty() || self.has_raw_inputs()
    }

    /// Values in each pooled vector (0 for a model whose every feature is
    /// a sequence's).
    pub fn pooled_dim(&self) -> usize {
        self.pooled_features().next().and_then(|f| self.table(&f.table)).map_or(0, |t| t.dim)
    }

    /// Values per position of sequence `s` (its channels' dims, summed).
    pub fn sequence_width(&self, s: usize) -> usize {
        let index = |name: &String| self.features.iter().position(|f| &f.name == name);
        self.sequences[s].features.iter().filter_map(index).map(|f| self.feature_dim(f)).sum()
    }

    /// Values in a row of feature `f`'s table (0 for a table not listed).
    pub fn feature_dim(&self, f: usize) -> usize {
        self.table(&self.features[f].table).map_or(0, |t| t.dim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema() -> SplitSchema {
        serde_json::from_str(
            r#"{"format": "narsil-split-1", "name": "m", "version": "1", "num_dense": 2,
                "tables": [{"name": "t", "rows": 10, "dim": 64, "storage": "int8_rowwise", "row_bytes": 80,
                            "file": "tables/t.bin", "sha256": ""}],
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
    fn a_raw_input_has_no_table_nor_weight_takes_no_pooled_column_and_may_be_a_sequence_channel() {
        let raw = |name: &str| FeatureSpec {
            name: name.into(),
            table: String::new(),
            pooling: PoolingMode::Raw,
            weighted: false,
        };
        let mut split = schema();
        let none =
            FeatureSpec { name: "h".into(), table: "t".into(), pooling: PoolingMode::None, weighted: false };
        split.features.splice(1..1, [raw("query_time"), none, raw("h_time")]);
        split.sequences = vec![narsil_core::sequence::SequenceJson {
            name: "hist".into(),
            features: vec!["h".into(), "h_time".into()],
            max_len: 4,
            keep: None,
            working_set: None,
            package_working_set: None,
            request_rows: true,
        }];
        split.request_level = vec!["h".into(), "h_time".into()];
        assert_eq!(split.check(), Ok(()));
        assert_eq!(split.pooled_features().map(|f| f.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(split.sequence_width(0), 64, "the raw channel adds no value to look up");
        let model = split.model_schema("torch", "cpu");
        assert!(model.sparse[1].raw_input && model.sparse[1].num_rows == 0 && !model.sparse[1].raw_ids);
        assert_eq!(model.row_raw_inputs(), [1]);
        assert_eq!((model.sequences[0].raw_channels, model.sequences[0].request_rows), (1, true));
        assert!(split.takes_unpooled_inputs());
        // A sequence of raw channels only (no value looked up) is one.
        split.sequences[0].features = vec!["h_time".into()];
        split.features.remove(2);
        split.request_level = vec!["h_time".into()];
        assert_eq!(split.check(), Ok(()));
        assert_eq!(split.sequence_width(0), 0);
        // A raw input with a table, or weighted: refused, naming it.
        let mut bad = split.clone();
        bad.features[1].table = "t".into();
        let e = bad.check().unwrap_err();
        assert!(e.contains("\"query_time\" is a raw input") && e.contains("names table \"t\""), "{e}");
        let mut bad = split.clone();
        bad.features[1].weighted = true;
        bad.features[2].weighted = true;
        bad.features[3].weighted = true;
        let e = bad.check().unwrap_err();
        assert!(e.contains("\"query_time\" is a raw input") && e.contains("weighted"), "{e}");
        // A table's feature without a table.
        let mut bad = split.clone();
        bad.features[0].table.clear();
        assert!(bad.check().unwrap_err().contains("\"a\" names no table"));
        // No dense cut beside raw inputs.
        let mut bad = split;
        bad.dense_bottom = Some("dense_bottom.pt".into());
        bad.dense_top = Some("dense_top.pt".into());
        assert!(bad.check().unwrap_err().contains("has no dense_bottom/dense_top"));
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
        let cut = |names: &[&str]| {
            Some(UserOnceSpec {
                network: "dense_user_once.pt".into(),
                request_level: names.iter().map(|n| n.to_string()).collect(),
                package: None,
                package_bf16: None,
            })
        };
        bad.dense_bottom = Some("dense_bottom.pt".into());
        bad.dense_user_once = cut(&["a", "dense"]);
        assert_eq!(bad.check(), Ok(()));
        bad.dense_user_once = cut(&["a"]);
        assert!(bad.check().unwrap_err().contains("dense features among its request_level"));
        bad.dense_user_once = cut(&["c", "dense"]);
        assert!(bad.check().unwrap_err().contains("names \"c\", not a feature"));
        bad.dense_bottom = None;
        bad.dense_user_once = cut(&["a", "dense"]);
        assert!(bad.check().unwrap_err().contains("needs dense_bottom"));
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
}
