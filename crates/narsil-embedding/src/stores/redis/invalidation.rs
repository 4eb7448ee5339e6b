//! Keeping the hot-row cache true to the cluster (see [the
//! module](super), "Online updates"): the process subscribes to
//! [`INVALIDATION_CHANNEL`] through one seed after another, removes the
//! rows each message names from the cache and moves their table's epoch,
//! and while it is not subscribed the cache is empty and unused.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use fred::prelude::{ClientLike, EventInterface, PubsubInterface, Server};
use fred::types::Value;
use tokio::sync::broadcast::error::RecvError;

use super::client::{node_client, quit, Client, ClientError, NODE_TIMEOUT};
use super::config::RedisSeeds;
use crate::stores::row_cache::RowCache;

/// The channel row invalidations are published on.
pub const INVALIDATION_CHANNEL: &str = "narsil:rows-updated";

/// How often the invalidation subscription is checked, and how long its
/// node may take to answer.
const SUBSCRIPTION_PING: Duration = NODE_TIMEOUT;

/// What the subscriber and the tables share: the cache, each table's
/// epoch, and whether invalidations are arriving.
pub(crate) struct Invalidation {
    cache: Option<RowCache>,
    subscribed: AtomicBool,
    tables: Mutex<HashMap<String, Weak<TableState>>>,
}

/// A table's number in the cache and its invalidation epoch.
pub(crate) struct TableState {
    pub(crate) number: u32,
    pub(crate) epoch: AtomicU64,
}

static NEXT_TABLE: AtomicU32 = AtomicU32::new(0);

impl Invalidation {
    /// Invalidation state around `cache` (none: every row is read from
    /// the cluster), not subscribed yet.
    pub(crate) fn new(cache: Option<RowCache>) -> Self {
        Self { cache, subscribed: AtomicBool::new(false), tables: Mutex::default() }
    }

    /// The state of the table stored under `prefix`, shared by every
    /// version and lane that reads it.
    pub(crate) fn table(&self, prefix: &str) -> Arc<TableState> {
        let mut tables = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        tables.retain(|_, state| state.strong_count() > 0);
        if let Some(state) = tables.get(prefix).and_then(Weak::upgrade) {
            return state;
        }
        let number = NEXT_TABLE.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(TableState { number, epoch: AtomicU64::new(0) });
        tables.insert(prefix.to_string(), Arc::downgrade(&state));
        state
    }

    /// The cache, while invalidations are arriving.
    pub(crate) fn cache(&self) -> Option<&RowCache> {
        self.cache.as_ref().filter(|_| self.subscribed.load(Ordering::Acquire))
    }

    /// The cache's bytes now, if there is one (whether in use or not).
    pub(crate) fn cache_bytes(&self) -> Option<u64> {
        self.cache.as_ref().map(RowCache::bytes)
    }

    /// Forgets every cached row, for when invalidations may have been
    /// missed: fetches under way when this happens do not cache what they
    /// read (every table's epoch moves).
    fn forget_all(&self) {
        let tables = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        for state in tables.values().filter_map(Weak::upgrade) {
            state.epoch.fetch_add(1, Ordering::AcqRel);
        }
        if let Some(cache) = &self.cache {
            cache.clear();
        }
    }

    /// Applies one published message ([`invalidation_message`]).
    fn apply(&self, payload: &[u8]) {
        let Some(newline) = payload.iter().position(|&b| b == b'\n') else { return };
        let prefix = String::from_utf8_lossy(&payload[..newline]);
        let state =
            self.tables.lock().unwrap_or_else(|e| e.into_inner()).get(&*prefix).and_then(Weak::upgrade);
        let (Some(state), Some(cache)) = (state, &self.cache) else { return };
        state.epoch.fetch_add(1, Ordering::AcqRel);
        for id in payload[newline + 1..].chunks_exact(8) {
            cache.remove(state.number, u64::from_le_bytes(id.try_into().expect("8 bytes")));
        }
    }

    /// Subscribes through one seed after another for as long as the
    /// process holds the cluster; while not subscribed the cache is empty
    /// and unused.
    pub(crate) async fn subscribe_forever(self: Arc<Self>, seeds: RedisSeeds) {
        loop {
            for (host, port) in seeds.hosts() {
                let client = node_client(&Server::new(host.as_str(), *port));
                let mut messages = client.message_rx();
                if !matches!(tokio::time::timeout(SUBSCRIPTION_PING, subscribe(&client)).await, Ok(Ok(()))) {
                    quit(client);
                    continue;
                }
                self.subscribed.store(true, Ordering::Release);
                // A node that stops answering keeps its connection open: a
                // ping every second that goes unanswered ends the
                // subscription too, as does a message missed (lagged).
                let mut ping = tokio::time::interval(SUBSCRIPTION_PING);
                loop {
                    tokio::select! {
                        message = messages.recv() => match message {
                            Ok(message) => {
                                if let Some(payload) = message.value.as_bytes() {
                                    self.apply(payload);
                                }
                            }
                            Err(RecvError::Lagged(_) | RecvError::Closed) => break,
                        },
                        _ = ping.tick() => {
                            let answered = tokio::time::timeout(SUBSCRIPTION_PING, client.ping::<Value>(None)).await;
                            if !matches!(answered, Ok(Ok(_))) {
                                break;
                            }
                        }
                    }
                }
                self.subscribed.store(false, Ordering::Release);
                self.forget_all();
                quit(client);
                tracing::warn!(node = %format!("{host}:{port}"), "lost the row-invalidation subscription; reading every row from the cluster until it is back");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The message that invalidates rows `ids` of the table stored under
/// `prefix` (what `narsil tables push` publishes): `PREFIX\n`, then each id
/// as a little-endian u64.
pub fn invalidation_message(prefix: &str, ids: &[u64]) -> Vec<u8> {
    let mut message = Vec::with_capacity(prefix.len() + 1 + ids.len() * 8);
    message.extend_from_slice(prefix.as_bytes());
    message.push(b'\n');
    for &id in ids {
        message.extend_from_slice(&id.to_le_bytes());
    }
    message
}

async fn subscribe(client: &Client) -> Result<(), ClientError> {
    client.init().await?;
    client.subscribe(INVALIDATION_CHANNEL).await
}

#[cfg(test)]
mod tests {
    use super::*;

    use invalidation_message as message;

    #[test]
    fn a_message_names_the_table_then_each_id_in_eight_little_endian_bytes() {
        let message = message("narsil/m/1/t", &[1, 0x0102]);
        assert_eq!(&message[..13], b"narsil/m/1/t\n");
        assert_eq!(&message[13..], [[1, 0, 0, 0, 0, 0, 0, 0], [2, 1, 0, 0, 0, 0, 0, 0]].concat());
    }

    #[test]
    fn a_message_removes_its_rows_and_moves_its_table_s_epoch_only() {
        let invalidation = Invalidation::new(Some(RowCache::new(1 << 20)));
        invalidation.subscribed.store(true, Ordering::Release);
        let (a, b) = (invalidation.table("narsil/m/1/a"), invalidation.table("narsil/m/1/b"));
        let cache = invalidation.cache().unwrap();
        for id in 0..4 {
            cache.insert(a.number, id, &[1; 8]);
            cache.insert(b.number, id, &[2; 8]);
        }
        invalidation.apply(&message("narsil/m/1/a", &[1, 3]));
        let cached =
            |table: &TableState| (0..4).filter(|&id| cache.get_into(table.number, id, &mut [0; 8])).count();
        assert_eq!((cached(&a), cached(&b)), (2, 4));
        assert_eq!((a.epoch.load(Ordering::Acquire), b.epoch.load(Ordering::Acquire)), (1, 0));
        invalidation.apply(b"no newline");
        invalidation.apply(&message("narsil/m/1/unknown", &[0]));
        assert_eq!((cached(&a), cached(&b)), (2, 4), "a malformed or foreign message changes nothing");
    }

    #[test]
    fn the_cache_is_used_only_while_subscribed_and_emptied_when_the_subscription_drops() {
        let invalidation = Invalidation::new(Some(RowCache::new(1 << 20)));
        let table = invalidation.table("t");
        assert!(invalidation.cache().is_none(), "not subscribed yet");
        invalidation.subscribed.store(true, Ordering::Release);
        invalidation.cache().unwrap().insert(table.number, 5, &[9; 8]);
        invalidation.forget_all();
        assert_eq!(invalidation.cache_bytes(), Some(0));
        assert_eq!(table.epoch.load(Ordering::Acquire), 1, "fetches under way do not cache what they read");
        assert!(Invalidation::new(None).cache_bytes().is_none());
    }

    #[test]
    fn versions_reading_one_table_share_its_state_while_one_holds_it() {
        let invalidation = Invalidation::new(None);
        let first = invalidation.table("t");
        assert!(Arc::ptr_eq(&first, &invalidation.table("t")));
        let number = first.number;
        drop(first);
        assert_ne!(invalidation.table("t").number, number, "a table no one holds starts afresh");
    }
}
