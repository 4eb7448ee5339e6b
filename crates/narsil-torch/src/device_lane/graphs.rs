//! The lane's dense network per batch-size bucket ([`crate::buckets`]): a
//! CUDA graph captured per bucket over static inputs (one lane captures at
//! a time; a bucket whose capture fails runs eagerly), or, on the CPU
//! device, a padded eager forward through the same bucket logic; and the
//! lane's one log line on its graphs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tch::{Device, Tensor};

use super::DeviceLane;
use crate::cuda;

/// Graph captures run one lane at a time. Lanes start together, so without
/// it every lane would capture at once through the one TorchScript
/// executor their dense network shares (whose first runs on CUDA profile
/// and fuse), and a capture that fails for it runs its bucket eagerly.
static CAPTURE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A bucket's graph: static inputs (in the network's precision) and how it
/// runs.
pub(super) struct BucketGraph {
    pub(super) bucket: usize,
    pub(super) inputs: [Tensor; 2],
    pub(super) replay: Replay,
}

pub(super) enum Replay {
    /// A captured CUDA graph.
    Cuda(cuda::Graph),
    /// The CPU device: an eager forward over the padded static inputs (the
    /// bucket logic without a graph, for tests).
    Padded,
}

/// Whether a failed capture was logged (once per process).
pub(super) static CAPTURE_FAILURE_LOGGED: AtomicBool = AtomicBool::new(false);

impl DeviceLane {
    /// The lane's one info-level line on its graphs, which `gpu_check.sh`
    /// reads: "CUDA graphs: used for buckets [..]" (and the buckets left
    /// eager, with why) or "CUDA graphs: not used: <why>".
    pub(super) fn graphs_line(&self, no_shim: Option<&str>, eager: &[(usize, String)]) -> String {
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
    pub(super) fn capture_graphs(&mut self) -> Vec<(usize, String)> {
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
                    // One memory pool for the lane's graphs: the first's.
                    let share = self.graphs.iter().find_map(|g| match &g.replay {
                        Replay::Cuda(graph) => Some(graph),
                        Replay::Padded => None,
                    });
                    streams
                        .capture(
                            || model.dense_network.forward_tensors(&[&dense, &pooled]).map_err(|e| e.0),
                            3,
                            share,
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
}
