//! The units that travel between stages: a queued request ([`Entry`]), a
//! fused batch on its way to a lane ([`Job`]), and a request's answer
//! ([`Prediction`]).

use std::time::{Duration, Instant};

use narsil_core::{KeyedBatch, SampleBatch};
use tokio::sync::oneshot;

use crate::admission::Permit;
use crate::error::EngineError;

/// A request's scores and how they were computed.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// One probability per sample, in request order.
    pub scores: Vec<f32>,
    /// Rows in the fused forward.
    pub fused_rows: usize,
    /// Requests in the fused forward.
    pub fused_requests: usize,
    /// Admission to forward start.
    pub queue_time: Duration,
    /// Forward duration.
    pub compute_time: Duration,
}

/// Where a request's answer goes.
pub type ReplySender = oneshot::Sender<Result<Prediction, EngineError>>;

/// A validated request waiting in the collector.
#[derive(Debug)]
pub struct Entry {
    /// The request's samples.
    pub request: SampleBatch,
    /// Its reply channel; closed when the client went away.
    pub reply: ReplySender,
    /// When it was admitted.
    pub admitted: Instant,
    /// When its caller stops waiting, if ever.
    pub deadline: Option<Instant>,
    /// Its place in the admission queue.
    pub permit: Permit,
}

impl Entry {
    /// True when nobody will read the answer: the client cancelled or its
    /// deadline passed (the caller's timer has already answered it).
    pub fn is_abandoned(&self, now: Instant) -> bool {
        self.reply.is_closed() || self.deadline.is_some_and(|d| d <= now)
    }
}

/// A request's reply channel once its rows are part of a fused batch.
#[derive(Debug)]
pub struct Waiter {
    /// Reply channel.
    pub reply: ReplySender,
    /// When the request was admitted.
    pub admitted: Instant,
}

/// A fused batch and the requests waiting for its rows, in batch order.
#[derive(Debug)]
pub struct Job {
    /// Key-major fused input.
    pub batch: KeyedBatch,
    /// One waiter per fused request.
    pub waiters: Vec<Waiter>,
}
