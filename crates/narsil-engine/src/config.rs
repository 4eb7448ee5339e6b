//! Engine settings, checked once at startup.

use std::sync::Arc;
use std::time::Duration;

use narsil_core::request::RequestLimits;

use crate::flush::{ContinuousBatching, FlushPolicy, PerRequest};
use crate::memory::MemoryBudget;
use crate::setting::Setting;

/// How queued requests become forward passes: each mode is a flush policy
/// ([`crate::flush`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecutionMode {
    /// Fuse queued requests into one forward (continuous batching).
    Batch,
    /// One request per forward, on the next free lane.
    Worker,
}

impl ExecutionMode {
    /// Every mode, as the command line offers them.
    pub const ALL: [Self; 2] = [Self::Batch, Self::Worker];

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Batch => "batch",
            Self::Worker => "worker",
        }
    }

    /// One line on what it does, for `--help`.
    pub fn help(self) -> &'static str {
        match self {
            Self::Batch => "Fuse queued requests into one forward (continuous batching)",
            Self::Worker => "One forward per request on the next free lane",
        }
    }

    /// The flush policy it stands for, with `config`'s limits (the token
    /// budget for a model `with_sequences` only: elsewhere tokens are rows,
    /// which `max_batch_rows` bounds).
    pub fn flush_policy(self, config: &EngineConfig, with_sequences: bool) -> Arc<dyn FlushPolicy> {
        match self {
            Self::Batch => Arc::new(ContinuousBatching {
                max_requests: config.max_batch_requests,
                max_rows: config.max_batch_rows,
                max_tokens: if with_sequences { config.max_batch_tokens } else { usize::MAX },
                timeout: config.batch_timeout,
            }),
            Self::Worker => Arc::new(PerRequest),
        }
    }
}

impl std::str::FromStr for ExecutionMode {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        Self::ALL.into_iter().find(|m| m.name() == name).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|m| m.name()).collect();
            format!("unknown execution mode {name:?}; one of {}", names.join(", "))
        })
    }
}

/// Everything the engine needs to know besides the model.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Batch or worker execution.
    pub mode: ExecutionMode,
    /// Most requests fused into one forward (batch mode).
    pub max_batch_requests: usize,
    /// Most rows fused into one forward.
    pub max_batch_rows: usize,
    /// Most tokens fused into one forward: rows plus the sequence positions
    /// they look up (a ranking request's history once). Applies to models
    /// with sequence features only; a request over it is cut into parts
    /// within it (a row over it alone is a part of its own).
    pub max_batch_tokens: usize,
    /// How long the oldest queued request may wait for company once a lane
    /// is free; zero sends at once.
    pub batch_timeout: Duration,
    /// Executor lanes (threads each owning a model instance).
    pub lanes: usize,
    /// Most threads one forward may use: a forward that starts with other
    /// lanes idle and nothing queued gets the cores they leave free, up to
    /// this (see `parallelism`); 1 keeps every forward on one thread.
    pub max_forward_threads: usize,
    /// Most requests admitted but not yet started.
    pub max_queue_requests: usize,
    /// Most rows admitted but not yet started.
    pub max_queue_rows: usize,
    /// The process-wide bound on request memory (decoding, queued, in a
    /// forward), shared by every engine started with a clone of this
    /// config; a single request larger than it is refused as invalid.
    pub memory: MemoryBudget,
    /// Longest a request may wait for its forward to start; past it the
    /// request gets DEADLINE_EXCEEDED and is never computed. `None`: only
    /// the caller's deadline applies.
    pub queue_timeout: Option<Duration>,
    /// Per-request limits checked before queueing.
    pub limits: RequestLimits,
    /// Failed forwards in a row after which the backend counts as unhealthy
    /// (health NOT_SERVING until a forward succeeds); 0: never.
    pub unhealthy_after_failures: u32,
    /// How often an idle lane probes an unhealthy backend.
    pub health_probe_interval: Duration,
    /// Whether each lane whose backend has a stage (a split model's
    /// embedding stage) runs it one batch ahead on a thread of its own
    /// (see `lanes`).
    pub stage_ahead: bool,
    /// The model's request-level features by name (`dense` for the dense
    /// features), replacing what the model declares
    /// ([`narsil_core::RequestLevel::parse`]); `None`: the model's own.
    pub request_level: Option<Vec<String>>,
}

impl EngineConfig {
    /// Checks the settings against each other.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            (Setting::Lanes, self.lanes),
            (Setting::MaxForwardThreads, self.max_forward_threads),
            (Setting::MaxBatchRequests, self.max_batch_requests),
            (Setting::MaxBatchRows, self.max_batch_rows),
            (Setting::MaxBatchTokens, self.max_batch_tokens),
            (Setting::MaxQueueRequests, self.max_queue_requests),
            (Setting::MaxQueueRows, self.max_queue_rows),
            (Setting::MaxQueueBytes, self.memory.max()),
        ];
        if let Some((setting, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(ConfigError::Zero(*setting));
        }
        if self.limits.max_samples > self.max_queue_rows {
            return Err(ConfigError::RequestOverQueue {
                max_request_samples: self.limits.max_samples,
                max_queue_rows: self.max_queue_rows,
            });
        }
        if self.queue_timeout.is_some_and(|t| t.is_zero()) {
            return Err(ConfigError::Zero(Setting::QueueTimeout));
        }
        Ok(())
    }
}

/// Settings that cannot work, alone or together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.describe(Setting::field))]
pub enum ConfigError {
    /// A count or duration that must be positive is zero.
    Zero(Setting),
    /// One request may carry more samples than the queue may hold rows, so
    /// the largest valid request could never be admitted.
    RequestOverQueue {
        /// Most samples per request.
        max_request_samples: usize,
        /// Most rows queued.
        max_queue_rows: usize,
    },
}

impl ConfigError {
    /// The message, with each setting named by `name`.
    pub fn describe(&self, name: impl Fn(Setting) -> &'static str) -> String {
        match *self {
            Self::Zero(setting @ Setting::QueueTimeout) => {
                format!("{} must be positive when set", name(setting))
            }
            Self::Zero(setting) => format!("{} must be at least 1", name(setting)),
            Self::RequestOverQueue { max_request_samples, max_queue_rows } => format!(
                "{} ({max_request_samples}) must not exceed {} ({max_queue_rows})",
                name(Setting::MaxRequestSamples),
                name(Setting::MaxQueueRows)
            ),
        }
    }
}
