//! Why a model's tables cannot be opened, in any store: the one error every
//! store's open returns ([`crate::stores::StoreConfig::open`]) and the
//! file checks return ([`crate::stores::table_file`]), naming the table and
//! its file or store.

use std::path::PathBuf;

use crate::stores::row_store::FetchError;

/// Why a table cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    /// The file cannot be read.
    #[error("table {table:?}: cannot read {}: {source}", path.display())]
    Read {
        /// The table.
        table: String,
        /// Its file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file's size is not the schema's rows times row bytes.
    #[error("table {table:?}: {} holds {actual} bytes, but {rows} rows of {row_bytes} bytes take {expected} (truncated, or not this schema's table)", path.display())]
    Size {
        /// The table.
        table: String,
        /// Its file.
        path: PathBuf,
        /// Bytes in the file.
        actual: u64,
        /// Bytes the schema implies.
        expected: u64,
        /// Rows in the schema.
        rows: u64,
        /// Bytes per row.
        row_bytes: usize,
    },
    /// The file's bytes are not the ones the schema's `sha256` names.
    #[error("table {table:?}: {} has SHA-256 {actual}, but schema.json names {expected} (changed since it was published, or not this schema's table): not served", path.display())]
    Hash {
        /// The table.
        table: String,
        /// Its file.
        path: PathBuf,
        /// The schema's hash.
        expected: String,
        /// The file's.
        actual: String,
    },
    /// The slot index of a table in popularity order cannot be used.
    #[error("table {table:?}: slot index {}: {why}", path.display())]
    Layout {
        /// The table.
        table: String,
        /// The index's file.
        path: PathBuf,
        /// Why.
        why: String,
    },
    /// The id map of a table whose ids are raw cannot be used.
    #[error("table {table:?}: id map {}: {why}", path.display())]
    IdMap {
        /// The table.
        table: String,
        /// The map's file.
        path: PathBuf,
        /// Why.
        why: String,
    },
    /// The table is not in the store that holds it elsewhere (or that
    /// store cannot be reached).
    #[error("table {table:?}: {source}")]
    Store {
        /// The table.
        table: String,
        /// Why.
        source: FetchError,
    },
}
