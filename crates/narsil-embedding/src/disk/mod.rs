//! The `disk` table store, for tables larger than the memory the server
//! may use: rows read from the table files with direct I/O (never through
//! the page cache) into a row cache in RAM bounded in bytes
//! (`--table-cache-bytes`, the same [`crate::row_cache::RowCache`] as the
//! `redis` store's, one per process, shared by every table of every model
//! version). Per fused batch and table the distinct ids that miss the
//! cache are sorted by file offset, rows that share a block are read once,
//! and every read of the batch is in flight at once (on an io_uring, or on
//! a pool of `pread` threads where the kernel refuses rings).
//!
//! * [`reads`]: planning direct reads of whole blocks, and making them on
//!   threads.
//! * [`uring`]: making them on an io_uring.
//! * [`store`]: the store kind, its configuration and a table's rows.

pub mod reads;
pub mod store;
pub mod uring;
