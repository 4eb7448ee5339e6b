//! When queued requests go to a lane: the flush policy. It is pure and
//! clock-injected (every decision takes the time it is asked at), so a
//! policy is tested without threads or sleeps. The queue asks it whether a
//! request may join a batch, when a batch is full, and when the open batch
//! is due; order, sweeping and top-up are the queue's (`collector.rs`).
//!
//! Two policies: [`ContinuousBatching`] (batch mode) and [`PerRequest`]
//! (worker mode). A new one is a type implementing [`FlushPolicy`] here and
//! the [`crate::ExecutionMode`] that picks it (config.rs); the command line
//! lists the modes from there.

use std::time::{Duration, Instant};

/// What a queued batch holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fill {
    /// Requests (or parts of split requests).
    pub requests: usize,
    /// Rows (samples).
    pub rows: usize,
    /// Tokens: rows plus the sequence positions they look up (a ranking
    /// request's history counted once); equal to rows for models without
    /// sequence features.
    pub tokens: usize,
}

/// When queued requests are fused and sent.
pub trait FlushPolicy: Send + Sync + std::fmt::Debug {
    /// Whether a request holding `adding` (one request: its rows and
    /// tokens) may join a batch holding `fill` (asked for non-empty batches
    /// only: an empty one takes any request).
    fn fits(&self, fill: Fill, adding: Fill) -> bool;

    /// Whether a batch holding `fill` takes no more requests: it is sealed,
    /// and goes to the next free lane.
    fn is_full(&self, fill: Fill) -> bool;

    /// When an open batch that is not full, whose oldest request was
    /// admitted at `oldest`, goes to a free lane.
    fn due_at(&self, oldest: Instant) -> Instant;

    /// The most one batch holds: `requests`, and a batch of several
    /// requests at most `rows` rows and `tokens` tokens (one request alone
    /// may hold more).
    fn limits(&self) -> Fill;
}

/// Continuous batching: requests that arrive while the lanes are busy are
/// fused, up to `max_requests`, `max_rows` and `max_tokens` (rows plus the
/// sequence positions they look up); a free lane takes the open
/// batch once its oldest request has waited `timeout` (zero: at once, so a
/// lone request on an idle server never waits).
#[derive(Debug, Clone, Copy)]
pub struct ContinuousBatching {
    /// Most requests per batch.
    pub max_requests: usize,
    /// Most rows per batch.
    pub max_rows: usize,
    /// Most tokens per batch (rows plus sequence positions): a batch of
    /// long histories is sealed sooner.
    pub max_tokens: usize,
    /// Longest the oldest request waits for company once a lane is free.
    pub timeout: Duration,
}

impl FlushPolicy for ContinuousBatching {
    fn fits(&self, fill: Fill, adding: Fill) -> bool {
        fill.requests < self.max_requests
            && fill.rows + adding.rows <= self.max_rows
            && fill.tokens + adding.tokens <= self.max_tokens
    }

    fn is_full(&self, fill: Fill) -> bool {
        fill.requests >= self.max_requests || fill.rows >= self.max_rows || fill.tokens >= self.max_tokens
    }

    fn due_at(&self, oldest: Instant) -> Instant {
        oldest + self.timeout
    }

    fn limits(&self) -> Fill {
        Fill { requests: self.max_requests, rows: self.max_rows, tokens: self.max_tokens }
    }
}

/// Worker mode: every request (or part of a split one) is a forward of its
/// own, on the next free lane.
#[derive(Debug, Clone, Copy)]
pub struct PerRequest;

impl FlushPolicy for PerRequest {
    fn fits(&self, _fill: Fill, _adding: Fill) -> bool {
        false
    }

    fn is_full(&self, fill: Fill) -> bool {
        fill.requests >= 1
    }

    fn due_at(&self, oldest: Instant) -> Instant {
        oldest
    }

    fn limits(&self) -> Fill {
        Fill { requests: 1, rows: usize::MAX, tokens: usize::MAX }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(requests: usize, rows: usize) -> Fill {
        Fill { requests, rows, tokens: rows }
    }

    /// One request of `rows` rows and as many tokens.
    fn request(rows: usize) -> Fill {
        fill(1, rows)
    }

    #[test]
    fn continuous_batching_fuses_up_to_its_limits_and_waits_its_timeout() {
        let policy = ContinuousBatching {
            max_requests: 4,
            max_rows: 100,
            max_tokens: 1000,
            timeout: Duration::from_millis(2),
        };
        assert!(policy.fits(fill(1, 60), request(40)), "exactly max_rows fits");
        assert!(!policy.fits(fill(1, 60), request(41)), "one row more does not");
        assert!(!policy.fits(fill(4, 4), request(1)), "max_requests reached");
        assert!(!policy.is_full(fill(3, 99)));
        assert!(policy.is_full(fill(4, 4)) && policy.is_full(fill(1, 100)));
        let now = Instant::now();
        assert_eq!(policy.due_at(now), now + Duration::from_millis(2));
        let at_once = ContinuousBatching { timeout: Duration::ZERO, ..policy };
        assert_eq!(at_once.due_at(now), now, "a lone request is not held back");
    }

    #[test]
    fn long_histories_seal_a_batch_at_its_tokens_before_its_rows() {
        let policy = ContinuousBatching {
            max_requests: 16,
            max_rows: 4096,
            max_tokens: 1000,
            timeout: Duration::ZERO,
        };
        // 10 candidates and a history of 500 positions: 510 tokens.
        let ranking = Fill { requests: 1, rows: 10, tokens: 510 };
        assert!(!policy.fits(ranking, ranking), "1,020 tokens do not fit 1,000");
        assert!(policy.fits(ranking, Fill { requests: 1, rows: 10, tokens: 490 }));
        assert!(policy.is_full(Fill { requests: 2, rows: 20, tokens: 1000 }));
        assert!(!policy.is_full(ranking));
    }

    #[test]
    fn per_request_sends_every_request_alone_and_at_once() {
        let now = Instant::now();
        assert!(!PerRequest.fits(fill(1, 1), request(1)));
        assert!(PerRequest.is_full(fill(1, 5000)));
        assert!(!PerRequest.is_full(fill(0, 0)));
        assert_eq!(PerRequest.due_at(now), now);
    }
}
