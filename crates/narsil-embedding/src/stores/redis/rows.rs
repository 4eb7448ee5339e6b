//! Reading a fused batch's rows from a Redis Cluster: every table of the
//! batch together, not one table after another.
//!
//! [`RedisRows`]'s batch fetch looks each table's distinct ids up in the hot-row cache
//! ([`crate::stores::row_cache`], kept true by [`super::invalidation`]), then sends
//! one `MGET` per (table, bucket) that holds missed ids (keys:
//! [`super::keys`]), for every table together, all at once: the cluster
//! client pipelines the commands bound for one node over its connection,
//! so a batch waits for a few round trips, not one per table.
//! The wait is bounded by the store's fetch timeout and by the batch's
//! deadline (the latest of its callers'): past it nobody waits for the
//! answer. The client's own retries (a moved slot, a failed-over master)
//! happen inside that bound.
//!
//! A row the cluster does not hold fails the batch, or, with
//! `--missing-rows zero`, is pooled as zeros (all-zero bytes are a zero
//! vector in every storage type: INT8 rows with scale and bias 0, FP32
//! rows of 0.0) and counted.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use fred::prelude::KeysInterface;
use fred::types::Value;
use narsil_core::DependencyWatcher;

use super::cluster::RedisCluster;
use super::invalidation::TableState;
use super::keys::{row_key, rows_key};
use crate::schema::RedisTableSpec;
use crate::stores::batch::{copy_cached, fetch_alone, parts_as};
use crate::stores::row_store::{
    BatchFetch, BatchGroup, FetchError, FetchPart, Fetched, MissingRows, RowStore,
};

/// A table whose rows are on a Redis Cluster.
pub struct RedisRows {
    name: String,
    spec: RedisTableSpec,
    cluster: Arc<RedisCluster>,
    state: Arc<TableState>,
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
        let loaded: Option<u64> = cluster.run("reading the row count", cluster.client().get(&key))?;
        match loaded {
            Some(n) if n == rows => {
                let state = cluster.invalidation.table(&spec.prefix);
                Ok(Self { name: name.into(), spec: spec.clone(), cluster, state })
            }
            Some(n) => Err(FetchError::failed(format!(
                "table {name:?}: the cluster holds {n} rows under {}, the schema says {rows}",
                spec.prefix
            ))),
            None => Err(FetchError::failed(format!(
                "table {name:?}: not loaded on {} (no {key}): run `narsil tables load`",
                cluster.seeds()
            ))),
        }
    }
}

/// Copies the rows of every part (tables of one cluster) into their `out`
/// buffers, reading what the cache lacks in one call that ends by
/// `deadline` at the latest. Returns what each part got from the cache and
/// how many rows it lacked (zeros).
fn fetch_tables(parts: &mut [FetchPart<'_>], deadline: Option<Instant>) -> Result<Vec<Fetched>, FetchError> {
    let tables = parts_as::<RedisRows>(parts, "Redis").map_err(|(_, error)| error)?;
    let Some(cluster) = tables.first().map(|rows| Arc::clone(&rows.cluster)) else { return Ok(Vec::new()) };
    let cache = cluster.invalidation.cache();
    let mut fetched = vec![Fetched::default(); parts.len()];
    // Per part, the indices of `ids` to read, grouped by bucket.
    let mut reads: Vec<(usize, Vec<usize>)> = Vec::new();
    let mut epochs = Vec::with_capacity(parts.len());
    for (p, (part, &table)) in parts.iter_mut().zip(&tables).enumerate() {
        debug_assert!(Arc::ptr_eq(&table.cluster, &cluster), "one cluster per fetch");
        epochs.push(table.state.epoch.load(Ordering::Acquire));
        let mut by_bucket: Vec<Vec<usize>> = vec![Vec::new(); table.spec.buckets as usize];
        let missing = copy_cached(part, cache, table.state.number);
        fetched[p].cached = part.ids.len() - missing.len();
        for i in missing {
            by_bucket[table.spec.bucket(part.ids[i] as u64) as usize].push(i);
        }
        reads.extend(by_bucket.into_iter().filter(|b| !b.is_empty()).map(|b| (p, b)));
    }
    if reads.is_empty() {
        return Ok(fetched);
    }
    let client = cluster.client();
    let commands = reads.iter().map(|(p, indices)| {
        let (part, table) = (&parts[*p], tables[*p]);
        let keys: Vec<String> = indices.iter().map(|&i| row_key(&table.spec, part.ids[i] as u64)).collect();
        client.mget::<Vec<Value>, _>(keys)
    });
    let replies = cluster.run_all("reading rows", deadline, commands)?;
    // Rows read before an invalidation of their table arrived may be old:
    // cache a table's rows only if none arrived meanwhile.
    let cache_for: Vec<Option<_>> = tables
        .iter()
        .zip(&epochs)
        .map(|(table, &epoch)| cache.filter(|_| table.state.epoch.load(Ordering::Acquire) == epoch))
        .collect();
    for ((p, indices), values) in reads.iter().zip(replies) {
        let (part, table) = (&mut parts[*p], tables[*p]);
        let row_bytes = part.row_bytes;
        for (&i, value) in indices.iter().zip(&values) {
            let row = &mut part.out[i * row_bytes..(i + 1) * row_bytes];
            // A row's bytes come back as a string when they happen to be
            // UTF-8: the same bytes.
            match value.as_bytes() {
                Some(value) if value.len() == row_bytes => {
                    row.copy_from_slice(value);
                    if let Some(cache) = cache_for[*p] {
                        cache.insert(table.state.number, part.ids[i] as u64, row);
                    }
                }
                Some(value) => {
                    return Err(FetchError::failed(format!(
                        "table {:?}: row {} holds {} bytes, not {row_bytes}",
                        table.name,
                        part.ids[i],
                        value.len()
                    )))
                }
                // Not cached: a load or a push may write it.
                None if cluster.missing_rows == MissingRows::Zero => {
                    row.fill(0);
                    fetched[*p].zeroed += 1;
                }
                None => {
                    return Err(FetchError::failed(format!(
                        "table {:?}: row {} is missing from the cluster (serve with --missing-rows zero to pool it as zeros)",
                        table.name, part.ids[i]
                    )))
                }
            }
        }
    }
    Ok(fetched)
}

impl RowStore for RedisRows {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn local_rows(&self) -> Option<&[u8]> {
        None
    }

    fn fetch(
        &self,
        ids: &[i64],
        row_bytes: usize,
        out: &mut [u8],
        deadline: Option<Instant>,
    ) -> Result<Fetched, FetchError> {
        fetch_alone(self, self, ids, row_bytes, out, deadline)
    }

    fn may_fault(&self) -> bool {
        false
    }

    fn batch_fetch(&self) -> Option<&dyn BatchFetch> {
        Some(self)
    }

    /// Every table of a model is on the one cluster its store names: the
    /// first table watched watches them all.
    fn watch_reachability(&self, watcher: DependencyWatcher) -> Option<DependencyWatcher> {
        self.cluster.watch_reachability(watcher);
        None
    }
}

/// A cluster's tables of a batch are read together: their `MGET`s pipelined
/// at once.
impl BatchFetch for RedisRows {
    fn group(&self) -> BatchGroup {
        BatchGroup { kind: "redis", instance: Arc::as_ptr(&self.cluster) as usize }
    }

    fn fetch_parts(
        &self,
        parts: &mut [FetchPart<'_>],
        deadline: Option<Instant>,
    ) -> Result<Vec<Fetched>, (Option<usize>, FetchError)> {
        // One call for every table: a failure is every table's.
        fetch_tables(parts, deadline).map_err(|error| (None, error))
    }
}
