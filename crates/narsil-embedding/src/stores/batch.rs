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

use super::row_store::{BatchFetch, BatchGroup, FetchError, FetchPart, Fetched, RowStore};
use crate::metrics::TableCounters;

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
