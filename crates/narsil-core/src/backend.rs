//! The contract between the engine and a model: a synchronous forward over a
//! fused key-major batch. Lanes own one backend instance each, on their own
//! thread; no tensor ever crosses a channel.

use std::path::PathBuf;
use std::sync::Arc;

use crate::batch::{assemble, KeyedBatch};
use crate::id_push::{IdMapTable, IdPush, IdsPushed};
use crate::request::RequestSamples;
use crate::schema::ModelSchema;
use crate::staged::StagedBatch;

/// What caused a [`BackendError`]: the library's own error, kept whole so
/// operators see the chain (shared, so a fused forward's error can be
/// answered to every request in it).
pub type ErrorSource = Arc<dyn std::error::Error + Send + Sync>;

/// A failure to load or run a model. Its message is shown to operators and,
/// for forward failures, to the clients whose batch failed; [`error_chain`]
/// renders it with its causes.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BackendError {
    /// The model file is missing, unreadable, or not a model this backend
    /// can serve (including a schema it cannot use).
    #[error("cannot load model {}: {reason}", path.display())]
    Load {
        /// The file or directory given as the model.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
        /// The library error underneath, if any.
        #[source]
        source: Option<ErrorSource>,
    },
    /// The backend's settings, or this machine, cannot run the model as
    /// asked (device, precision, native libraries).
    #[error("{reason}")]
    Setup {
        /// What is missing or wrong.
        reason: String,
        /// The library error underneath, if any.
        #[source]
        source: Option<ErrorSource>,
    },
    /// A forward pass failed.
    #[error("forward failed: {reason}")]
    Forward {
        /// Where it failed.
        reason: String,
        /// The library error underneath, if any.
        #[source]
        source: Option<ErrorSource>,
    },
    /// A store the forward reads from (a remote table store) did not
    /// deliver in time or is unreachable: the request may succeed later.
    #[error("{reason}")]
    Unavailable {
        /// What could not be read.
        reason: String,
        /// The library error underneath, if any.
        #[source]
        source: Option<ErrorSource>,
    },
    /// Every caller of the batch stopped waiting before the forward could
    /// finish: the batch's deadline (the latest of its callers') passed, so
    /// the forward stopped early (a table store stops its reads then). Not
    /// a failure of the backend: the engine answers the batch's requests
    /// DEADLINE_EXCEEDED and leaves the backend's health alone. Return it
    /// only once [`KeyedBatch::deadline`] has passed; a batch without a
    /// deadline (warm-up, health probes, a caller without one) is never
    /// abandoned, and the engine counts the error as a failure there.
    #[error("every caller stopped waiting: {reason}")]
    Abandoned {
        /// What was stopped, and when.
        reason: String,
    },
    /// A forward returned a different number of scores than rows times
    /// outputs.
    #[error("forward returned {got} scores for {rows} rows")]
    WrongScoreCount {
        /// Rows in the batch.
        rows: usize,
        /// Scores returned.
        got: usize,
    },
    /// The backend panicked (the lane caught it and keeps serving).
    #[error("backend panicked during {during}")]
    Panicked {
        /// What it was doing: loading, warm-up, forward.
        during: String,
    },
}

impl BackendError {
    /// The model at `path` cannot be loaded, because `reason`.
    pub fn load(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Self::Load { path: path.into(), reason: reason.into(), source: None }
    }

    /// The backend cannot run as configured, because `reason`.
    pub fn setup(reason: impl Into<String>) -> Self {
        Self::Setup { reason: reason.into(), source: None }
    }

    /// A forward failed at `reason`.
    pub fn forward(reason: impl Into<String>) -> Self {
        Self::Forward { reason: reason.into(), source: None }
    }

    /// The forward over a batch whose every caller stopped waiting was
    /// stopped at `reason` ([`BackendError::Abandoned`]).
    pub fn abandoned(reason: impl Into<String>) -> Self {
        Self::Abandoned { reason: reason.into() }
    }

    /// The same error, caused by `cause` (kept as its source).
    pub fn caused_by(mut self, cause: impl std::error::Error + Send + Sync + 'static) -> Self {
        let cause: ErrorSource = Arc::new(cause);
        match &mut self {
            Self::Load { source, .. }
            | Self::Setup { source, .. }
            | Self::Forward { source, .. }
            | Self::Unavailable { source, .. } => {
                *source = Some(cause);
            }
            Self::Abandoned { .. } | Self::WrongScoreCount { .. } | Self::Panicked { .. } => {}
        }
        self
    }
}

/// `error` followed by each of its causes, joined by `: `.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(next) = cause {
        text.push_str(": ");
        text.push_str(&next.to_string());
        cause = next.source();
    }
    text
}

/// One lane's model instance.
pub trait ModelBackend: Send {
    /// Scores every row of `batch` for every output of the schema: returns
    /// exactly `batch.rows` scores per output, output after output
    /// (`outputs x rows`). A row's scores must depend only on that row's
    /// inputs.
    fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError>;

    /// Whether its forwards take batches with request-level blocks
    /// ([`KeyedBatch::request_blocks`]: a grouped request's rows hold empty
    /// bags for the request-level features, pooled once from the block);
    /// the lane hands the others [`KeyedBatch::into_flat`]'s batch.
    fn takes_request_level(&self) -> bool {
        false
    }

    /// Threads the next forwards may use (at least 1): more when the
    /// other lanes are idle and nothing else is queued, 1 under load. A
    /// backend that cannot change its threads ignores it.
    fn set_threads(&mut self, _threads: usize) {}

    /// The part of this lane's forwards that can run one batch ahead, on a
    /// thread of its own ([`crate::staged`]), if the backend has one.
    /// Asked once, when the lane starts serving; the lane then runs only
    /// [`ModelBackend::forward_staged`] on batches that stage staged.
    fn take_stage(&mut self) -> Option<Box<dyn BatchStage>> {
        None
    }

    /// The rest of the forward over `batch`, given what the lane's stage
    /// made of it; returns what [`ModelBackend::forward`] would. The
    /// default ignores `staged` and runs the whole forward.
    fn forward_staged(&mut self, batch: &KeyedBatch, staged: StagedBatch) -> Result<Vec<f32>, BackendError> {
        drop(staged);
        self.forward(batch)
    }
}

/// The part of a lane's forwards that can run one batch ahead, on a thread
/// of its own.
pub trait BatchStage: Send {
    /// Stages `batch` for the lane's [`ModelBackend::forward_staged`].
    /// Fails as the whole forward would have (an id out of range, a store
    /// that cannot deliver, [`BackendError::Abandoned`] once the batch's
    /// deadline passed).
    fn stage(&mut self, batch: &KeyedBatch) -> Result<StagedBatch, BackendError>;
}

/// Creates lane instances of one model. Loaded once; shared by every lane.
pub trait BackendFactory: Send + Sync {
    /// The model's input schema.
    fn schema(&self) -> &ModelSchema;

    /// Creates lane `lane`'s instance. Called on that lane's own thread, so
    /// per-thread settings (intra-op threads, timer slack) apply to it.
    fn create_lane(&self, lane: usize) -> Result<Box<dyn ModelBackend>, BackendError>;

    /// Whether its lanes take batches with request-level blocks
    /// ([`ModelBackend::takes_request_level`]). The engine charges a
    /// grouped request to a model whose lanes do not the copy of its block
    /// into every row that their flat batch makes, before it is queued.
    fn takes_request_level(&self) -> bool {
        false
    }

    /// Floating-point operations of the model's dense arithmetic per sample
    /// (its GEMMs and batched products, 2 per multiply-add), when the backend
    /// knows them: the arithmetic a forward cannot avoid, which `narsil
    /// bench-forward` holds against this core's peak.
    fn dense_flops_per_sample(&self) -> Option<f64> {
        None
    }

    /// Row counts each lane runs once before the server reports SERVING.
    fn warmup_rows(&self) -> Vec<usize> {
        vec![1, 100]
    }

    /// Adds the backend's own metrics (the embedding stage's per-table
    /// counters, say) to the engine's `registry`, whose samples carry the
    /// model and version labels.
    fn register_metrics(&self, _registry: &mut prometheus_client::registry::Registry) {}

    /// Hands `watcher` whether what the backend's forwards need outside the
    /// process (a remote table store) answers: once now, then at every
    /// change, for as long as it returns true. Backends that need nothing
    /// outside the process never call it.
    fn watch_dependencies(&self, _watcher: DependencyWatcher) {}

    /// Adds raw ids to a table's id map while the model serves, each with
    /// its row ([`IdPush`]): checked only, applied (all of them servable at
    /// once, or none: a refusal says why), or replayed from the model's
    /// push log before the version serves. Backends without id maps refuse.
    fn push_ids(&self, _push: &IdPush<'_>) -> Result<IdsPushed, String> {
        Err("this backend holds no id maps (only split models' tables declare them)".into())
    }

    /// The tables that declare an id map, each with its rows' format and
    /// whether it takes pushes; none for a backend without id maps.
    fn id_map_tables(&self) -> Vec<IdMapTable> {
        Vec::new()
    }
}

/// Told whether a backend's outside dependencies answer (true) or not;
/// returns false once it no longer wants to be told (its engine is gone).
pub type DependencyWatcher = Box<dyn Fn(bool) -> bool + Send + Sync>;

/// A valid batch of `rows` rows for warm-up: zero dense values and id 0 in
/// every bag.
pub fn warmup_batch(schema: &ModelSchema, rows: usize) -> KeyedBatch {
    let request = RequestSamples {
        num_samples: rows,
        dense: vec![0.0; rows * schema.num_dense],
        lengths: vec![1; rows * schema.num_sparse()],
        ids: vec![0; rows * schema.num_sparse()],
        weights: if schema.num_unweighted() < schema.num_sparse() {
            vec![1.0; rows * schema.num_sparse()]
        } else {
            vec![]
        },
        ..Default::default()
    };
    assemble(schema.num_dense, schema.num_sparse(), [&request])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_chain_names_every_cause() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let error = BackendError::load("/m/model.pt", "not TorchScript").caused_by(io);
        assert_eq!(error_chain(&error), "cannot load model /m/model.pt: not TorchScript: no such file");
        let forward = BackendError::forward("libtorch");
        assert_eq!(error_chain(&forward), "forward failed: libtorch");
        assert_eq!(
            error_chain(&BackendError::WrongScoreCount { rows: 3, got: 2 }),
            "forward returned 2 scores for 3 rows"
        );
        assert_eq!(
            error_chain(&BackendError::abandoned("reading rows of t")),
            "every caller stopped waiting: reading rows of t"
        );
    }
}
