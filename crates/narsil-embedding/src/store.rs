//! Where a table's rows come from, behind one trait: the embedding stage
//! asks a [`RowStore`] either for every row in this process's address
//! space (`memory`, `mmap`: the stage pools straight from them) or for the
//! rows of a fused batch's distinct ids (a store on other machines copies
//! them into the stage's buffer, once per distinct id).

use crate::table::{Table, TableStore};

/// A store's failure to deliver rows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct FetchError(pub String);

/// A table's rows, wherever they live.
pub trait RowStore: Send + Sync {
    /// Which store holds them, for logs and metrics (`memory`, `mmap`).
    fn kind(&self) -> &'static str;

    /// Every row end to end (row `id` at `id * row_bytes`), when the rows
    /// are in this process's address space.
    fn local_rows(&self) -> Option<&[u8]>;

    /// Copies the rows of `ids` (distinct, each a valid row) into `out`:
    /// row `i` at `i * row_bytes`, `out.len() == ids.len() * row_bytes`.
    /// Returns how many came from a cache in this process rather than the
    /// store.
    fn fetch(&self, ids: &[i64], row_bytes: usize, out: &mut [u8]) -> Result<usize, FetchError>;

    /// Whether reading a row can wait on the disk (the stage then counts
    /// the major page faults of its lookups).
    fn may_fault(&self) -> bool;
}

impl RowStore for Table {
    fn kind(&self) -> &'static str {
        match self.store() {
            TableStore::Memory => "memory",
            TableStore::Mmap | TableStore::Redis(_) => "mmap",
        }
    }

    fn local_rows(&self) -> Option<&[u8]> {
        Some(self.bytes())
    }

    fn fetch(&self, ids: &[i64], row_bytes: usize, out: &mut [u8]) -> Result<usize, FetchError> {
        let rows = self.bytes();
        for (&id, row) in ids.iter().zip(out.chunks_exact_mut(row_bytes)) {
            let start = id as usize * row_bytes;
            row.copy_from_slice(&rows[start..start + row_bytes]);
        }
        Ok(0)
    }

    fn may_fault(&self) -> bool {
        self.store() == TableStore::Mmap
    }
}
