//! One lane's forward: the key-major batch becomes the model's three input
//! tensors (Narsil's export) or TorchRec's input dict (each feature group a
//! slice of the batch, ids as int32), and every output comes back as `f32`s,
//! output after output.
//!
//! On CPU the inputs are copied into fresh tensors (a few hundred KiB at the
//! largest batches, small next to the forward). On CUDA they are written into
//! pinned host buffers owned by the lane and copied to the GPU
//! asynchronously; the buffers are reused, which is safe because each
//! forward ends with a synchronous copy of the scores back to the host.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use narsil_core::{BackendError, KeyedBatch, ModelBackend};
use tch::{Device, Kind, Tensor};

use crate::model::TorchModel;

extern "C" {
    fn narsil_enter_inference_mode();
}

/// Puts the calling thread in libtorch's inference mode for good (no
/// autograd bookkeeping on any tensor it creates).
pub fn enter_inference_mode() {
    // SAFETY: the shim only constructs a c10::InferenceMode guard.
    unsafe { narsil_enter_inference_mode() }
}

/// A lane's model instance: the shared module plus the lane's staging.
pub struct TorchLane {
    model: Arc<TorchModel>,
    staging: Option<PinnedStaging>,
    threads: IntraOpThreads,
}

/// A lane thread's libtorch intra-op thread count (per calling thread:
/// OpenMP), changed only when it changes.
pub(crate) struct IntraOpThreads {
    /// `--intra-op-threads`: the fewest threads a forward uses.
    min: usize,
    /// What the calling thread is set to now.
    now: usize,
}

impl IntraOpThreads {
    /// Sets the calling thread to `min` (at least 1) threads.
    pub(crate) fn new(min: usize) -> Self {
        let min = min.max(1);
        tch::set_num_threads(min as i32);
        Self { min, now: min }
    }

    /// Sets the calling thread to `threads`, or the minimum if higher.
    pub(crate) fn set(&mut self, threads: usize) {
        let threads = threads.max(self.min);
        if threads != self.now {
            tch::set_num_threads(threads as i32);
            self.now = threads;
        }
    }
}

impl TorchLane {
    /// A lane for `model` whose forwards use at least `min_threads`
    /// intra-op threads (the calling thread is set to that many); pinned
    /// staging is set up for CUDA models.
    pub fn new(model: Arc<TorchModel>, min_threads: usize) -> Self {
        let staging = match model.device() {
            Device::Cpu => None,
            device => Some(PinnedStaging::new(device)),
        };
        Self { model, staging, threads: IntraOpThreads::new(min_threads) }
    }

    fn inputs(&mut self, batch: &KeyedBatch) -> Result<[Tensor; 3], BackendError> {
        let rows = batch.rows as i64;
        let dense_shape = [rows, batch.num_dense as i64];
        Ok(match &mut self.staging {
            None => [
                Tensor::f_from_slice(&batch.dense)
                    .and_then(|t| t.f_reshape(dense_shape))
                    .map_err(torch_error)?,
                Tensor::f_from_slice(&batch.lengths).map_err(torch_error)?,
                Tensor::f_from_slice(&batch.ids).map_err(torch_error)?,
            ],
            Some(staging) => [
                staging.dense.upload(&batch.dense)?.f_reshape(dense_shape).map_err(torch_error)?,
                staging.lengths.upload(&batch.lengths)?,
                staging.ids.upload(&batch.ids)?,
            ],
        })
    }
}

impl ModelBackend for TorchLane {
    /// libtorch's intra-op thread count is per calling thread (OpenMP), so
    /// each lane sets its own; only a change is passed on.
    fn set_threads(&mut self, threads: usize) {
        self.threads.set(threads);
    }

    fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
        if self.model.dict_signature() {
            return self.forward_dict(batch);
        }
        let [dense, lengths, ids] = self.inputs(batch)?;
        let output = self
            .model
            .module
            .forward(&dense, &lengths, &ids)
            .map_err(|e| BackendError::forward("the TorchScript forward").caused_by(e))?;
        let mut scores = Vec::with_capacity(batch.rows);
        append_scores(&output, batch.rows, &mut scores)?;
        Ok(scores)
    }
}

impl TorchLane {
    /// TorchRec's signature: each feature group key-major under its own
    /// keys, ids as int32 (what TorchRec's server sends; int64 for a model
    /// whose features take raw 64-bit ids, a managed-collision model's
    /// remapping needs them whole, and for a model with raw integer
    /// inputs), and every output the schema names,
    /// output after output.
    fn forward_dict(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
        let device = self.model.device();
        let rows = batch.rows;
        let unweighted = self.model.schema().num_unweighted();
        let split = batch.feature_offsets[unweighted];
        let on_device = |t: Tensor| t.f_to_device(device).map_err(torch_error);
        let raw_ids = self.model.schema().takes_int64_ids();
        let ids = |ids: &[i64]| {
            on_device(if raw_ids {
                Tensor::from_slice(ids)
            } else {
                Tensor::from_slice(&ids.iter().map(|&id| id as i32).collect::<Vec<_>>())
            })
        };
        let dense = on_device(
            Tensor::f_from_slice(&batch.dense)
                .and_then(|t| t.f_reshape([rows as i64, batch.num_dense as i64]))
                .map_err(torch_error)?,
        )?;
        let mut inputs = vec![
            (c"float_features", dense),
            (
                c"id_list_features.lengths",
                on_device(Tensor::from_slice(&batch.lengths[..unweighted * rows]))?,
            ),
            (c"id_list_features.values", ids(&batch.ids[..split])?),
        ];
        if unweighted < batch.num_sparse {
            inputs.push((
                c"id_score_list_features.lengths",
                on_device(Tensor::from_slice(&batch.lengths[unweighted * rows..]))?,
            ));
            inputs.push((c"id_score_list_features.values", ids(&batch.ids[split..])?));
            inputs.push((
                c"id_score_list_features.weights",
                on_device(Tensor::from_slice(&batch.weights[split..]))?,
            ));
        }
        let named: Vec<(&std::ffi::CStr, &Tensor)> = inputs.iter().map(|(name, t)| (*name, t)).collect();
        let outputs = self
            .model
            .module
            .forward_dict(&named, self.model.output_names())
            .map_err(|e| BackendError::forward("the TorchScript forward").caused_by(e))?;
        let mut scores = Vec::with_capacity(rows * outputs.len());
        for output in &outputs {
            append_scores(output, rows, &mut scores)?;
        }
        Ok(scores)
    }
}

/// One output's `rows` scores (`[B]` or `[B, 1]`, any float dtype, any
/// device) appended to `scores` as `f32`.
pub(crate) fn append_scores(output: &Tensor, rows: usize, scores: &mut Vec<f32>) -> Result<(), BackendError> {
    let output = output
        .f_to_device(Device::Cpu)
        .and_then(|t| t.f_to_kind(Kind::Float))
        .and_then(|t| t.f_reshape([-1]))
        .map_err(torch_error)?;
    let got = output.numel();
    if got != rows {
        return Err(BackendError::WrongScoreCount { rows, got });
    }
    // Straight into the answer's buffer: one copy out of the tensor.
    let start = scores.len();
    scores.resize(start + rows, 0.0);
    output.f_copy_data(&mut scores[start..], rows).map_err(torch_error)
}

pub(crate) fn torch_error(e: tch::TchError) -> BackendError {
    BackendError::forward("libtorch").caused_by(e)
}

/// Reusable pinned host buffers for one lane's three inputs.
struct PinnedStaging {
    dense: PinnedBuffer,
    lengths: PinnedBuffer,
    ids: PinnedBuffer,
}

impl PinnedStaging {
    fn new(device: Device) -> Self {
        Self {
            dense: PinnedBuffer::new(Kind::Float, device),
            lengths: PinnedBuffer::new(Kind::Int, device),
            ids: PinnedBuffer::new(Kind::Int64, device),
        }
    }
}

/// A pinned host tensor that grows to the largest batch seen.
struct PinnedBuffer {
    host: Option<Tensor>,
    kind: Kind,
    device: Device,
}

static PINNING_FAILURE_LOGGED: AtomicBool = AtomicBool::new(false);

/// `host` pinned for `device`'s copies; where pinning fails (the locked
/// memory limit, a driver that refuses), `host` itself, pageable: its
/// copies are then staged by the driver and wait for the host, slower but
/// correct (warned once per process).
pub(crate) fn pinned_or_pageable(host: Tensor, device: Device) -> Tensor {
    match host.f_pin_memory(device) {
        Ok(pinned) => pinned,
        Err(why) => {
            if !PINNING_FAILURE_LOGGED.swap(true, Ordering::Relaxed) {
                tracing::warn!(reason = %why, "cannot pin host memory: staging through pageable buffers (slower copies)");
            }
            host
        }
    }
}

impl PinnedBuffer {
    fn new(kind: Kind, device: Device) -> Self {
        Self { host: None, kind, device }
    }

    /// Copies `data` into the pinned buffer and starts its asynchronous copy
    /// to the device.
    fn upload<T: tch::kind::Element>(&mut self, data: &[T]) -> Result<Tensor, BackendError> {
        if T::KIND != self.kind {
            return Err(BackendError::forward(format!(
                "a {:?} input staged in a {:?} buffer",
                T::KIND,
                self.kind
            )));
        }
        let len = data.len();
        let capacity = self.host.as_ref().map_or(0, Tensor::numel);
        if capacity < len.max(1) {
            let size = len.max(1).next_power_of_two() as i64;
            let host = Tensor::f_empty([size], (self.kind, Device::Cpu)).map_err(torch_error)?;
            self.host = Some(pinned_or_pageable(host, self.device));
        }
        let host = self.host.as_ref().expect("allocated above");
        // SAFETY: `host` is a contiguous CPU tensor (pinned where the
        // driver allowed) of `kind` with at least `len` elements; `data` has exactly `len` elements of the
        // same element type.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), host.data_ptr() as *mut T, data.len());
        }
        host.f_narrow(0, 0, len as i64)
            .and_then(|t| t.f_to_device_(self.device, self.kind, true, false))
            .map_err(torch_error)
    }
}
