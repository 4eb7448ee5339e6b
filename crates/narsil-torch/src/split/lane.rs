//! A split model's CPU lane: the embedding stage pools each batch (on the
//! lane, or one batch ahead on the lane's stage thread with
//! `--stage-ahead`, [`SplitStage`]), then the dense network (whole, or its
//! cut for ranking requests: [`crate::split::dense_cut`]) scores it on memory the
//! lane owns. Loaded and created by [`crate::split::SplitFactory`].

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;

use narsil_core::{BackendError, BatchStage, KeyedBatch, ModelBackend, StagedBatch};
use narsil_embedding::{Bf16, PooledValue, StageScratch};

use crate::lane::{append_scores, IntraOpThreads};
use crate::precision::DensePrecision;
use crate::split::dense_cut::DenseCut;
use crate::split::inputs::{in_precision, lent, unpooled_inputs, Lendable};
use crate::split::model::SplitModel;

/// A lane of a split model: its stage buffers, pooled embeddings and
/// dense features, reused.
pub(crate) struct SplitLane {
    model: Arc<SplitModel>,
    scratch: StageScratch,
    pooled: Vec<f32>,
    /// The pooled block of a dense network in bf16, which the stage writes
    /// in bf16 as it pools (no cast of an FP32 block).
    pooled_bf16: Vec<Bf16>,
    /// The batch's dense features copied, so that the dense network gets
    /// memory the lane owns (see [`SplitLane::dense_forward`]).
    dense: Vec<f32>,
    threads: IntraOpThreads,
    /// Pooled blocks handed back to the lane's [`SplitStage`] for reuse,
    /// once it has one.
    spent: Option<Sender<Vec<f32>>>,
}

impl SplitLane {
    pub(crate) fn new(model: Arc<SplitModel>, min_threads: usize) -> Self {
        Self {
            model,
            scratch: StageScratch::default(),
            pooled: Vec::new(),
            pooled_bf16: Vec::new(),
            dense: Vec::new(),
            threads: IntraOpThreads::new(min_threads),
            spent: None,
        }
    }

    /// Pools `batch` into the lane's block of its dense network's element
    /// type (`block` picks it) and scores it.
    fn pool_and_score<T: PooledValue + Lendable>(
        &mut self,
        batch: &KeyedBatch,
        block: impl Fn(&mut Self) -> &mut Vec<T>,
    ) -> Result<Vec<f32>, BackendError> {
        let mut pooled = std::mem::take(block(self));
        let model = &*self.model;
        let scored = model
            .stage
            .pool_into(batch, &mut self.scratch, &mut pooled)
            .map_err(BackendError::from)
            .and_then(|()| {
                Self::dense_forward(model, batch, &mut self.dense, &mut pooled, Some(&self.scratch))
            });
        *block(self) = pooled;
        scored
    }

    /// The dense network's forward over `batch`'s dense features, its
    /// `pooled` block and, where the stage laid them out (`unpooled`: the
    /// scratch it pooled `batch` with), its sequences and raw inputs.
    ///
    /// The network may write into its inputs: a TorchScript graph or an
    /// AOTInductor package with an in-place op on an input (`relu_`,
    /// `clamp_`) writes into the tensor's memory. So it is lent only memory
    /// the lane holds exclusively and never reads again: `pooled` (the
    /// lane's block or the staged one, each fully rewritten by the next
    /// pool) and a copy of the dense features in `dense` (DLRM's 13 floats
    /// a row, against 6.5 KiB of pooled values), never `batch.dense`, which
    /// the engine's batch holds immutably and reads afterwards.
    fn dense_forward<T: Lendable>(
        model: &SplitModel,
        batch: &KeyedBatch,
        dense: &mut Vec<f32>,
        pooled: &mut [T],
        unpooled: Option<&StageScratch>,
    ) -> Result<Vec<f32>, BackendError> {
        let (rows, width) = (batch.rows, model.stage.pooled_width());
        // SAFETY: `dense` and `pooled` are exclusive borrows for the whole
        // of this function, so nothing else reads or writes them while the
        // tensors exist; the tensors and the network's output (which may
        // alias them) are dropped below, before this returns; the dense
        // network (a TorchScript module or an AOTInductor package) keeps no
        // reference to its inputs. What it may write into them is never
        // read: `dense` is refilled before each forward and `pooled` is
        // overwritten whole by the next pool.
        let pooled = in_precision(unsafe { lent(pooled, rows, width) }?, model.precision)?;
        let output = match &model.dense_cut {
            // The dense arch once per request: the batch's dense rows are
            // the cut's to read, never copied here.
            Some(cut) if DenseCut::applies(batch) => {
                cut.forward(batch, &pooled, |input| in_precision(input, model.precision))?
            }
            _ => {
                dense.clear();
                dense.extend_from_slice(&batch.dense);
                // SAFETY: as above.
                let dense = in_precision(unsafe { lent(dense, rows, batch.num_dense) }?, model.precision)?;
                let unpooled = match unpooled {
                    Some(scratch) => {
                        unpooled_inputs(scratch, model.stage.row_raw_width(), rows, model.precision)?
                    }
                    None => Vec::new(),
                };
                let mut inputs = vec![&dense, &pooled];
                inputs.extend(unpooled.iter());
                model
                    .dense_network
                    .forward_tensors(&inputs)
                    .map_err(|e| BackendError::forward("the dense network").caused_by(e))?
            }
        };
        // One output: [B]; several: [outputs, B], output after output as
        // the engine splits them.
        let values = rows * model.schema.outputs.len();
        let mut scores = Vec::with_capacity(values);
        append_scores(&output, values, &mut scores)?;
        drop((pooled, output));
        Ok(scores)
    }
}

/// A split lane's embedding stage on a thread of its own: pools each batch
/// into a block the lane hands back once its dense forward is done.
struct SplitStage {
    model: Arc<SplitModel>,
    scratch: StageScratch,
    spent: Receiver<Vec<f32>>,
}

impl BatchStage for SplitStage {
    fn stage(&mut self, batch: &KeyedBatch) -> Result<StagedBatch, BackendError> {
        let started = Instant::now();
        // A spent block (at most two are in use: one staged, one in the
        // dense forward) keeps its pages.
        let mut pooled = self.spent.try_recv().unwrap_or_default();
        self.model.stage.pool(batch, &mut self.scratch, &mut pooled).map_err(BackendError::from)?;
        Ok(StagedBatch {
            values: pooled,
            width: self.model.stage.pooled_width(),
            took: started.elapsed(),
            ticket: None,
        })
    }
}

impl ModelBackend for SplitLane {
    /// The stage pools request-level bags once per unit and broadcasts them
    /// (on the host, or by a gather on the device).
    fn takes_request_level(&self) -> bool {
        true
    }

    fn set_threads(&mut self, threads: usize) {
        self.threads.set(threads);
    }

    fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
        match self.model.precision {
            DensePrecision::Bf16 => self.pool_and_score(batch, |lane| &mut lane.pooled_bf16),
            DensePrecision::Fp32 | DensePrecision::Int8 => {
                self.pool_and_score(batch, |lane| &mut lane.pooled)
            }
        }
    }

    /// None for a model with sequences or raw inputs: they are not part of
    /// the staged block, so its stage runs on the lane.
    fn take_stage(&mut self) -> Option<Box<dyn BatchStage>> {
        if self.model.stage.takes_unpooled_inputs() {
            return None;
        }
        let (spent, to_stage) = channel();
        self.spent = Some(spent);
        Some(Box::new(SplitStage {
            model: Arc::clone(&self.model),
            scratch: StageScratch::default(),
            spent: to_stage,
        }))
    }

    fn forward_staged(&mut self, batch: &KeyedBatch, staged: StagedBatch) -> Result<Vec<f32>, BackendError> {
        // The staged block is the lane's now (owned): the dense network may
        // write into it, and the stage pools over it whole when it is reused.
        let mut pooled = staged.values;
        let scores = Self::dense_forward(&self.model, batch, &mut self.dense, &mut pooled, None);
        if let Some(spent) = &self.spent {
            // The stage may be gone (shutting down): the block is freed.
            let _ = spent.send(pooled);
        }
        scores
    }
}
