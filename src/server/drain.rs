//! The server's phases, in one place every part of it follows: serving,
//! draining (health NOT_SERVING, the repository no longer watched, the gRPC
//! listener closing after the grace period), drained (every call answered,
//! the models stopped; the admin endpoint closes last). A stop is asked for
//! by a signal, or by the one model of a `--model` server failing to load,
//! which is then the server's error.

use narsil_engine::LaneFailed;
use tokio::sync::watch;

/// Where the server is in its life.
#[derive(Debug, Clone)]
pub enum Phase {
    /// Taking calls.
    Serving,
    /// A stop was asked for (`failed`: because the model failed to load).
    Draining { failed: Option<LaneFailed> },
    /// Every call answered and every model stopped.
    Drained { failed: Option<LaneFailed> },
}

/// The phase, shared by every part of the server; cheap to clone.
#[derive(Debug, Clone)]
pub struct Drain {
    phase: watch::Sender<Phase>,
}

impl Default for Drain {
    fn default() -> Self {
        Self { phase: watch::Sender::new(Phase::Serving) }
    }
}

impl Drain {
    /// Begins draining, once: a later call changes nothing (the first
    /// reason wins).
    pub fn begin(&self, failed: Option<LaneFailed>) {
        self.phase.send_if_modified(|phase| match phase {
            Phase::Serving => {
                *phase = Phase::Draining { failed };
                true
            }
            _ => false,
        });
    }

    /// Marks the drain complete.
    pub fn finish(&self) {
        self.phase.send_modify(|phase| {
            let failed = match phase {
                Phase::Draining { failed } => failed.take(),
                _ => None,
            };
            *phase = Phase::Drained { failed };
        });
    }

    /// Resolves once draining has begun.
    pub fn draining(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        self.reached(|phase| !matches!(phase, Phase::Serving))
    }

    /// Resolves once the drain is complete.
    pub fn drained(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        self.reached(|phase| matches!(phase, Phase::Drained { .. }))
    }

    /// Whether a stop was asked for (by anything).
    pub fn is_draining(&self) -> bool {
        !matches!(*self.phase.borrow(), Phase::Serving)
    }

    /// Why the server stopped, if its model failed to load.
    pub fn failure(&self) -> Option<LaneFailed> {
        match &*self.phase.borrow() {
            Phase::Draining { failed } | Phase::Drained { failed } => failed.clone(),
            Phase::Serving => None,
        }
    }

    fn reached(&self, done: fn(&Phase) -> bool) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut phase = self.phase.subscribe();
        async move {
            // The sender lives as long as any clone of the drain; if every
            // clone is gone nothing can be waited for any more.
            let _ = phase.wait_for(done).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_first_reason_wins_and_waiters_see_each_phase() {
        let drain = Drain::default();
        let draining = tokio::spawn(drain.draining());
        let drained = tokio::spawn(drain.drained());
        assert!(!drain.is_draining());
        drain.begin(Some(LaneFailed::Stopped));
        drain.begin(None);
        draining.await.unwrap();
        assert!(matches!(drain.failure(), Some(LaneFailed::Stopped)));
        assert!(!drained.is_finished());
        drain.finish();
        drained.await.unwrap();
        assert!(matches!(drain.failure(), Some(LaneFailed::Stopped)), "kept once drained");
    }
}
