//! Stage ahead on a device lane: the lane's stage thread stages batch N+1
//! into one of two buffer sets on the copy stream while batch N runs on the
//! compute stream ([`crate::handoff`]); an event recorded after the set's
//! copies orders them before the forward that reads it. The lane takes the
//! set its batch was staged into, or stages the batch itself where none
//! matches (requests dropped after staging, a failed stage).

use std::sync::Arc;
use std::time::Instant;

use narsil_core::{BackendError, BatchStage, KeyedBatch, ModelBackend, StagedBatch};

use super::staging::{stage_into, BufferSet, HostScratch};
use super::{cuda_error, DeviceLane};
use crate::cuda::{self, Event, LaneStreams, Which};
use crate::handoff::Handoff;
use crate::lane::enter_inference_mode;
use crate::split_model::SplitModel;

impl DeviceLane {
    /// The lane's stage thread's stage, staging into the two buffer sets
    /// this lane then takes its staged batches from.
    pub(super) fn stage_thread(&mut self) -> Box<dyn BatchStage> {
        let device = self.model.device;
        let groups = self.model.device_tables.as_ref().map_or(0, |t| t.groups());
        let event = || self.streams.as_ref().and_then(|_| cuda::shim().ok()).and_then(|s| Event::new(s).ok());
        let handoff =
            Handoff::new(BufferSet::new(device, groups, event()), BufferSet::new(device, groups, event()));
        self.handoff = Some(Arc::clone(&handoff));
        Box::new(DeviceStage {
            model: Arc::clone(&self.model),
            handoff,
            seq: 0,
            scratch: HostScratch::default(),
            streams: self.streams.clone(),
            on_stream: false,
        })
    }

    /// The forward of `batch`, staged by the stage thread: over the set it
    /// was staged into once its copies are ordered before the forward, or
    /// staged here where no set holds it.
    pub(super) fn forward_handed_over(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
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
