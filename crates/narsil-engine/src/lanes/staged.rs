//! Stage ahead: with `--stage-ahead` and a backend that has a stage
//! ([`narsil_core::BatchStage`]: a split model's embedding stage), each
//! lane has a stage thread that takes the collector's batches and stages
//! them, one batch ahead: while the lane runs batch N's forward, batch
//! N+1 is staged (its rows fetched and pooled), then waits, handed over
//! once the lane is free (a rendezvous, so at most one batch is staged
//! ahead). Its wait there, from the end of its stage to the lane taking it,
//! is queue time for its requests (`narsil_stage_handover_seconds`), and
//! the lane chooses its forward's threads then, as the collector would for
//! a batch taken at that moment ([`Collector::threads_at_handover`]): at
//! the stage's take the lane was busy, which made that choice 1. Before
//! its forward a staged batch loses the requests whose caller stopped
//! waiting meanwhile (DEADLINE_EXCEEDED for those whose deadline passed),
//! rows and all; with none left the forward is skipped.
//!
//! [`Collector::threads_at_handover`]: crate::collector::Collector::threads_at_handover

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::time::Instant;

use narsil_core::{BackendError, BatchStage, ModelBackend, StagedBatch};

use super::LaneContext;
use crate::collector::NextJob;
use crate::job::Job;

/// What a lane's stage thread hands the lane.
enum Staged {
    /// A batch taken from the collector, and its stage's result.
    Job(Box<StagedJob>),
    /// Nothing was due within the idle limit: time to probe.
    Idle,
}

/// A batch taken at `taken`, and what its stage made of it by `ready`.
struct StagedJob {
    job: Job,
    taken: Instant,
    staged: Result<StagedBatch, BackendError>,
    /// When its stage finished: from then on it waits for the lane.
    ready: Instant,
}

impl LaneContext {
    /// Runs the forwards of batches a stage thread of this lane takes and
    /// stages, one batch ahead; falls back to [`Self::serve`] when that
    /// thread cannot be started.
    pub(super) fn serve_staged(&self, backend: &mut dyn ModelBackend, stage: Box<dyn BatchStage>) {
        let (handover, staged) = sync_channel(0);
        let started = std::thread::scope(|scope| {
            let stager = std::thread::Builder::new()
                .name(format!("narsil-stage-{}", self.lane))
                .spawn_scoped(scope, move || self.stage_ahead(stage, handover));
            if let Err(error) = stager {
                tracing::error!(lane = self.lane, %error, "no stage thread; staging on the lane");
                return false;
            }
            for next in staged {
                match next {
                    Staged::Job(staged) => {
                        let StagedJob { mut job, taken, staged, ready } = *staged;
                        let handover = ready.elapsed();
                        job.threads = self.collector.threads_at_handover();
                        self.stats.batches_staged.inc();
                        self.stats.stage_handover_seconds.observe(handover.as_secs_f64());
                        self.run_job(backend, job, taken, handover, Some(staged));
                        self.collector.finished_job();
                    }
                    Staged::Idle => self.probe(backend),
                }
            }
            true
        });
        if !started {
            self.serve(backend);
        }
    }

    /// The stage thread: takes the collector's next batch, stages it and
    /// waits until the lane takes it; ends when the collector closes.
    fn stage_ahead(&self, mut stage: Box<dyn BatchStage>, lane: SyncSender<Staged>) {
        loop {
            let next = match self.collector.next_job(self.idle_limit(), false) {
                NextJob::Job(due) => {
                    let (job, taken) = self.take(due);
                    let staged = catch_unwind(AssertUnwindSafe(|| stage.stage(&job.batch)))
                        .unwrap_or_else(|_| Err(BackendError::Panicked { during: "staging".into() }));
                    Staged::Job(Box::new(StagedJob { job, taken, staged, ready: Instant::now() }))
                }
                NextJob::Idle => Staged::Idle,
                NextJob::Closed => return,
            };
            if lane.send(next).is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use narsil_core::mock::mock_scores;
    use narsil_core::KeyedBatch;

    use super::super::fixtures::{config, metric, one_sample, schema, wait_until, Factory};
    use super::*;
    use crate::engine::{Engine, EngineHandle};
    use crate::job::Prediction;

    /// A staged backend whose forwards wait at a gate, recording the
    /// threads each staged forward was given.
    #[derive(Default)]
    struct Gate {
        open: AtomicBool,
        staged: AtomicUsize,
        threads: Mutex<Vec<usize>>,
    }

    struct Gated {
        gate: Arc<Gate>,
        threads: usize,
    }

    struct CountingStage(Arc<Gate>);

    impl BatchStage for CountingStage {
        fn stage(&mut self, batch: &KeyedBatch) -> Result<StagedBatch, BackendError> {
            self.0.staged.fetch_add(1, Ordering::SeqCst);
            Ok(StagedBatch { values: vec![0.0; batch.rows], width: 1, took: Duration::ZERO, ticket: None })
        }
    }

    impl ModelBackend for Gated {
        fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
            Ok(mock_scores(batch))
        }

        fn set_threads(&mut self, threads: usize) {
            self.threads = threads;
        }

        fn take_stage(&mut self) -> Option<Box<dyn BatchStage>> {
            Some(Box::new(CountingStage(Arc::clone(&self.gate))))
        }

        fn forward_staged(
            &mut self,
            batch: &KeyedBatch,
            _staged: StagedBatch,
        ) -> Result<Vec<f32>, BackendError> {
            self.gate.threads.lock().unwrap().push(self.threads);
            while !self.gate.open.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(mock_scores(batch))
        }
    }

    /// How long the staged batch B waits at the hand-over.
    const HELD: Duration = Duration::from_millis(100);

    /// One lane on two cores, staging ahead: A's forward waits at the gate
    /// while B is taken and staged, then B waits at the hand-over for
    /// [`HELD`] before the gate opens. Returns A's and B's answers, the
    /// engine's handle (engine stopped) and the gate.
    async fn staged_behind_a_busy_lane() -> (Prediction, Prediction, EngineHandle, Arc<Gate>) {
        let gate = Arc::new(Gate::default());
        let lanes_gate = Arc::clone(&gate);
        let lane = move || Gated { gate: Arc::clone(&lanes_gate), threads: 1 };
        let engine =
            Engine::start(Arc::new(Factory { schema: schema(), lane: Box::new(lane) }), config(true))
                .unwrap();
        let handle = engine.handle();
        handle.wait_ready().await.unwrap();
        let send = || {
            let handle = handle.clone();
            tokio::spawn(async move { handle.predict(one_sample(), None, None).await.unwrap() })
        };
        let a = send();
        wait_until("A in its forward", || gate.threads.lock().unwrap().len() == 1).await;
        let b = send();
        wait_until("B staged", || gate.staged.load(Ordering::SeqCst) == 2).await;
        tokio::time::sleep(HELD).await;
        gate.open.store(true, Ordering::SeqCst);
        let (a, b) = (a.await.unwrap(), b.await.unwrap());
        engine.shutdown().await;
        (a, b, handle, gate)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_staged_batch_s_wait_for_its_busy_lane_is_queue_time() {
        let (_, b, handle, _) = staged_behind_a_busy_lane().await;
        // B was taken at once: nearly all of its queue time is the
        // hand-over (about HELD; half of it leaves room for a slow stage
        // thread between counting B staged and finishing its stage).
        let at_least = HELD / 2;
        assert!(
            b.queue_time >= at_least,
            "B waited {HELD:?} at the hand-over; queue time {:?}",
            b.queue_time
        );
        let text = handle.metrics_text();
        assert_eq!(metric(&text, "narsil_stage_handover_seconds_count"), 2.0, "A's and B's");
        assert!(metric(&text, "narsil_stage_handover_seconds_sum") >= at_least.as_secs_f64(), "{text}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_staged_batch_s_threads_are_chosen_when_its_lane_takes_it() {
        let (_, _, _, gate) = staged_behind_a_busy_lane().await;
        // B was taken while A's forward ran (1 thread then); at the
        // hand-over the server is otherwise idle and nothing is queued.
        assert_eq!(*gate.threads.lock().unwrap(), vec![2, 2], "threads of A's and B's forwards");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn batches_run_through_the_staged_path_are_counted() {
        let (_, _, handle, _) = staged_behind_a_busy_lane().await;
        assert_eq!(handle.stats().batches_staged, 2);
        assert_eq!(metric(&handle.metrics_text(), "narsil_batches_staged_total"), 2.0);
        // Without stage ahead the same backend's batches are not staged.
        let gate = Arc::new(Gate { open: AtomicBool::new(true), ..Default::default() });
        let lane = move || Gated { gate: Arc::clone(&gate), threads: 1 };
        let engine =
            Engine::start(Arc::new(Factory { schema: schema(), lane: Box::new(lane) }), config(false))
                .unwrap();
        let handle = engine.handle();
        handle.wait_ready().await.unwrap();
        handle.predict(one_sample(), None, None).await.unwrap();
        assert_eq!((handle.stats().forwards, handle.stats().batches_staged), (1, 0));
        engine.shutdown().await;
    }
}
