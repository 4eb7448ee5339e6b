//! The stage's first step where a table's ids are raw 64-bit values
//! ([`crate::schema::TableIds`]): a copy of the batch whose ids of those
//! tables' features (the rows' bags and the request-level units') are
//! rows, through the table's id map ([`crate::id_map`]: ids it does not
//! hold get its default row, counted in `narsil_table_unmapped_ids_total`)
//! or `id mod rows` in the table's convention
//! ([`narsil_core::ids::Modulo`]: the one rule, whichever protocol sent
//! the id). Every later step (range checks, dedup, every store's fetch,
//! pooling, the device path's lookups) then reads rows, as for any table;
//! a batch of a model without such tables is not copied.
//!
//! A mapped table that holds pushed ids ([`super::pushed_ids`]) maps the
//! ids its map lacks through one snapshot of them per batch: a pushed id
//! becomes the virtual row `rows + k`, and the snapshot is kept for the
//! batch's later steps (which read that row from it).
//!
//! The maps themselves are opened and checked with the stage
//! ([`open_id_maps`]).

use std::path::Path;
use std::sync::Arc;

use narsil_core::ids::Modulo;
use narsil_core::KeyedBatch;

use super::pushed_ids::{Overlay, PushedIds};
use super::{EmbeddingStage, StageTable};
use crate::id_map::{IdMap, SlottedMap};
use crate::schema::{SplitSchema, TableIds, TableSpec};
use crate::stores::table_error::TableError;

/// How a table's ids become rows, ready for lookups.
pub(super) enum IdMapping {
    /// Ids are rows.
    Identity,
    /// `id mod rows`, in this convention.
    Modulo(Modulo),
    /// Through the map, then the ids pushed since the model loaded; ids
    /// neither holds get `default_row`.
    Map { map: MapLookup, default_row: u64, overlay: Overlay },
}

/// Where a mapped table looks its raw ids up.
pub(super) enum MapLookup {
    /// Its map's hash table ([`IdMap`]): rows in the table's order.
    Hashed(Arc<IdMap>),
    /// The table laid out by its map ([`SlottedMap`]): rows of the laid-out
    /// table, which is the table's store.
    Slotted(Arc<SlottedMap>),
}

impl MapLookup {
    /// The row of `raw`, if the map holds it.
    pub(super) fn row(&self, raw: i64) -> Option<u64> {
        match self {
            Self::Hashed(map) => map.row(raw),
            Self::Slotted(map) => map.row(raw),
        }
    }

    /// Each of `raws`' rows into `rows`, each id the map lacks asked of
    /// `elsewhere` then given `default_row`; how many neither held.
    #[inline]
    fn map_into_or(
        &self,
        raws: &[i64],
        rows: &mut [i64],
        default_row: u64,
        elsewhere: impl FnMut(i64) -> Option<i64>,
    ) -> u64 {
        match self {
            Self::Hashed(map) => map.map_into_or(raws, rows, default_row, elsewhere),
            Self::Slotted(map) => {
                debug_assert_eq!(map.default_row(), default_row);
                map.map_into_or(raws, rows, elsewhere)
            }
        }
    }
}

impl IdMapping {
    /// The mapping `spec` declares, with its map opened (`map`: the
    /// table's, where it declares one).
    pub(super) fn of(spec: &TableSpec, map: Option<Arc<IdMap>>) -> Self {
        match (&spec.ids, map) {
            (TableIds::Identity, _) => Self::Identity,
            (TableIds::Modulo(convention), _) => Self::Modulo(*convention),
            (TableIds::Map(declared), Some(map)) => {
                let map = MapLookup::Hashed(map);
                Self::Map { map, default_row: declared.default_row, overlay: Overlay::new(spec.row_bytes) }
            }
            (TableIds::Map(_), None) => {
                panic!("table {:?} declares an id map: the stage is given it opened", spec.name)
            }
        }
    }
}

/// Per table, the pushed ids a batch mapped some of its ids to (none where
/// it mapped none): what its later steps read those rows from.
pub(super) type BatchPushed = Vec<Option<Arc<PushedIds>>>;

impl EmbeddingStage {
    /// Whether some table's ids are raw (its batches are mapped first).
    pub fn maps_ids(&self) -> bool {
        self.tables.iter().any(|t| !matches!(t.mapping, IdMapping::Identity))
    }

    /// `batch` with every id of a table whose ids are raw replaced by its
    /// row: written into `into` (its buffers reused) and returned, or
    /// `batch` itself where no table's ids are raw.
    ///
    /// Through the tables' id maps only: ids pushed while serving are the
    /// CPU stage's ([`Self::pool`]); a stage whose tables are looked up
    /// elsewhere (the device's tensor stage, which calls this) refuses
    /// pushes ([`Self::refuse_pushes`]).
    pub fn map_ids_skipping_pushes<'a>(
        &self,
        batch: &'a KeyedBatch,
        into: &'a mut KeyedBatch,
    ) -> &'a KeyedBatch {
        self.map_batch(batch, into, None)
    }

    /// [`Self::map_ids_skipping_pushes`] for the stage's own pooling,
    /// through the pushed ids too: into `pushes.0`, per table, the snapshot
    /// of them the batch used (none where it found no id in them). A table
    /// laid out by its id map keeps its raw ids (its pooling maps them:
    /// [`super::pool_laid_out`]) and gets its snapshot in `pushes.1`; the
    /// batch is copied only where some other table's ids are raw.
    pub(super) fn map_batch<'a>(
        &self,
        batch: &'a KeyedBatch,
        into: &'a mut KeyedBatch,
        pushes: Option<(&mut BatchPushed, &mut BatchPushed)>,
    ) -> &'a KeyedBatch {
        let (mut pushed, laid_out) = pushes.unzip();
        if let Some(pushed) = pushed.as_deref_mut() {
            pushed.clear();
            pushed.resize(self.tables.len(), None);
        }
        // Tables whose ids this pass leaves raw: laid out by their maps,
        // when the stage pools them itself.
        let pooling = laid_out.is_some();
        let keeps_raw = |table: &StageTable| pooling && table.laid_out().is_some();
        if let Some(laid_out) = laid_out {
            laid_out.clear();
            laid_out.resize(self.tables.len(), None);
            for (t, table) in self.tables.iter().enumerate() {
                if let (true, IdMapping::Map { overlay, .. }) = (keeps_raw(table), &table.mapping) {
                    laid_out[t] = overlay.snapshot();
                }
            }
        }
        let maps = |table: &StageTable| !matches!(table.mapping, IdMapping::Identity) && !keeps_raw(table);
        if !self.tables.iter().any(maps) {
            return batch;
        }
        batch.copy_into(into);
        for (t, table) in self.tables.iter().enumerate().filter(|(_, table)| maps(table)) {
            // One snapshot per table and batch: every id of it sees the
            // same pushes.
            let snapshot = match (&table.mapping, &pushed) {
                (IdMapping::Map { overlay, .. }, Some(_)) => overlay.snapshot(),
                _ => None,
            };
            let mut hit = false;
            for &f in &table.features {
                let range = batch.feature_offsets[f]..batch.feature_offsets[f + 1];
                hit |= map_table_ids(
                    table,
                    snapshot.as_deref(),
                    &batch.ids[range.clone()],
                    &mut into.ids[range],
                );
                let (Some(from), Some(to)) = (&batch.request_blocks, &mut into.request_blocks) else {
                    continue;
                };
                if let Some(k) = from.position(f) {
                    let range = from.feature_offsets[k]..from.feature_offsets[k + 1];
                    hit |= map_table_ids(
                        table,
                        snapshot.as_deref(),
                        &from.ids[range.clone()],
                        &mut to.ids[range],
                    );
                }
            }
            if let (true, Some(pushed)) = (hit, pushed.as_deref_mut()) {
                pushed[t] = snapshot;
            }
        }
        into
    }
}

/// `raws` as `table`'s rows, into `rows`, ids its map lacks looked up in
/// `pushed` (virtual rows `rows + k`); whether any was.
fn map_table_ids(table: &StageTable, pushed: Option<&PushedIds>, raws: &[i64], rows: &mut [i64]) -> bool {
    match &table.mapping {
        IdMapping::Identity => false,
        IdMapping::Modulo(convention) => {
            let modulus = table.spec.rows;
            for (row, &raw) in rows.iter_mut().zip(raws) {
                *row = convention.row(raw, modulus) as i64;
            }
            false
        }
        IdMapping::Map { map, default_row, .. } => {
            let Some(pushed) = pushed else {
                let unmapped = map.map_into_or(raws, rows, *default_row, |_| None);
                table.counters.unmapped_ids.inc_by(unmapped);
                return false;
            };
            let (first, mut hit) = (table.spec.rows as i64, false);
            let unmapped = map.map_into_or(raws, rows, *default_row, |raw| {
                let k = pushed.get(raw)?;
                hit = true;
                Some(first + i64::from(k))
            });
            table.counters.unmapped_ids.inc_by(unmapped);
            hit
        }
    }
}

/// The id maps of `schema`'s tables that declare one, opened from `dir`
/// and checked (every byte, and its SHA-256 against the schema's), mapped:
/// a table laid out by its map drops it at load, so only a map kept as a
/// hash table is copied onto huge pages, after the layout
/// ([`EmbeddingStage::hashed_maps_onto_huge_pages`]).
pub(super) fn open_id_maps(dir: &Path, schema: &SplitSchema) -> Result<Vec<Option<Arc<IdMap>>>, TableError> {
    let mut maps = Vec::with_capacity(schema.tables.len());
    for table in &schema.tables {
        let TableIds::Map(spec) = &table.ids else {
            maps.push(None);
            continue;
        };
        let path = dir.join(&spec.file);
        let error = |why: String| TableError::IdMap { table: table.name.clone(), path: path.clone(), why };
        let (map, sha256) = IdMap::open(&path, table.rows).map_err(|e| error(e.to_string()))?;
        if !sha256.eq_ignore_ascii_case(&spec.sha256) {
            return Err(error(format!(
                "its SHA-256 is {sha256}, but schema.json names {} (changed since it was published, or not this table's map): not served",
                spec.sha256
            )));
        }
        maps.push(Some(Arc::new(map)));
    }
    Ok(maps)
}

impl EmbeddingStage {
    /// The maps kept as hash tables of tables whose rows sit in this
    /// process's memory (read in place, never from the disk): copied onto
    /// huge pages as the tables are ([`IdMap::onto_huge_pages`]). Returns
    /// how many are on huge pages now.
    pub(super) fn hashed_maps_onto_huge_pages(&mut self) -> usize {
        let mut copied = 0;
        for table in &mut self.tables {
            let in_memory = table.store.local_rows().is_some() && !table.store.may_fault();
            if let (true, IdMapping::Map { map: MapLookup::Hashed(map), .. }) =
                (in_memory, &mut table.mapping)
            {
                // Held by this stage alone (it was opened with it).
                if let Some(map) = Arc::get_mut(map) {
                    copied += usize::from(map.move_onto_huge_pages());
                }
            }
        }
        copied
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use narsil_core::ids::Modulo;
    use narsil_core::{assemble, KeyedBatch, RequestSamples};

    use super::super::fixtures::{batch, rows, schema, wide_rows};
    use super::super::pooling::tests::Fetching;
    use super::super::{EmbeddingStage, StageScratch};
    use crate::id_map::{build, IdMap};
    use crate::schema::{IdMapSpec, SplitSchema, TableIds, TableSpec};
    use crate::stores::row_store::RowStore;

    /// Raw id of row `row` in the tests' maps: large, and negative for odd
    /// rows.
    fn raw(row: i64) -> i64 {
        let raw = (row + 1).wrapping_mul(0x5851_f42d_4c95_7f2d);
        if row % 2 == 1 {
            -raw.abs()
        } else {
            raw.abs()
        }
    }

    #[test]
    fn raw_ids_through_a_map_pool_as_their_rows_on_local_and_fetching_stores_and_new_ids_get_the_default_row()
    {
        let mut schema = schema();
        let plain = schema.clone();
        let mut maps = Vec::new();
        for table in &mut schema.tables {
            let pairs: Vec<(i64, u64)> = (0..table.rows as i64 - 1).map(|r| (raw(r), r as u64)).collect();
            let default_row = table.rows - 1;
            let map = IdMap::from_bytes(build(&pairs, table.rows).unwrap(), table.rows).unwrap();
            maps.push(Some(Arc::new(map)));
            table.ids =
                TableIds::Map(IdMapSpec { file: "unused".into(), sha256: "00".repeat(32), default_row });
        }
        let rows_batch = batch();
        // The same batch as raw ids; the ids of the last row of each table
        // become ids never seen (the default row is that last row).
        let mut raw_batch = rows_batch.clone();
        let mut unseen = 0;
        for (f, feature) in schema.features.iter().enumerate() {
            let last = schema.table(&feature.table).unwrap().rows as i64 - 1;
            for id in &mut raw_batch.ids[rows_batch.feature_offsets[f]..rows_batch.feature_offsets[f + 1]] {
                unseen += u64::from(*id == last);
                *id = if *id == last { 777_000 + f as i64 } else { raw(*id) };
            }
        }
        for local in [true, false] {
            let stores = |schema: &crate::schema::SplitSchema| -> Vec<Arc<dyn RowStore>> {
                schema
                    .tables
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        let table = rows(t, 3 + i as u8);
                        if local {
                            Arc::new(table) as Arc<dyn RowStore>
                        } else {
                            Arc::new(Fetching(table)) as Arc<dyn RowStore>
                        }
                    })
                    .collect()
            };
            let mut expected = Vec::new();
            EmbeddingStage::new(&plain, stores(&plain))
                .pool(&rows_batch, &mut StageScratch::default(), &mut expected)
                .unwrap();
            let stage = EmbeddingStage::with_id_maps(&schema, stores(&schema), maps.clone());
            assert!(stage.maps_ids());
            let (mut scratch, mut pooled) = (StageScratch::default(), Vec::new());
            // Twice: the scratch copy is reused.
            for _ in 0..2 {
                stage.pool(&raw_batch, &mut scratch, &mut pooled).unwrap();
                assert_eq!(pooled, expected, "local {local}");
            }
            let counted: u64 =
                schema.tables.iter().map(|t| stage.metrics().table(&t.name).unmapped_ids.get()).sum();
            assert_eq!(counted, 2 * unseen);
            // The mapped copy leaves the batch as sent.
            let mut copy = KeyedBatch::default();
            assert_eq!(stage.map_ids_skipping_pushes(&raw_batch, &mut copy).ids.len(), raw_batch.ids.len());
            assert_ne!(copy.ids, raw_batch.ids);
        }
    }

    #[test]
    fn maps_are_opened_mapped_and_only_those_kept_as_hash_tables_go_onto_huge_pages() {
        // Maps of 70,000 ids (over 2 MiB each, worth huge pages). "shared"
        // keeps 16 spare bytes a row (laid out: its map is dropped);
        // "own" none (kept as a hash table).
        let mut schema = schema();
        let dir = tempfile::tempdir().unwrap();
        for (t, table) in schema.tables.iter_mut().enumerate() {
            table.rows = 70_000;
            table.row_bytes = if t == 0 { 32 } else { 16 };
            let pairs: Vec<(i64, u64)> = (0..table.rows as i64 - 1).map(|r| (raw(r), r as u64)).collect();
            let bytes = build(&pairs, table.rows).unwrap();
            let file = format!("{}.idmap", table.name);
            std::fs::write(dir.path().join(&file), &bytes).unwrap();
            let sha256 = crate::sha256::sha256_of_bytes(&bytes);
            table.ids = TableIds::Map(IdMapSpec { file: file.into(), sha256, default_row: table.rows - 1 });
        }
        let maps = super::open_id_maps(dir.path(), &schema).unwrap();
        assert!(maps.iter().flatten().all(|map| !map.on_huge_pages()), "no copy at open");
        let stores =
            schema.tables.iter().map(|spec| Arc::new(wide_rows(spec, 3)) as Arc<dyn RowStore>).collect();
        let mut stage = EmbeddingStage::with_id_maps(&schema, stores, maps);
        assert_eq!(stage.lay_out_mapped_tables(), 1, "\"shared\" laid out, its map dropped uncopied");
        let copied = stage.hashed_maps_onto_huge_pages();
        let wanted = crate::stores::local::huge_pages::huge_pages_wanted();
        assert_eq!(copied, usize::from(wanted), "\"own\"'s map, kept, copied where huge pages are wanted");
    }

    /// Ids at the edges of both readings of 64 bits: around 0, 2^31, 2^32,
    /// 2^63 (`i64::MIN`, which UINT64 sends as 2^63) and 2^64 - 1 (`-1`),
    /// and large ids of either sign.
    const EXTREME_IDS: [i64; 16] = [
        0,
        1,
        -1,
        -2,
        9,
        i64::MAX,
        i64::MAX - 1,
        i64::MIN,
        i64::MIN + 1,
        1 << 31,
        -(1 << 32),
        (1 << 32) + 3,
        0x5851_f42d_4c95_7f2d,
        -0x5851_f42d_4c95_7f2d,
        -0x7fff_ffff_0000_0001,
        1_000_000_007,
    ];

    /// Table sizes: one row, a few, primes, powers of two and their
    /// neighbours (2^64 mod them and 2^63 mod them differ).
    const TABLE_ROWS: [u64; 7] = [1, 2, 10, 7, 1000, 65_536, 65_537];

    /// Per table of `rows`, the row of each id as Python's arithmetic gives
    /// it: `id % rows` on the id as a signed value, and on its 64 bits as
    /// an unsigned one (`id & (2**64 - 1)`, as KServe's UINT64 sends it).
    fn python_rows(ids: &[i64], rows: &[u64]) -> (Vec<Vec<i64>>, Vec<Vec<i64>>) {
        let workspace = concat!(env!("CARGO_MANIFEST_DIR"), "/../../.venv/bin/python");
        let python = if std::path::Path::new(workspace).exists() { workspace } else { "python3" };
        let program = "import json, sys\n\
            ids, rows = json.loads(sys.argv[1]), json.loads(sys.argv[2])\n\
            print(json.dumps([[[i % n for i in ids] for n in rows], [[(i & (2**64 - 1)) % n for i in ids] for n in rows]]))";
        let out = std::process::Command::new(python)
            .args([
                "-c",
                program,
                &serde_json::to_string(ids).unwrap(),
                &serde_json::to_string(rows).unwrap(),
            ])
            .output()
            .unwrap_or_else(|e| panic!("running {python}: {e}"));
        assert!(out.status.success(), "{python}: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    }

    #[test]
    fn modulo_tables_map_extreme_ids_as_pythons_signed_and_unsigned_arithmetic_does() {
        let (signed, unsigned) = python_rows(&EXTREME_IDS, &TABLE_ROWS);
        // The example the docs give: 2^64 - 1 in a table of 10 rows.
        let ten = TABLE_ROWS.iter().position(|&r| r == 10).unwrap();
        assert_eq!((signed[ten][2], unsigned[ten][2]), (9, 5));
        let n = EXTREME_IDS.len();
        let request = RequestSamples {
            num_samples: 1,
            dense: vec![0.5],
            lengths: vec![n as u32; TABLE_ROWS.len()],
            ids: EXTREME_IDS.repeat(TABLE_ROWS.len()),
            ..Default::default()
        };
        let batch = assemble(1, TABLE_ROWS.len(), [&request]);
        for (declared, wanted) in [
            (r#""modulo""#, &signed),
            (r#"{"modulo": "signed"}"#, &signed),
            (r#"{"modulo": "unsigned"}"#, &unsigned),
        ] {
            let ids: TableIds = serde_json::from_str(declared).unwrap_or_else(|e| panic!("{declared}: {e}"));
            let tables: Vec<TableSpec> = TABLE_ROWS
                .iter()
                .enumerate()
                .map(|(t, &rows)| TableSpec {
                    name: format!("t{t}"),
                    rows,
                    ids: ids.clone(),
                    ..schema().tables[0].clone()
                })
                .collect();
            let schema = SplitSchema::one_table_per_feature("m", "1", 1, tables, vec!["default".into()]);
            let stores = schema.tables.iter().map(|t| Arc::new(rows(t, 1)) as Arc<dyn RowStore>).collect();
            let stage = EmbeddingStage::new(&schema, stores);
            let mut mapped = KeyedBatch::default();
            let mapped = stage.map_ids_skipping_pushes(&batch, &mut mapped);
            for (t, wanted) in wanted.iter().enumerate() {
                let range = mapped.feature_offsets[t]..mapped.feature_offsets[t + 1];
                assert_eq!(&mapped.ids[range], &wanted[..], "{declared}, {} rows", TABLE_ROWS[t]);
            }
        }
    }

    #[test]
    fn a_modulo_table_takes_any_64_bit_id() {
        let mut schema = schema();
        let plain = schema.clone();
        for table in &mut schema.tables {
            table.ids = TableIds::Modulo(Modulo::Signed);
        }
        let stores = |schema: &crate::schema::SplitSchema| -> Vec<Arc<dyn RowStore>> {
            schema.tables.iter().map(|t| Arc::new(rows(t, 5)) as Arc<dyn RowStore>).collect()
        };
        let rows_batch = batch();
        let mut raw_batch = rows_batch.clone();
        for (f, feature) in schema.features.iter().enumerate() {
            let n = schema.table(&feature.table).unwrap().rows as i64;
            for (k, id) in raw_batch.ids[rows_batch.feature_offsets[f]..rows_batch.feature_offsets[f + 1]]
                .iter_mut()
                .enumerate()
            {
                // i64::MIN and -1 wrap too (signed: never negative).
                *id = match k % 3 {
                    0 => *id - n * 1_000_003,
                    1 => *id + n * ((i64::MAX - *id) / n),
                    _ => *id,
                };
            }
        }
        raw_batch.ids[0] = i64::MIN;
        let mut wrapped = rows_batch.clone();
        wrapped.ids[0] = Modulo::Signed.row(i64::MIN, schema.tables[0].rows) as i64;
        let (mut expected, mut pooled) = (Vec::new(), Vec::new());
        EmbeddingStage::new(&plain, stores(&plain))
            .pool(&wrapped, &mut StageScratch::default(), &mut expected)
            .unwrap();
        EmbeddingStage::new(&schema, stores(&schema))
            .pool(&raw_batch, &mut StageScratch::default(), &mut pooled)
            .unwrap();
        assert_eq!(pooled, expected);
    }
}
