//! Probes: while the shared [`BackendHealth`](crate::health::BackendHealth)
//! says unhealthy, an idle lane waits at most a probe interval for a batch,
//! then probes the backend with a one-row forward, so that a recovered
//! backend turns healthy again without traffic (which load balancers stop
//! sending once health says NOT_SERVING).

use std::time::Duration;

use narsil_core::backend::warmup_batch;
use narsil_core::ModelBackend;

use super::LaneContext;

impl LaneContext {
    /// How long an idle lane waits before probing: only while unhealthy.
    pub(super) fn idle_limit(&self) -> Option<Duration> {
        (!self.health.is_healthy()).then_some(self.probe_interval)
    }

    /// A one-row forward to see whether an unhealthy backend has recovered.
    pub(super) fn probe(&self, backend: &mut dyn ModelBackend) {
        let batch = warmup_batch(self.factory.schema(), 1);
        let succeeded =
            self.checked_forward(backend, &batch, "probe forward", |b, batch| b.forward(batch)).is_ok();
        self.stats.probe_forwards.inc();
        self.record_health(succeeded);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::Arc;

    use narsil_core::BackendError;

    use super::super::fixtures::{abandoned_error, lane, schema, Factory, Scripted};
    use super::super::LaneShared;
    use super::*;
    use crate::error::LaneFailed;

    #[test]
    fn probes_and_warm_ups_never_take_a_claim_of_abandonment_for_success() {
        // Their batches carry no deadline.
        assert_eq!(warmup_batch(&schema(), 1).deadline, None);
        let lane = lane(1);
        lane.probe(&mut Scripted([abandoned_error()].into()));
        assert!(!lane.health.is_healthy(), "an abandoned probe is a failed probe");
        lane.probe(&mut Scripted(VecDeque::new()));
        assert!(lane.health.is_healthy());
        let failing = Factory { schema: schema(), lane: Box::new(|| Scripted([abandoned_error()].into())) };
        let lane = LaneContext {
            lane: 0,
            shared: Arc::new(LaneShared {
                factory: Arc::new(failing),
                ..Arc::into_inner(lane.shared).unwrap()
            }),
        };
        let failed = lane.load_and_warm_up().err().expect("warm-up fails");
        assert!(
            matches!(failed, LaneFailed::WarmUp { error: BackendError::Abandoned { .. }, .. }),
            "{failed:?}"
        );
    }
}
