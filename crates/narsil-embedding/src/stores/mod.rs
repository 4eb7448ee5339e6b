//! Where a split model's table rows live. One trait, one registry, one
//! module per kind:
//!
//! * [`row_store`]: the [`RowStore`] trait every table's rows implement
//!   (rows in this process, or fetched by distinct id), and what a fetch
//!   returns or fails with.
//! * [`batch`]: fetching a batch's rows of many tables at once, a store's
//!   own capability ([`BatchFetch`]) that the stage asks each table's store
//!   for; tables whose stores batch together are fetched in one call.
//! * [`config`]: the choice of store (`--table-store`): what a kind declares
//!   (its syntax, how it opens a model's tables, the store flags it takes);
//!   [`registry`]: the table of kinds, one line each.
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
pub mod config;
pub mod disk;
pub mod local;
pub mod redis;
pub mod registry;
pub mod row_cache;
pub mod row_store;

pub use batch::{BatchFetch, FetchPart};
pub use config::{StoreConfig, StoreKind};
pub use row_store::RowStore;
