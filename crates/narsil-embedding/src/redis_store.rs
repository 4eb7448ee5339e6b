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
//! spreads over `buckets` slots (64 by default), hence over every master.
//! The key `{PREFIX/meta}rows` holds the row count, written last by a load,
//! so a store that lacks it was never fully loaded.
//!
//! A fetch sends one `MGET` per bucket that holds ids of the batch, all at
//! once over the cluster client's multiplexed connections (the client
//! pipelines the commands bound for one node), and waits for them together,
//! bounded by the store's timeout. A missing row is an error, never a zero.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::future::try_join_all;
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;

use crate::schema::RedisTableSpec;
use crate::store::{FetchError, RowStore};

/// How long a fetch (every bucket of one table for one batch) may take
/// before the batch fails.
pub const DEFAULT_FETCH_TIMEOUT: Duration = Duration::from_secs(1);

/// Buckets per table `narsil tables load` writes unless told otherwise.
pub const DEFAULT_BUCKETS: u32 = 64;

/// The cluster's seed nodes, as given to `--table-store`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RedisSeeds(Arc<[String]>);

impl RedisSeeds {
    /// Parses `redis://HOST:PORT[,HOST:PORT...]` (later seeds may omit the
    /// scheme).
    pub fn parse(text: &str) -> Result<Self, String> {
        let rest =
            text.strip_prefix("redis://").ok_or_else(|| format!("`{text}` does not start with redis://"))?;
        let seeds: Vec<String> = rest
            .split(',')
            .map(|seed| seed.trim().trim_start_matches("redis://").trim_end_matches('/'))
            .map(|seed| {
                let (host, port) =
                    seed.rsplit_once(':').ok_or_else(|| format!("seed `{seed}` has no :PORT"))?;
                if host.is_empty() || port.parse::<u16>().is_err() {
                    return Err(format!("seed `{seed}` is not HOST:PORT"));
                }
                Ok(format!("redis://{seed}"))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self(seeds.into()))
    }

    /// The seed URLs.
    pub fn urls(&self) -> &[String] {
        &self.0
    }
}

impl std::fmt::Display for RedisSeeds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hosts: Vec<&str> = self.0.iter().map(|url| url.trim_start_matches("redis://")).collect();
        write!(f, "redis://{}", hosts.join(","))
    }
}

/// A connection to one Redis Cluster, shared by every table and lane of
/// the process that uses it. It runs its own small runtime: lanes are
/// plain threads and block on their fetches.
pub struct RedisCluster {
    runtime: tokio::runtime::Runtime,
    connection: ClusterConnection,
    timeout: Duration,
    seeds: RedisSeeds,
}

/// Clusters some live table uses, by seeds.
static LIVE: Mutex<Option<HashMap<RedisSeeds, Weak<RedisCluster>>>> = Mutex::new(None);

impl RedisCluster {
    /// The process's connection to the cluster at `seeds`, opened now if
    /// no live table holds one.
    pub fn shared(seeds: &RedisSeeds) -> Result<Arc<Self>, FetchError> {
        let mut guard = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        let live = guard.get_or_insert_with(HashMap::new);
        live.retain(|_, cluster| cluster.strong_count() > 0);
        if let Some(cluster) = live.get(seeds).and_then(Weak::upgrade) {
            return Ok(cluster);
        }
        let cluster = Arc::new(Self::connect(seeds, DEFAULT_FETCH_TIMEOUT)?);
        live.insert(seeds.clone(), Arc::downgrade(&cluster));
        Ok(cluster)
    }

    /// A new connection to the cluster at `seeds`; each request may take
    /// `timeout`.
    pub fn connect(seeds: &RedisSeeds, timeout: Duration) -> Result<Self, FetchError> {
        let error =
            |what: &str, e: redis::RedisError| FetchError(format!("Redis Cluster {seeds}: {what}: {e}"));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("narsil-redis")
            .enable_all()
            .build()
            .map_err(|e| FetchError(format!("cannot start the Redis client's runtime: {e}")))?;
        let client = ClusterClientBuilder::new(seeds.urls().to_vec())
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .retries(2)
            .build()
            .map_err(|e| error("bad seeds", e))?;
        let connection =
            block_on(&runtime, async { tokio::time::timeout(timeout, client.get_async_connection()).await })
                .map_err(|_| FetchError(format!("Redis Cluster {seeds}: no answer within {timeout:?}")))?
                .map_err(|e| error("cannot connect", e))?;
        Ok(Self { runtime, connection, timeout, seeds: seeds.clone() })
    }

    /// The seeds it was opened with.
    pub fn seeds(&self) -> &RedisSeeds {
        &self.seeds
    }

    /// Runs `work` against the cluster, bounded by the timeout, blocking
    /// the calling thread.
    pub fn run<T: Send, F>(
        &self,
        what: &str,
        work: impl FnOnce(ClusterConnection) -> F,
    ) -> Result<T, FetchError>
    where
        F: std::future::Future<Output = redis::RedisResult<T>> + Send,
    {
        let future = work(self.connection.clone());
        let timeout = self.timeout;
        match block_on(&self.runtime, async { tokio::time::timeout(timeout, future).await }) {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(FetchError(format!("Redis Cluster {}: {what}: {e}", self.seeds))),
            Err(_) => {
                Err(FetchError(format!("Redis Cluster {}: {what}: no answer within {timeout:?}", self.seeds)))
            }
        }
    }
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
    format!("{{{}/{}}}{id}", spec.prefix, id % u64::from(spec.buckets))
}

/// The key that holds the table's row count once it is loaded.
pub fn rows_key(spec: &RedisTableSpec) -> String {
    format!("{{{}/meta}}rows", spec.prefix)
}

/// A table whose rows are on a Redis Cluster.
pub struct RedisRows {
    name: String,
    spec: RedisTableSpec,
    cluster: Arc<RedisCluster>,
}

impl RedisRows {
    /// The table `name` at `spec` on `cluster`, checked to be loaded with
    /// `rows` rows.
    pub fn open(
        name: &str,
        spec: &RedisTableSpec,
        rows: u64,
        cluster: Arc<RedisCluster>,
    ) -> Result<Self, FetchError> {
        let key = rows_key(spec);
        let command = redis::cmd("GET").arg(&key).clone();
        let loaded: Option<u64> =
            cluster.run("reading the row count", |mut c| async move { command.query_async(&mut c).await })?;
        match loaded {
            Some(n) if n == rows => Ok(Self { name: name.into(), spec: spec.clone(), cluster }),
            Some(n) => Err(FetchError(format!(
                "table {name:?}: the cluster holds {n} rows under {}, the schema says {rows}",
                spec.prefix
            ))),
            None => Err(FetchError(format!(
                "table {name:?}: not loaded on {} (no {key}): run `narsil tables load`",
                cluster.seeds()
            ))),
        }
    }
}

impl RowStore for RedisRows {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn local_rows(&self) -> Option<&[u8]> {
        None
    }

    fn fetch(&self, ids: &[i64], row_bytes: usize, out: &mut [u8]) -> Result<(), FetchError> {
        let buckets = self.spec.buckets as usize;
        let mut by_bucket: Vec<Vec<usize>> = vec![Vec::new(); buckets];
        for (i, &id) in ids.iter().enumerate() {
            by_bucket[id as usize % buckets].push(i);
        }
        let by_bucket: Vec<Vec<usize>> = by_bucket.into_iter().filter(|b| !b.is_empty()).collect();
        let commands: Vec<redis::Cmd> = by_bucket
            .iter()
            .map(|indices| {
                let mut command = redis::cmd("MGET");
                for &i in indices {
                    command.arg(row_key(&self.spec, ids[i] as u64));
                }
                command
            })
            .collect();
        let replies: Vec<Vec<Option<Vec<u8>>>> = self.cluster.run("reading rows", |connection| {
            try_join_all(commands.into_iter().map(move |command| {
                let mut connection = connection.clone();
                async move { command.query_async(&mut connection).await }
            }))
        })?;
        for (indices, values) in by_bucket.iter().zip(replies) {
            for (&i, value) in indices.iter().zip(values) {
                let row = value.ok_or_else(|| {
                    FetchError(format!("table {:?}: row {} is missing from the cluster", self.name, ids[i]))
                })?;
                if row.len() != row_bytes {
                    return Err(FetchError(format!(
                        "table {:?}: row {} holds {} bytes, not {row_bytes}",
                        self.name,
                        ids[i],
                        row.len()
                    )));
                }
                out[i * row_bytes..(i + 1) * row_bytes].copy_from_slice(&row);
            }
        }
        Ok(())
    }

    fn may_fault(&self) -> bool {
        false
    }
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
/// `MSET`s in flight at once when loading.
const LOAD_IN_FLIGHT: usize = 32;

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
    let buckets = u64::from(spec.buckets);
    // Chunks of rows of one bucket (one hash slot): ids b, b + buckets, ...
    let mut chunks: Vec<Vec<u64>> = Vec::new();
    for bucket in 0..buckets.min(count) {
        let ids: Vec<u64> = (bucket..count).step_by(buckets as usize).collect();
        chunks.extend(ids.chunks(LOAD_CHUNK_ROWS).map(<[u64]>::to_vec));
    }
    let mut written = 0u64;
    for group in chunks.chunks(LOAD_IN_FLIGHT) {
        let commands: Vec<redis::Cmd> = group
            .iter()
            .map(|ids| {
                let mut command = redis::cmd("MSET");
                for &id in ids {
                    let start = id as usize * row_bytes;
                    command.arg(row_key(spec, id)).arg(&rows[start..start + row_bytes]);
                }
                command
            })
            .collect();
        cluster.run("writing rows", |connection| {
            try_join_all(commands.into_iter().map(move |command| {
                let mut connection = connection.clone();
                async move { command.query_async::<()>(&mut connection).await }
            }))
        })?;
        written += group.iter().map(|ids| ids.len() as u64).sum::<u64>();
        progress(written);
    }
    let present = count_present(cluster, spec, count)?;
    if present != count {
        return Err(FetchError(format!("{}: {present} of {count} rows present after writing", spec.prefix)));
    }
    let command = redis::cmd("SET").arg(rows_key(spec)).arg(count).clone();
    cluster.run("writing the row count", |mut c| async move { command.query_async::<()>(&mut c).await })?;
    Ok(Loaded { rows: count, bytes: count * row_bytes as u64 })
}

/// How many of the rows `0..count` have a key under `spec` (`EXISTS` over
/// each bucket's keys).
pub fn count_present(cluster: &RedisCluster, spec: &RedisTableSpec, count: u64) -> Result<u64, FetchError> {
    let buckets = u64::from(spec.buckets);
    let mut commands = Vec::new();
    for bucket in 0..buckets.min(count) {
        let ids: Vec<u64> = (bucket..count).step_by(buckets as usize).collect();
        for chunk in ids.chunks(LOAD_CHUNK_ROWS * 4) {
            let mut command = redis::cmd("EXISTS");
            for &id in chunk {
                command.arg(row_key(spec, id));
            }
            commands.push(command);
        }
    }
    let mut present = 0;
    for group in commands.chunks(LOAD_IN_FLIGHT) {
        let group = group.to_vec();
        let counts: Vec<u64> = cluster.run("counting rows", |connection| {
            try_join_all(group.into_iter().map(move |command| {
                let mut connection = connection.clone();
                async move { command.query_async(&mut connection).await }
            }))
        })?;
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
        assert_eq!(seeds.urls(), ["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"]);
        assert_eq!(seeds.to_string(), "redis://127.0.0.1:7000,127.0.0.1:7001");
        assert!(RedisSeeds::parse("127.0.0.1:7000").unwrap_err().contains("redis://"));
        assert!(RedisSeeds::parse("redis://127.0.0.1").unwrap_err().contains("no :PORT"));
        assert!(RedisSeeds::parse("redis://h:x").unwrap_err().contains("not HOST:PORT"));
    }

    #[test]
    fn rows_of_one_bucket_share_a_hash_tag() {
        let spec = RedisTableSpec { prefix: "narsil/dlrm/1/t_cat_0".into(), buckets: 64 };
        assert_eq!(row_key(&spec, 130), "{narsil/dlrm/1/t_cat_0/2}130");
        assert_eq!(row_key(&spec, 2), "{narsil/dlrm/1/t_cat_0/2}2");
        assert_eq!(rows_key(&spec), "{narsil/dlrm/1/t_cat_0/meta}rows");
    }
}
