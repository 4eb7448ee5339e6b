//! Narsil's embedding stage, between the collector and the dense network
//! of a split model (tables apart from the dense network; models/README.md,
//! "Split models"):
//!
//! * [`schema`]: a split model's `schema.json`: dense features, tables,
//!   sparse features mapped to tables, outputs; checked when read.
//! * [`sha256`]: the SHA-256s the schema names, as it names them (the one
//!   format check), and hashing the files it names.
//! * [`stores`]: where a table's rows live, one room: the [`RowStore`]
//!   trait, the registry of kinds `--table-store` names, and each kind in a
//!   module of its own (`memory` and `mmap`, `disk`, `redis`), with the row
//!   cache the fetching stores share and the batch-fetch capability the
//!   stage asks a store for.
//! * [`id_map`]: a table's map of raw 64-bit ids to rows (the file
//!   format, its checks, lookups, and the writer the exporters and `narsil
//!   tables map` share; the build from a vocabulary larger than memory,
//!   sorted on disk, that `narsil tables map` calls: [`id_map::build`]).
//! * [`popularity_order`]: the slot index that finds each id's row in a
//!   table laid out in popularity order, and the writer of the rows and the
//!   index in that order ([`popularity_order::writer`], what `narsil tables
//!   order` calls).
//! * [`dedup`]: distinct ids per table in a fused batch (what fetching
//!   each row once saves).
//! * [`pool`]: pooling bags of INT8 row-wise rows into the dense network's
//!   input, with FBGEMM's arithmetic (AVX2 + FMA when the CPU has them,
//!   chosen at run time; a scalar path otherwise), and of FP32 rows.
//! * [`pooled_value`]: what the pooled block holds, FP32 or bf16 (each bag
//!   rounded as it is pooled, for a dense network in bf16).
//! * [`publish`]: publishing a model's files by rename (claimed under a
//!   temporary name with `O_EXCL`, synced, renamed, the directory synced),
//!   as every writer of a model's files and the push log do.
//! * [`stage`]: the stage itself: per fused batch and table, dedup, fetch,
//!   pool; with [`metrics`] per table.

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod dedup;
pub mod id_map;
pub mod metrics;
pub mod pool;
pub mod pooled_value;
pub mod popularity_order;
pub mod publish;
pub mod schema;
pub mod sha256;
pub mod stage;
pub mod stores;

pub use dedup::{DistinctIds, IdCount};
pub use id_map::{IdMap, IdMapError};
pub use metrics::StageMetrics;
pub use pool::{pool_rows, OutOfRange, Pooling};
pub use pooled_value::{Bf16, PooledValue};
pub use popularity_order::{SlotIndex, SlotIndexError};
pub use schema::{
    DenseFormTimings, FormTimes, IdMapSpec, Layout, PackageTimes, PoolingMode, RedisTableSpec, SchemaError,
    SplitSchema, Storage, TableIds, TableSpec, UserOnceSpec,
};
pub use stage::{held, EmbeddingStage, Held, SequenceValues, StageError, StageScratch};
pub use stores::local::table::{LocalRows, Table};
pub use stores::redis::{RedisCluster, RedisRows, RedisSeeds, RedisStoreConfig};
pub use stores::registry::STORE_KINDS;
pub use stores::row_store::{FetchError, Fetched, MissingRows, RowStore};
pub use stores::table_error::TableError;
pub use stores::table_store::{OpenedTables, StoreConfig, StoreFlags, StoreKind, TableStore};

/// (tests only) Counts this thread's heap allocations, for tests that a
/// step allocates nothing per bag or id.
#[cfg(test)]
pub(crate) mod counted_allocations {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    struct Counting;

    thread_local! {
        static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
    }

    // SAFETY: every call is passed to the system allocator unchanged; the
    // count is a thread-local `Cell` of constant initialisation (no
    // allocation, no destructor), read where it can be.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
            // SAFETY: the caller's contract, passed on.
            unsafe { System.alloc(layout) }
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: the caller's contract, passed on.
            unsafe { System.dealloc(ptr, layout) }
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
            // SAFETY: the caller's contract, passed on.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    #[global_allocator]
    static COUNTING: Counting = Counting;

    /// How many allocations (and reallocations) `f` made on this thread.
    pub(crate) fn during(f: impl FnOnce()) -> u64 {
        let before = ALLOCATIONS.with(Cell::get);
        f();
        ALLOCATIONS.with(Cell::get) - before
    }
}
