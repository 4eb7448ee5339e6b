//! The golden file `models/export_dlrm.py` and `models/export_torchrec.py`
//! write next to a model: fixed random requests (sample-major, as on the
//! wire) and the scores Python computed for each, alone, with the exported
//! TorchScript files. Backends' parity tests compare against it. A golden
//! request may be a ranking request: its request-level features once in a
//! block (`request`), its rows the candidates (`models/import_gr.py
//! --golden` writes such).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

use crate::request::{IdPolicy, InvalidInput, RequestLimits, RequestSamples};
use crate::schema::ModelSchema;

/// A whole golden file.
#[derive(Debug, Clone, Deserialize)]
pub struct Golden {
    /// The requests, in file order.
    pub requests: Vec<GoldenRequest>,
}

/// One request and its reference scores.
#[derive(Debug, Clone, Deserialize)]
pub struct GoldenRequest {
    /// Samples in the request.
    pub batch_size: usize,
    /// `[batch_size x num_dense]`, sample-major.
    pub dense: Vec<f32>,
    /// `[batch_size x num_sparse]` bag lengths, sample-major.
    pub lengths: Vec<u32>,
    /// Ids, bag after bag in sample-major order.
    pub ids: Vec<i64>,
    /// Weights of the weighted features' ids, as on the wire
    /// (`export_torchrec.py` models with weighted features).
    #[serde(default)]
    pub weights: Vec<f32>,
    /// Scores of the INT8 TorchScript model (`model_default.pt`).
    #[serde(default)]
    pub scores_int8: Vec<f32>,
    /// Scores of the FP32 TorchScript model (`model_fp32.pt`).
    #[serde(default)]
    pub scores_fp32: Vec<f32>,
    /// Scores per output name (`export_torchrec.py`'s `model.pt`).
    #[serde(default)]
    pub outputs: std::collections::BTreeMap<String, Vec<f32>>,
    /// A ranking request's request-level features, once for its rows (whose
    /// `lengths` then cover the other features only); absent for a flat
    /// request.
    #[serde(default)]
    pub request: Option<GoldenBlock>,
}

/// A golden ranking request's block, as on the wire (`narsil.v1`'s
/// `RequestFeatures`).
#[derive(Debug, Clone, Deserialize)]
pub struct GoldenBlock {
    /// The dense features when they are request-level.
    #[serde(default)]
    pub dense: Vec<f32>,
    /// Ids per request-level feature, in schema order.
    pub lengths: Vec<u32>,
    /// Their ids, feature after feature.
    pub ids: Vec<i64>,
    /// Weights of the weighted request-level features' ids.
    #[serde(default)]
    pub weights: Vec<f32>,
}

impl Golden {
    /// Reads `golden.json` from a model directory.
    pub fn read(dir: &Path) -> Result<Self, String> {
        let path = dir.join("golden.json");
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }
}

impl GoldenRequest {
    /// The request as the engine receives it (not yet validated).
    pub fn sample_batch(&self) -> RequestSamples {
        RequestSamples {
            num_samples: self.batch_size,
            dense: self.dense.clone(),
            lengths: self.lengths.clone(),
            ids: self.ids.clone(),
            weights: self.weights.clone(),
            request: self.request.as_ref().map(|block| {
                Arc::new(crate::RequestBlock {
                    dense: block.dense.clone(),
                    lengths: block.lengths.clone(),
                    ids: block.ids.clone(),
                    weights: block.weights.clone(),
                    ..Default::default()
                })
            }),
            ..Default::default()
        }
    }

    /// The request validated against `schema` (ids handled by `policy`), as
    /// the engine would queue it.
    pub fn validated(&self, schema: &ModelSchema, policy: IdPolicy) -> Result<RequestSamples, InvalidInput> {
        let mut batch = self.sample_batch();
        batch.validate(schema, RequestLimits::new(usize::MAX, policy))?;
        Ok(batch)
    }
}

/// Where `scripts/test.sh` exports the small test model
/// (`models/generated/test-small`), or `NARSIL_TEST_MODEL_DIR`. Panics with
/// the command that makes one when it holds no golden file, so a test that
/// needs it fails rather than passes vacuously.
pub fn test_model_dir() -> PathBuf {
    let dir = std::env::var_os("NARSIL_TEST_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/generated/test-small"));
    assert!(
        dir.join("golden.json").is_file(),
        "no exported test model in {0}: run scripts/test.sh, or \
         .venv/bin/python models/export_dlrm.py --num-rows 1000 --out {0}",
        dir.display()
    );
    dir
}

/// Copies the split model in `source` (its files and `tables/`) into `dest`,
/// for tests that change a copy.
pub fn copy_split_model(source: &Path, dest: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dest.join("tables"))?;
    for dir in ["", "tables"] {
        for entry in std::fs::read_dir(source.join(dir))? {
            let path = entry?.path();
            if path.is_file() {
                std::fs::copy(&path, dest.join(dir).join(path.file_name().expect("a file has a name")))?;
            }
        }
    }
    Ok(())
}

/// The largest `|got - want|` (NaN when a score is NaN, so that no
/// tolerance accepts it), or `None` when the lengths differ.
pub fn max_abs_diff(got: &[f32], want: &[f32]) -> Option<f32> {
    (got.len() == want.len()).then(|| {
        got.iter().zip(want).map(|(g, w)| (g - w).abs()).fold(0.0, |worst: f32, d| {
            if worst.is_nan() || d.is_nan() {
                f32::NAN
            } else {
                worst.max(d)
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_abs_diff_finds_the_largest_gap_and_rejects_length_mismatch() {
        assert_eq!(max_abs_diff(&[1.0, 2.0], &[1.5, 2.0]), Some(0.5));
        assert_eq!(max_abs_diff(&[1.0], &[1.0, 2.0]), None);
        // f32::max would drop a NaN and report 0.5: a NaN score must fail.
        assert!(max_abs_diff(&[f32::NAN, 1.0], &[0.5, 1.5]).unwrap().is_nan());
        assert!(max_abs_diff(&[1.0, f32::NAN], &[0.5, 1.5]).unwrap().is_nan());
    }

    #[test]
    fn a_golden_file_parses_into_sample_batches() {
        let json = r#"{"schema": {}, "requests": [{"batch_size": 1, "dense": [0.5],
            "lengths": [2], "ids": [3, 4], "scores_int8": [0.25], "scores_fp32": [0.26]}]}"#;
        let golden: Golden = serde_json::from_str(json).unwrap();
        let batch = golden.requests[0].sample_batch();
        assert_eq!((batch.num_samples, batch.lengths, batch.ids), (1, vec![2], vec![3, 4]));
        assert!(batch.request.is_none());
    }

    #[test]
    fn a_golden_ranking_request_carries_its_block() {
        let json = r#"{"requests": [{"batch_size": 2, "dense": [], "lengths": [1, 1], "ids": [5, 6],
            "request": {"lengths": [2], "ids": [7, 8]}, "outputs": {"ctr": [0.1, 0.2]}}]}"#;
        let golden: Golden = serde_json::from_str(json).unwrap();
        let batch = golden.requests[0].sample_batch();
        let block = batch.request.expect("the block");
        assert_eq!((block.lengths.as_slice(), block.ids.as_slice()), (&[2][..], &[7, 8][..]));
        assert_eq!(batch.ids, [5, 6]);
    }
}
