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
//!
//! A DLRM export also writes the top with the rest of the user's arithmetic
//! once (`dense_user_once.pt`, `models/user_once.py`): the products among
//! the request-level vectors and their share of the over arch's first
//! layer per unit, only the products with a candidate vector per row. It
//! serves a batch whose request-level features are the ones it was cut for
//! (a server started with another `--request-level` keeps `dense_top`), in
//! the top's form (`dense_user_once.pt2`, `_bf16.pt2` where the top runs as
//! a package; none for the precision: the top's package).

use std::path::{Path, PathBuf};

use narsil_core::{BackendError, KeyedBatch};
use narsil_embedding::SplitSchema;
use tch::{Device, Tensor};

use crate::lane::torch_error;
use crate::precision::DensePrecision;
use crate::split::dense_network::{DenseForm, DenseNetwork};

/// The two parts, loaded, and the top with the user's arithmetic once.
pub struct DenseCut {
    bottom: DenseNetwork,
    top: DenseNetwork,
    user_once: Option<UserOnce>,
}

/// `dense_user_once.pt` and the request-level features it was cut for.
struct UserOnce {
    network: DenseNetwork,
    /// Schema indices, ascending (as [`narsil_core::RequestBlocks::features`]).
    features: Vec<usize>,
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
        let user_once = match &split.dense_user_once {
            Some(spec) => {
                // In the top's form: its package for the precision where
                // the top runs as one.
                let package = match precision {
                    DensePrecision::Bf16 => spec.package_bf16.clone(),
                    _ => spec.package.clone(),
                };
                match (top.form(), package) {
                    (DenseForm::Pt2, None) => {
                        tracing::info!(%precision, "the top runs as a package and the user-once cut has none for this precision: ranking requests run the top's package");
                        None
                    }
                    (form, package) => {
                        let network = part(&spec.network, package, form)?;
                        let features: Vec<usize> = (split.features.iter().enumerate())
                            .filter(|(_, f)| spec.request_level.contains(&f.name))
                            .map(|(i, _)| i)
                            .collect();
                        tracing::info!(
                            form = %network.form(),
                            request_level = ?spec.request_level,
                            "dense network cut: ranking requests with these request-level features compute the \
                             user's products and their share of the first layer once per request"
                        );
                        Some(UserOnce { network, features })
                    }
                }
            }
            None => None,
        };
        Ok(Some(Self { bottom, top, user_once }))
    }

    /// Whether `batch` gains from the cut: some grouped request sent its
    /// dense features once.
    pub(crate) fn applies(batch: &KeyedBatch) -> bool {
        batch.request_blocks.as_ref().is_some_and(|blocks| !blocks.dense.is_empty())
    }

    /// The user-once top where it was cut for `batch`'s request-level
    /// features (and the batch gains from the cut at all).
    fn user_once_for(&self, batch: &KeyedBatch) -> Option<&UserOnce> {
        let blocks = batch.request_blocks.as_ref()?;
        self.user_once.as_ref().filter(|cut| Self::applies(batch) && cut.features == blocks.features)
    }

    /// Whether `batch` runs through the user-once top.
    pub(crate) fn runs_user_once(&self, batch: &KeyedBatch) -> bool {
        self.user_once_for(batch).is_some()
    }

    /// `batch`'s scores over its `pooled` block (`[rows, width]`, in the
    /// network's precision): the bottom once per unit and once per flat
    /// row (a unit of its own), then the user-once top where it was cut for
    /// the batch's request-level features, else the bottom's output
    /// gathered into the rows and the top.
    pub(crate) fn forward(
        &self,
        batch: &KeyedBatch,
        pooled: &Tensor,
        in_precision: impl Fn(Tensor) -> Result<Tensor, BackendError>,
    ) -> Result<Tensor, BackendError> {
        let blocks = batch.request_blocks.as_ref().expect("applies() holds");
        let num_dense = batch.num_dense;
        // The bottom's inputs: each unit some kept request uses (a batch
        // whose callers left keeps their units: they run nothing), then
        // each flat row; each row's bottom row, and a row of each.
        let mut inputs = Vec::with_capacity((blocks.unit_count + batch.rows) * num_dense);
        let mut row_input = Vec::with_capacity(batch.rows);
        let mut unit_row = Vec::new();
        let mut bottom_row = vec![None; blocks.unit_count];
        let mut start = 0;
        for (&rows, unit) in batch.request_rows.iter().zip(&blocks.request_unit) {
            match unit {
                Some(unit) => {
                    let row = *bottom_row[*unit].get_or_insert_with(|| {
                        unit_row.push(start as i64);
                        inputs.extend_from_slice(&blocks.dense[unit * num_dense..(unit + 1) * num_dense]);
                        unit_row.len() as i64 - 1
                    });
                    row_input.extend(std::iter::repeat_n(row, rows));
                }
                None => {
                    for row in start..start + rows {
                        row_input.push(unit_row.len() as i64);
                        unit_row.push(row as i64);
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
        let row_input = Tensor::from_slice(&row_input);
        if let Some(user_once) = self.user_once_for(batch) {
            return user_once
                .network
                .forward_tensors(&[
                    &in_precision(embedding)?,
                    pooled,
                    &row_input,
                    &Tensor::from_slice(&unit_row),
                ])
                .map_err(|e| BackendError::forward("the dense network's user-once top").caused_by(e));
        }
        let gathered =
            embedding.f_index_select(0, &row_input).and_then(|t| t.f_contiguous()).map_err(torch_error)?;
        self.top
            .forward_tensors(&[&in_precision(gathered)?, pooled])
            .map_err(|e| BackendError::forward("the dense network's top").caused_by(e))
    }
}
