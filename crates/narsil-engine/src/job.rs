//! The units that travel between stages: a queued request ([`Entry`]), the
//! [`Ticket`] that decides once whether it starts or expires, a fused batch
//! on its way to a lane ([`Job`]), and a request's answer ([`Prediction`]).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use narsil_core::{KeyedBatch, StagedBatch};
use tokio::sync::oneshot;

use crate::admission::Permit;
use crate::error::EngineError;
use crate::memory::Lease;
use crate::working_sets::WorkingShare;

/// A request's scores and how they were computed.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// Per model output (schema order), one score per sample, in request
    /// order.
    pub outputs: Vec<Vec<f32>>,
    /// Forwards the request's samples took part in: more than one when it
    /// had more samples than a forward may carry.
    pub forwards: usize,
    /// Rows in those forwards, all told.
    pub fused_rows: usize,
    /// Most requests fused into one of those forwards (this one included).
    pub fused_requests: usize,
    /// Admission to the start of the request's first forward.
    pub queue_time: Duration,
    /// Time spent in those forwards.
    pub compute_time: Duration,
    /// Version of the model that computed it (the schema's `version`).
    pub model_version: Arc<str>,
}

impl Prediction {
    /// One answer from the answers of a split request's parts, in order.
    pub fn merge(parts: Vec<Prediction>) -> Prediction {
        let mut parts = parts.into_iter();
        let mut whole = parts.next().expect("a request has at least one part");
        for part in parts {
            for (whole, part) in whole.outputs.iter_mut().zip(part.outputs) {
                whole.extend(part);
            }
            whole.forwards += part.forwards;
            whole.fused_rows += part.fused_rows;
            whole.fused_requests = whole.fused_requests.max(part.fused_requests);
            whole.compute_time += part.compute_time;
        }
        whole
    }
}

const QUEUED: u8 = 0;
const STARTED: u8 = 1;
const ABANDONED: u8 = 2;

/// Decides, exactly once, whether a queued request reaches a forward or
/// expires: a lane starting it and its caller's timer race on one atomic,
/// so a request answered DEADLINE_EXCEEDED is never computed, and a request
/// that started is never expired by its queue timeout. Shared by every part
/// of a split request.
#[derive(Debug, Default)]
pub struct Ticket(AtomicU8);

impl Ticket {
    /// A ticket for a request that has not started.
    pub fn new() -> Arc<Self> {
        Arc::new(Self(AtomicU8::new(QUEUED)))
    }

    /// Marks the request started; false when it was abandoned first.
    pub fn start(&self) -> bool {
        match self.0.compare_exchange(QUEUED, STARTED, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => true,
            Err(state) => state == STARTED,
        }
    }

    /// Abandons the request if no part of it has started; true if it did so
    /// (the request will never be computed).
    pub fn abandon(&self) -> bool {
        self.0.compare_exchange(QUEUED, ABANDONED, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// True once abandoned.
    pub fn is_abandoned(&self) -> bool {
        self.0.load(Ordering::Acquire) == ABANDONED
    }
}

/// Where a request's answer goes.
pub type ReplySender = oneshot::Sender<Result<Prediction, EngineError>>;

/// A validated request (or one part of a split request) waiting in the
/// collector. Its samples are not here: they wait beside it in its queued
/// batch, reordered key-major, and are held there only.
#[derive(Debug)]
pub struct Entry {
    /// The engine's id for the request (shared by its parts), as in its
    /// tracing span.
    pub id: u64,
    /// Its samples (rows).
    pub rows: usize,
    /// Its rows plus the sequence positions they look up
    /// ([`narsil_core::RequestSamples::tokens`]): what a batch's
    /// `max_tokens` counts.
    pub tokens: usize,
    /// Its decoded bytes on the process's memory budget, held until its
    /// forward ends.
    pub lease: Lease,
    /// For a model with sequences: each sequence's units (histories and the
    /// rows attending to each), for fusing it only where the fused
    /// forward's working set is no more than its requests'
    /// ([`crate::collector::FusedWorkingSet`]).
    pub units: Vec<Vec<narsil_core::working_set::Unit>>,
    /// For a model with sequences: its hold on the model's working-set
    /// lease for `units`, with what fusing it into its batch added (the
    /// padding it or its batch takes once fused); kept until its forward
    /// ends.
    pub working: Option<WorkingShare>,
    /// Its reply channel; closed when the caller went away.
    pub reply: ReplySender,
    /// When it was admitted.
    pub admitted: Instant,
    /// When it may no longer start: the earlier of the caller's deadline and
    /// the queue timeout.
    pub expires: Option<Instant>,
    /// When its caller stops waiting for the answer (`None`: no deadline).
    pub deadline: Option<Instant>,
    /// Shared with the caller and the request's other parts.
    pub ticket: Arc<Ticket>,
    /// Its place in the admission queue, given back when the entry is
    /// dropped (it starts, expires or is swept).
    #[expect(dead_code, reason = "held for its Drop")]
    pub permit: Permit,
}

/// What the collector does with a queued entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Keep it (and, when dispatching, it has been started).
    Keep,
    /// Drop it: its caller went away or already gave up.
    Drop,
    /// Drop it and answer DEADLINE_EXCEEDED: it expired while queued.
    Expire,
}

impl Entry {
    /// What it adds to a batch.
    pub fn fill(&self) -> crate::flush::Fill {
        crate::flush::Fill { requests: 1, rows: self.rows, tokens: self.tokens }
    }

    /// The working set it holds for its units (0 without sequences).
    pub fn working_bytes(&self) -> usize {
        self.working.as_ref().map_or(0, WorkingShare::bytes)
    }

    /// Decides the entry's fate at `now`. With `start`, a kept entry's
    /// request is marked started (it is about to be computed).
    pub fn fate(&self, now: Instant, start: bool) -> Fate {
        if self.reply.is_closed() {
            return Fate::Drop;
        }
        if self.expires.is_some_and(|e| e <= now) && self.ticket.abandon() {
            return Fate::Expire;
        }
        let alive = if start { self.ticket.start() } else { !self.ticket.is_abandoned() };
        if alive {
            Fate::Keep
        } else {
            Fate::Drop
        }
    }
}

/// A request's reply channel once its rows are part of a fused batch.
#[derive(Debug)]
pub struct Waiter {
    /// The request's id.
    pub id: u64,
    /// Reply channel.
    pub reply: ReplySender,
    /// When the request was admitted.
    pub admitted: Instant,
    /// When its caller stops waiting for the answer (`None`: no deadline).
    pub deadline: Option<Instant>,
    /// Its bytes on the memory budget, returned once the forward is over.
    pub lease: Lease,
    /// Its hold on the model's working-set lease, likewise.
    pub working: Option<WorkingShare>,
}

/// A fused batch and the requests waiting for its rows, in batch order.
#[derive(Debug)]
pub struct Job {
    /// Threads its forward may use (see [`crate::parallelism`]).
    pub threads: usize,
    /// Key-major fused input.
    pub batch: KeyedBatch,
    /// One waiter per fused request.
    pub waiters: Vec<Waiter>,
}

impl Job {
    /// Drops the requests nobody waits for any more at `now` (their caller
    /// went away, or their deadline passed: answered DEADLINE_EXCEEDED) and
    /// their rows, from the batch and from what its stage made of it: for a
    /// batch staged ahead, taken a while before its forward. Returns how
    /// many were dropped.
    pub fn retain_waiting(&mut self, now: Instant, staged: &mut StagedBatch) -> usize {
        let keep: Vec<bool> =
            self.waiters.iter().map(|w| !w.reply.is_closed() && w.deadline.is_none_or(|d| d > now)).collect();
        let dropped = keep.iter().filter(|&&k| !k).count();
        if dropped == 0 {
            return 0;
        }
        staged.retain_requests(&self.batch.request_rows, |r| keep[r]);
        self.batch = self.batch.retain_requests(|r| keep[r]);
        let waiters = std::mem::take(&mut self.waiters);
        for (waiter, keep) in waiters.into_iter().zip(&keep) {
            if *keep {
                self.waiters.push(waiter);
            } else if waiter.deadline.is_some_and(|d| d <= now) {
                let _ = waiter.reply.send(Err(EngineError::DeadlineExceeded));
            }
        }
        dropped
    }
}
