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

use std::ffi::c_char;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use narsil_core::{BackendError, BatchStage, KeyedBatch, ModelBackend, StagedBatch};
use narsil_embedding::StageScratch;
use tch::{Device, Kind, Tensor};

use crate::buckets::Padded;
use crate::cuda::{self, Event, LaneStreams, Which};
use crate::handoff::Handoff;
use crate::lane::{enter_inference_mode, torch_error, IntraOpThreads};
use crate::precision::DensePrecision;
use crate::split_model::SplitModel;
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

static PINNING_FAILURE_LOGGED: AtomicBool = AtomicBool::new(false);

/// `host` pinned for `device`'s copies; where pinning fails (the locked
/// memory limit, a driver that refuses), `host` itself, pageable: its
/// copies are then staged by the driver and wait for the host, slower but
/// correct (warned once per process).
fn pinned_or_pageable(host: Tensor, device: Device) -> Tensor {
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

/// Graph captures run one lane at a time. Lanes start together, so without
/// it every lane would capture at once through the one TorchScript
/// executor their dense network shares (whose first runs on CUDA profile
/// and fuse), and a capture that fails for it runs its bucket eagerly.
static CAPTURE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `dst.copy_(src, non_blocking)` (tch's `copy_` always blocks).
fn copy_into(dst: &mut Tensor, src: &Tensor, non_blocking: bool) -> Result<(), BackendError> {
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

fn cuda_error(what: &str) -> impl FnOnce(String) -> BackendError + '_ {
    move |message| {
        BackendError::forward(format!("CUDA: {what}")).caused_by(crate::script_module::LibtorchError(message))
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
    /// buffer on the calling thread's current stream (non-blocking: the
    /// host buffer must not be rewritten before that stream has run it);
    /// returns the `[len]` device view (on the CPU device: the host view).
    pub fn upload<T: tch::kind::Element>(&mut self, data: &[T]) -> Result<Tensor, BackendError> {
        if T::KIND != self.kind {
            return Err(BackendError::forward(format!(
                "a {:?} input staged in a {:?} buffer",
                T::KIND,
                self.kind
            )));
        }
        let len = data.len();
        if self.capacity() < len.max(1) {
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
    rows: usize,
    dense: Tensor,
    /// The pooled block (tables on the host), or the lookups to pool it on
    /// the device (tables there).
    pooled: Pooled,
}

enum Pooled {
    Block(Tensor),
    Lookups(Vec<DeviceLookup>),
}

/// A set of staging buffers: a batch's dense features, and its pooled block
/// or its lookups.
pub struct BufferSet {
    dense: StagedBuffer,
    pooled: StagedBuffer,
    rows: Vec<StagedBuffer>,
    bags: Vec<StagedBuffer>,
    multipliers: Vec<StagedBuffer>,
    /// Recorded after the set's copies (CUDA).
    event: Option<Event>,
    held: Option<Held>,
}

impl BufferSet {
    fn new(device: Device, groups: usize, event: Option<Event>) -> Self {
        let buffers = |kind| (0..groups).map(|_| StagedBuffer::new(kind, device)).collect();
        Self {
            dense: StagedBuffer::new(Kind::Float, device),
            pooled: StagedBuffer::new(Kind::Float, device),
            rows: buffers(Kind::Int64),
            bags: buffers(Kind::Int64),
            multipliers: buffers(Kind::Float),
            event,
            held: None,
        }
    }

    /// Host allocations of all its buffers so far.
    pub fn allocations(&self) -> usize {
        [&self.dense, &self.pooled]
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
struct HostScratch {
    stage: StageScratch,
    pooled: Vec<f32>,
    lookup: Lookup,
}

/// Stages `batch` into `set`: dense features, and the pooled block (tables
/// on the host: pooled here by the CPU stage) or the lookups (tables on the
/// device).
fn stage_into(
    model: &SplitModel,
    batch: &KeyedBatch,
    set: &mut BufferSet,
    scratch: &mut HostScratch,
) -> Result<Held, BackendError> {
    let rows = batch.rows as i64;
    let dense =
        set.dense.upload(&batch.dense)?.f_reshape([rows, batch.num_dense as i64]).map_err(torch_error)?;
    let pooled = match &model.device_tables {
        None => {
            model.stage.pool(batch, &mut scratch.stage, &mut scratch.pooled).map_err(BackendError::from)?;
            let width = model.stage.pooled_width() as i64;
            Pooled::Block(set.pooled.upload(&scratch.pooled)?.f_reshape([rows, width]).map_err(torch_error)?)
        }
        Some(tables) => {
            scratch.lookup.fill(batch, tables.features(), tables.groups()).map_err(BackendError::from)?;
            let mut lookups = Vec::with_capacity(tables.groups());
            for (g, group) in scratch.lookup.groups.iter().enumerate() {
                lookups.push(DeviceLookup {
                    rows: set.rows[g].upload(&group.rows)?,
                    bags: set.bags[g].upload(&group.bags)?,
                    multipliers: if group.scaled {
                        Some(set.multipliers[g].upload(&group.multipliers)?)
                    } else {
                        None
                    },
                });
            }
            Pooled::Lookups(lookups)
        }
    };
    Ok(Held { rows: batch.rows, dense, pooled })
}

/// A bucket's graph: static inputs (in the network's precision) and how it
/// runs.
struct BucketGraph {
    bucket: usize,
    inputs: [Tensor; 2],
    replay: Replay,
}

enum Replay {
    /// A captured CUDA graph.
    Cuda(cuda::Graph),
    /// The CPU device: an eager forward over the padded static inputs (the
    /// bucket logic without a graph, for tests).
    Padded,
}

/// Whether a failed capture was logged (once per process).
static CAPTURE_FAILURE_LOGGED: AtomicBool = AtomicBool::new(false);

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
        let device = model.device;
        let mut no_shim = None;
        let streams = match device {
            Device::Cpu => None,
            Device::Cuda(index) => match cuda::shim() {
                Ok(shim) => {
                    let streams = LaneStreams::new(shim, index).map_err(cuda_error("lane streams"))?;
                    streams.use_on_this_thread(Which::Compute).map_err(cuda_error("lane streams"))?;
                    Some(Arc::new(streams))
                }
                Err(why) => {
                    if !CAPTURE_FAILURE_LOGGED.swap(true, Ordering::Relaxed) {
                        tracing::warn!(reason = %why, "no CUDA shim: one stream, no CUDA graphs (eager forwards)");
                    }
                    no_shim = Some(why.to_string());
                    None
                }
            },
            other => return Err(BackendError::setup(format!("split models do not run on {other:?}"))),
        };
        let groups = model.device_tables.as_ref().map_or(0, |t| t.groups());
        let event = |streams: &Option<Arc<LaneStreams>>| -> Result<Option<Event>, BackendError> {
            match streams {
                None => Ok(None),
                Some(_) => {
                    let shim = cuda::shim().map_err(cuda_error("events"))?;
                    Event::new(shim).map(Some).map_err(cuda_error("events"))
                }
            }
        };
        let set = BufferSet::new(device, groups, event(&streams)?);
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
        if capture {
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

    /// The lane's one info-level line on its graphs, which `gpu_check.sh`
    /// reads: "CUDA graphs: used for buckets [..]" (and the buckets left
    /// eager, with why) or "CUDA graphs: not used: <why>".
    fn graphs_line(&self, no_shim: Option<&str>, eager: &[(usize, String)]) -> String {
        let graphs = self.graph_buckets();
        let why_eager = match eager {
            [] => String::new(),
            [(_, why), ..] => {
                let buckets: Vec<usize> = eager.iter().map(|(bucket, _)| *bucket).collect();
                format!("; eager for buckets {buckets:?}: {why}")
            }
        };
        match (self.model.device, no_shim) {
            (Device::Cpu, _) => {
                format!("CUDA graphs: not used: the CPU device (padded eager buckets {graphs:?})")
            }
            (_, Some(why)) => format!("CUDA graphs: not used: no CUDA shim ({why})"),
            _ if self.model.buckets.rows().is_empty() => {
                format!("CUDA graphs: not used: no buckets ({} is empty)", crate::buckets::BUCKETS_ENV)
            }
            _ if graphs.is_empty() => format!("CUDA graphs: not used: every capture failed{why_eager}"),
            _ => format!("CUDA graphs: used for buckets {graphs:?}{why_eager}"),
        }
    }

    /// Captures a graph per bucket (CUDA), or sets up padded buckets (the
    /// CPU device, when the model asks for them); a bucket whose capture
    /// fails runs eagerly (warned once per process). Returns the buckets
    /// left eager, with why.
    fn capture_graphs(&mut self) -> Vec<(usize, String)> {
        let mut eager = Vec::new();
        let model = Arc::clone(&self.model);
        let (device, kind) = (model.device, self.network_kind());
        let width = model.stage.pooled_width() as i64;
        for &bucket in model.buckets.rows() {
            let inputs = [
                Tensor::f_zeros([bucket as i64, model.schema.num_dense as i64], (kind, device)),
                Tensor::f_zeros([bucket as i64, width], (kind, device)),
            ];
            let [Ok(dense), Ok(pooled)] = inputs else {
                tracing::warn!(bucket, "cannot allocate a bucket's static inputs: eager forwards for it");
                eager.push((bucket, "cannot allocate its static inputs".to_string()));
                continue;
            };
            let replay = match (&self.streams, device) {
                (None, Device::Cpu) => Ok(Replay::Padded),
                (None, _) => continue,
                (Some(streams), _) => {
                    let _one_at_a_time = CAPTURE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    streams
                        .capture(
                            || model.dense_network.forward_tensors(&[&dense, &pooled]).map_err(|e| e.0),
                            3,
                        )
                        .map(Replay::Cuda)
                }
            };
            match replay {
                Ok(replay) => self.graphs.push(BucketGraph { bucket, inputs: [dense, pooled], replay }),
                Err(why) => {
                    if !CAPTURE_FAILURE_LOGGED.swap(true, Ordering::Relaxed) {
                        tracing::warn!(bucket, reason = %why, "CUDA graph capture failed: eager forwards for this bucket (logged once)");
                    }
                    eager.push((bucket, format!("capture failed: {why}")));
                }
            }
        }
        eager
    }

    /// Pools (if the tables are on the device), runs the dense network and
    /// copies the scores back.
    fn run(&mut self, held: Held) -> Result<Vec<f32>, BackendError> {
        let model = Arc::clone(&self.model);
        let rows = held.rows;
        let pooled = match held.pooled {
            Pooled::Block(block) => block,
            Pooled::Lookups(lookups) => {
                model.device_tables.as_ref().expect("lookups only with device tables").pool(rows, &lookups)?
            }
        };
        let outputs = model.schema.outputs.len();
        let kind = self.network_kind();
        let scores = match self.graphs.iter_mut().find(|g| g.bucket >= rows) {
            Some(graph) => {
                let padded = Padded { rows, bucket: graph.bucket };
                for (input, real) in graph.inputs.iter_mut().zip([&held.dense, &pooled]) {
                    let mut head = input.f_narrow(0, 0, rows as i64).map_err(torch_error)?;
                    copy_into(&mut head, real, false)?;
                }
                let output = match &graph.replay {
                    Replay::Cuda(cuda_graph) => {
                        cuda_graph.replay().map_err(cuda_error("graph replay"))?;
                        cuda_graph.output().shallow_clone()
                    }
                    Replay::Padded => model
                        .dense_network
                        .forward_tensors(&[&graph.inputs[0], &graph.inputs[1]])
                        .map_err(|e| BackendError::forward("the dense network").caused_by(e))?,
                };
                if output.numel() != outputs * padded.bucket {
                    return Err(BackendError::WrongScoreCount {
                        rows: outputs * padded.bucket,
                        got: output.numel(),
                    });
                }
                output
                    .f_reshape([outputs as i64, padded.bucket as i64])
                    .and_then(|t| t.f_narrow(1, 0, rows as i64))
                    .and_then(|t| t.f_to_kind(Kind::Float))
                    .and_then(|t| t.f_reshape([-1]))
                    .map_err(torch_error)?
            }
            None => {
                let dense = held.dense.f_to_kind(kind).map_err(torch_error)?;
                let pooled = pooled.f_to_kind(kind).map_err(torch_error)?;
                model
                    .dense_network
                    .forward_tensors(&[&dense, &pooled])
                    .map_err(|e| BackendError::forward("the dense network").caused_by(e))?
                    .f_to_kind(Kind::Float)
                    .and_then(|t| t.f_reshape([-1]))
                    .map_err(torch_error)?
            }
        };
        let values = rows * outputs;
        if scores.numel() != values {
            return Err(BackendError::WrongScoreCount { rows: values, got: scores.numel() });
        }
        self.download(&scores, values)
    }

    /// The scores into a pinned host buffer (a blocking copy: it waits for
    /// the compute stream), then into the answer.
    fn download(&mut self, scores: &Tensor, values: usize) -> Result<Vec<f32>, BackendError> {
        let mut out = vec![0.0f32; values];
        if scores.device() == Device::Cpu {
            scores.f_copy_data(&mut out, values).map_err(torch_error)?;
            return Ok(out);
        }
        if self.scores.as_ref().map_or(0, Tensor::numel) < values.max(1) {
            // Pinned, grown to the largest batch: a DMA copy, not a staged one.
            let size = values.max(1).next_power_of_two() as i64;
            let host = Tensor::f_empty([size], (Kind::Float, Device::Cpu)).map_err(torch_error)?;
            self.scores = Some(pinned_or_pageable(host, self.model.device));
        }
        let host = self.scores.as_ref().expect("allocated above");
        let mut head = host.f_narrow(0, 0, values as i64).map_err(torch_error)?;
        copy_into(&mut head, scores, false)?;
        head.f_copy_data(&mut out, values).map_err(torch_error)?;
        Ok(out)
    }
}

impl ModelBackend for DeviceLane {
    fn set_threads(&mut self, threads: usize) {
        self.threads.set(threads);
    }

    fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
        let model = Arc::clone(&self.model);
        let held = stage_into(&model, batch, &mut self.set, &mut self.scratch)?;
        self.run(held)
    }

    fn take_stage(&mut self) -> Option<Box<dyn BatchStage>> {
        let device = self.model.device;
        let groups = self.model.device_tables.as_ref().map_or(0, |t| t.groups());
        let event = || self.streams.as_ref().and_then(|_| cuda::shim().ok()).and_then(|s| Event::new(s).ok());
        let handoff =
            Handoff::new(BufferSet::new(device, groups, event()), BufferSet::new(device, groups, event()));
        self.handoff = Some(Arc::clone(&handoff));
        Some(Box::new(DeviceStage {
            model: Arc::clone(&self.model),
            handoff,
            seq: 0,
            scratch: HostScratch::default(),
            streams: self.streams.clone(),
            on_stream: false,
        }))
    }

    fn forward_staged(&mut self, batch: &KeyedBatch, staged: StagedBatch) -> Result<Vec<f32>, BackendError> {
        drop(staged);
        let Some(handoff) = self.handoff.clone() else { return self.forward(batch) };
        let held = {
            let Some(mut set) = handoff.take(batch) else {
                // Requests were dropped after staging (a new batch): staged here.
                return self.forward(batch);
            };
            let Some(held) = set.held.take() else { return self.forward(batch) };
            if let (Some(event), Some(streams)) = (&set.event, &self.streams) {
                event.block(streams, Which::Compute).map_err(cuda_error("waiting for the staged copy"))?;
            }
            held
        };
        if held.rows != batch.rows {
            return self.forward(batch);
        }
        // The set stays untouched until the stage thread's batch after next,
        // which comes only after this forward has returned.
        self.run(held)
    }
}

/// A device lane's stage thread: stages each batch into the next buffer set
/// on the copy stream.
struct DeviceStage {
    model: Arc<SplitModel>,
    handoff: Arc<Handoff<BufferSet>>,
    seq: u64,
    scratch: HostScratch,
    streams: Option<Arc<LaneStreams>>,
    on_stream: bool,
}

impl BatchStage for DeviceStage {
    fn stage(&mut self, batch: &KeyedBatch) -> Result<StagedBatch, BackendError> {
        let started = Instant::now();
        if !self.on_stream {
            enter_inference_mode();
            if let Some(streams) = &self.streams {
                streams.use_on_this_thread(Which::Copy).map_err(cuda_error("the copy stream"))?;
            }
            self.on_stream = true;
        }
        let mut staging = self.handoff.stage(self.seq);
        self.seq += 1;
        let set = staging.set();
        // The set's last copies (batch seq - 2's) have run before its host
        // buffers are rewritten.
        if let Some(event) = &set.event {
            event.synchronize().map_err(cuda_error("the previous copy"))?;
        }
        match stage_into(&self.model, batch, set, &mut self.scratch) {
            Ok(held) => {
                set.held = Some(held);
                if let (Some(event), Some(streams)) = (&set.event, &self.streams) {
                    event.record(streams, Which::Copy).map_err(cuda_error("recording the copy"))?;
                }
                staging.staged(batch);
                // What is staged lives in the buffer set: the host block is
                // empty (width 0: dropping requests from it is a no-op).
                Ok(StagedBatch { values: Vec::new(), width: 0, took: started.elapsed() })
            }
            Err(error) => {
                staging.failed();
                Err(error)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Staging buffers are allocated once and grow only for a larger batch
    /// (on CUDA the same code pins them: never per request).
    #[test]
    fn a_staging_buffer_is_allocated_once_and_grows_only_for_a_larger_batch() {
        let mut buffer = StagedBuffer::new(Kind::Float, Device::Cpu);
        let values: Vec<f32> = (0..300).map(|i| i as f32).collect();
        for len in [100, 50, 100, 128, 1, 0] {
            let staged = buffer.upload(&values[..len]).unwrap();
            assert_eq!(staged.numel(), len);
            assert_eq!(Vec::<f32>::try_from(&staged).unwrap(), values[..len]);
        }
        assert_eq!((buffer.allocations(), buffer.capacity()), (1, 128));
        drop(buffer.upload(&values[..129]).unwrap());
        assert_eq!((buffer.allocations(), buffer.capacity()), (2, 256));
        let error = buffer.upload(&[1i64, 2]).unwrap_err().to_string();
        assert!(error.contains("Int64") && error.contains("Float"), "{error}");
    }

    #[test]
    fn a_buffer_set_counts_every_buffers_allocations() {
        let mut set = BufferSet::new(Device::Cpu, 2, None);
        drop(set.dense.upload(&[1.0f32; 10]).unwrap());
        drop(set.rows[1].upload(&[1i64; 10]).unwrap());
        drop(set.dense.upload(&[1.0f32; 16]).unwrap());
        assert_eq!(set.allocations(), 2);
    }
}
