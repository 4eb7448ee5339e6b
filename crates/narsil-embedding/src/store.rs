//! Where a table's rows come from, behind one trait: the embedding stage
//! asks a [`RowStore`] either for every row in this process's address
//! space (`memory`, `mmap`: the stage pools straight from them) or for the
//! rows of a fused batch's distinct ids (a store on other machines copies
//! them into the stage's buffer, once per distinct id).

use std::any::Any;
use std::time::Instant;

/// A store's failure to deliver rows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct FetchError(pub String);

/// What a fetch delivered besides the rows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fetched {
    /// Rows served from a cache in this process rather than the store.
    pub cached: usize,
    /// Rows the store lacks, delivered as zeros (`--missing-rows zero`).
    pub zeroed: usize,
}

/// A table's rows, wherever they live.
pub trait RowStore: Send + Sync {
    /// Which store holds them, for logs and metrics (`memory`, `mmap`).
    fn kind(&self) -> &'static str;

    /// Every row end to end (row `id` at `id * row_bytes`), when the rows
    /// are in this process's address space.
    fn local_rows(&self) -> Option<&[u8]>;

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

    /// The store as itself, for a stage that reads some stores' tables of a
    /// batch together (a Redis Cluster's: [`crate::redis_rows::fetch_tables`]).
    fn as_any(&self) -> &dyn Any;
}
