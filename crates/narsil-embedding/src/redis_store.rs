//! The `redis` table store: a table's rows on a Redis Cluster, shared by
//! every replica that names the cluster (`narsil serve --table-store
//! redis://HOST:PORT[,HOST:PORT...]`), written there by `narsil tables
//! load`.
//!
//! Key layout: row `id` of a table is the key `{PREFIX/BUCKET}ID` (`ID` in
//! decimal) holding the row's bytes, the same layout as the table's file.
//! `PREFIX` is `narsil/MODEL/VERSION/TABLE` (the split schema's name,
//! version and table), so two model versions never read each other's rows;
//! `BUCKET` is `id % buckets`. The braces are Redis Cluster's hash tag: the
//! rows of one bucket share a hash slot, so the distinct ids of a fused
//! batch that fall in one bucket are read with one `MGET`, and a table
//! spreads over `buckets` slots (16 by default): the model's tables
//! together over every master. A batch sends tables x buckets commands at
//! most: 64 buckets took twice as long per batch as 16.
//! The key `{PREFIX/meta}rows` holds the row count, written last by a load,
//! so a store that lacks it was never fully loaded.
//!
//! A fetch looks the batch's distinct ids up in the process's hot-row cache
//! ([`crate::row_cache`]) and sends one `MGET` per table and bucket that
//! holds missed ids, every table's together over the cluster client's
//! multiplexed connections, bounded by the store's timeout and the batch's
//! deadline ([`crate::redis_rows`]). A missing row is an error unless the
//! operator chose `--missing-rows zero`.
//!
//! Online updates (`narsil tables push`): the pusher writes new rows, then
//! publishes their ids on the channel [`INVALIDATION_CHANNEL`] (Redis
//! Cluster forwards a `PUBLISH` to every node). Each process subscribes
//! through one node and removes those rows from its cache, so its next
//! batch reads them from the cluster. What a fused batch can observe: each
//! row either before or after the update (never a mix within a row); rows
//! of one batch may be from either side. The cache is used only while the
//! subscription is up (its node answers a ping every second): when it
//! drops, the cache is cleared and every row is read from the cluster until
//! the process has subscribed again, so a lost
//! invalidation can never leave an old row cached. A fetch that began
//! before an invalidation of its table does not cache what it read (the
//! table's epoch moved), so an old row cannot come back after its
//! invalidation.
//!
//! Start-up: a cluster that does not answer when a model is loaded fails
//! the load with an error naming the seeds and `--table-store` (`narsil
//! serve` exits 1): a wrong address or a store that is not up yet shows at
//! deploy time, where an orchestrator restarts the process, instead of as a
//! server that listens and answers nothing. Topology: the slot map is
//! re-read from every node of the last map as well as from the seeds, so a
//! single seed whose master died does not leave the store blind.
//!
//! Health: the process pings every master four times a second; when none
//! has answered for [`UNREACHABLE_AFTER`], every engine serving from the
//! cluster is told the store does not answer (grpc.health NOT_SERVING, with
//! or without traffic), and told again at the first answer. One master
//! down (a failover) leaves the others answering: it alone never turns a
//! replica NOT_SERVING, as every replica would turn at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use fred::prelude::{
    Builder, ClientLike, ClusterInterface, Config, EventInterface, KeysInterface, PubsubInterface,
    ReconnectPolicy, Server, ServerConfig,
};
use fred::types::config::{ClusterDiscoveryPolicy, UnresponsiveConfig};
use fred::types::{RespVersion, Value};
use narsil_core::DependencyWatcher;
use tokio::sync::broadcast::error::RecvError;

use crate::row_cache::RowCache;
use crate::schema::RedisTableSpec;
use crate::store::FetchError;

/// The Redis client: `fred`'s, chosen over `redis` 1.8 (cluster-async) by
/// `benchmarks/redis_clients.py` (the store's read pattern on a real
/// cluster): about 20% less CPU and latency per batch, and with every
/// command of a batch in flight it reads again 3.5 s after a master is
/// killed, where `redis` did not within 12 s (it did only with about 50 or
/// fewer in flight, which cost it throughput).
pub type Client = fred::clients::Client;

/// The client's error.
pub type ClientError = fred::error::Error;

/// The channel row invalidations are published on.
pub const INVALIDATION_CHANNEL: &str = "narsil:rows-updated";

/// How often the invalidation subscription is checked, and how long its
/// node may take to answer.
const SUBSCRIPTION_PING: Duration = Duration::from_secs(1);

/// How often the masters are pinged to tell whether the store answers.
const REACHABILITY_PING: Duration = Duration::from_millis(250);

/// How long no master may answer before the store counts as unreachable:
/// with pings every 250 ms, NOT_SERVING follows 1 to 1.5 s after the last
/// answer.
pub const UNREACHABLE_AFTER: Duration = Duration::from_secs(1);

/// The hot-row cache's bound unless `--table-cache-bytes` says otherwise.
pub const DEFAULT_CACHE_BYTES: u64 = 256 << 20;

/// How long a fetch (every table of one batch, retries included) may take
/// before the batch fails, unless `--table-fetch-timeout-ms` says
/// otherwise or the batch's deadline comes first: a fetch takes about a
/// millisecond, so this only bounds how long a batch waits on a node that
/// stopped answering (5 failed batches in a row turn health NOT_SERVING,
/// `--unhealthy-after-failures`).
pub const DEFAULT_FETCH_TIMEOUT: Duration = Duration::from_millis(250);

/// How long the first connection to the cluster (its slot map, then every
/// master) may take, at least.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a connection may leave a command unanswered before it is
/// closed and made again (at least the request timeout).
const UNRESPONSIVE_AFTER: Duration = Duration::from_secs(1);

/// Commands in flight at once while loading or counting a table (a
/// batch's reads are all sent at once).
const LOAD_IN_FLIGHT: usize = 32;

/// Buckets per table `narsil tables load` writes unless told otherwise.
pub const DEFAULT_BUCKETS: u32 = 16;

/// The cluster's seed nodes, as given to `--table-store`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RedisSeeds(Arc<[(String, u16)]>);

impl RedisSeeds {
    /// Parses `redis://HOST:PORT[,HOST:PORT...]` (later seeds may omit the
    /// scheme).
    pub fn parse(text: &str) -> Result<Self, String> {
        let rest =
            text.strip_prefix("redis://").ok_or_else(|| format!("`{text}` does not start with redis://"))?;
        let seeds: Vec<(String, u16)> = rest
            .split(',')
            .map(|seed| seed.trim().trim_start_matches("redis://").trim_end_matches('/'))
            .map(|seed| {
                let (host, port) =
                    seed.rsplit_once(':').ok_or_else(|| format!("seed `{seed}` has no :PORT"))?;
                match port.parse::<u16>() {
                    Ok(port) if !host.is_empty() => Ok((host.to_string(), port)),
                    _ => Err(format!("seed `{seed}` is not HOST:PORT")),
                }
            })
            .collect::<Result<_, _>>()?;
        Ok(Self(seeds.into()))
    }

    /// The seeds as (host, port).
    pub fn hosts(&self) -> &[(String, u16)] {
        &self.0
    }
}

impl std::fmt::Display for RedisSeeds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hosts: Vec<String> = self.0.iter().map(|(host, port)| format!("{host}:{port}")).collect();
        write!(f, "redis://{}", hosts.join(","))
    }
}

/// What a fetch does with a row the cluster does not hold (a table loaded
/// partly, or a key removed by hand).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum MissingRows {
    /// The batch fails (its requests get UNAVAILABLE): no score is ever
    /// computed from a row that is not there.
    #[default]
    Error,
    /// The row pools as zeros (every value 0, as a freshly initialised
    /// row), counted by `narsil_table_missing_rows_total`.
    Zero,
}

impl std::str::FromStr for MissingRows {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "error" => Ok(Self::Error),
            "zero" => Ok(Self::Zero),
            _ => Err(format!("`{text}` is not a missing-rows policy: use `error` or `zero`")),
        }
    }
}

impl std::fmt::Display for MissingRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Error => "error",
            Self::Zero => "zero",
        })
    }
}

/// The `redis` store as `--table-store`, `--table-cache-bytes`,
/// `--table-fetch-timeout-ms` and `--missing-rows` chose it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RedisStoreConfig {
    /// The cluster's seed nodes.
    pub seeds: RedisSeeds,
    /// The hot-row cache's bound (0: no cache).
    pub cache_bytes: u64,
    /// The longest a batch's fetch may take when its callers' deadlines
    /// allow more (or some caller set none).
    pub fetch_timeout: Duration,
    /// What a row the cluster lacks becomes.
    pub missing_rows: MissingRows,
}

impl RedisStoreConfig {
    /// The cluster at `seeds` with the default cache, timeout and policy.
    pub fn new(seeds: RedisSeeds) -> Self {
        Self {
            seeds,
            cache_bytes: DEFAULT_CACHE_BYTES,
            fetch_timeout: DEFAULT_FETCH_TIMEOUT,
            missing_rows: MissingRows::Error,
        }
    }
}

impl std::fmt::Display for RedisStoreConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (cache {} MiB, fetch timeout {:?}, missing rows: {})",
            self.seeds,
            self.cache_bytes >> 20,
            self.fetch_timeout,
            self.missing_rows
        )
    }
}

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

    /// Applies one published message: `PREFIX\n` then ids as little-endian
    /// u64s.
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
    async fn subscribe_forever(self: Arc<Self>, seeds: RedisSeeds) {
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

/// A client for one node (the invalidation subscription, health pings):
/// RESP3 (pings and messages share a subscribed connection), no
/// reconnecting (a lost connection is noticed, and a new client made).
fn node_client(server: &Server) -> Client {
    let config = Config {
        server: ServerConfig::Centralized { server: server.clone() },
        version: RespVersion::RESP3,
        ..Config::default()
    };
    let mut builder = Builder::from_config(config);
    builder
        .with_connection_config(|c| c.connection_timeout = SUBSCRIPTION_PING)
        .with_performance_config(|p| p.broadcast_channel_capacity = 1024);
    builder.build().expect("a single-node configuration is valid")
}

async fn subscribe(client: &Client) -> Result<(), ClientError> {
    client.init().await?;
    client.subscribe(INVALIDATION_CHANNEL).await
}

/// Closes `client`'s connections without waiting on a node that may not
/// answer.
fn quit(client: Client) {
    tokio::spawn(async move {
        let _ = tokio::time::timeout(SUBSCRIPTION_PING, client.quit()).await;
    });
}

/// Whether the cluster answers, and the engines to tell when that changes.
struct Reachability {
    state: Mutex<(bool, Vec<DependencyWatcher>)>,
}

impl Reachability {
    fn new() -> Self {
        Self { state: Mutex::new((true, Vec::new())) }
    }

    fn watch(&self, watcher: DependencyWatcher) {
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
    async fn ping_masters_forever(self: Arc<Self>, cluster: Client) {
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
            cluster.invalidation = Arc::new(Invalidation {
                cache: Some(RowCache::new(config.cache_bytes, 80)),
                subscribed: AtomicBool::new(false),
                tables: Mutex::default(),
            });
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
            .map_err(|e| FetchError(format!("cannot start the Redis client's runtime: {e}")))?;
        let connect_timeout = timeout.max(CONNECT_TIMEOUT);
        let connected =
            block_on(&runtime, async { tokio::time::timeout(connect_timeout, client.init()).await })
                .map_err(|_| {
                    FetchError(format!(
                        "Redis Cluster {seeds} (--table-store): no answer within {connect_timeout:?}"
                    ))
                })
                .and_then(|answer| {
                    answer.map_err(|e| {
                        FetchError(format!("Redis Cluster {seeds} (--table-store): cannot connect: {e}"))
                    })
                });
        if let Err(error) = connected {
            // Not waited for: a model is loaded inside the server's async
            // context, where waiting for a runtime to stop panics.
            runtime.shutdown_background();
            return Err(error);
        }
        let invalidation = Arc::new(Invalidation {
            cache: None,
            subscribed: AtomicBool::new(false),
            tables: Mutex::default(),
        });
        Ok(Self {
            runtime: Some(runtime),
            client,
            timeout,
            seeds: seeds.clone(),
            invalidation,
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
        self.invalidation.cache.as_ref().map(RowCache::bytes)
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
            return Err(FetchError(format!("Redis Cluster {seeds}: {what}: every caller's deadline passed")));
        }
        match block_on(self.runtime(), async { tokio::time::timeout(timeout, work).await }) {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(FetchError(format!("Redis Cluster {seeds}: {what}: {e}"))),
            Err(_) if timeout < self.timeout => Err(FetchError(format!(
                "Redis Cluster {seeds}: {what}: no answer within {timeout:?}, when every caller's deadline passed"
            ))),
            Err(_) => Err(FetchError(format!("Redis Cluster {seeds}: {what}: no answer within {timeout:?}"))),
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
fn cluster_client(seeds: &RedisSeeds, timeout: Duration) -> Result<Client, FetchError> {
    let mut server = ServerConfig::new_clustered(seeds.hosts().to_vec());
    // The slot map is re-read from every node of the last map, not only
    // from the seeds: with one seed whose master died, the seeds alone
    // would never answer again.
    server
        .set_cluster_discovery_policy(ClusterDiscoveryPolicy::UseCache)
        .map_err(|e| FetchError(format!("Redis Cluster {seeds}: {e}")))?;
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
    builder.build().map_err(|e| FetchError(format!("Redis Cluster {seeds}: {e}")))
}

/// Runs `future` to completion on `runtime`. Lanes (plain threads) block
/// on it directly; a caller inside an async runtime (a model loaded by the
/// server) cannot, so a scoped thread blocks for it.
fn block_on<F: std::future::Future + Send>(runtime: &tokio::runtime::Runtime, future: F) -> F::Output
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

/// The key of row `id` of the table `spec` describes.
pub fn row_key(spec: &RedisTableSpec, id: u64) -> String {
    format!("{{{}/{}}}{id}", spec.prefix, spec.bucket(id))
}

/// The key that holds the table's row count once it is loaded.
pub fn rows_key(spec: &RedisTableSpec) -> String {
    format!("{{{}/meta}}rows", spec.prefix)
}

/// What loading a table wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loaded {
    /// Rows written.
    pub rows: u64,
    /// Bytes of row values written.
    pub bytes: u64,
}

/// Rows per `MSET` when loading.
const LOAD_CHUNK_ROWS: usize = 512;

/// Writes every row of a table (`rows`: its file's bytes, `row_bytes`
/// each) under `spec`, calling `progress` with the rows written so far,
/// then checks that every row's key exists and writes the row count (the
/// mark of a complete load). Writing again writes the same keys: a load
/// can be repeated or resumed by running it again.
pub fn load_table(
    cluster: &RedisCluster,
    spec: &RedisTableSpec,
    rows: &[u8],
    row_bytes: usize,
    mut progress: impl FnMut(u64),
) -> Result<Loaded, FetchError> {
    let count = (rows.len() / row_bytes) as u64;
    let chunks = bucket_chunks(spec, count, LOAD_CHUNK_ROWS);
    let mut written = 0u64;
    for group in chunks.chunks(LOAD_IN_FLIGHT) {
        write_rows(cluster, spec, rows, row_bytes, group.iter().map(Vec::as_slice))?;
        written += group.iter().map(|ids| ids.len() as u64).sum::<u64>();
        progress(written);
    }
    let present = count_present(cluster, spec, count)?;
    if present != count {
        return Err(FetchError(format!("{}: {present} of {count} rows present after writing", spec.prefix)));
    }
    let client = cluster.client();
    cluster.run("writing the row count", client.set::<(), _, _>(rows_key(spec), count, None, None, false))?;
    Ok(Loaded { rows: count, bytes: count * row_bytes as u64 })
}

/// The ids `0..count` of a table under `spec`, bucket by bucket (one hash
/// slot each: ids b, b + buckets, ...), in chunks of at most `chunk`.
fn bucket_chunks(spec: &RedisTableSpec, count: u64, chunk: usize) -> Vec<Vec<u64>> {
    let buckets = u64::from(spec.buckets);
    let mut chunks = Vec::new();
    for bucket in 0..buckets.min(count) {
        let ids: Vec<u64> = (bucket..count).step_by(buckets as usize).collect();
        chunks.extend(ids.chunks(chunk).map(<[u64]>::to_vec));
    }
    chunks
}

/// Writes the rows of each group of `ids` (each group within one bucket)
/// with one `MSET` per group.
fn write_rows<'a>(
    cluster: &RedisCluster,
    spec: &RedisTableSpec,
    rows: &[u8],
    row_bytes: usize,
    groups: impl Iterator<Item = &'a [u64]>,
) -> Result<(), FetchError> {
    let client = cluster.client();
    let commands = groups.map(|ids| {
        let pairs: Vec<(String, Value)> = ids
            .iter()
            .map(|&id| {
                let start = id as usize * row_bytes;
                (row_key(spec, id), Value::Bytes(rows[start..start + row_bytes].to_vec().into()))
            })
            .collect();
        client.mset(pairs)
    });
    cluster.run_all("writing rows", None, commands).map(drop)
}

/// Writes the rows `ids` of a table (`rows`: every row of its new
/// version, `row_bytes` each) under `spec`, then publishes their ids so
/// that every serving process drops its cached copies.
pub fn push_rows(
    cluster: &RedisCluster,
    spec: &RedisTableSpec,
    rows: &[u8],
    row_bytes: usize,
    ids: &[u64],
) -> Result<(), FetchError> {
    let mut by_bucket: HashMap<u64, Vec<u64>> = HashMap::new();
    for &id in ids {
        by_bucket.entry(spec.bucket(id)).or_default().push(id);
    }
    write_rows(cluster, spec, rows, row_bytes, by_bucket.values().map(Vec::as_slice))?;
    let mut message = Vec::with_capacity(spec.prefix.len() + 1 + ids.len() * 8);
    message.extend_from_slice(spec.prefix.as_bytes());
    message.push(b'\n');
    for &id in ids {
        message.extend_from_slice(&id.to_le_bytes());
    }
    let publish = cluster.client().publish::<(), _, _>(INVALIDATION_CHANNEL, Value::Bytes(message.into()));
    cluster.run("publishing the updated ids", publish)
}

/// How many of the rows `0..count` have a key under `spec` (`EXISTS` over
/// each bucket's keys).
pub fn count_present(cluster: &RedisCluster, spec: &RedisTableSpec, count: u64) -> Result<u64, FetchError> {
    let chunks = bucket_chunks(spec, count, LOAD_CHUNK_ROWS * 4);
    let client = cluster.client();
    let mut present = 0;
    for group in chunks.chunks(LOAD_IN_FLIGHT) {
        let commands = group.iter().map(|chunk| {
            client.exists::<u64, _>(chunk.iter().map(|&id| row_key(spec, id)).collect::<Vec<_>>())
        });
        let counts = cluster.run_all("counting rows", None, commands)?;
        present += counts.iter().sum::<u64>();
    }
    Ok(present)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_parse_from_the_flag_and_print_back() {
        let seeds = RedisSeeds::parse("redis://127.0.0.1:7000,127.0.0.1:7001").unwrap();
        assert_eq!(seeds.hosts(), [("127.0.0.1".to_string(), 7000), ("127.0.0.1".to_string(), 7001)]);
        assert_eq!(seeds.to_string(), "redis://127.0.0.1:7000,127.0.0.1:7001");
        assert!(RedisSeeds::parse("127.0.0.1:7000").unwrap_err().contains("redis://"));
        assert!(RedisSeeds::parse("redis://127.0.0.1").unwrap_err().contains("no :PORT"));
        assert!(RedisSeeds::parse("redis://h:x").unwrap_err().contains("not HOST:PORT"));
    }

    #[test]
    fn watchers_hear_the_state_now_and_each_change_until_they_decline() {
        use std::sync::atomic::AtomicUsize;
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
    fn rows_of_one_bucket_share_a_hash_tag() {
        let spec = RedisTableSpec { prefix: "narsil/dlrm/1/t_cat_0".into(), buckets: 64 };
        assert_eq!(row_key(&spec, 130), "{narsil/dlrm/1/t_cat_0/2}130");
        assert_eq!(row_key(&spec, 2), "{narsil/dlrm/1/t_cat_0/2}2");
        assert_eq!(rows_key(&spec), "{narsil/dlrm/1/t_cat_0/meta}rows");
    }
}
