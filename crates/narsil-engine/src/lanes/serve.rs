//! The plain serving loop: a lane takes the collector's next due batch and
//! runs it whole (stage and forward on the lane), probing while idle.

use std::time::{Duration, Instant};

use narsil_core::ModelBackend;

use super::LaneContext;
use crate::collector::{Due, NextJob};
use crate::job::Job;

impl LaneContext {
    /// Takes batches from the collector and runs each whole.
    pub(super) fn serve(&self, backend: &mut dyn ModelBackend) {
        let mut finished_job = false;
        loop {
            let next = self.collector.next_job(self.idle_limit(), finished_job);
            finished_job = matches!(next, NextJob::Job(_));
            match next {
                NextJob::Job(due) => {
                    let (job, taken) = self.take(due);
                    self.run_job(backend, job, taken, Duration::ZERO, None);
                }
                NextJob::Idle => self.probe(backend),
                NextJob::Closed => return,
            }
        }
    }

    /// The job of a batch just taken from the collector, and when it was
    /// taken: the end of its requests' queue time.
    pub(super) fn take(&self, due: Due) -> (Job, Instant) {
        let taken = Instant::now();
        let job = due.into_job();
        for waiter in &job.waiters {
            self.stats.queue_seconds.observe(taken.saturating_duration_since(waiter.admitted).as_secs_f64());
        }
        (job, taken)
    }
}
