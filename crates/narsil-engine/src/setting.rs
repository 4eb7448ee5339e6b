//! The engine's settings by name: what configuration errors and queue
//! limits point at, so each front end can name them its own way (`narsil
//! serve` by its flags). A leaf: it uses nothing else of the engine.

/// An [`EngineConfig`](crate::EngineConfig) setting, as errors name it. Front ends name it their
/// own way ([`ConfigError::describe`](crate::ConfigError::describe)); `narsil serve` by its flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    /// `lanes`.
    Lanes,
    /// `max_forward_threads`.
    MaxForwardThreads,
    /// `max_batch_requests`.
    MaxBatchRequests,
    /// `max_batch_rows`.
    MaxBatchRows,
    /// `max_batch_tokens`.
    MaxBatchTokens,
    /// `max_queue_requests`.
    MaxQueueRequests,
    /// `max_queue_rows`.
    MaxQueueRows,
    /// `max_queue_bytes`.
    MaxQueueBytes,
    /// `limits.max_samples`: most samples in one request.
    MaxRequestSamples,
    /// `queue_timeout`.
    QueueTimeout,
}

impl Setting {
    /// The field's name in [`EngineConfig`](crate::EngineConfig).
    pub fn field(self) -> &'static str {
        match self {
            Self::Lanes => "lanes",
            Self::MaxForwardThreads => "max_forward_threads",
            Self::MaxBatchRequests => "max_batch_requests",
            Self::MaxBatchRows => "max_batch_rows",
            Self::MaxBatchTokens => "max_batch_tokens",
            Self::MaxQueueRequests => "max_queue_requests",
            Self::MaxQueueRows => "max_queue_rows",
            Self::MaxQueueBytes => "max_queue_bytes",
            Self::MaxRequestSamples => "limits.max_samples",
            Self::QueueTimeout => "queue_timeout",
        }
    }
}
