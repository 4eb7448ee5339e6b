//! The DLRM forward as TorchRec computes it, on Burn's `burn-flex` backend:
//!
//! 1. dense arch: `relu(x W^T + b)` per layer, `[rows, num_dense] -> [rows, dim]`;
//! 2. pooled embedding bags, from Narsil's embedding stage
//!    (`narsil_embedding`, the same stage the libtorch backend's split models
//!    use): `[rows, T, dim]`;
//! 3. interaction: `z = [dense; pooled]` is `[rows, T+1, dim]`, `z z^T` is
//!    `[rows, T+1, T+1]`; its upper triangle without the diagonal, row-major
//!    (`torch.triu_indices(T+1, T+1, 1)`), follows the dense embedding:
//!    `[rows, dim + T(T+1)/2]`;
//! 4. over arch (ReLU after every layer but the last), sigmoid. A last layer
//!    of `k` units is a `k`-task model: one score per unit (output after
//!    output in the forward's result).
//!
//! Every row is computed from that row's inputs only, so a fused batch gives
//! each request the scores it gets alone.

use burn_backend::ops::{ActivationOps, FloatTensorOps, IntTensorOps, ModuleOps};
use burn_backend::{Shape, TensorData};
use burn_flex::{Flex, FlexDevice, FlexTensor};
use narsil_core::{BackendError, KeyedBatch};
use narsil_embedding::{EmbeddingStage, StageScratch};

use crate::weights::LinearWeights;

/// The backend the forward runs on.
type B = Flex;

/// A linear layer in the layout `ModuleOps::linear` takes.
struct Linear {
    /// Output units.
    outputs: usize,
    /// `[in, out]`.
    weight: FlexTensor,
    /// `[out]`.
    bias: FlexTensor,
}

impl Linear {
    fn new(layer: &LinearWeights, device: &FlexDevice) -> Self {
        // PyTorch stores [out, in]; linear wants [in, out]: transpose once.
        let mut weight = vec![0.0; layer.weight.len()];
        for o in 0..layer.outputs {
            for i in 0..layer.inputs {
                weight[i * layer.outputs + o] = layer.weight[o * layer.inputs + i];
            }
        }
        Self {
            outputs: layer.outputs,
            weight: B::float_from_data(TensorData::new(weight, [layer.inputs, layer.outputs]), device),
            bias: B::float_from_data(TensorData::new(layer.bias.clone(), [layer.outputs]), device),
        }
    }

    fn forward(&self, x: FlexTensor) -> FlexTensor {
        B::linear(x, self.weight.clone(), Some(self.bias.clone()))
    }
}

/// A DLRM ready to run. Immutable and shared by every lane (tensors are
/// reference-counted; forwards never write to the weights).
pub struct BurnDlrm {
    dense: Vec<Linear>,
    over: Vec<Linear>,
    stage: EmbeddingStage,
    features: usize,
    dim: usize,
    num_dense: usize,
    /// Flat indices of the upper triangle (without diagonal) of a
    /// `(T+1) x (T+1)` matrix, row-major.
    triu: FlexTensor,
    device: FlexDevice,
}

impl BurnDlrm {
    /// Moves the dense and over arch into Burn tensors; `stage` pools the
    /// `features` sparse features' bags, `dim` values each.
    pub fn new(
        dense: &[LinearWeights],
        over: &[LinearWeights],
        stage: EmbeddingStage,
        features: usize,
        dim: usize,
    ) -> Self {
        let device = FlexDevice;
        let n = features + 1;
        let triu: Vec<i64> = (0..n).flat_map(|r| (r + 1..n).map(move |c| (r * n + c) as i64)).collect();
        let triu_len = triu.len();
        Self {
            dense: dense.iter().map(|l| Linear::new(l, &device)).collect(),
            over: over.iter().map(|l| Linear::new(l, &device)).collect(),
            stage,
            features,
            dim,
            num_dense: dense[0].inputs,
            triu: B::int_from_data(TensorData::new(triu, [triu_len]), &device),
            device,
        }
    }

    /// The embedding stage (its metrics, for the engine's).
    pub fn stage(&self) -> &EmbeddingStage {
        &self.stage
    }

    /// Scores every row of `batch`; `scratch` and `pooled` are the lane's
    /// buffers for the embedding stage.
    pub fn forward(
        &self,
        batch: &KeyedBatch,
        scratch: &mut StageScratch,
        pooled: &mut Vec<f32>,
    ) -> Result<Vec<f32>, BackendError> {
        let rows = batch.rows;
        let features = self.features;
        if batch.num_dense != self.num_dense || batch.num_sparse != features {
            return Err(BackendError::forward(format!(
                "batch has {} dense and {} sparse features; the model takes {} and {features}",
                batch.num_dense, batch.num_sparse, self.num_dense
            )));
        }
        let mut x =
            B::float_from_data(TensorData::new(batch.dense.clone(), [rows, self.num_dense]), &self.device);
        for layer in &self.dense {
            x = B::relu(layer.forward(x));
        }

        self.stage.pool(batch, scratch, pooled).map_err(BackendError::from)?;
        // Burn takes its tensors' data by value: the block moves in (the
        // lane's buffer is allocated again next forward, as a fresh one was).
        let pooled = TensorData::new(std::mem::take(pooled), [rows, features, self.dim]);
        let pooled = B::float_from_data(pooled, &self.device);
        let dense_row = B::float_reshape(x.clone(), Shape::new([rows, 1, self.dim]));
        let z = B::float_cat(vec![dense_row, pooled], 1);
        let dots = B::float_matmul(z.clone(), B::float_swap_dims(z, 1, 2));
        let dots = B::float_reshape(dots, Shape::new([rows, (features + 1) * (features + 1)]));
        let pairs = B::float_select(dots, 1, self.triu.clone());

        let mut y = B::float_cat(vec![x, pairs], 1);
        let last = self.over.len() - 1;
        for (i, layer) in self.over.iter().enumerate() {
            y = layer.forward(y);
            if i < last {
                y = B::relu(y);
            }
        }
        // [rows, k] -> [k, rows]: output after output.
        let scores = B::float_swap_dims(B::sigmoid(y), 0, 1)
            .into_data()
            .try_into_vec::<f32>()
            .map_err(|e| BackendError::forward(format!("reading scores: {e:?}")))?;
        let outputs = self.over.last().map_or(1, |layer| layer.outputs);
        if scores.len() != rows * outputs {
            return Err(BackendError::WrongScoreCount { rows, got: scores.len() });
        }
        Ok(scores)
    }
}
