//! Fetching a batch's rows of many tables at once, as the stage does it.
//! The capability itself ([`BatchFetch`], asked for by
//! [`RowStore::batch_fetch`]) is declared with [`RowStore`] in `row_store`,
//! as the two traits name each other. Tables whose stores answer with the
//! same [`BatchGroup`] are fetched in one call ([`group_tables`]: a Redis
//! Cluster's reads of every table pipelined together; a disk's reads of
//! every table in flight on one ring), the others one table at a time
//! ([`RowStore::fetch`]); a batching store fetches one table alone through
//! [`fetch_alone`]. A new batching store implements [`BatchFetch`] in its
//! own module; the stage is not edited.

use std::time::Instant;

use super::row_cache::RowCache;
use super::row_store::{BatchFetch, BatchGroup, FetchError, FetchPart, Fetched, RowStore};
use crate::metrics::TableCounters;

/// The body every batching store's fetch starts with, part one: each
/// part's store as the concrete `T` a batch of this store is made of (the
/// stage groups parts by [`BatchGroup`], so all are), or the failure
/// naming the first that is not (`kind`: the store, for the message).
pub fn parts_as<'a, T: 'static>(
    parts: &[FetchPart<'a>],
    kind: &str,
) -> Result<Vec<&'a T>, (usize, FetchError)> {
    parts
        .iter()
        .enumerate()
        .map(|(p, part)| {
            part.store.downcast_ref::<T>().ok_or_else(|| {
                (p, FetchError::failed(format!("a {kind} fetch was handed another store's table")))
            })
        })
        .collect()
}

/// Part two: the rows of `part` that `cache` holds (under `table`) copied
/// into its `out`; the places (indexes into its ids) of the others, to
/// fetch, in order.
pub fn copy_cached(part: &mut FetchPart<'_>, cache: Option<&RowCache>, table: u32) -> Vec<usize> {
    let row_bytes = part.row_bytes;
    let mut missing = Vec::new();
    for (place, &id) in part.ids.iter().enumerate() {
        let out = &mut part.out[place * row_bytes..(place + 1) * row_bytes];
        if !cache.is_some_and(|cache| cache.get_into(table, id as u64, out)) {
            missing.push(place);
        }
    }
    missing
}

/// One table's fetch through its store's batch fetch (what a batching
/// store's [`RowStore::fetch`] is), its reads counted nowhere.
pub fn fetch_alone(
    batcher: &dyn BatchFetch,
    store: &dyn RowStore,
    ids: &[i64],
    row_bytes: usize,
    out: &mut [u8],
    deadline: Option<Instant>,
) -> Result<Fetched, FetchError> {
    let counters = TableCounters::default();
    let mut parts = [FetchPart { store, ids, row_bytes, out, counters: &counters }];
    let fetched = batcher.fetch_parts(&mut parts, deadline).map_err(|(_, error)| error)?;
    Ok(fetched[0])
}

/// Table indexes grouped by the [`BatchGroup`] of their store, first seen
/// first; `None` groups tables fetched one by one.
pub fn group_tables<'s>(
    stores: impl IntoIterator<Item = (usize, &'s dyn RowStore)>,
) -> Vec<(Option<BatchGroup>, Vec<usize>)> {
    let mut groups: Vec<(Option<BatchGroup>, Vec<usize>)> = Vec::new();
    for (t, store) in stores {
        let group = store.batch_fetch().map(|batcher| batcher.group());
        match groups.iter_mut().find(|(g, _)| group.is_some() && *g == group) {
            Some((_, tables)) => tables.push(t),
            None => groups.push((group, vec![t])),
        }
    }
    groups
}
