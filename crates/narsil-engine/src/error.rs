//! Why the engine could not produce scores for a request.

use narsil_core::InvalidInput;

/// One error per way a request can fail inside the engine. The RPC layer
/// maps each to one status code.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// The request does not fit the model's schema or the server's limits.
    #[error(transparent)]
    Invalid(#[from] InvalidInput),
    /// Admission is full; the message says which limit.
    #[error("server overloaded: {0}")]
    Overloaded(String),
    /// The request's deadline passed before its forward could start.
    #[error("deadline exceeded before the request reached the model")]
    DeadlineExceeded,
    /// Lanes are still loading or warming up.
    #[error("model is still loading")]
    NotReady,
    /// The engine is shutting down and takes no new work.
    #[error("server is shutting down")]
    ShuttingDown,
    /// The forward pass of the request's batch failed.
    #[error("backend error: {0}")]
    Backend(String),
}
