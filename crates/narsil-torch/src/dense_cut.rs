//! A split model's dense network cut in two for ranking requests: the part
//! that sees only the dense features (DLRM's dense arch, the "bottom MLP":
//! `dense_bottom.pt`, `[rows, num_dense] -> [rows, D]` FP32) and the rest
//! (`dense_top.pt` and its packages: `forward(dense embedding, pooled)`).
//! When every dense feature is request-level, a batch's grouped requests
//! need the bottom once per request-level unit, not once per candidate:
//! the lane runs it on the units' dense rows (and each flat row's), gathers
//! its output into the rows, and runs the top. `models/export_dlrm.py
//! --split` writes the cut and checks `top(bottom(dense), pooled)` against
//! the whole network; models without it (TorchRec exports, extracted
//! models, INT8, device lanes) serve ranking requests through the whole
//! network on the broadcast dense rows.

use std::path::{Path, PathBuf};

use narsil_core::{BackendError, KeyedBatch};
use narsil_embedding::SplitSchema;
use tch::{Device, Tensor};

use crate::dense_network::{DenseForm, DenseNetwork};
use crate::lane::torch_error;
use crate::precision::DensePrecision;

/// The two parts, loaded.
pub struct DenseCut {
    bottom: DenseNetwork,
    top: DenseNetwork,
}

impl DenseCut {
    /// The cut the schema names, the top in the form the whole network was
    /// loaded in (`whole`); `None` where the schema names none, for INT8
    /// (its one form is the whole package), or where the whole network
    /// runs as a package and the top has none for `precision` (its
    /// TorchScript form could cost more than the bottom saves).
    pub(crate) fn load(
        dir: &Path,
        split: &SplitSchema,
        whole: DenseForm,
        precision: DensePrecision,
        runners: usize,
    ) -> Result<Option<Self>, BackendError> {
        let (Some(bottom), Some(top)) = (&split.dense_bottom, &split.dense_top) else { return Ok(None) };
        let top_package = match precision {
            DensePrecision::Fp32 => split.dense_top_package.clone(),
            DensePrecision::Bf16 => split.dense_top_package_bf16.clone(),
            DensePrecision::Int8 => return Ok(None),
        };
        let top_form = match (whole, &top_package) {
            (DenseForm::Pt2, Some(_)) => DenseForm::Pt2,
            (DenseForm::Pt2, None) => {
                tracing::info!(%precision, "no dense_top package for this precision: ranking requests run the whole dense network");
                return Ok(None);
            }
            _ => DenseForm::TorchScript,
        };
        // Each part loads as a whole network would, from a schema naming it.
        let part = |network: &PathBuf, package: Option<PathBuf>, form| {
            let (dense_package, dense_package_bf16) = match precision {
                DensePrecision::Bf16 => (None, package),
                _ => (package, None),
            };
            let schema = SplitSchema {
                dense_network: network.clone(),
                dense_package,
                dense_package_bf16,
                dense_package_int8: None,
                dense_form_timings: None,
                ..split.clone()
            };
            DenseNetwork::load(dir, &schema, form, precision, runners, Device::Cpu)
        };
        let bottom = part(bottom, None, DenseForm::TorchScript)?;
        let top = part(top, top_package, top_form)?;
        tracing::info!(bottom = %bottom.form(), top = %top.form(), "dense network cut: ranking requests run the dense arch once per request");
        Ok(Some(Self { bottom, top }))
    }

    /// Whether `batch` gains from the cut: some grouped request sent its
    /// dense features once.
    pub(crate) fn applies(batch: &KeyedBatch) -> bool {
        batch.request_blocks.as_ref().is_some_and(|blocks| !blocks.dense.is_empty())
    }

    /// `batch`'s scores over its `pooled` block (`[rows, width]`, in the
    /// network's precision): the bottom once per unit and once per flat
    /// row, its output gathered into the rows, then the top.
    pub(crate) fn forward(
        &self,
        batch: &KeyedBatch,
        pooled: &Tensor,
        in_precision: impl Fn(Tensor) -> Result<Tensor, BackendError>,
    ) -> Result<Tensor, BackendError> {
        let blocks = batch.request_blocks.as_ref().expect("applies() holds");
        let num_dense = batch.num_dense;
        let mut inputs = blocks.dense.clone();
        let mut row_input = Vec::with_capacity(batch.rows);
        let mut start = 0;
        for (&rows, unit) in batch.request_rows.iter().zip(&blocks.request_unit) {
            match unit {
                Some(unit) => row_input.extend(std::iter::repeat_n(*unit as i64, rows)),
                None => {
                    for row in start..start + rows {
                        row_input.push((inputs.len() / num_dense) as i64);
                        inputs.extend_from_slice(&batch.dense[row * num_dense..(row + 1) * num_dense]);
                    }
                }
            }
            start += rows;
        }
        let bottom_rows = (inputs.len() / num_dense) as i64;
        let dense = Tensor::f_from_slice(&inputs)
            .and_then(|t| t.f_view([bottom_rows, num_dense as i64]))
            .map_err(torch_error)?;
        let embedding = self
            .bottom
            .forward_tensors(&[&in_precision(dense)?])
            .map_err(|e| BackendError::forward("the dense network's bottom").caused_by(e))?;
        let gathered = embedding
            .f_index_select(0, &Tensor::from_slice(&row_input))
            .and_then(|t| t.f_contiguous())
            .map_err(torch_error)?;
        self.top
            .forward_tensors(&[&in_precision(gathered)?, pooled])
            .map_err(|e| BackendError::forward("the dense network's top").caused_by(e))
    }
}
