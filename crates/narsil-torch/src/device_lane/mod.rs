//! A split model's lane on a device (`--device cuda[:N]`): the batch's
//! inputs staged through host buffers allocated once per lane (pinned on
//! CUDA, grown only when a larger batch comes) into device buffers, the
//! embedding stage either on the host (the CPU stage; its pooled block is
//! copied) or on the device ([`crate::tensor_stage`]: only ids, bags and
//! multipliers are copied), the dense network as a CUDA graph per batch-size
//! bucket ([`crate::buckets`]; eager where capture failed or past the
//! largest bucket), and the scores copied back through a pinned buffer.
//!
//! On CUDA each lane has a compute stream and a copy stream
//! ([`crate::cuda`]). With stage ahead, the lane's stage thread stages batch
//! N+1 into one of two buffer sets on the copy stream while batch N runs on
//! the compute stream ([`crate::handoff`]); an event orders the copy before
//! the forward that reads it.
//!
//! The same code runs on the CPU device (no pinning, no streams, graphs
//! replaced by padded eager forwards through the same bucket logic): that is
//! how everything but the CUDA calls is tested here (`tests/device_path.rs`).
//!
//! This file holds the lane (its streams, buffers and graphs, set up when
//! it is created) and its [`ModelBackend`] implementation; each of its
//! jobs is a file of its own:
//!
//! * `staging.rs`: the staging buffers ([`StagedBuffer`], a batch's
//!   [`BufferSet`]), staging a batch into a set, and the copies between
//!   host and device (pinned where the driver allows);
//! * `graphs.rs`: a CUDA graph (or, on the CPU device, a padded eager
//!   forward) per batch-size bucket, captured one lane at a time, and the
//!   lane's log line on its graphs;
//! * `forward.rs`: the forward over a staged batch: pooling on the device,
//!   the dense network through its bucket's graph, the scores copied back;
//! * `staged.rs`: stage ahead: the stage thread staging into two buffer
//!   sets on the copy stream, and the lane taking its batch's set.

mod forward;
mod graphs;
mod staged;
mod staging;
#[cfg(test)]
mod tests;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use narsil_core::{BackendError, BatchStage, KeyedBatch, ModelBackend, StagedBatch};
use tch::{Device, Kind, Tensor};

use crate::cuda::{self, CudaShim, Event, LaneStreams, Which};
use crate::handoff::Handoff;
use crate::lane::IntraOpThreads;
use crate::precision::DensePrecision;
use crate::split::model::SplitModel;
use graphs::{BucketGraph, CAPTURE_FAILURE_LOGGED};
use staging::{CopyOrder, HostScratch};

pub use staging::{BufferSet, Held, StagedBuffer};

fn cuda_error(what: &str) -> impl FnOnce(String) -> BackendError + '_ {
    move |message| {
        BackendError::forward(format!("CUDA: {what}")).caused_by(crate::script_module::LibtorchError(message))
    }
}

/// A split model's lane on a device.
pub struct DeviceLane {
    model: Arc<SplitModel>,
    set: BufferSet,
    scratch: HostScratch,
    /// Pinned host memory the scores are copied back into (CUDA).
    scores: Option<Tensor>,
    streams: Option<Arc<LaneStreams>>,
    graphs: Vec<BucketGraph>,
    threads: IntraOpThreads,
    handoff: Option<Arc<Handoff<BufferSet>>>,
}

impl DeviceLane {
    /// A lane on the model's device; on CUDA its streams (the calling
    /// thread's current stream becomes its compute stream) and, with
    /// `capture`, its graphs, captured now, on the stream that replays them.
    pub(crate) fn new(
        model: Arc<SplitModel>,
        min_threads: usize,
        capture: bool,
    ) -> Result<Self, BackendError> {
        let shim = match model.device {
            Device::Cpu => Ok(None),
            Device::Cuda(index) => cuda::shim().map(|shim| Some((shim, index))),
            other => return Err(BackendError::setup(format!("split models do not run on {other:?}"))),
        };
        Self::with_shim(model, min_threads, capture, shim)
    }

    /// A lane on the CPU device whose stream, event and graph calls go to
    /// `shim` (the recording fake) as CUDA device 0's would.
    #[cfg(test)]
    pub(super) fn with_fake(
        model: Arc<SplitModel>,
        capture: bool,
        shim: &'static CudaShim,
    ) -> Result<Self, BackendError> {
        Self::with_shim(model, 1, capture, Ok(Some((shim, 0))))
    }

    /// A lane whose streams come from `shim` on its CUDA device index (none:
    /// the CPU device; an error: CUDA without the shim, why).
    fn with_shim(
        model: Arc<SplitModel>,
        min_threads: usize,
        capture: bool,
        shim: Result<Option<(&'static CudaShim, usize)>, String>,
    ) -> Result<Self, BackendError> {
        let device = model.device;
        let mut no_shim = None;
        let streams = match shim {
            Ok(None) => None,
            Ok(Some((shim, index))) => {
                let streams = LaneStreams::new(shim, index).map_err(|e| match e {
                    e @ cuda::StreamsError::Full { .. } => BackendError::setup(e.to_string()),
                    cuda::StreamsError::Shim(message) => cuda_error("lane streams")(message),
                })?;
                streams.use_on_this_thread(Which::Compute).map_err(cuda_error("lane streams"))?;
                Some(Arc::new(streams))
            }
            Err(why) => {
                if !CAPTURE_FAILURE_LOGGED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(reason = %why, "no CUDA shim: one stream, no CUDA graphs (eager forwards)");
                }
                no_shim = Some(why);
                None
            }
        };
        let groups = model.device_tables.as_ref().map_or(0, |t| t.groups());
        // The lane's own set: its copies go to the compute stream.
        let set = BufferSet::new(device, groups, copy_order(&streams, Which::Compute)?);
        let mut lane = Self {
            set,
            scratch: HostScratch::default(),
            scores: None,
            streams,
            graphs: Vec::new(),
            threads: IntraOpThreads::new(min_threads),
            handoff: None,
            model,
        };
        if capture && lane.model.stage.takes_unpooled_inputs() {
            tracing::info!(
                "CUDA graphs: not used: the model has sequence features or raw inputs (their shapes vary per \
                 batch)"
            );
        } else if capture {
            let eager = lane.capture_graphs();
            tracing::info!("{}", lane.graphs_line(no_shim.as_deref(), &eager));
        }
        Ok(lane)
    }

    /// Host allocations of the lane's own staging buffers so far.
    pub fn staging_allocations(&self) -> usize {
        self.set.allocations()
    }

    /// Buckets this lane runs as graphs (or padded, on the CPU device).
    pub fn graph_buckets(&self) -> Vec<usize> {
        self.graphs.iter().map(|g| g.bucket).collect()
    }

    fn network_kind(&self) -> Kind {
        match self.model.precision {
            DensePrecision::Fp32 | DensePrecision::Int8 => Kind::Float,
            DensePrecision::Bf16 => Kind::BFloat16,
        }
    }
}

impl ModelBackend for DeviceLane {
    /// The stage pools request-level bags once per unit and broadcasts them
    /// (on the host, or by a gather on the device).
    fn takes_request_level(&self) -> bool {
        true
    }

    fn set_threads(&mut self, threads: usize) {
        self.threads.set(threads);
    }

    fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
        let model = Arc::clone(&self.model);
        let held = self.set.stage(&model, batch, &mut self.scratch)?;
        self.run(held)
    }

    /// None for a model with sequences or raw inputs: its lane stages its
    /// own batches.
    fn take_stage(&mut self) -> Option<Box<dyn BatchStage>> {
        if self.model.stage.takes_unpooled_inputs() {
            return None;
        }
        match self.stage_thread() {
            Ok(stage) => Some(stage),
            Err(error) => {
                // Never two sets without the events that order their copies.
                tracing::warn!(error = %narsil_core::error_chain(&error), "no stage ahead for this lane: it stages its batches itself");
                None
            }
        }
    }

    fn forward_staged(&mut self, batch: &KeyedBatch, staged: StagedBatch) -> Result<Vec<f32>, BackendError> {
        self.forward_handed_over(batch, &staged)
    }
}

/// Where a buffer set's copies go and their event: `which` of the lane's
/// streams (none without streams).
fn copy_order(streams: &Option<Arc<LaneStreams>>, which: Which) -> Result<Option<CopyOrder>, BackendError> {
    let Some(streams) = streams else { return Ok(None) };
    let event = Event::new(streams.shim()).map_err(cuda_error("events"))?;
    Ok(Some(CopyOrder { streams: Arc::clone(streams), which, event }))
}
