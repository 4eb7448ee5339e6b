//! Why the engine could not produce scores for a request.

use narsil_core::{error_chain, BackendError, InvalidInput};

use crate::admission::QueueFull;
use crate::config::ConfigError;

/// Why the engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The settings cannot work.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A lane thread could not be spawned.
    #[error("cannot start lane threads")]
    Threads(#[source] std::io::Error),
    /// The request-level features named for the model are not its own.
    #[error("--request-level: {0}")]
    RequestLevel(String),
}

/// Why the lanes did not all become ready.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LaneFailed {
    /// Creating the lane's model instance failed.
    #[error("lane {lane}: loading the model failed")]
    Load {
        /// The lane.
        lane: usize,
        /// The backend's error.
        #[source]
        error: BackendError,
    },
    /// A warm-up forward failed.
    #[error("lane {lane}: warm-up forward of {rows} rows failed")]
    WarmUp {
        /// The lane.
        lane: usize,
        /// Rows in the warm-up batch.
        rows: usize,
        /// The backend's error.
        #[source]
        error: BackendError,
    },
    /// The lanes ended (engine shut down) before all were ready.
    #[error("lanes stopped before becoming ready")]
    Stopped,
}

/// One error per way a request can fail inside the engine. The RPC layer
/// maps each to one status code.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    /// The request does not fit the model's schema or the server's limits.
    #[error(transparent)]
    Invalid(#[from] InvalidInput),
    /// Admission is full; says which limit.
    #[error("server overloaded: {0}")]
    Overloaded(QueueFull),
    /// The request alone exceeds a queue limit (`needed` > `max`), so no
    /// amount of waiting admits it.
    #[error("invalid message: needs {} {}, more than the queue may ever hold ({})", .0.needed, .0.limit.unit(), .0.max)]
    NeverFits(QueueFull),
    /// The request's deadline passed before its forward could start, or,
    /// with every other caller of its batch gone too, before the forward
    /// could finish (the backend stopped it: [`BackendError::Abandoned`]).
    #[error("deadline exceeded before the request reached the model")]
    DeadlineExceeded,
    /// Lanes are still loading or warming up.
    #[error("model is still loading")]
    NotReady,
    /// The model asked for has no version loaded and warm (none published,
    /// every one failed, or all unloaded).
    #[error("model {0:?} has no version ready to serve")]
    NoServingVersion(String),
    /// The engine is shutting down and takes no new work.
    #[error("server is shutting down")]
    ShuttingDown,
    /// The forward pass of the request's batch failed (shown with its
    /// causes: clients see the whole reason).
    #[error("backend error: {}", error_chain(.0))]
    Backend(BackendError),
}
