//! Staging a batch's inputs onto the lane's device: host buffers allocated
//! once per lane (pinned on CUDA, grown only when a larger batch comes),
//! each with its device twin; a set of them per batch in flight (dense
//! features, and the pooled block or the lookups); and the copies between
//! host and device (`copy_` without blocking, through the C++ shim).
//!
//! A copy without blocking reads its host buffer when its stream gets to
//! it, so a host buffer must not be rewritten before that: a set rewrites
//! its host buffers only in [`BufferSet::stage`], which first waits on the
//! host for the event it recorded after its previous copies (on CUDA with
//! the shim: each set's copies go to one stream of the lane, the compute
//! stream for the lane's own set, the copy stream for stage ahead's).
//! Without the shim there is one stream and no event: the lane's forward
//! ends with a blocking copy of its scores, which waits for that stream,
//! copies included; on the CPU device there is no copy.

use std::ffi::c_char;
use std::sync::Arc;

use narsil_core::{BackendError, KeyedBatch};
use narsil_embedding::StageScratch;
use tch::{Device, Kind, Tensor};

use super::cuda_error;
use crate::cuda::{Event, LaneStreams, Which};
use crate::lane::{pinned_or_pageable, torch_error};
use crate::split::model::SplitModel;
use crate::tensor_stage::{DeviceLookup, Lookup};

type RawTensor = torch_sys::C_tensor;

extern "C" {
    fn narsil_tensor_copy(
        dst: *mut RawTensor,
        src: *const RawTensor,
        non_blocking: i32,
        error: *mut *mut c_char,
    ) -> i32;
}

/// `dst.copy_(src, non_blocking)` (tch's `copy_` always blocks).
pub(super) fn copy_into(dst: &mut Tensor, src: &Tensor, non_blocking: bool) -> Result<(), BackendError> {
    let mut error = std::ptr::null_mut();
    // SAFETY: two live tensors (tch handles are `at::Tensor*`) and an
    // out-pointer that outlive the call; the shim throws nothing.
    let status =
        unsafe { narsil_tensor_copy(dst.as_mut_ptr(), src.as_ptr(), non_blocking as i32, &mut error) };
    if status == 0 {
        Ok(())
    } else {
        let message = crate::script_module::take_string(error).unwrap_or_else(|| "unknown error".into());
        Err(BackendError::forward("libtorch").caused_by(crate::script_module::LibtorchError(message)))
    }
}

/// A host buffer (pinned on CUDA) and its device twin, grown to the largest
/// batch seen; never allocated per batch.
pub struct StagedBuffer {
    kind: Kind,
    device: Device,
    host: Option<Tensor>,
    on_device: Option<Tensor>,
    allocations: usize,
}

impl StagedBuffer {
    /// An empty buffer of `kind` for `device`.
    pub fn new(kind: Kind, device: Device) -> Self {
        Self { kind, device, host: None, on_device: None, allocations: 0 }
    }

    /// How many times its memory was allocated (grown).
    pub fn allocations(&self) -> usize {
        self.allocations
    }

    /// Elements it holds without growing.
    pub fn capacity(&self) -> usize {
        self.host.as_ref().map_or(0, |t| t.numel())
    }

    /// Writes `data` into the host buffer and starts its copy to the device
    /// buffer on the calling thread's current stream (non-blocking);
    /// returns the `[len]` device view (on the CPU device: the host view).
    ///
    /// # Safety
    ///
    /// No copy from the host buffer may still be pending: the stream of
    /// its previous upload has run it (waited for on the host, as
    /// [`BufferSet::stage`] does with its event), or there was none (the
    /// CPU device, or a first upload). Otherwise the pending copy may read
    /// this batch's values, or half of them.
    unsafe fn upload<T: tch::kind::Element>(&mut self, data: &[T]) -> Result<Tensor, BackendError> {
        if T::KIND != self.kind {
            return Err(BackendError::forward(format!(
                "a {:?} input staged in a {:?} buffer",
                T::KIND,
                self.kind
            )));
        }
        let len = data.len();
        let grown = self.capacity() < len.max(1);
        if grown {
            let size = len.max(1).next_power_of_two() as i64;
            let host = Tensor::f_empty([size], (self.kind, Device::Cpu)).map_err(torch_error)?;
            self.host = Some(match self.device {
                Device::Cpu => host,
                device => pinned_or_pageable(host, device),
            });
            self.on_device = match self.device {
                Device::Cpu => None,
                device => Some(Tensor::f_empty([size], (self.kind, device)).map_err(torch_error)?),
            };
            self.allocations += 1;
        }
        let host = self.host.as_ref().expect("allocated above");
        #[cfg(test)]
        crate::cuda::fake::host_write(host.data_ptr() as usize, grown);
        // SAFETY: `host` is a contiguous CPU tensor of `kind` (checked to be
        // T's) with at least `len` elements, and `data` has `len` of them;
        // no other reference to its memory is in use (the caller's contract:
        // the previous copy from it has run).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), host.data_ptr() as *mut T, len) };
        let host = host.f_narrow(0, 0, len as i64).map_err(torch_error)?;
        match &self.on_device {
            None => Ok(host),
            Some(on_device) => {
                let mut view = on_device.f_narrow(0, 0, len as i64).map_err(torch_error)?;
                copy_into(&mut view, &host, true)?;
                Ok(view)
            }
        }
    }
}

/// One batch's staged inputs, on the device.
pub struct Held {
    pub(super) rows: usize,
    pub(super) dense: Tensor,
    /// The pooled block (tables on the host), or the lookups to pool it on
    /// the device (tables there).
    pub(super) pooled: Pooled,
    /// The dense network's inputs after the pooled block (each sequence's
    /// values, units' offsets, rows' units, raw channels and units' request
    /// rows; the rows' raw inputs) on the device (the host stage's, copied).
    pub(super) sequences: Vec<Tensor>,
}

pub(super) enum Pooled {
    Block(Tensor),
    /// Per group, and for ranking requests the request-level units and the
    /// gather index ([`crate::tensor_stage::Lookup::gather`]).
    Lookups(Vec<DeviceLookup>, Option<(usize, Tensor)>),
}

/// Where a set's copies go (one of the lane's streams) and the event
/// recorded there after them (CUDA, with the shim).
pub(super) struct CopyOrder {
    /// Dropped first: before the streams it was recorded on.
    pub(super) event: Event,
    pub(super) streams: Arc<LaneStreams>,
    pub(super) which: Which,
}

/// A set of staging buffers: a batch's dense features, and its pooled block
/// or its lookups.
pub struct BufferSet {
    dense: StagedBuffer,
    pooled: StagedBuffer,
    rows: Vec<StagedBuffer>,
    bags: Vec<StagedBuffer>,
    multipliers: Vec<StagedBuffer>,
    gather: StagedBuffer,
    order: Option<CopyOrder>,
    pub(super) held: Option<Held>,
}

impl BufferSet {
    pub(super) fn new(device: Device, groups: usize, order: Option<CopyOrder>) -> Self {
        let buffers = |kind| (0..groups).map(|_| StagedBuffer::new(kind, device)).collect();
        Self {
            dense: StagedBuffer::new(Kind::Float, device),
            pooled: StagedBuffer::new(Kind::Float, device),
            rows: buffers(Kind::Int64),
            bags: buffers(Kind::Int64),
            multipliers: buffers(Kind::Float),
            gather: StagedBuffer::new(Kind::Int64, device),
            order,
            held: None,
        }
    }

    /// Stages `batch` into the set (see [`stage_into`]): waits on the host
    /// for the set's previous copies (its event) before rewriting its host
    /// buffers, issues the new copies on the set's stream and records the
    /// event after them.
    pub(super) fn stage(
        &mut self,
        model: &SplitModel,
        batch: &KeyedBatch,
        scratch: &mut HostScratch,
    ) -> Result<Held, BackendError> {
        if let Some(order) = &self.order {
            order.streams.use_on_this_thread(order.which).map_err(cuda_error("the staging stream"))?;
            order.event.synchronize().map_err(cuda_error("waiting for the previous copy"))?;
        }
        // SAFETY: the copies from the set's host buffers are done: waited
        // for above (they were issued on the set's stream before its event
        // was recorded there), or, without an event, there is one stream
        // whose previous forward ended with a blocking copy (or no copy: the
        // CPU device).
        let held = unsafe { stage_into(model, batch, self, scratch) }?;
        if let Some(order) = &self.order {
            order.event.record(&order.streams, order.which).map_err(cuda_error("recording the copy"))?;
        }
        Ok(held)
    }

    /// Makes `which` of `streams` wait (on the device) for the set's copies
    /// before what is issued to it next (the forward that reads them).
    pub(super) fn wait_on(&self, streams: &LaneStreams, which: Which) -> Result<(), BackendError> {
        match &self.order {
            Some(order) => {
                order.event.block(streams, which).map_err(cuda_error("waiting for the staged copy"))
            }
            None => Ok(()),
        }
    }

    /// Host allocations of all its buffers so far.
    pub fn allocations(&self) -> usize {
        [&self.dense, &self.pooled, &self.gather]
            .into_iter()
            .chain(&self.rows)
            .chain(&self.bags)
            .chain(&self.multipliers)
            .map(StagedBuffer::allocations)
            .sum()
    }
}

/// A lane's host-side scratch for staging.
#[derive(Default)]
pub(super) struct HostScratch {
    stage: StageScratch,
    pooled: Vec<f32>,
    lookup: Lookup,
    /// The batch with its raw ids mapped to rows (tables with id maps).
    mapped: KeyedBatch,
}

/// Stages `batch` into `set`: dense features, and the pooled block (tables
/// on the host: pooled here by the CPU stage) or the lookups (tables on the
/// device).
///
/// # Safety
///
/// As [`StagedBuffer::upload`]'s, for every buffer of the set.
unsafe fn stage_into(
    model: &SplitModel,
    batch: &KeyedBatch,
    set: &mut BufferSet,
    scratch: &mut HostScratch,
) -> Result<Held, BackendError> {
    let rows = batch.rows as i64;
    // SAFETY: no copy from the set's buffers is pending (the caller's).
    let dense = unsafe { set.dense.upload(&batch.dense) }?
        .f_reshape([rows, batch.num_dense as i64])
        .map_err(torch_error)?;
    let mut sequences = Vec::new();
    let pooled = match &model.device_tables {
        None => {
            model.stage.pool(batch, &mut scratch.stage, &mut scratch.pooled).map_err(BackendError::from)?;
            // A sequence model's sequences and a model's raw inputs:
            // copied as they are (their shapes vary per batch; such a model
            // runs eagerly, staged on the lane).
            let raw_width = model.stage.row_raw_width();
            let unpooled = crate::split::inputs::unpooled_inputs(
                &scratch.stage,
                raw_width,
                batch.rows,
                model.precision,
            )?;
            for input in unpooled {
                sequences.push(input.f_to(model.device).map_err(torch_error)?);
            }
            let width = model.stage.pooled_width() as i64;
            Pooled::Block(
                // SAFETY: as above.
                unsafe { set.pooled.upload(&scratch.pooled) }?
                    .f_reshape([rows, width])
                    .map_err(torch_error)?,
            )
        }
        Some(tables) => {
            // Raw ids become rows first, as the CPU stage maps them.
            let batch = model.stage.map_ids_skipping_pushes(batch, &mut scratch.mapped);
            scratch.lookup.fill(batch, tables.features(), tables.groups()).map_err(BackendError::from)?;
            let mut lookups = Vec::with_capacity(tables.groups());
            for (g, group) in scratch.lookup.groups.iter().enumerate() {
                lookups.push(DeviceLookup {
                    // SAFETY: as above.
                    rows: unsafe { set.rows[g].upload(&group.rows) }?,
                    // SAFETY: as above.
                    bags: unsafe { set.bags[g].upload(&group.bags) }?,
                    multipliers: if group.scaled {
                        // SAFETY: as above.
                        Some(unsafe { set.multipliers[g].upload(&group.multipliers) }?)
                    } else {
                        None
                    },
                });
            }
            let broadcast = match scratch.lookup.units {
                0 => None,
                // SAFETY: as above.
                units => Some((units, unsafe { set.gather.upload(&scratch.lookup.gather) }?)),
            };
            Pooled::Lookups(lookups, broadcast)
        }
    };
    Ok(Held { rows: batch.rows, dense, pooled, sequences })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upload<T: tch::kind::Element>(buffer: &mut StagedBuffer, data: &[T]) -> Result<Tensor, BackendError> {
        assert_eq!(buffer.device, Device::Cpu);
        // SAFETY: the CPU device: no copy is ever pending.
        unsafe { buffer.upload(data) }
    }

    /// Staging buffers are allocated once and grow only for a larger batch
    /// (on CUDA the same code pins them: never per request).
    #[test]
    fn a_staging_buffer_is_allocated_once_and_grows_only_for_a_larger_batch() {
        let mut buffer = StagedBuffer::new(Kind::Float, Device::Cpu);
        let values: Vec<f32> = (0..300).map(|i| i as f32).collect();
        for len in [100, 50, 100, 128, 1, 0] {
            let staged = upload(&mut buffer, &values[..len]).unwrap();
            assert_eq!(staged.numel(), len);
            assert_eq!(Vec::<f32>::try_from(&staged).unwrap(), values[..len]);
        }
        assert_eq!((buffer.allocations(), buffer.capacity()), (1, 128));
        drop(upload(&mut buffer, &values[..129]).unwrap());
        assert_eq!((buffer.allocations(), buffer.capacity()), (2, 256));
        let error = upload(&mut buffer, &[1i64, 2]).unwrap_err().to_string();
        assert!(error.contains("Int64") && error.contains("Float"), "{error}");
    }

    #[test]
    fn a_buffer_set_counts_every_buffers_allocations() {
        let mut set = BufferSet::new(Device::Cpu, 2, None);
        drop(upload(&mut set.dense, &[1.0f32; 10]).unwrap());
        drop(upload(&mut set.rows[1], &[1i64; 10]).unwrap());
        drop(upload(&mut set.dense, &[1.0f32; 16]).unwrap());
        assert_eq!(set.allocations(), 2);
    }
}
