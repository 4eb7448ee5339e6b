//! The Redis client and its bridge to blocking callers: how the store's
//! cluster client and its single-node clients (the invalidation
//! subscription, health pings) are configured, closing a client without
//! waiting on its node, and running a future on the store's own runtime
//! from a lane (a plain thread) or from inside the server's async context.

use std::time::Duration;

use fred::prelude::{Builder, ClientLike, Config, ReconnectPolicy, Server, ServerConfig};
use fred::types::config::{ClusterDiscoveryPolicy, UnresponsiveConfig};
use fred::types::RespVersion;

use super::config::RedisSeeds;
use crate::stores::row_store::FetchError;

/// The Redis client: `fred`'s, chosen over `redis` 1.8 (cluster-async) by
/// `benchmarks/redis_clients.py` (the store's read pattern on a real
/// cluster): about 20% less CPU and latency per batch, and with every
/// command of a batch in flight it reads again 3.5 s after a master is
/// killed, where `redis` did not within 12 s (it did only with about 50 or
/// fewer in flight, which cost it throughput).
pub type Client = fred::clients::Client;

/// The client's error.
pub type ClientError = fred::error::Error;

/// How long a single node may take to connect, to answer a ping of the
/// invalidation subscription, or to quit.
pub(crate) const NODE_TIMEOUT: Duration = Duration::from_secs(1);

/// How long the first connection to the cluster (its slot map, then every
/// master) may take, at least.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a connection may leave a command unanswered before it is
/// closed and made again (at least the request timeout).
pub(crate) const UNRESPONSIVE_AFTER: Duration = Duration::from_secs(1);

/// A client for the cluster at `seeds` whose requests may take `timeout`,
/// each tried up to three times (a moved slot, a failed-over master),
/// reconnecting every 100 ms. Connecting to a node and reading the slot
/// map may take `timeout` too: the client reads the map from the seeds in
/// order, and with a 1 s bound a stopped seed made every read wait 1 s, so
/// that under load the client never caught up with the failover
/// (`tests/redis_store_e2e.rs`, a master SIGSTOPped). A connection with a
/// command unanswered for [`UNRESPONSIVE_AFTER`] (or `timeout`, if longer)
/// is closed and made again: a node that stopped answering without
/// closing its connections (a hung machine, a partition) would otherwise
/// hold its slots' commands after the cluster had failed over to its
/// replica, as the client learns the new slot map only on reconnecting or
/// on a redirect.
pub(crate) fn cluster_client(seeds: &RedisSeeds, timeout: Duration) -> Result<Client, FetchError> {
    let mut server = ServerConfig::new_clustered(seeds.hosts().to_vec());
    // The slot map is re-read from every node of the last map, not only
    // from the seeds: with one seed whose master died, the seeds alone
    // would never answer again.
    server
        .set_cluster_discovery_policy(ClusterDiscoveryPolicy::UseCache)
        .map_err(|e| FetchError::failed(format!("Redis Cluster {seeds}: {e}")))?;
    let config = Config { server, ..Config::default() };
    let mut builder = Builder::from_config(config);
    builder
        .with_connection_config(|c| {
            // Connecting and reading the slot map give up on a node that
            // does not answer as fast as a request would, and ask another.
            c.connection_timeout = timeout;
            c.internal_command_timeout = timeout;
            c.max_command_attempts = 3;
            c.unresponsive = UnresponsiveConfig {
                max_timeout: Some(timeout.max(UNRESPONSIVE_AFTER)),
                interval: UNRESPONSIVE_AFTER / 4,
            };
        })
        .with_performance_config(|p| p.default_command_timeout = timeout)
        .set_policy(ReconnectPolicy::new_constant(0, 100));
    builder.build().map_err(|e| FetchError::failed(format!("Redis Cluster {seeds}: {e}")))
}

/// A client for one node (the invalidation subscription, health pings):
/// RESP3 (pings and messages share a subscribed connection), no
/// reconnecting (a lost connection is noticed, and a new client made).
pub(crate) fn node_client(server: &Server) -> Client {
    let config = Config {
        server: ServerConfig::Centralized { server: server.clone() },
        version: RespVersion::RESP3,
        ..Config::default()
    };
    let mut builder = Builder::from_config(config);
    builder
        .with_connection_config(|c| c.connection_timeout = NODE_TIMEOUT)
        .with_performance_config(|p| p.broadcast_channel_capacity = 1024);
    builder.build().expect("a single-node configuration is valid")
}

/// Closes `client`'s connections without waiting on a node that may not
/// answer.
pub(crate) fn quit(client: Client) {
    tokio::spawn(async move {
        let _ = tokio::time::timeout(NODE_TIMEOUT, client.quit()).await;
    });
}

/// Runs `future` to completion on `runtime`. Lanes (plain threads) block
/// on it directly; a caller inside an async runtime (a model loaded by the
/// server) cannot, so a scoped thread blocks for it.
pub(crate) fn block_on<F: std::future::Future + Send>(
    runtime: &tokio::runtime::Runtime,
    future: F,
) -> F::Output
where
    F::Output: Send,
{
    if tokio::runtime::Handle::try_current().is_err() {
        return runtime.block_on(future);
    }
    std::thread::scope(|scope| {
        scope.spawn(|| runtime.block_on(future)).join().expect("the Redis client panicked")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_on_runs_from_a_plain_thread_and_from_inside_a_runtime() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        assert_eq!(block_on(&runtime, async { 7 }), 7);
        let outer = tokio::runtime::Builder::new_current_thread().build().unwrap();
        assert_eq!(outer.block_on(async { block_on(&runtime, async { 8 }) }), 8, "no nested-runtime panic");
    }
}
