//! Narsil's embedding stage, between the collector and the dense network
//! of a split model (tables apart from the dense network; models/README.md,
//! "Split models"):
//!
//! * [`schema`]: a split model's `schema.json`: dense features, tables,
//!   sparse features mapped to tables, outputs; checked when read.
//! * [`table`]: a table's rows, read into memory or mapped from its file
//!   (`memory` and `mmap` stores), checked against the schema, with errors
//!   naming the table and the file.
//! * [`store`]: the trait every table store's rows implement (rows in
//!   this process, or fetched by distinct id).
//! * [`table_store`]: the choice of store (`--table-store`), an open set:
//!   what a kind declares (its syntax, how it opens a model's tables, the
//!   store flags it takes); [`store_kinds`]: the table of kinds.
//! * [`local_store`]: the `memory` and `mmap` stores.
//! * [`layout`]: tables laid out in popularity order (hot rows packed into
//!   shared blocks) and the slot index that finds each id's row.
//! * [`redis`]: tables on a Redis Cluster (the `redis` store), a module of
//!   one file per job: configuration, the shared connection, key layout,
//!   reading a batch's rows of every table together, invalidation, health;
//!   [`row_cache`]: its hot-row cache (also the `disk` store's).
//! * [`disk`]: tables beyond RAM (the `disk` store): rows read from their
//!   files with direct I/O into the same row cache.
//! * [`shared`]: tables shared by content across the model versions of a
//!   process.
//! * [`dedup`]: distinct ids per table in a fused batch (what fetching
//!   each row once saves).
//! * [`pool`]: pooling bags of INT8 row-wise rows into the dense network's
//!   input, with FBGEMM's arithmetic (AVX2 + FMA when the CPU has them,
//!   chosen at run time; a scalar path otherwise), and of FP32 rows.
//! * [`stage`]: the stage itself: per fused batch and table, dedup, fetch,
//!   pool; with [`metrics`] per table.

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod dedup;
pub mod disk;
pub mod layout;
pub mod local_store;
pub mod metrics;
pub mod pool;
pub mod redis;
pub mod row_cache;
pub mod schema;
pub mod shared;
pub mod stage;
pub mod store;
pub mod store_kinds;
pub mod table;
pub mod table_store;

pub use dedup::{DistinctIds, IdCount};
pub use layout::{Popularity, SlotIndex};
pub use metrics::StageMetrics;
pub use pool::{pool_rows, OutOfRange, Pooling};
pub use redis::{RedisCluster, RedisRows, RedisSeeds, RedisStoreConfig};
pub use schema::{Layout, PoolingMode, RedisTableSpec, SchemaError, SplitSchema, Storage, TableSpec};
pub use stage::{EmbeddingStage, StageError, StageScratch};
pub use store::{FetchError, Fetched, MissingRows, RowStore};
pub use store_kinds::STORE_KINDS;
pub use table::{LocalRows, Table, TableError};
pub use table_store::{OpenedTables, StoreConfig, StoreFlags, StoreKind, TableStore};
