//! [`RedisCluster`]: the process's connection to one Redis Cluster, shared
//! by every table and lane that reads it, on a small runtime of its own,
//! with its hot-row cache, invalidation subscriber and health pings; and
//! running commands against it from blocking callers, bounded by the
//! store's timeout and the batch's deadline.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use fred::prelude::ClientLike;
use narsil_core::DependencyWatcher;

use super::client::{block_on, cluster_client, Client, ClientError, CONNECT_TIMEOUT};
use super::config::{RedisSeeds, RedisStoreConfig};
use super::invalidation::Invalidation;
use super::reachability::Reachability;
use crate::stores::row_cache::RowCache;
use crate::stores::row_store::{FetchError, MissingRows};

/// A connection to one Redis Cluster, shared by every table and lane of
/// the process that uses it, with the process's hot-row cache. It runs its
/// own small runtime: lanes are plain threads and block on their fetches.
pub struct RedisCluster {
    /// Taken only by `drop`.
    runtime: Option<tokio::runtime::Runtime>,
    client: Client,
    timeout: Duration,
    seeds: RedisSeeds,
    pub(crate) invalidation: Arc<Invalidation>,
    pub(crate) missing_rows: MissingRows,
    reachability: Arc<Reachability>,
}

/// Clusters some live table uses, by configuration.
static LIVE: Mutex<Option<HashMap<RedisStoreConfig, Weak<RedisCluster>>>> = Mutex::new(None);

impl RedisCluster {
    /// The process's connection to the cluster `config` names, opened now
    /// (with its cache and invalidation subscriber) if no live table holds
    /// one.
    pub fn shared(config: &RedisStoreConfig) -> Result<Arc<Self>, FetchError> {
        let mut guard = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        let live = guard.get_or_insert_with(HashMap::new);
        live.retain(|_, cluster| cluster.strong_count() > 0);
        if let Some(cluster) = live.get(config).and_then(Weak::upgrade) {
            return Ok(cluster);
        }
        let mut cluster = Self::connect(&config.seeds, config.fetch_timeout)?;
        cluster.missing_rows = config.missing_rows;
        if config.cache_bytes > 0 {
            cluster.invalidation = Arc::new(Invalidation::new(Some(RowCache::new(config.cache_bytes))));
            let subscriber = cluster.invalidation.clone().subscribe_forever(config.seeds.clone());
            cluster.runtime().spawn(subscriber);
        }
        let pinger = cluster.reachability.clone().ping_masters_forever(cluster.client.clone());
        cluster.runtime().spawn(pinger);
        let cluster = Arc::new(cluster);
        live.insert(config.clone(), Arc::downgrade(&cluster));
        Ok(cluster)
    }

    /// A new connection to the cluster at `seeds`, without a cache; each
    /// request may take `timeout`.
    pub fn connect(seeds: &RedisSeeds, timeout: Duration) -> Result<Self, FetchError> {
        let client = cluster_client(seeds, timeout)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("narsil-redis")
            .enable_all()
            .build()
            .map_err(|e| FetchError::failed(format!("cannot start the Redis client's runtime: {e}")))?;
        let connect_timeout = timeout.max(CONNECT_TIMEOUT);
        let connected =
            block_on(&runtime, async { tokio::time::timeout(connect_timeout, client.init()).await })
                .map_err(|_| {
                    FetchError::failed(format!(
                        "Redis Cluster {seeds} (--table-store): no answer within {connect_timeout:?}"
                    ))
                })
                .and_then(|answer| {
                    answer.map_err(|e| {
                        FetchError::failed(format!(
                            "Redis Cluster {seeds} (--table-store): cannot connect: {e}"
                        ))
                    })
                });
        if let Err(error) = connected {
            // Not waited for: a model is loaded inside the server's async
            // context, where waiting for a runtime to stop panics.
            runtime.shutdown_background();
            return Err(error);
        }
        Ok(Self {
            runtime: Some(runtime),
            client,
            timeout,
            seeds: seeds.clone(),
            invalidation: Arc::new(Invalidation::new(None)),
            missing_rows: MissingRows::Error,
            reachability: Arc::new(Reachability::new()),
        })
    }

    /// Tells `watcher` whether the cluster answers, now and at each change
    /// (for a cluster opened with [`RedisCluster::shared`]; one from
    /// [`RedisCluster::connect`] is not watched and always says it does).
    pub fn watch_reachability(&self, watcher: DependencyWatcher) {
        self.reachability.watch(watcher);
    }

    fn runtime(&self) -> &tokio::runtime::Runtime {
        self.runtime.as_ref().expect("the runtime lives until drop")
    }

    /// Whether the hot-row cache is in use now (configured, and
    /// invalidations arriving).
    pub fn caching(&self) -> bool {
        self.invalidation.cache().is_some()
    }

    /// The hot-row cache's bytes now, if there is one.
    pub fn cache_bytes(&self) -> Option<u64> {
        self.invalidation.cache_bytes()
    }

    /// The seeds it was opened with.
    pub fn seeds(&self) -> &RedisSeeds {
        &self.seeds
    }

    /// The client, for commands to give [`Self::run`].
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Runs `work` (commands of [`Self::client`]) against the cluster,
    /// bounded by the timeout, blocking the calling thread.
    pub fn run<T: Send>(
        &self,
        what: &str,
        work: impl std::future::Future<Output = Result<T, ClientError>> + Send,
    ) -> Result<T, FetchError> {
        self.run_until(what, None, work)
    }

    /// [`Self::run`], given up at `deadline` too if that comes before the
    /// timeout (retries included: they happen inside `work`).
    pub fn run_until<T: Send>(
        &self,
        what: &str,
        deadline: Option<Instant>,
        work: impl std::future::Future<Output = Result<T, ClientError>> + Send,
    ) -> Result<T, FetchError> {
        let seeds = &self.seeds;
        let timeout =
            deadline.map_or(self.timeout, |d| self.timeout.min(d.saturating_duration_since(Instant::now())));
        if timeout.is_zero() {
            return Err(FetchError::abandoned(format!(
                "Redis Cluster {seeds}: {what}: every caller's deadline passed"
            )));
        }
        match block_on(self.runtime(), async { tokio::time::timeout(timeout, work).await }) {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(FetchError::failed(format!("Redis Cluster {seeds}: {what}: {e}"))),
            Err(_) if timeout < self.timeout => Err(FetchError::abandoned(format!(
                "Redis Cluster {seeds}: {what}: no answer within {timeout:?}, when every caller's deadline passed"
            ))),
            Err(_) => Err(FetchError::failed(format!("Redis Cluster {seeds}: {what}: no answer within {timeout:?}"))),
        }
    }

    /// Runs every command of `commands` at once (the client pipelines
    /// those bound for one node over its connection, nodes in parallel),
    /// all within one [`Self::run_until`] bound; their replies in order.
    pub fn run_all<T: Send, F>(
        &self,
        what: &str,
        deadline: Option<Instant>,
        commands: impl IntoIterator<Item = F>,
    ) -> Result<Vec<T>, FetchError>
    where
        F: std::future::Future<Output = Result<T, ClientError>> + Send,
    {
        self.run_until(what, deadline, futures_util::future::try_join_all(commands))
    }
}

impl Drop for RedisCluster {
    /// Stops the client's runtime without waiting for it: the last model
    /// version that used the cluster may be dropped inside an async
    /// context, where waiting would panic.
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}
