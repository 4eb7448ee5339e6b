//! Whether the cluster answers (see [the module](super), "Health"): every
//! master is pinged four times a second over a connection of its own; when
//! none has answered for [`UNREACHABLE_AFTER`] the engines serving from the
//! cluster are told, and told again at the first answer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fred::prelude::{ClientLike, ClusterInterface, Server};
use fred::types::Value;
use narsil_core::DependencyWatcher;

use super::client::{node_client, quit, Client, UNRESPONSIVE_AFTER};

/// How often the masters are pinged to tell whether the store answers.
const REACHABILITY_PING: Duration = Duration::from_millis(250);

/// How long no master may answer before the store counts as unreachable:
/// with pings every 250 ms, NOT_SERVING follows 1 to 1.5 s after the last
/// answer.
pub const UNREACHABLE_AFTER: Duration = Duration::from_secs(1);

/// Whether the cluster answers, and the engines to tell when that changes.
pub(crate) struct Reachability {
    state: Mutex<(bool, Vec<DependencyWatcher>)>,
}

impl Reachability {
    /// Answering, with no one to tell yet.
    pub(crate) fn new() -> Self {
        Self { state: Mutex::new((true, Vec::new())) }
    }

    /// Tells `watcher` whether the cluster answers now, and at each change
    /// for as long as it returns true.
    pub(crate) fn watch(&self, watcher: DependencyWatcher) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if watcher(state.0) {
            state.1.push(watcher);
        }
    }

    fn set(&self, answers: bool) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.0 != answers {
            state.0 = answers;
            state.1.retain(|watcher| watcher(answers));
        }
    }

    /// Pings every master of `cluster`'s slot map each
    /// [`REACHABILITY_PING`]; the store answers while one of them has
    /// within [`UNREACHABLE_AFTER`]. Each master is pinged over its own
    /// single-node connection, made again once it has closed: the cluster
    /// client holds commands for every node while it reconnects to a dead
    /// one, which would make one master's failover look like the whole
    /// store gone. (A connection to a stopped node stays open, so a long
    /// stop makes no new connections.) While a master does not answer, the
    /// cluster client re-reads the slot map (one read at a time), so that
    /// it follows the failover as soon as the cluster has made it, even
    /// when no command of its own failed in a way that tells it to.
    pub(crate) async fn ping_masters_forever(self: Arc<Self>, cluster: Client) {
        let mut ping = tokio::time::interval(REACHABILITY_PING);
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_answer = Instant::now();
        let mut connected: HashMap<Server, Client> = HashMap::new();
        let syncing = Arc::new(AtomicBool::new(false));
        loop {
            ping.tick().await;
            let masters =
                cluster.cached_cluster_state().map(|state| state.unique_primary_nodes()).unwrap_or_default();
            connected.retain(|server, _| masters.contains(server));
            let pings = masters.into_iter().map(|server| {
                let known = connected.get(&server).cloned();
                async move {
                    let fresh = known.is_none();
                    let client = known.unwrap_or_else(|| node_client(&server));
                    let answer = tokio::time::timeout(REACHABILITY_PING, async {
                        if fresh {
                            client.init().await?;
                        }
                        client.ping::<Value>(None).await
                    })
                    .await;
                    (server, client, matches!(answer, Ok(Ok(_))))
                }
            });
            let (mut answered, mut silent) = (false, false);
            for (server, client, ok) in futures_util::future::join_all(pings).await {
                answered |= ok;
                silent |= !ok;
                if ok || client.is_connected() {
                    connected.insert(server, client);
                } else {
                    connected.remove(&server);
                    quit(client);
                }
            }
            if answered {
                last_answer = Instant::now();
                self.set(true);
            } else if last_answer.elapsed() >= UNREACHABLE_AFTER {
                self.set(false);
            }
            if silent && !syncing.swap(true, Ordering::AcqRel) {
                let (cluster, syncing) = (cluster.clone(), syncing.clone());
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(UNRESPONSIVE_AFTER, cluster.sync_cluster()).await;
                    syncing.store(false, Ordering::Release);
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    #[test]
    fn watchers_hear_the_state_now_and_each_change_until_they_decline() {
        let reachability = Reachability::new();
        let heard = Arc::new(Mutex::new(Vec::new()));
        let calls = Arc::new(AtomicUsize::new(0));
        let (h, c) = (heard.clone(), calls.clone());
        reachability.watch(Box::new(move |answers| {
            h.lock().unwrap().push(answers);
            c.fetch_add(1, Ordering::Relaxed) < 2
        }));
        reachability.set(true);
        reachability.set(false);
        reachability.set(false);
        reachability.set(true);
        reachability.set(false);
        assert_eq!(*heard.lock().unwrap(), [true, false, true], "no repeats; nothing after it declined");
    }

    #[test]
    fn a_watcher_that_declines_at_once_is_not_kept() {
        let reachability = Reachability::new();
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        reachability.watch(Box::new(move |_| {
            c.fetch_add(1, Ordering::Relaxed);
            false
        }));
        reachability.set(false);
        assert_eq!(calls.load(Ordering::Relaxed), 1);
    }
}
