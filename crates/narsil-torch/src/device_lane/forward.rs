//! The lane's forward over a staged batch: pooling on the device (tables
//! there), the dense network (its bucket's graph, or eager past the largest
//! bucket) and the scores copied back through a pinned host buffer.

use std::sync::Arc;

use narsil_core::BackendError;
use tch::{Device, Kind, Tensor};

use super::graphs::Replay;
use super::staging::{copy_into, Held, Pooled};
use super::{cuda_error, DeviceLane};
use crate::buckets::Padded;
use crate::lane::pinned_or_pageable;
use crate::lane::torch_error;

impl DeviceLane {
    /// Pools (if the tables are on the device), runs the dense network and
    /// copies the scores back.
    pub(super) fn run(&mut self, held: Held) -> Result<Vec<f32>, BackendError> {
        let model = Arc::clone(&self.model);
        let rows = held.rows;
        let pooled = match held.pooled {
            Pooled::Block(block) => block,
            Pooled::Lookups(lookups, broadcast) => {
                let tables = model.device_tables.as_ref().expect("lookups only with device tables");
                tables.pool(rows, &lookups, broadcast.as_ref().map(|(units, gather)| (*units, gather)))?
            }
        };
        let outputs = model.schema.outputs.len();
        let kind = self.network_kind();
        // A sequence model has no graphs (its inputs' shapes vary).
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
                let mut inputs = vec![&dense, &pooled];
                inputs.extend(held.sequences.iter());
                model
                    .dense_network
                    .forward_tensors(&inputs)
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
