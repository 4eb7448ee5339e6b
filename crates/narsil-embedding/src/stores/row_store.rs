//! Where a table's rows come from, behind one trait: the embedding stage
//! asks a [`RowStore`] either for every row in this process's address
//! space (`memory`, `mmap`: the stage pools straight from them) or for the
//! rows of a fused batch's distinct ids (a store on other machines copies
//! them into the stage's buffer, once per distinct id). Which store a
//! model's tables are opened in is [`crate::stores::table_store`]'s.
//!
//! Fetching the rows of many tables of a batch at once is a store's own
//! capability, declared here with the trait ([`BatchFetch`], its
//! [`BatchGroup`] and [`FetchPart`]s: the trait and the capability name
//! each other); the stage's grouping by it is [`crate::stores::batch`]'s.

use std::any::Any;
use std::time::Instant;

use narsil_core::DependencyWatcher;

use crate::metrics::TableCounters;

/// A store's failure to deliver rows: a failure of the store, or a fetch
/// given up because every caller of its batch had stopped waiting (not the
/// store's fault: it is not counted against the store or the replica's
/// health).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct FetchError {
    /// What went wrong, naming the store (and the file or node).
    pub message: String,
    /// Whether the fetch stopped because the batch's deadline (the latest
    /// of its callers') passed.
    pub abandoned: bool,
}

impl FetchError {
    /// The store could not deliver, because `message`.
    pub fn failed(message: impl Into<String>) -> Self {
        Self { message: message.into(), abandoned: false }
    }

    /// The fetch stopped at the batch's deadline: `message` says where.
    pub fn abandoned(message: impl Into<String>) -> Self {
        Self { message: message.into(), abandoned: true }
    }
}

/// What a fetch delivered besides the rows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fetched {
    /// Rows served from a cache in this process rather than the store.
    pub cached: usize,
    /// Rows the store lacks, delivered as zeros (`--missing-rows zero`).
    pub zeroed: usize,
}

/// What a fetch does with a row its store does not hold (a table loaded
/// partly, or a key removed by hand): `--missing-rows`.
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

/// A table's rows, wherever they live.
pub trait RowStore: Any + Send + Sync {
    /// Which store holds them, for logs and metrics (`memory`, `mmap`).
    fn kind(&self) -> &'static str;

    /// Every row end to end (row `id` at `id * row_bytes`, or at its slot
    /// where [`RowStore::slots`] says), when the rows are in this process's
    /// address space.
    fn local_rows(&self) -> Option<&[u8]>;

    /// For local rows laid out in popularity order: where each id's row is
    /// in [`RowStore::local_rows`] ([`crate::popularity_order`]).
    fn slots(&self) -> Option<&crate::popularity_order::SlotIndex> {
        None
    }

    /// Row `id`'s `row_bytes` bytes among [`RowStore::local_rows`] (through
    /// [`RowStore::slots`] where the rows are laid out in popularity order);
    /// `None` when the rows are not in this process.
    fn local_row(&self, id: i64, row_bytes: usize) -> Option<&[u8]> {
        let at = self.slots().map_or(id, |index| index.slot(id)) as usize * row_bytes;
        Some(&self.local_rows()?[at..at + row_bytes])
    }

    /// Copies the rows of `ids` (distinct, each a valid row) into `out`:
    /// row `i` at `i * row_bytes`, `out.len() == ids.len() * row_bytes`,
    /// giving up at `deadline` (when the batch's callers stop waiting).
    fn fetch(
        &self,
        ids: &[i64],
        row_bytes: usize,
        out: &mut [u8],
        deadline: Option<Instant>,
    ) -> Result<Fetched, FetchError>;

    /// Whether reading a row can wait on the disk (the stage then counts
    /// the major page faults of its lookups).
    fn may_fault(&self) -> bool;

    /// For a store that fetches the rows of many tables of a batch at once:
    /// how ([`BatchFetch`]; the stage's grouping: `stores::batch`). The stage then hands it every part
    /// of its group in one call instead of calling [`RowStore::fetch`] per
    /// table.
    fn batch_fetch(&self) -> Option<&dyn BatchFetch> {
        None
    }

    /// For rows on other machines, or read from a disk that may fail or
    /// stall (`redis`, `disk`): tells `watcher` whether their store
    /// answers, now and at each change (the serving health follows it),
    /// until `watcher` returns false. Rows in this process's memory always
    /// answer and give `watcher` back.
    fn watch_reachability(&self, watcher: DependencyWatcher) -> Option<DependencyWatcher> {
        Some(watcher)
    }
}

impl dyn RowStore {
    /// The store as its own type, if it is a `T`: for a store's
    /// [`BatchFetch`] to find its tables among a batch's parts, and the
    /// stage to find the tables it may lay out.
    pub fn downcast_ref<T: Any>(&self) -> Option<&T> {
        (self as &dyn Any).downcast_ref()
    }
}

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
    /// order, or why it failed: with the index of the part that failed
    /// (its table's failure: a file cut short, a read's EIO), or none where
    /// the call failed for every part at once (one pipeline to a cluster).
    fn fetch_parts(
        &self,
        parts: &mut [FetchPart<'_>],
        deadline: Option<Instant>,
    ) -> Result<Vec<Fetched>, (Option<usize>, FetchError)>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_rows_policies_parse_by_name_and_print_back() {
        for policy in [MissingRows::Error, MissingRows::Zero] {
            assert_eq!(policy.to_string().parse(), Ok(policy));
        }
        assert_eq!(MissingRows::default(), MissingRows::Error, "no score from a missing row unless asked");
        let unknown = "skip".parse::<MissingRows>().unwrap_err();
        assert!(unknown.contains("`skip`") && unknown.contains("`error` or `zero`"), "{unknown}");
    }
}
