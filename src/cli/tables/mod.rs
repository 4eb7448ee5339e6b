//! `narsil tables load`: puts a split model's tables on a Redis Cluster
//! for the `redis` table store, then records where in the model's
//! `schema.json`. `narsil tables push`: writes new rows for a live model
//! there, and tells every serving process to drop its cached copies. The
//! commands are here; writing the rows in the store's key layout is
//! [`narsil_embedding::stores::redis::writes`]. `narsil tables order`: a copy of a model with its tables laid
//! out in popularity order ([`order`]). `narsil tables map`: a table's id
//! map from a vocabulary, sorted on disk ([`map`]). `narsil tables
//! push-ids`: new raw ids and their rows added to a served model's id maps
//! ([`push_ids`]). What they write into a model is published by rename
//! ([`narsil_embedding::publish`]). The formats' writers are
//! `narsil_embedding`'s, beside their readers (`popularity_order::writer`,
//! `id_map::build`, `stores::redis::writes`, `schema::edit`): these
//! commands keep their arguments, progress lines and publication.

mod map;
mod order;
mod push_ids;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, Subcommand};
use narsil_embedding::schema::edit::edit_tables;
use narsil_embedding::stores::redis::writes::{load_table, push_rows};
use narsil_embedding::stores::redis::DEFAULT_BUCKETS;
use narsil_embedding::{LocalRows, RedisCluster, RedisSeeds, RedisTableSpec, SplitSchema, Table};

/// `narsil tables ...`.
#[derive(Debug, Args)]
pub struct TablesArgs {
    #[command(subcommand)]
    command: TablesCommand,
}

#[derive(Debug, Subcommand)]
enum TablesCommand {
    /// Write a split model's tables to a Redis Cluster (every row, then a
    /// check that every row is there), and name the cluster's keys in the
    /// model's schema.json. Idempotent: running it again rewrites the same
    /// keys, so an interrupted load is finished by running it again.
    Load(LoadTablesArgs),
    /// Write new rows for a model whose tables are on a Redis Cluster,
    /// while it is served: the rows where NEW's tables differ from MODEL's,
    /// then their ids on the invalidation channel, so that every replica
    /// reads them afresh (no restart, no reload).
    Push(PushTablesArgs),
    /// Add new raw ids, each with its row, to the id maps of a model while
    /// it is served (tables in the memory or mmap store): the entries of
    /// --from's maps that MODEL's maps lack, rows from --from's tables,
    /// sent to each server's admin address. Each body is added at once to
    /// every ready version of the model; no new version, no reload.
    PushIds(push_ids::PushIdsArgs),
    /// Write a copy of a split model whose tables hold their rows in
    /// popularity order (from an id log), each with a slot index: hot rows
    /// then share pages and blocks, which is what the `mmap` and `disk`
    /// stores read. Every store serves the copy with the same scores.
    Order(order::OrderTablesArgs),
    /// Build a table's id map (raw 64-bit ids to rows) from a vocabulary,
    /// the raw id of each row, and name it in the model's schema.json. The
    /// ids are sorted on disk in runs: the peak memory is --memory-bytes
    /// and a few MiB, whatever the vocabulary's size.
    Map(map::MapTablesArgs),
}

/// `narsil tables push`.
#[derive(Debug, Args)]
pub struct PushTablesArgs {
    /// The split model whose tables are loaded (its schema.json names
    /// their keys; its table files are what the cluster holds).
    model: PathBuf,
    /// The cluster: `redis://HOST:PORT[,HOST:PORT...]`.
    #[arg(long)]
    store: String,
    /// A split model directory with the new rows: tables of the same
    /// names and shapes.
    #[arg(long)]
    from: PathBuf,
    /// Rows written (and invalidated) per step.
    #[arg(long, default_value_t = 1000)]
    rows_per_step: usize,
    /// Pace: at most this many rows per second (0: as fast as the cluster
    /// takes them).
    #[arg(long, default_value_t = 0)]
    rows_per_second: u64,
}

/// `narsil tables load`.
#[derive(Debug, Args)]
pub struct LoadTablesArgs {
    /// The split model directory (its schema.json and tables/).
    model: PathBuf,
    /// The cluster: `redis://HOST:PORT[,HOST:PORT...]` (seed nodes).
    #[arg(long)]
    store: String,
    /// Hash-tag buckets per table: a fused batch reads a table with one
    /// MGET per bucket its ids fall in; more buckets spread a table over
    /// more hash slots (and masters), fewer send fewer commands per batch.
    #[arg(long, default_value_t = DEFAULT_BUCKETS, value_parser = clap::value_parser!(u32).range(1..=16384))]
    buckets: u32,
}

/// Runs `narsil tables ...` (blocking: the Redis client has its own
/// runtime).
pub fn run(args: TablesArgs) -> anyhow::Result<()> {
    match args.command {
        TablesCommand::Load(args) => load(&args),
        TablesCommand::Push(args) => push(&args),
        TablesCommand::PushIds(args) => push_ids::push_ids(&args),
        TablesCommand::Order(args) => order::order(&args),
        TablesCommand::Map(args) => map::map(&args),
    }
}

/// Opens a table to read its rows in id order (`Table::bytes`): mapped, or
/// read into memory (which puts a table in popularity order back in id
/// order).
fn in_id_order(dir: &Path, spec: &narsil_embedding::TableSpec) -> anyhow::Result<Table> {
    let store = if spec.layout.is_some() { LocalRows::Memory } else { LocalRows::Mmap };
    Ok(Table::load(dir, spec, store)?)
}

fn load(args: &LoadTablesArgs) -> anyhow::Result<()> {
    let seeds = RedisSeeds::parse(&args.store).map_err(|e| anyhow::anyhow!("--store: {e}"))?;
    let schema = SplitSchema::read(&args.model).with_context(|| format!("{}", args.model.display()))?;
    let cluster = RedisCluster::connect(&seeds, Duration::from_secs(30))?;
    let started = Instant::now();
    let (mut rows, mut bytes) = (0u64, 0u64);
    let mut specs = Vec::with_capacity(schema.tables.len());
    for (i, spec) in schema.tables.iter().enumerate() {
        let table = in_id_order(&args.model, spec)?;
        let redis = RedisTableSpec {
            prefix: format!("narsil/{}/{}/{}", schema.name, schema.version, spec.name),
            buckets: args.buckets,
        };
        let table_started = Instant::now();
        let mut last_print = Instant::now();
        let label = format!("[{}/{}] {}", i + 1, schema.tables.len(), spec.name);
        let loaded = load_table(&cluster, &redis, table.bytes(), spec.row_bytes, |written| {
            if last_print.elapsed() > Duration::from_millis(500) {
                eprint!("\r{label}: {written}/{} rows", spec.rows);
                let _ = std::io::stderr().flush();
                last_print = Instant::now();
            }
        })?;
        eprintln!(
            "\r{label}: {} rows, {:.1} MiB in {:.1} s, every row checked",
            loaded.rows,
            loaded.bytes as f64 / (1 << 20) as f64,
            table_started.elapsed().as_secs_f64()
        );
        rows += loaded.rows;
        bytes += loaded.bytes;
        specs.push((spec.name.clone(), redis));
    }
    record_locations(&args.model, &specs)?;
    println!(
        "loaded {} tables ({rows} rows, {:.1} MiB) of {} version {} onto {seeds} in {:.1} s; {} names them",
        specs.len(),
        bytes as f64 / (1 << 20) as f64,
        schema.name,
        schema.version,
        started.elapsed().as_secs_f64(),
        args.model.join("schema.json").display()
    );
    Ok(())
}

fn push(args: &PushTablesArgs) -> anyhow::Result<()> {
    let seeds = RedisSeeds::parse(&args.store).map_err(|e| anyhow::anyhow!("--store: {e}"))?;
    let schema = SplitSchema::read(&args.model).with_context(|| format!("{}", args.model.display()))?;
    let new_schema =
        SplitSchema::read(&args.from).with_context(|| format!("--from {}", args.from.display()))?;
    let cluster = RedisCluster::connect(&seeds, Duration::from_secs(30))?;
    let started = Instant::now();
    let (mut compared, mut pushed) = (0u64, 0u64);
    for spec in &schema.tables {
        let redis = spec.redis.as_ref().with_context(|| {
            format!("table {:?} is not on a cluster: run `narsil tables load` first", spec.name)
        })?;
        let new_spec =
            new_schema.table(&spec.name).with_context(|| format!("--from has no table {:?}", spec.name))?;
        if (new_spec.rows, new_spec.row_bytes, new_spec.storage) != (spec.rows, spec.row_bytes, spec.storage)
        {
            anyhow::bail!("table {:?}: --from's shape differs (rows, row bytes, storage)", spec.name);
        }
        let old = in_id_order(&args.model, spec)?;
        let new = in_id_order(&args.from, new_spec)?;
        let changed: Vec<u64> = (0..spec.rows)
            .filter(|&id| {
                let range = id as usize * spec.row_bytes..(id as usize + 1) * spec.row_bytes;
                old.bytes()[range.clone()] != new.bytes()[range]
            })
            .collect();
        compared += spec.rows;
        for step in changed.chunks(args.rows_per_step.max(1)) {
            push_rows(&cluster, redis, new.bytes(), spec.row_bytes, step)?;
            pushed += step.len() as u64;
            if args.rows_per_second > 0 {
                let due = Duration::from_secs_f64(pushed as f64 / args.rows_per_second as f64);
                std::thread::sleep(due.saturating_sub(started.elapsed()));
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "pushed {pushed} changed rows of {compared} onto {seeds} in {seconds:.2} s ({:.0} rows/s), each invalidated",
        pushed as f64 / seconds.max(1e-9)
    );
    Ok(())
}

/// Adds each table's `redis` location to `dir/schema.json`, keeping every
/// other field as it is.
fn record_locations(dir: &Path, specs: &[(String, RedisTableSpec)]) -> anyhow::Result<()> {
    edit_tables(dir, dir, |name, table| {
        if let Some((_, redis)) = specs.iter().find(|(n, _)| n == name) {
            table["redis"] = serde_json::to_value(redis)?;
        }
        Ok(())
    })
}
