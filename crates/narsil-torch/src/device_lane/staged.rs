//! Stage ahead on a device lane: the lane's stage thread stages batch N+1
//! into one of two buffer sets on the copy stream while batch N runs on the
//! compute stream ([`crate::handoff`]); an event recorded after the set's
//! copies orders them before the forward that reads it (the compute stream
//! waits for it) and before the set's host buffers are rewritten (the stage
//! thread waits for it). The staged batch the engine hands the lane carries
//! the batch's sequence number ([`crate::handoff::ticket`]); the lane takes
//! the set holding that number, or stages the batch itself where none does
//! (requests dropped after staging, a failed stage).

use std::sync::Arc;
use std::time::Instant;

use narsil_core::{BackendError, BatchStage, KeyedBatch, ModelBackend, StagedBatch};

use super::staging::{BufferSet, HostScratch};
use super::{copy_order, DeviceLane};
use crate::cuda::Which;
use crate::handoff::{self, Handoff};
use crate::lane::enter_inference_mode;
use crate::split::model::SplitModel;

impl DeviceLane {
    /// The lane's stage thread's stage, staging into the two buffer sets
    /// (their copies on the lane's copy stream) this lane then takes its
    /// staged batches from.
    pub(super) fn stage_thread(&mut self) -> Result<Box<dyn BatchStage>, BackendError> {
        let device = self.model.device;
        let groups = self.model.device_tables.as_ref().map_or(0, |t| t.groups());
        let set =
            || Ok::<_, BackendError>(BufferSet::new(device, groups, copy_order(&self.streams, Which::Copy)?));
        let handoff = Handoff::new(set()?, set()?);
        self.handoff = Some(Arc::clone(&handoff));
        Ok(Box::new(DeviceStage {
            model: Arc::clone(&self.model),
            handoff,
            seq: 0,
            scratch: HostScratch::default(),
            inference_mode: false,
        }))
    }

    /// The forward of `batch`, staged by the stage thread: over the set
    /// holding its sequence number once the compute stream waits for that
    /// set's copies, or staged here where no set holds it.
    pub(super) fn forward_handed_over(
        &mut self,
        batch: &KeyedBatch,
        staged: &StagedBatch,
    ) -> Result<Vec<f32>, BackendError> {
        let Some(handoff) = self.handoff.clone() else { return self.forward(batch) };
        // No ticket: requests were dropped after staging (a new batch).
        let Some(seq) = handoff::ticket(staged) else { return self.forward(batch) };
        let held = {
            let Some(mut set) = handoff.take(seq) else { return self.forward(batch) };
            let Some(held) = set.held.take() else { return self.forward(batch) };
            if held.rows != batch.rows {
                return self.forward(batch);
            }
            if let Some(streams) = &self.streams {
                set.wait_on(streams, Which::Compute)?;
            }
            held
        };
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
    inference_mode: bool,
}

impl BatchStage for DeviceStage {
    fn stage(&mut self, batch: &KeyedBatch) -> Result<StagedBatch, BackendError> {
        let started = Instant::now();
        if !self.inference_mode {
            enter_inference_mode();
            self.inference_mode = true;
        }
        let seq = self.seq;
        self.seq += 1;
        let mut staging = self.handoff.stage(seq);
        // The set's last copies (batch seq - 2's) have run before its host
        // buffers are rewritten: `BufferSet::stage` waits for its event.
        let set = staging.set();
        match set.stage(&self.model, batch, &mut self.scratch) {
            Ok(held) => {
                set.held = Some(held);
                staging.staged();
                // What is staged lives in the buffer set: the block the
                // engine hands over carries only the ticket.
                Ok(handoff::ticket_block(seq, started.elapsed()))
            }
            Err(error) => {
                staging.failed();
                Err(error)
            }
        }
    }
}
