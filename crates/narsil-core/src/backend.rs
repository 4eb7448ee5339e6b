//! The contract between the engine and a model: a synchronous forward over a
//! fused key-major batch. Lanes own one backend instance each, on their own
//! thread; no tensor ever crosses a channel.

use crate::batch::{assemble, KeyedBatch};
use crate::request::SampleBatch;
use crate::schema::ModelSchema;

/// A failure to load or run a model. The message is shown to operators and,
/// for forward failures, to the clients whose batch failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BackendError(pub String);

/// One lane's model instance.
pub trait ModelBackend: Send {
    /// Scores every row of `batch`: returns exactly `batch.rows` probabilities.
    /// A row's score must depend only on that row's inputs.
    fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError>;
}

/// Creates lane instances of one model. Loaded once; shared by every lane.
pub trait BackendFactory: Send + Sync {
    /// The model's input schema.
    fn schema(&self) -> &ModelSchema;

    /// Creates lane `lane`'s instance. Called on that lane's own thread, so
    /// per-thread settings (intra-op threads, timer slack) apply to it.
    fn create_lane(&self, lane: usize) -> Result<Box<dyn ModelBackend>, BackendError>;

    /// Floating-point operations of the model's MLPs per sample (2 per
    /// multiply-add), when the backend knows them: the arithmetic a forward
    /// cannot avoid, which `narsil bench-forward` holds against the GEMM peak.
    fn mlp_flops_per_sample(&self) -> Option<f64> {
        None
    }

    /// Row counts each lane runs once before the server reports SERVING.
    fn warmup_rows(&self) -> Vec<usize> {
        vec![1, 100]
    }
}

/// A valid batch of `rows` rows for warm-up: zero dense values and id 0 in
/// every bag.
pub fn warmup_batch(schema: &ModelSchema, rows: usize) -> KeyedBatch {
    let request = SampleBatch {
        batch_size: rows,
        dense: vec![0.0; rows * schema.num_dense],
        lengths: vec![1; rows * schema.num_sparse()],
        ids: vec![0; rows * schema.num_sparse()],
        ..Default::default()
    };
    assemble(schema.num_dense, schema.num_sparse(), [&request])
}
