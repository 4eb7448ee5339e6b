//! What the embedding stage records per table, as Prometheus metrics
//! (labelled `table`, beside the model and version labels of the engine
//! that registers them):
//!
//! * `narsil_table_ids_total`: ids looked up;
//! * `narsil_table_distinct_ids_total`: distinct ids per fused batch,
//!   summed (ids over distinct ids is the dedup ratio), for tables whose
//!   store fetches or maps rows (a table in memory is not deduplicated);
//! * `narsil_table_rows_fetched_total`: rows read from the store (one per
//!   distinct id, less those the hot-row cache held; one per id for a table
//!   in memory);
//! * `narsil_table_cache_hits_total`: distinct ids served from the hot-row
//!   cache of a remote store (`redis`); over the distinct ids, the hit
//!   rate;
//! * `narsil_table_store_errors_total`: fetches the store failed (the
//!   batch's requests got UNAVAILABLE);
//! * `narsil_table_missing_rows_total`: rows a remote store lacked, pooled
//!   as zeros (`--missing-rows zero`);
//! * `narsil_table_unmapped_ids_total`: raw ids a table's id map did not
//!   hold, served from its default row (new users and items: over
//!   `narsil_table_ids_total`, the share the model has never seen);
//! * `narsil_table_pushed_ids`: raw ids pushed to a table's id map while
//!   it serves (`narsil tables push-ids`), held with their rows;
//! * `narsil_table_pushed_bytes`: the bytes those ids are charged (their
//!   rows and 32 bytes of index each), which `--max-pushed-bytes` bounds;
//!   `narsil_table_pushes_over_bound_total`: pushes refused past that
//!   bound;
//! * `narsil_table_fetch_seconds`: time to look up and pool one fused
//!   batch's rows of the table (for a remote store, once they arrived);
//! * `narsil_table_remote_fetch_seconds` (no `table` label): reading one
//!   fused batch's rows of every table of a store that fetches many
//!   tables at once (`redis`, `disk`), cache lookups included;
//! * `narsil_table_major_faults_total`: for stores that can wait on the
//!   disk (`mmap`), the major page faults taken while looking up: when it
//!   grows, the working set no longer fits in the page cache;
//! * `narsil_table_disk_bytes_read_total`, `narsil_table_disk_read_seconds`,
//!   `narsil_table_disk_reads_in_flight`: for the `disk` store, bytes read
//!   from a table's file (whole 4 KiB blocks), the time of each read (one
//!   run of touching blocks), and the reads under way now;
//! * `narsil_table_read_ahead_seconds` (no `table` label): reading a fused
//!   batch's mapped rows ahead in parallel, which the stage does while
//!   lookups take major faults;
//! * `narsil_request_level_bags_pooled_total`,
//!   `narsil_request_level_rows_broadcast_total` (no `table` label): the
//!   request-level bags of ranking requests pooled (once per distinct
//!   block of a fused batch and feature), and the candidate rows they were
//!   broadcast to: rows over bags is what sending them once saved;
//! * `narsil_sequence_positions_total`, `narsil_sequence_rows_total` (no
//!   `table` label): sequence positions looked up (each unit's once) and the
//!   rows that attended to them: rows times a unit's positions over the
//!   positions is what looking a history up once per request saved;
//!   `narsil_sequence_padding_positions_total`: the positions a dense
//!   network that pads every attended unit of a batch to the batch's
//!   longest would add (over positions plus padding: its padding waste).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct TableLabel {
    table: String,
}

fn fetch_buckets() -> Histogram {
    // 2 µs to ~0.5 s.
    Histogram::new(exponential_buckets(2e-6, 2.0, 18))
}

/// One table's counters (shared with the families that expose them; the
/// module's docs say what each counts). A store's batch fetch records its
/// reads in them ([`crate::stores::FetchPart`]).
#[derive(Debug, Clone)]
pub struct TableCounters {
    pub ids: Counter,
    pub distinct_ids: Counter,
    pub rows_fetched: Counter,
    pub cache_hits: Counter,
    pub store_errors: Counter,
    pub missing_rows: Counter,
    pub unmapped_ids: Counter,
    pub pushed_ids: Gauge,
    pub pushed_bytes: Gauge,
    pub pushes_over_bound: Counter,
    pub fetch_seconds: Histogram,
    pub major_faults: Counter,
    pub disk: DiskCounters,
}

impl Default for TableCounters {
    /// Counters registered nowhere.
    fn default() -> Self {
        StageMetrics::default().table("")
    }
}

/// A table's reads from its file (the `disk` store).
#[derive(Debug, Clone)]
pub struct DiskCounters {
    /// Bytes read (whole blocks).
    pub bytes_read: Counter,
    /// Seconds per read.
    pub read_seconds: Histogram,
    /// Reads under way.
    pub in_flight: Gauge,
}

impl Default for DiskCounters {
    fn default() -> Self {
        Self { bytes_read: Counter::default(), read_seconds: fetch_buckets(), in_flight: Gauge::default() }
    }
}

/// The stage's metric families.
#[derive(Debug)]
pub struct StageMetrics {
    ids: Family<TableLabel, Counter>,
    distinct_ids: Family<TableLabel, Counter>,
    rows_fetched: Family<TableLabel, Counter>,
    cache_hits: Family<TableLabel, Counter>,
    store_errors: Family<TableLabel, Counter>,
    missing_rows: Family<TableLabel, Counter>,
    unmapped_ids: Family<TableLabel, Counter>,
    pushed_ids: Family<TableLabel, Gauge>,
    pushed_bytes: Family<TableLabel, Gauge>,
    pushes_over_bound: Family<TableLabel, Counter>,
    fetch_seconds: Family<TableLabel, Histogram, fn() -> Histogram>,
    major_faults: Family<TableLabel, Counter>,
    disk_bytes_read: Family<TableLabel, Counter>,
    disk_read_seconds: Family<TableLabel, Histogram, fn() -> Histogram>,
    disk_reads_in_flight: Family<TableLabel, Gauge>,
    read_ahead_seconds: Histogram,
    remote_fetch_seconds: Histogram,
    request_level_bags: Counter,
    request_level_rows: Counter,
    sequence_positions: Counter,
    sequence_rows: Counter,
    sequence_padding: Counter,
}

impl Default for StageMetrics {
    fn default() -> Self {
        Self {
            ids: Family::default(),
            distinct_ids: Family::default(),
            rows_fetched: Family::default(),
            cache_hits: Family::default(),
            store_errors: Family::default(),
            missing_rows: Family::default(),
            unmapped_ids: Family::default(),
            pushed_ids: Family::default(),
            pushed_bytes: Family::default(),
            pushes_over_bound: Family::default(),
            fetch_seconds: Family::new_with_constructor(fetch_buckets),
            major_faults: Family::default(),
            disk_bytes_read: Family::default(),
            disk_read_seconds: Family::new_with_constructor(fetch_buckets),
            disk_reads_in_flight: Family::default(),
            read_ahead_seconds: fetch_buckets(),
            remote_fetch_seconds: fetch_buckets(),
            request_level_bags: Counter::default(),
            request_level_rows: Counter::default(),
            sequence_positions: Counter::default(),
            sequence_rows: Counter::default(),
            sequence_padding: Counter::default(),
        }
    }
}

impl StageMetrics {
    /// Table `table`'s counters, created at zero.
    pub(crate) fn table(&self, table: &str) -> TableCounters {
        let label = TableLabel { table: table.to_string() };
        TableCounters {
            ids: self.ids.get_or_create(&label).clone(),
            distinct_ids: self.distinct_ids.get_or_create(&label).clone(),
            rows_fetched: self.rows_fetched.get_or_create(&label).clone(),
            cache_hits: self.cache_hits.get_or_create(&label).clone(),
            store_errors: self.store_errors.get_or_create(&label).clone(),
            missing_rows: self.missing_rows.get_or_create(&label).clone(),
            unmapped_ids: self.unmapped_ids.get_or_create(&label).clone(),
            pushed_ids: self.pushed_ids.get_or_create(&label).clone(),
            pushed_bytes: self.pushed_bytes.get_or_create(&label).clone(),
            pushes_over_bound: self.pushes_over_bound.get_or_create(&label).clone(),
            fetch_seconds: self.fetch_seconds.get_or_create(&label).clone(),
            major_faults: self.major_faults.get_or_create(&label).clone(),
            disk: DiskCounters {
                bytes_read: self.disk_bytes_read.get_or_create(&label).clone(),
                read_seconds: self.disk_read_seconds.get_or_create(&label).clone(),
                in_flight: self.disk_reads_in_flight.get_or_create(&label).clone(),
            },
        }
    }

    /// Time spent reading batches' mapped rows ahead.
    pub(crate) fn read_ahead_seconds(&self) -> &Histogram {
        &self.read_ahead_seconds
    }

    /// Time spent reading batches' rows of the stores that fetch many
    /// tables at once.
    pub(crate) fn remote_fetch_seconds(&self) -> &Histogram {
        &self.remote_fetch_seconds
    }

    /// Counts a batch's request-level bags pooled and the rows they were
    /// broadcast to.
    pub fn count_request_level(&self, bags: usize, rows: usize) {
        self.request_level_bags.inc_by(bags as u64);
        self.request_level_rows.inc_by(rows as u64);
    }

    /// Counts a batch's sequence positions looked up, the rows that
    /// attend to them, and the padding of its attended units to their
    /// longest.
    pub fn count_sequences(&self, positions: usize, rows: usize, padding: usize) {
        self.sequence_positions.inc_by(positions as u64);
        self.sequence_rows.inc_by(rows as u64);
        self.sequence_padding.inc_by(padding as u64);
    }

    /// Sequence positions looked up, rows that attended to them, and
    /// padding to each batch's longest attended unit, so far.
    pub fn sequence_counts(&self) -> (u64, u64, u64) {
        (self.sequence_positions.get(), self.sequence_rows.get(), self.sequence_padding.get())
    }

    /// Request-level bags pooled and rows broadcast, so far.
    pub fn request_level_counts(&self) -> (u64, u64) {
        (self.request_level_bags.get(), self.request_level_rows.get())
    }

    /// Adds every family to `registry` (whose prefix is `narsil`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "request_level_bags_pooled",
            "Request-level bags of ranking requests pooled (once per distinct block of a fused batch and feature)",
            self.request_level_bags.clone(),
        );
        registry.register(
            "request_level_rows_broadcast",
            "Candidate rows that took request-level bags pooled once (rows / bags pooled x features = the saving)",
            self.request_level_rows.clone(),
        );
        registry.register(
            "sequence_positions",
            "Sequence positions looked up unpooled (each distinct history of a fused batch once)",
            self.sequence_positions.clone(),
        );
        registry.register(
            "sequence_rows",
            "Rows (candidates) that attended to a looked-up sequence, one per row and sequence",
            self.sequence_rows.clone(),
        );
        registry.register(
            "sequence_padding_positions",
            "Positions a dense network padding each attended unit of a batch to the batch's longest would add",
            self.sequence_padding.clone(),
        );
        registry.register("table_ids", "Ids looked up in a table", self.ids.clone());
        registry.register(
            "table_distinct_ids",
            "Distinct ids per fused batch in a table, summed (ids / distinct ids = the dedup ratio)",
            self.distinct_ids.clone(),
        );
        registry.register(
            "table_rows_fetched",
            "Rows read from a table's store (once per distinct id of a fused batch)",
            self.rows_fetched.clone(),
        );
        registry.register(
            "table_cache_hits",
            "Distinct ids of a fused batch served from the hot-row cache of a remote store (over distinct ids: the hit rate)",
            self.cache_hits.clone(),
        );
        registry.register(
            "table_store_errors",
            "Fetches a table's store failed (their batch's requests got UNAVAILABLE)",
            self.store_errors.clone(),
        );
        registry.register(
            "table_missing_rows",
            "Rows a remote store lacked, pooled as zeros (--missing-rows zero)",
            self.missing_rows.clone(),
        );
        registry.register(
            "table_unmapped_ids",
            "Raw ids a table's id map did not hold, served from its default row",
            self.unmapped_ids.clone(),
        );
        registry.register(
            "table_pushed_ids",
            "Raw ids pushed to a table's id map while it serves, held with their rows",
            self.pushed_ids.clone(),
        );
        registry.register_with_unit(
            "table_pushed",
            "Bytes a table's pushed ids are charged: their rows and 32 bytes of index each (bounded by --max-pushed-bytes)",
            Unit::Bytes,
            self.pushed_bytes.clone(),
        );
        registry.register(
            "table_pushes_over_bound",
            "Pushes of ids to a table refused because its pushed ids would pass --max-pushed-bytes",
            self.pushes_over_bound.clone(),
        );
        registry.register_with_unit(
            "table_fetch",
            "Time to look up and pool one fused batch's rows of a table (for a remote store, once they arrived)",
            Unit::Seconds,
            self.fetch_seconds.clone(),
        );
        registry.register_with_unit(
            "table_remote_fetch",
            "Time to read one fused batch's rows of every remote table, cache lookups included",
            Unit::Seconds,
            self.remote_fetch_seconds.clone(),
        );
        registry.register(
            "table_major_faults",
            "Major page faults while looking up a memory-mapped table (disk reads: the working set exceeds the page cache)",
            self.major_faults.clone(),
        );
        registry.register(
            "table_disk_bytes_read",
            "Bytes read from a table's file by the disk store (whole 4 KiB blocks)",
            self.disk_bytes_read.clone(),
        );
        registry.register_with_unit(
            "table_disk_read",
            "Time of one read of a table's file by the disk store (a run of touching blocks)",
            Unit::Seconds,
            self.disk_read_seconds.clone(),
        );
        registry.register(
            "table_disk_reads_in_flight",
            "Reads of a table's file by the disk store under way now",
            self.disk_reads_in_flight.clone(),
        );
        registry.register_with_unit(
            "table_read_ahead",
            "Time to read a fused batch's memory-mapped rows ahead in parallel (done while lookups take major faults)",
            Unit::Seconds,
            self.read_ahead_seconds.clone(),
        );
    }
}
