//! Rows onto a Redis Cluster for `narsil tables load` and `push`, in the
//! `redis` store's key layout ([`super::keys`]): a whole table loaded and
//! checked ([`load_table`]), changed rows pushed and their ids published so
//! serving processes drop their cached copies ([`push_rows`]). The store
//! reads these keys ([`super::rows`]) and applies the published ids
//! ([`super::invalidation`]).

use std::collections::HashMap;

use fred::prelude::{KeysInterface, PubsubInterface};
use fred::types::Value;

use super::cluster::RedisCluster;
use super::invalidation::{invalidation_message, INVALIDATION_CHANNEL};
use super::keys::{bucket_chunks, row_key, rows_key};
use crate::schema::RedisTableSpec;
use crate::stores::row_store::FetchError;

/// Rows per `MSET` when loading.
const LOAD_CHUNK_ROWS: usize = 512;

/// Commands in flight at once while loading or counting a table (a
/// batch's reads are all sent at once).
const LOAD_IN_FLIGHT: usize = 32;

/// What loading a table wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loaded {
    /// Rows written.
    pub rows: u64,
    /// Bytes of row values written.
    pub bytes: u64,
}

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
        return Err(FetchError::failed(format!(
            "{}: {present} of {count} rows present after writing",
            spec.prefix
        )));
    }
    let client = cluster.client();
    cluster.run("writing the row count", client.set::<(), _, _>(rows_key(spec), count, None, None, false))?;
    Ok(Loaded { rows: count, bytes: count * row_bytes as u64 })
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
    let message = Value::Bytes(invalidation_message(&spec.prefix, ids).into());
    let publish = cluster.client().publish::<(), _, _>(INVALIDATION_CHANNEL, message);
    cluster.run("publishing the updated ids", publish)
}

/// How many of the rows `0..count` have a key under `spec` (`EXISTS` over
/// each bucket's keys).
fn count_present(cluster: &RedisCluster, spec: &RedisTableSpec, count: u64) -> Result<u64, FetchError> {
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
