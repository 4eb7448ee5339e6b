//! `model.json`: the schema of a model that cannot state its own (a
//! TorchScript module with TorchRec's inference signature). Found beside the
//! model file, or named with `--model-config`:
//!
//! ```json
//! {"dense_features": 13,
//!  "sparse_features": [{"name": "cat_0", "num_rows": 100000, "weighted": false}, ...],
//!  "outputs": ["default"],
//!  "name": "dlrm", "version": "1",
//!  "request_level": ["cat_0", "cat_1", "dense"]}
//! ```
//!
//! `sparse_features` lists each feature group in the order of the model's
//! own `KeyedJaggedTensor` keys: the unweighted ones (`id_list_features`)
//! and the weighted ones (`id_score_list_features`, `"weighted": true`).
//! Narsil serves the unweighted group first, then the weighted one, each in
//! the order listed. `weighted` defaults to false, `outputs` to
//! `["default"]` (TorchRec's single output), `name` to the model directory's
//! name and `version` to `"1"`. `"raw_ids": true` marks a feature whose ids
//! the model maps to rows itself (a TorchRec managed-collision model): any
//! 64-bit id is taken, passed to the model as `int64`. `"pooling": "raw"`
//! (and no `num_rows`) declares a raw integer input: its int64 values reach
//! the model as sent, never range-checked ([`crate::SparseFeature::raw_input`];
//! one per sample outside a sequence). `request_level` (optional) names the
//! features that are the same for every candidate of a ranking request
//! (`dense` for the dense features): see [`crate::request_level`].
//! `sequences` (optional) declares sequence features
//! (`[{"name", "features", "max_len", "keep"}]`): see [`crate::sequence`].

use std::collections::HashSet;
use std::path::Path;

use serde::Deserialize;

use crate::schema::{ModelSchema, RequestLevel, SparseFeature, DEFAULT_OUTPUT};
use crate::sequence::{declare, SequenceJson};

/// The file name looked for beside a model.
pub const FILE_NAME: &str = "model.json";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigJson {
    dense_features: usize,
    sparse_features: Vec<FeatureJson>,
    #[serde(default)]
    outputs: Option<Vec<String>>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    version: Option<String>,
    #[serde(default)]
    request_level: Vec<String>,
    #[serde(default)]
    sequences: Vec<SequenceJson>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FeatureJson {
    name: String,
    #[serde(default)]
    num_rows: Option<u64>,
    #[serde(default)]
    weighted: bool,
    #[serde(default)]
    raw_ids: bool,
    /// `raw` for a raw integer input; nothing else (the model pools its own
    /// features).
    #[serde(default)]
    pooling: Option<String>,
}

impl FeatureJson {
    /// The feature, checked: a raw input has no rows, weight nor raw ids;
    /// any other feature has rows. `at` names it in errors.
    fn feature(self, at: &str) -> Result<SparseFeature, String> {
        let raw = match self.pooling.as_deref() {
            None => false,
            Some("raw") => true,
            Some(other) => {
                return Err(format!(
                    "{at}.pooling: {other:?}; model.json takes only \"raw\" (a raw integer input), the model \
                     pools its other features itself"
                ))
            }
        };
        if raw {
            if let Some(rows) = self.num_rows {
                return Err(format!("{at}.num_rows: {rows}, but a raw input (pooling \"raw\") has no table"));
            }
            if self.weighted || self.raw_ids {
                return Err(format!(
                    "{at}: a raw input (pooling \"raw\") is neither weighted nor raw_ids: its values reach \
                     the model as sent"
                ));
            }
            return Ok(SparseFeature::raw(self.name));
        }
        match self.num_rows {
            None => Err(format!("{at}.num_rows: missing (every feature but a raw input has a table)")),
            Some(0) => Err(format!("{at}.num_rows: must be at least 1")),
            Some(num_rows) => Ok(SparseFeature {
                weighted: self.weighted,
                raw_ids: self.raw_ids,
                ..SparseFeature::new(self.name, num_rows)
            }),
        }
    }
}

/// Parses a model config. `default_name` names the model when the config
/// does not. Errors name the field at fault (`sparse_features[3].num_rows`).
pub fn parse(text: &str, default_name: &str, backend: &str, device: &str) -> Result<ModelSchema, String> {
    let config: ConfigJson = serde_json::from_str(text).map_err(|e| e.to_string())?;
    if config.sparse_features.is_empty() {
        return Err("sparse_features: the model needs at least one sparse feature".into());
    }
    let mut names = HashSet::new();
    for (i, feature) in config.sparse_features.iter().enumerate() {
        if feature.name.is_empty() || !names.insert(feature.name.as_str()) {
            return Err(format!("sparse_features[{i}].name: {:?} is empty or repeated", feature.name));
        }
    }
    let features = config
        .sparse_features
        .into_iter()
        .enumerate()
        .map(|(i, f)| f.feature(&format!("sparse_features[{i}]")))
        .collect::<Result<Vec<_>, _>>()?;
    let outputs = config.outputs.unwrap_or_else(|| vec![DEFAULT_OUTPUT.into()]);
    if outputs.is_empty() {
        return Err("outputs: the model needs at least one output".into());
    }
    let mut seen = HashSet::new();
    if let Some(repeated) = outputs.iter().find(|o| o.is_empty() || !seen.insert(o.as_str())) {
        return Err(format!("outputs: {repeated:?} is empty or repeated"));
    }
    let (unweighted, weighted): (Vec<_>, Vec<_>) = features.into_iter().partition(|f| !f.weighted);
    let mut schema = ModelSchema {
        name: config.name.unwrap_or_else(|| default_name.into()),
        version: config.version.unwrap_or_else(|| "1".into()),
        backend: backend.into(),
        device: device.into(),
        num_dense: config.dense_features,
        sparse: unweighted.into_iter().chain(weighted).collect(),
        outputs,
        request_level: RequestLevel::default(),
        sequences: Vec::new(),
    };
    schema.request_level = RequestLevel::parse(config.request_level.iter().map(String::as_str), &schema)
        .map_err(|e| format!("request_level: {e}"))?;
    schema.sequences = declare(&config.sequences, &schema).map_err(|e| format!("sequences: {e}"))?;
    Ok(schema)
}

/// Reads and parses the config at `path`; errors start with the path.
pub fn read(path: &Path, default_name: &str, backend: &str, device: &str) -> Result<ModelSchema, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse(&text, default_name, backend, device).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(text: &str) -> Result<ModelSchema, String> {
        parse(text, "dir", "torch", "cpu")
    }

    #[test]
    fn the_documented_form_parses_with_defaults() {
        let schema = parsed(
            r#"{"dense_features": 13, "sparse_features": [{"name": "cat_0", "num_rows": 100000, "weighted": false},
                {"name": "w_0", "num_rows": 50, "weighted": true}, {"name": "cat_1", "num_rows": 7}]}"#,
        )
        .unwrap();
        assert_eq!((schema.name.as_str(), schema.version.as_str(), schema.num_dense), ("dir", "1", 13));
        let names: Vec<&str> = schema.sparse.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["cat_0", "cat_1", "w_0"], "unweighted first, each group in order");
        assert_eq!(schema.num_unweighted(), 2);
        assert_eq!(schema.outputs, ["default"]);
    }

    #[test]
    fn a_raw_input_is_declared_by_pooling_raw_without_rows_and_may_be_a_sequence_channel() {
        let schema = parsed(
            r#"{"dense_features": 1, "sparse_features": [{"name": "item", "num_rows": 100},
                {"name": "ts", "pooling": "raw"}, {"name": "hist", "num_rows": 100},
                {"name": "hist_ts", "pooling": "raw"}],
                "sequences": [{"name": "h", "features": ["hist", "hist_ts"], "max_len": 8, "request_rows": true}],
                "request_level": ["hist", "hist_ts"]}"#,
        )
        .unwrap();
        assert_eq!(schema.sparse[1], SparseFeature::raw("ts"));
        assert!(schema.sparse[3].raw_input && !schema.sparse[2].raw_input);
        assert_eq!(schema.row_raw_inputs(), [1], "the sequence's raw channel is not a row's");
        let h = &schema.sequences[0];
        assert_eq!((h.raw_channels, h.request_rows), (1, true));
        assert!(schema.takes_int64_ids());
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (r#"{"dense_features": 1, "sparse_features": []}"#, "sparse_features:"),
            (
                r#"{"dense_features": 1, "sparse_features": [{"name": "a", "num_rows": 0}]}"#,
                "sparse_features[0].num_rows",
            ),
            (
                r#"{"dense_features": 1, "sparse_features": [{"name": "a", "num_rows": 1}, {"name": "a", "num_rows": 1}]}"#,
                "sparse_features[1].name",
            ),
            (
                r#"{"dense_features": 1, "sparse_features": [{"name": "a", "num_rows": 1}], "outputs": []}"#,
                "outputs:",
            ),
            (
                r#"{"dense_features": 1, "sparse_features": [{"name": "a", "num_rows": 1}], "output": ["x"]}"#,
                "unknown field `output`",
            ),
            (r#"{"sparse_features": [{"name": "a", "num_rows": 1}]}"#, "missing field `dense_features`"),
            (
                r#"{"dense_features": 1, "sparse_features": [{"name": "a"}]}"#,
                "sparse_features[0].num_rows: missing",
            ),
            (
                r#"{"dense_features": 1, "sparse_features": [{"name": "a", "num_rows": 1}, {"name": "t", "pooling": "raw", "num_rows": 5}]}"#,
                "sparse_features[1].num_rows: 5, but a raw input",
            ),
            (
                r#"{"dense_features": 1, "sparse_features": [{"name": "t", "pooling": "raw", "weighted": true}]}"#,
                "sparse_features[0]: a raw input (pooling \"raw\") is neither weighted",
            ),
            (
                r#"{"dense_features": 1, "sparse_features": [{"name": "t", "pooling": "sum", "num_rows": 3}]}"#,
                "sparse_features[0].pooling: \"sum\"",
            ),
        ];
        for (text, field) in cases {
            let err = parsed(text).unwrap_err();
            assert!(err.contains(field), "{text}: {err}");
        }
    }
}
