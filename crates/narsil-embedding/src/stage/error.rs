//! Why a batch's embeddings cannot be pooled ([`StageError`]), and what
//! each reason makes of the batch's requests when the backend reports it.

use crate::pool::OutOfRange;
use crate::stores::row_store::FetchError;

/// Why a batch's embeddings cannot be pooled.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// An id outside its table (requests are validated before they get
    /// here, so this is a bug or a schema mismatch).
    #[error("feature {feature:?}: {source}")]
    OutOfRange {
        /// The feature.
        feature: String,
        /// The id and the table's rows.
        source: OutOfRange,
    },
    /// Every caller of the batch stopped waiting (their deadlines passed)
    /// before the store delivered its rows: the batch is abandoned, not
    /// failed.
    #[error("table {table:?}: the {store} store's fetch was given up: {source}")]
    Abandoned {
        /// The table.
        table: String,
        /// Which store.
        store: &'static str,
        /// Where it stopped.
        source: FetchError,
    },
    /// The store could not deliver rows.
    #[error("table {table:?}: the {store} store failed: {source}")]
    Fetch {
        /// The table.
        table: String,
        /// Which store.
        store: &'static str,
        /// Why.
        source: FetchError,
    },
}

impl From<StageError> for narsil_core::BackendError {
    /// A store that could not deliver rows makes the requests
    /// `Unavailable` (a retry may succeed: the cluster fails over); a fetch
    /// given up at the batch's deadline, `Abandoned` (not the backend's
    /// failure); any other stage error is a failed forward.
    fn from(error: StageError) -> Self {
        match error {
            StageError::Fetch { .. } => Self::Unavailable { reason: error.to_string(), source: None },
            StageError::Abandoned { .. } => Self::Abandoned { reason: error.to_string() },
            StageError::OutOfRange { .. } => Self::forward("the embedding stage").caused_by(error),
        }
    }
}
