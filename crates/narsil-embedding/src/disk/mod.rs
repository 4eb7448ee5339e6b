//! The `disk` table store, for tables larger than the memory the server
//! may use: rows read from the table files with direct I/O (never through
//! the page cache) into a row cache in RAM bounded in bytes
//! (`--table-cache-bytes`, the same [`crate::row_cache::RowCache`] as the
//! `redis` store's, one per process, shared by every table of every model
//! version). Per fused batch and table the distinct ids that miss the
//! cache are sorted by file offset, rows that share a block are read once,
//! and the reads run on several threads at once.
//!
//! * [`reads`]: planning and carrying out direct reads of whole blocks.
//! * [`store`]: the store kind, its configuration and a table's rows.

pub mod reads;
pub mod store;
