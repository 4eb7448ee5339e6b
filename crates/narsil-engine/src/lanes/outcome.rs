//! What a forward's outcome makes of the backend's health, and batches
//! abandoned by every caller.
//!
//! Every forward's outcome goes to the shared [`BackendHealth`]
//! ([`LaneContext::record_health`]).
//!
//! A batch whose every caller stopped waiting before its forward could
//! finish ([`BackendError::Abandoned`]: its deadline, the latest of its
//! callers', passed and a table store stopped its reads) is not a failed
//! forward: its requests are answered DEADLINE_EXCEEDED and it is counted
//! as abandoned (`narsil_batches_abandoned_total`) and nowhere else (not in
//! forwards, rows or requests computed, nor in compute time). Whether
//! health is told depends on where the batch's time went
//! ([`stalled_in_forward`]):
//!
//! * into the queue (the lane, or its stage thread, took the batch with
//!   less than half of its time left): health is not told, so an
//!   overloaded replica whose callers give up does not take itself out of
//!   its load balancer;
//! * into the forward (taken with more than half of its time left, and
//!   still not done: a table store too slow to deliver, as a disk is on its
//!   way to dying): a *stalled* batch (`narsil_batches_stalled_total`,
//!   counted in `narsil_batches_abandoned_total` too), which counts toward
//!   `--unhealthy-after-failures` as a failed forward does, so a replica
//!   whose store stalls every batch turns NOT_SERVING instead of answering
//!   DEADLINE_EXCEEDED to everyone while it says SERVING.
//!
//! The lane honours the claim only once the batch's deadline has passed
//! ([`abandoned`]); from a batch without one (warm-up, probes, a caller
//! without a deadline) it is a failure like any other.
//!
//! [`BackendHealth`]: crate::health::BackendHealth

use std::time::Instant;

use narsil_core::{error_chain, BackendError, KeyedBatch};

use super::LaneContext;
use crate::error::EngineError;
use crate::job::Job;

/// Whether `error`, from the forward over `batch`, is the batch abandoned
/// by every caller ([`BackendError::Abandoned`]) rather than a failure: only
/// once the batch's deadline has passed at `now`. A batch without one
/// (warm-up, probes, a caller without a deadline) has a caller waiting, so
/// the claim is a failure there.
pub(super) fn abandoned(error: &BackendError, batch: &KeyedBatch, now: Instant) -> bool {
    matches!(error, BackendError::Abandoned { .. }) && batch.deadline.is_some_and(|deadline| deadline <= now)
}

/// Whether an abandoned `job`, taken from the queue at `taken` (by its lane
/// or its lane's stage thread), spent its time in its forward rather than
/// in the queue: for the caller that stopped waiting last (whose deadline is
/// the batch's; of several, the one admitted first), the time from the take
/// to the deadline was longer than the time from admission to the take. Such
/// a batch was *stalled* by what its forward waited on (a table store too
/// slow to deliver) and counts toward the backend's health as a failure; a
/// batch taken with less than half of its time left was late because of the
/// queue (an overloaded replica) and does not.
fn stalled_in_forward(job: &Job, taken: Instant) -> bool {
    let last = job.waiters.iter().filter_map(|w| Some((w.deadline?, std::cmp::Reverse(w.admitted)))).max();
    last.is_some_and(|(deadline, std::cmp::Reverse(admitted))| {
        deadline.saturating_duration_since(taken) > taken.saturating_duration_since(admitted)
    })
}

impl LaneContext {
    /// Answers every request of `job`, abandoned by every caller (`error`,
    /// its forward's claim, honoured), DEADLINE_EXCEEDED and counts the
    /// batch as abandoned only; as a failed forward too, for health, when
    /// it stalled in its forward.
    pub(super) fn answer_abandoned(&self, job: Job, taken: Instant, error: &BackendError) {
        let rows = job.batch.rows;
        let stalled = stalled_in_forward(&job, taken);
        let requests: Vec<u64> = job.waiters.iter().map(|w| w.id).collect();
        tracing::debug!(lane = self.lane, rows, ?requests, stalled, error = %error_chain(error), "batch abandoned");
        self.stats.batches_abandoned.inc();
        if stalled {
            self.stats.batches_stalled.inc();
            self.record_health(false);
        }
        for waiter in job.waiters {
            let _ = waiter.reply.send(Err(EngineError::DeadlineExceeded));
        }
    }

    pub(super) fn record_health(&self, succeeded: bool) {
        if let Some(healthy) = self.health.record(succeeded) {
            self.stats.backend_healthy.set(i64::from(healthy));
            if healthy {
                tracing::info!(lane = self.lane, "backend healthy again after a successful forward");
            } else {
                tracing::error!(
                    lane = self.lane,
                    "backend unhealthy: too many failed (or stalled) forwards in a row"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::Arc;
    use std::time::Duration;

    use narsil_core::mock::mock_scores;
    use narsil_core::{assemble, ModelBackend};
    use tokio::sync::oneshot;

    use super::super::fixtures::{
        abandoned_error, config, lane, metric, one_sample, schema, wait_until, Factory, Scripted,
    };
    use super::*;
    use crate::config::EngineConfig;
    use crate::engine::Engine;
    use crate::job::{Prediction, Waiter};
    use crate::memory::MemoryBudget;

    type Answer = oneshot::Receiver<Result<Prediction, EngineError>>;

    /// A batch of `requests` one-sample requests whose callers all stop
    /// waiting at `deadline`, and their answers.
    fn job(requests: usize, deadline: Option<Instant>) -> (Job, Vec<Answer>) {
        let schema = schema();
        let request = one_sample();
        let mut batch =
            assemble(schema.num_dense, schema.num_sparse(), std::iter::repeat_n(&request, requests));
        batch.deadline = deadline;
        let budget = MemoryBudget::new(usize::MAX);
        let (waiters, answers) = (0..requests)
            .map(|id| {
                let (reply, answer) = oneshot::channel();
                let lease = budget.try_reserve(0).unwrap();
                let admitted = Instant::now();
                (Waiter { id: id as u64, reply, admitted, deadline, lease, working: None }, answer)
            })
            .unzip();
        (Job { threads: 1, batch, waiters }, answers)
    }

    /// Runs a batch of two requests whose deadline has passed on `backend`;
    /// their answers.
    fn run_late_batch(
        lane: &LaneContext,
        backend: &mut dyn ModelBackend,
    ) -> Vec<Result<Prediction, EngineError>> {
        let (job, answers) = job(2, Some(Instant::now()));
        lane.run_job(backend, job, Instant::now(), Duration::ZERO, None);
        answers.into_iter().map(|mut a| a.try_recv().expect("answered")).collect()
    }

    fn unavailable() -> BackendError {
        BackendError::Unavailable { reason: "the store is gone".into(), source: None }
    }

    #[test]
    fn ten_batches_whose_callers_all_left_leave_the_backend_healthy() {
        let lane = lane(5);
        let mut backend = Scripted((0..10).map(|_| abandoned_error()).collect());
        for batch in 0..10 {
            for answer in run_late_batch(&lane, &mut backend) {
                assert!(matches!(answer, Err(EngineError::DeadlineExceeded)), "batch {batch}: {answer:?}");
            }
        }
        let stats = lane.stats.snapshot(0);
        assert_eq!((stats.batches_abandoned, stats.batches_stalled, stats.backend_errors), (10, 0, 0));
        assert!(lane.health.is_healthy());
        assert_eq!(lane.stats.backend_healthy.get(), 1);
        let text = lane.stats.encode(0, 0, 0);
        assert!(text.contains("narsil_batches_abandoned_total 10"), "{text}");
        assert!(text.contains("narsil_forward_errors_total 0"), "{text}");
    }

    #[test]
    fn abandoned_batches_count_as_abandoned_only_not_as_forwards_rows_or_requests_computed() {
        let lane = lane(5);
        let mut backend = Scripted([abandoned_error(), abandoned_error()].into());
        run_late_batch(&lane, &mut backend);
        run_late_batch(&lane, &mut backend);
        let stats = lane.stats.snapshot(0);
        assert_eq!((stats.forwards, stats.rows_computed, stats.requests_computed), (0, 0, 0));
        assert_eq!(stats.batches_abandoned, 2);
        let text = lane.stats.encode(0, 0, 0);
        for empty in
            ["narsil_forwards_total 0", "narsil_compute_seconds_count 0", "narsil_batch_rows_count 0"]
        {
            assert!(text.contains(empty), "{empty}: {text}");
        }
        // A forward that fails ran: it counts, as one that succeeds does.
        run_late_batch(&lane, &mut Scripted([unavailable()].into()));
        run_late_batch(&lane, &mut backend);
        let stats = lane.stats.snapshot(0);
        assert_eq!((stats.forwards, stats.rows_computed, stats.requests_computed), (2, 4, 4));
        assert_eq!(metric(&lane.stats.encode(0, 0, 0), "narsil_compute_seconds_count"), 2.0);
    }

    /// A batch of two requests taken from the queue now, whose callers
    /// were admitted `queued` ago and stop waiting `left` from now, run on
    /// a backend that stops at the deadline; their answers are checked
    /// to be DEADLINE_EXCEEDED.
    fn run_abandoned_batch(lane: &LaneContext, queued: Duration, left: Duration) {
        let (mut job, answers) = job(2, Some(Instant::now() + left));
        for waiter in &mut job.waiters {
            waiter.admitted -= queued;
        }
        lane.run_job(&mut StopsAtTheDeadline, job, Instant::now(), Duration::ZERO, None);
        for mut answer in answers {
            let answer = answer.try_recv().expect("answered");
            assert!(matches!(answer, Err(EngineError::DeadlineExceeded)), "{answer:?}");
        }
    }

    #[test]
    fn consecutive_batches_stalled_in_their_forward_make_the_backend_unhealthy() {
        // Like a disk that has turned slow: every batch is taken at once,
        // with all of its time left, and its forward still waits on the
        // store until every caller has gone.
        let (queued, left) = (Duration::ZERO, Duration::from_millis(20));
        let lane = lane(3);
        run_abandoned_batch(&lane, queued, left);
        run_abandoned_batch(&lane, queued, left);
        assert!(lane.health.is_healthy(), "two stalled batches of three");
        // A batch late because of the queue (60 ms queued, 20 ms left)
        // neither counts nor starts the count again.
        run_abandoned_batch(&lane, Duration::from_millis(60), left);
        assert!(lane.health.is_healthy());
        run_abandoned_batch(&lane, queued, left);
        assert!(!lane.health.is_healthy(), "three stalled batches in a row");
        assert_eq!(lane.stats.backend_healthy.get(), 0);
        let stats = lane.stats.snapshot(0);
        assert_eq!((stats.batches_abandoned, stats.batches_stalled, stats.backend_errors), (4, 3, 0));
        assert_eq!(stats.forwards, 0, "abandoned batches are no forwards");
        let text = lane.stats.encode(0, 0, 0);
        assert_eq!(metric(&text, "narsil_batches_stalled_total"), 3.0);
        assert_eq!(metric(&text, "narsil_batches_abandoned_total"), 4.0);
        // Failures and stalls in a row count together (a disk slow, then
        // failing); a forward that succeeds makes it healthy again.
        let lane = self::lane(3);
        run_abandoned_batch(&lane, queued, left);
        run_late_batch(&lane, &mut Scripted([unavailable()].into()));
        run_abandoned_batch(&lane, queued, left);
        assert!(!lane.health.is_healthy());
        run_late_batch(&lane, &mut Scripted(VecDeque::new()));
        assert!(lane.health.is_healthy());
    }

    #[test]
    fn a_batch_is_stalled_when_taken_with_more_than_half_of_its_time_left() {
        let now = Instant::now();
        let at = |ms| now + Duration::from_millis(ms);
        let stalled = |admitted: &[(u64, u64)], taken| {
            let (mut job, _answers) = job(admitted.len(), None);
            for (waiter, &(admitted, deadline)) in job.waiters.iter_mut().zip(admitted) {
                (waiter.admitted, waiter.deadline) = (at(admitted), Some(at(deadline)));
            }
            stalled_in_forward(&job, at(taken))
        };
        assert!(stalled(&[(0, 100)], 40));
        assert!(!stalled(&[(0, 100)], 60));
        assert!(!stalled(&[(0, 100)], 100), "taken at its deadline");
        // The caller that left last decides; of two, the one queued longer.
        assert!(stalled(&[(0, 50), (30, 130)], 40), "90 ms left of the last caller's 100");
        assert!(!stalled(&[(30, 130), (0, 130)], 70), "60 of 130 left for the caller admitted first");
        assert!(!stalled_in_forward(&job(1, None).0, now), "no deadline");
    }

    #[test]
    fn failures_count_toward_unhealthy_across_abandoned_batches_in_between() {
        let lane = lane(5);
        let errors = [unavailable(), unavailable(), unavailable(), unavailable(), abandoned_error()];
        let mut backend = Scripted(errors.into_iter().chain([abandoned_error(), unavailable()]).collect());
        for _ in 0..4 {
            let answers = run_late_batch(&lane, &mut backend);
            assert!(answers
                .iter()
                .all(|a| matches!(a, Err(EngineError::Backend(BackendError::Unavailable { .. })))));
        }
        for _ in 0..2 {
            run_late_batch(&lane, &mut backend);
            assert!(lane.health.is_healthy(), "an abandoned batch is no failure");
        }
        run_late_batch(&lane, &mut backend);
        assert!(!lane.health.is_healthy(), "five failures in a row, abandoned batches aside");
        let stats = lane.stats.snapshot(0);
        assert_eq!((stats.batches_abandoned, stats.backend_errors), (2, 5));
        // Nor does an abandoned batch make it healthy again.
        let mut backend = Scripted([abandoned_error()].into());
        run_late_batch(&lane, &mut backend);
        assert!(!lane.health.is_healthy());
        run_late_batch(&lane, &mut backend);
        assert!(lane.health.is_healthy(), "a forward that succeeds does");
    }

    #[test]
    fn a_claim_of_abandonment_while_a_caller_still_waits_is_a_failure() {
        let lane = lane(1);
        // A caller without a deadline, and callers whose deadline is ahead.
        for deadline in [None, Some(Instant::now() + Duration::from_secs(3600))] {
            let (job, answers) = job(1, deadline);
            lane.run_job(
                &mut Scripted([abandoned_error()].into()),
                job,
                Instant::now(),
                Duration::ZERO,
                None,
            );
            for mut answer in answers {
                let answer = answer.try_recv().unwrap();
                assert!(
                    matches!(answer, Err(EngineError::Backend(BackendError::Abandoned { .. }))),
                    "{deadline:?}: {answer:?}"
                );
            }
        }
        let stats = lane.stats.snapshot(0);
        assert_eq!((stats.batches_abandoned, stats.backend_errors), (0, 2));
        assert!(!lane.health.is_healthy());
    }

    /// Like a table store whose reads stop once every caller left: a
    /// forward over a batch with a deadline runs past it, then stops.
    struct StopsAtTheDeadline;

    impl ModelBackend for StopsAtTheDeadline {
        fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
            let Some(deadline) = batch.deadline else { return Ok(mock_scores(batch)) };
            std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
            Err(abandoned_error())
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_of_batches_a_store_stalls_count_as_deadlines_and_take_the_replica_out() {
        let factory = Factory { schema: schema(), lane: Box::new(|| StopsAtTheDeadline) };
        // No probe in the test's time (a probe carries no deadline, and
        // would succeed here).
        let config = EngineConfig { health_probe_interval: Duration::from_secs(3600), ..config(false) };
        let engine = Engine::start(Arc::new(factory), config).unwrap();
        let handle = engine.handle();
        handle.wait_ready().await.unwrap();
        // Each request is taken at once, and its forward waits until its
        // caller has gone: a store too slow to deliver, not a queue.
        for sent in 1..=10 {
            let deadline = Instant::now() + Duration::from_millis(20);
            let answer = handle.predict(one_sample(), None, Some(deadline)).await;
            assert!(matches!(answer, Err(EngineError::DeadlineExceeded)), "{answer:?}");
            wait_until("the batch abandoned", || handle.stats().batches_abandoned == sent).await;
        }
        let stats = handle.stats();
        assert_eq!((stats.batches_stalled, stats.backend_errors, stats.forwards), (10, 0, 0));
        assert!(!*handle.backend_health().borrow(), "5 stalled batches in a row (the config's limit)");
        let text = handle.metrics_text();
        assert_eq!(
            metric(&text, r#"narsil_requests_total{model="dlrm",version="1",outcome="deadline"}"#),
            10.0
        );
        assert_eq!(metric(&text, "narsil_backend_healthy"), 0.0);
        engine.shutdown().await;
    }
}
