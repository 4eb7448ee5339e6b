//! Whether the backend is fit for traffic, from the outcomes of its
//! forwards: after `unhealthy_after` failed forwards in a row it is
//! unhealthy (grpc.health turns NOT_SERVING, so load balancers stop sending
//! it requests), and the next successful forward (a request's, or an idle
//! lane's probe) makes it healthy again. The lanes record a batch abandoned
//! by its callers as a failure when its time went into the forward (a
//! stalled table store), and not at all when it went into the queue
//! ([`crate::lanes`]). It is unhealthy too while what its
//! forwards need outside the process does not answer (a table store that
//! watches its cluster, [`narsil_core::BackendFactory::watch_dependencies`]):
//! that turns a replica NOT_SERVING without any traffic, and sooner than
//! failed forwards would.
//!
//! [`HealthTracker`] is the pure state; [`BackendHealth`] shares it between
//! lanes and publishes each change on a watch channel.

use std::sync::Mutex;

use tokio::sync::watch;

/// Consecutive failures and whether the dependencies answer; the verdict
/// follows from them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthTracker {
    /// Failed forwards in a row that make the backend unhealthy; 0 never does.
    unhealthy_after: u32,
    consecutive_failures: u32,
    dependencies_answer: bool,
}

impl HealthTracker {
    /// A healthy backend that turns unhealthy after `unhealthy_after`
    /// failures in a row (never with 0).
    pub fn new(unhealthy_after: u32) -> Self {
        Self { unhealthy_after, consecutive_failures: 0, dependencies_answer: true }
    }

    /// Records one forward's outcome; returns the new verdict when it changed.
    pub fn record(&mut self, succeeded: bool) -> Option<bool> {
        self.change(|t| {
            t.consecutive_failures = if succeeded { 0 } else { t.consecutive_failures.saturating_add(1) }
        })
    }

    /// Records whether the dependencies answer; returns the new verdict
    /// when it changed. Failed forwards counted meanwhile still count: once
    /// the dependencies answer again, a successful forward (an idle lane's
    /// probe) confirms the backend before it is healthy.
    pub fn set_dependencies(&mut self, answer: bool) -> Option<bool> {
        self.change(|t| t.dependencies_answer = answer)
    }

    fn change(&mut self, update: impl FnOnce(&mut Self)) -> Option<bool> {
        let was = self.is_healthy();
        update(self);
        let now = self.is_healthy();
        (now != was).then_some(now)
    }

    /// The current verdict.
    pub fn is_healthy(&self) -> bool {
        self.dependencies_answer
            && (self.unhealthy_after == 0 || self.consecutive_failures < self.unhealthy_after)
    }
}

/// The tracker shared by every lane, with its verdict published.
#[derive(Debug)]
pub struct BackendHealth {
    tracker: Mutex<HealthTracker>,
    published: watch::Sender<bool>,
}

impl BackendHealth {
    /// See [`HealthTracker::new`].
    pub fn new(unhealthy_after: u32) -> Self {
        Self { tracker: Mutex::new(HealthTracker::new(unhealthy_after)), published: watch::Sender::new(true) }
    }

    /// Records a forward's outcome; returns the new verdict when it changed
    /// (and publishes it).
    pub fn record(&self, succeeded: bool) -> Option<bool> {
        self.publish(|tracker| tracker.record(succeeded))
    }

    /// Records whether the dependencies answer; returns the new verdict
    /// when it changed (and publishes it).
    pub fn set_dependencies(&self, answer: bool) -> Option<bool> {
        self.publish(|tracker| tracker.set_dependencies(answer))
    }

    fn publish(&self, update: impl FnOnce(&mut HealthTracker) -> Option<bool>) -> Option<bool> {
        let changed = update(&mut self.tracker.lock().unwrap_or_else(|p| p.into_inner()));
        if let Some(healthy) = changed {
            self.published.send_replace(healthy);
        }
        changed
    }

    /// The current verdict.
    pub fn is_healthy(&self) -> bool {
        *self.published.borrow()
    }

    /// Follows the verdict (true: healthy).
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.published.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_unhealthy_after_n_failures_in_a_row_only() {
        let mut h = HealthTracker::new(3);
        assert_eq!(h.record(false), None);
        assert_eq!(h.record(false), None);
        assert_eq!(h.record(true), None, "a success in between starts the count again");
        assert_eq!(h.record(false), None);
        assert_eq!(h.record(false), None);
        assert_eq!(h.record(false), Some(false));
        assert!(!h.is_healthy());
        assert_eq!(h.record(false), None, "no second change while unhealthy");
    }

    #[test]
    fn one_success_makes_it_healthy_again() {
        let mut h = HealthTracker::new(1);
        assert_eq!(h.record(false), Some(false));
        assert_eq!(h.record(true), Some(true));
        assert!(h.is_healthy());
        assert_eq!(h.record(true), None);
    }

    #[test]
    fn zero_never_turns_unhealthy() {
        let mut h = HealthTracker::new(0);
        for _ in 0..100 {
            assert_eq!(h.record(false), None);
        }
        assert!(h.is_healthy());
    }

    #[test]
    fn dependencies_that_stop_answering_make_it_unhealthy_without_any_forward() {
        let mut h = HealthTracker::new(5);
        assert_eq!(h.set_dependencies(false), Some(false));
        assert_eq!(h.record(true), None, "a forward served from cached rows changes nothing");
        assert_eq!(h.set_dependencies(true), Some(true));
        // Failed forwards while they did not answer still count.
        h.set_dependencies(false);
        for _ in 0..5 {
            h.record(false);
        }
        assert_eq!(h.set_dependencies(true), None, "five failures in a row still stand");
        assert_eq!(h.record(true), Some(true), "a successful probe confirms it");
    }

    #[test]
    fn the_shared_verdict_is_published() {
        let health = BackendHealth::new(2);
        let mut seen = health.subscribe();
        health.record(false);
        assert!(!seen.has_changed().unwrap());
        assert_eq!(health.record(false), Some(false));
        assert!(seen.has_changed().unwrap());
        assert!(!*seen.borrow_and_update());
        assert!(!health.is_healthy());
        health.record(true);
        assert!(*seen.borrow_and_update());
    }
}
