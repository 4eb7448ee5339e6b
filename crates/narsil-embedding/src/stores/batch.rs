//! Fetching a batch's rows of many tables at once: a store's own
//! capability, which the embedding stage asks each table's store for
//! ([`crate::RowStore::batch_fetch`]). Tables whose stores answer with the
//! same [`BatchGroup`] are fetched in one call (a Redis Cluster's reads of
//! every table pipelined together; a disk's reads of every table in flight
//! on one ring), the others one table at a time
//! ([`crate::RowStore::fetch`]). A new batching store implements
//! [`BatchFetch`] in its own module; the stage is not edited.

use std::time::Instant;

use super::row_store::{FetchError, Fetched, RowStore};
use crate::metrics::TableCounters;

/// Which tables a store fetches together: one kind of store, and which of
/// its instances (a Redis Cluster's tables batch with that cluster's only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BatchGroup {
    /// The store kind (`disk`, `redis`).
    pub kind: &'static str,
    /// Which instance of it (an address, a number): 0 where every table of
    /// the kind batches together.
    pub instance: usize,
}

/// One table's part of a batch's fetch.
pub struct FetchPart<'a> {
    /// The table's rows (a store of the part's [`BatchGroup`]).
    pub store: &'a dyn RowStore,
    /// Its distinct ids in the batch.
    pub ids: &'a [i64],
    /// Bytes per row.
    pub row_bytes: usize,
    /// Where row `i` goes: `out[i * row_bytes..(i + 1) * row_bytes]`.
    pub out: &'a mut [u8],
    /// The table's counters (reads, bytes, time), for the store to record
    /// in.
    pub counters: &'a TableCounters,
}

/// A store that fetches the rows of many tables of a batch in one call.
pub trait BatchFetch: Send + Sync {
    /// The tables this one is fetched with: every part of one
    /// [`BatchFetch::fetch_parts`] call has a store of this group.
    fn group(&self) -> BatchGroup;

    /// Copies each part's rows into its `out`, giving up at `deadline` (the
    /// latest of the batch's callers'). Returns what each part fetched, in
    /// order, or the index of the part that failed and why.
    fn fetch_parts(
        &self,
        parts: &mut [FetchPart<'_>],
        deadline: Option<Instant>,
    ) -> Result<Vec<Fetched>, (usize, FetchError)>;
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
