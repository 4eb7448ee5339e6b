//! The `redis` table store: a table's rows on a Redis Cluster, shared by
//! every replica that names the cluster (`narsil serve --table-store
//! redis://HOST:PORT[,HOST:PORT...]`), written there by `narsil tables
//! load`.
//!
//! Key layout: row `id` of a table is the key `{PREFIX/BUCKET}ID` (`ID` in
//! decimal) holding the row's bytes, the same layout as the table's file.
//! `PREFIX` is `narsil/MODEL/VERSION/TABLE` (the split schema's name,
//! version and table), so two model versions never read each other's rows;
//! `BUCKET` is `id % buckets`. The braces are Redis Cluster's hash tag: the
//! rows of one bucket share a hash slot, so the distinct ids of a fused
//! batch that fall in one bucket are read with one `MGET`, and a table
//! spreads over `buckets` slots (16 by default): the model's tables
//! together over every master. A batch sends tables x buckets commands at
//! most: 64 buckets took twice as long per batch as 16.
//! The key `{PREFIX/meta}rows` holds the row count, written last by a load,
//! so a store that lacks it was never fully loaded ([`keys`]).
//!
//! A fetch looks the batch's distinct ids up in the process's hot-row cache
//! ([`crate::stores::row_cache`]) and sends one `MGET` per table and bucket that
//! holds missed ids, every table's together over the cluster client's
//! multiplexed connections, bounded by the store's timeout and the batch's
//! deadline ([`rows`]). A missing row is an error unless the operator
//! chose `--missing-rows zero`.
//!
//! Online updates (`narsil tables push`): the pusher writes new rows, then
//! publishes their ids on the channel [`INVALIDATION_CHANNEL`] (Redis
//! Cluster forwards a `PUBLISH` to every node). Each process subscribes
//! through one node ([`invalidation`]) and removes those rows from its
//! cache, so its next batch reads them from the cluster. What a fused batch
//! can observe: each row either before or after the update (never a mix
//! within a row); rows of one batch may be from either side. The cache is
//! used only while the subscription is up (its node answers a ping every
//! second): when it drops, the cache is cleared and every row is read from
//! the cluster until the process has subscribed again, so a lost
//! invalidation can never leave an old row cached. A fetch that began
//! before an invalidation of its table does not cache what it read (the
//! table's epoch moved), so an old row cannot come back after its
//! invalidation.
//!
//! Start-up: a cluster that does not answer when a model is loaded fails
//! the load with an error naming the seeds and `--table-store` (`narsil
//! serve` exits 1): a wrong address or a store that is not up yet shows at
//! deploy time, where an orchestrator restarts the process, instead of as a
//! server that listens and answers nothing. Topology: the slot map is
//! re-read from every node of the last map as well as from the seeds, so a
//! single seed whose master died does not leave the store blind.
//!
//! Health ([`reachability`]): the process pings every master four times a
//! second; when none has answered for [`UNREACHABLE_AFTER`], every engine
//! serving from the cluster is told the store does not answer (grpc.health
//! NOT_SERVING, with or without traffic), and told again at the first
//! answer. One master down (a failover) leaves the others answering: it
//! alone never turns a replica NOT_SERVING, as every replica would turn at
//! once.
//!
//! The files, one job each: [`config`] (the seeds and the store's
//! settings, with their defaults), [`store`] (the kind `--table-store`
//! names, opening a model's tables), [`cluster`] (the shared connection and
//! running commands from blocking callers), [`client`] (configuring the
//! clients, the runtime bridge), [`keys`] (the key layout), [`rows`]
//! (reading a batch's rows), [`invalidation`] and [`reachability`];
//! [`writes`] (loading and pushing rows in the key layout, what `narsil
//! tables load` and `push` call).

pub mod client;
pub mod cluster;
pub mod config;
pub mod invalidation;
pub mod keys;
pub mod reachability;
pub mod rows;
pub mod store;
pub mod writes;

pub use client::{Client, ClientError};
pub use cluster::RedisCluster;
pub use config::{RedisSeeds, RedisStoreConfig, DEFAULT_CACHE_BYTES, DEFAULT_FETCH_TIMEOUT};
pub use invalidation::INVALIDATION_CHANNEL;
pub use keys::{bucket_chunks, row_key, rows_key, DEFAULT_BUCKETS};
pub use reachability::UNREACHABLE_AFTER;
pub use rows::RedisRows;
pub use store::STORE;
