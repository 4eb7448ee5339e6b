//! Where a split model's table rows live. One trait, one registry, one
//! module per kind:
//!
//! * [`row_store`]: the [`RowStore`] trait every table's rows implement
//!   (rows in this process, or fetched by distinct id), what a fetch
//!   returns or fails with, and a store's own capability to fetch a
//!   batch's rows of many tables at once ([`BatchFetch`]: the two traits
//!   name each other, so they share the file).
//! * [`batch`]: the stage's use of that capability: a batch's tables
//!   grouped by store, each group fetched in one call.
//! * [`table_store`]: the choice of store (`--table-store`): what a kind
//!   declares (its syntax, how it opens a model's tables, the store flags it
//!   takes); [`registry`]: the table of kinds, one line each.
//! * [`table_error`]: why a model's tables cannot be opened, the one error
//!   every store's open returns.
//! * [`table_file`]: the one way a table's files are opened: size and
//!   SHA-256 checked (or vouched for by a stamp), the slot index read.
//! * [`local`]: the `memory` and `mmap` stores (a table's rows read into
//!   this process or mapped from its file, shared by content across the
//!   model versions of a process).
//! * [`disk`]: tables beyond RAM (the `disk` store): rows read from their
//!   files with direct I/O into the row cache.
//! * [`redis`]: tables on a Redis Cluster (the `redis` store).
//! * [`row_cache`]: the hot-row cache the fetching stores share, bounded in
//!   bytes.
//!
//! A new store is its module here (a [`StoreKind`], a [`StoreConfig`], its
//! [`RowStore`] and, if it fetches many tables' rows together, its
//! [`BatchFetch`]) plus its line in [`registry::STORE_KINDS`].

pub mod batch;
pub mod disk;
pub mod local;
pub mod redis;
pub mod registry;
pub mod row_cache;
pub mod row_store;
pub mod table_error;
pub mod table_file;
pub mod table_store;

pub use row_store::{BatchFetch, BatchGroup, FetchPart, RowStore};
pub use table_error::TableError;
pub use table_store::{StoreConfig, StoreKind};
