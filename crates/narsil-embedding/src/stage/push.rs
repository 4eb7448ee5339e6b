//! Pushing raw ids with their rows to a mapped table while it serves
//! ([`EmbeddingStage::push_ids`]): which pushes are refused and why, how a
//! push's entries are checked against what the table holds before its new
//! ids are swapped in at once ([`super::pushed_ids`]), how a push replayed
//! from the model's push log differs (an id the version holds keeps its
//! row), and the bound on the bytes a table's pushed ids hold.

use narsil_core::{IdMapTable, IdPush, IdsPushed, PushMode, INDEX_BYTES_PER_ID};

use super::map_ids::IdMapping;
use super::pushed_ids::{invalid_row, RawIds};
use super::{EmbeddingStage, StageTable};
use crate::schema::{Storage, TableSpec};

/// The most ids one table may hold pushed (a pushed id's place is a `u32`).
pub const MAX_PUSHED_IDS: u64 = u32::MAX as u64;

impl EmbeddingStage {
    /// Refuses every push from now on, saying `why`: for a stage whose
    /// tables are looked up elsewhere (copied to a device at load), which
    /// would never see the pushed rows.
    pub fn refuse_pushes(&mut self, why: impl Into<String>) {
        self.push_refusal = Some(why.into());
    }

    /// Ids pushed to table `table` so far; none for a table without an id
    /// map (or no such table).
    pub fn pushed(&self, table: &str) -> Option<u64> {
        match &self.tables.iter().find(|t| t.spec.name == table)?.mapping {
            IdMapping::Map { overlay, .. } => Some(overlay.len()),
            IdMapping::Identity | IdMapping::Modulo(_) => None,
        }
    }

    /// The tables that declare an id map, each with its rows' format and
    /// why it takes no pushes, if it takes none.
    pub fn id_map_tables(&self) -> Vec<IdMapTable> {
        self.tables
            .iter()
            .filter(|t| matches!(t.mapping, IdMapping::Map { .. }))
            .map(|t| IdMapTable {
                name: t.spec.name.clone(),
                row_format: row_format(&t.spec),
                refused: self.refusal(t),
            })
            .collect()
    }

    /// Why `table` (which declares a map) takes no pushes, if it takes none.
    fn refusal(&self, table: &StageTable) -> Option<String> {
        let name = &table.spec.name;
        if let Some(why) = &self.push_refusal {
            return Some(format!("table {name:?}: {why}"));
        }
        table
            .store
            .local_rows()
            .is_none()
            .then(|| format!("table {name:?}: {}", store_refusal(table.store.kind())))
    }

    /// Adds raw ids to table `push.table`'s id map with their rows
    /// ([`narsil_core::BackendFactory::push_ids`]: `entries` back to back,
    /// an 8-byte little-endian raw id then the table's `row_bytes` of its
    /// row), as `push.mode` says: checked only, applied (every new id
    /// servable at once, with the next batch, or none is), or replayed.
    ///
    /// Refused, naming why, for a table without an id map, a store that does
    /// not hold its rows in this process, a stage that refuses pushes, a
    /// body that is not whole entries, a row whose numbers are not finite,
    /// more ids than [`MAX_PUSHED_IDS`] or bytes than `push.max_bytes`
    /// (counted in `narsil_table_pushes_over_bound_total`), and, unless
    /// replayed, a raw id the table already holds (in its map or pushed)
    /// with another row. An id it already holds with the same row is left
    /// as it is and counted (`already_held`): a push sent twice changes
    /// nothing. Replayed, an id it holds with another row keeps it
    /// (`superseded`).
    pub fn push_ids(&self, push: &IdPush<'_>) -> Result<IdsPushed, String> {
        let table = push.table;
        let Some(t) = self.tables.iter().find(|t| t.spec.name == table) else {
            return Err(format!("the model has no table {table:?}"));
        };
        let (map, overlay) = match &t.mapping {
            IdMapping::Map { map, overlay, .. } => (map, overlay),
            IdMapping::Identity | IdMapping::Modulo(_) => {
                return Err(format!(
                    "table {table:?} declares no id map (its ids are {}): raw ids are pushed only to tables whose schema.json maps them (\"ids\": {{\"map\": ...}})",
                    if matches!(t.mapping, IdMapping::Modulo(_)) { "hashed modulo its rows" } else { "its rows" }
                ));
            }
        };
        if let Some(why) = self.refusal(t) {
            return Err(why);
        }
        let (row_bytes, storage) = (t.spec.row_bytes, t.spec.storage);
        let entry = 8 + row_bytes;
        if !push.entries.len().is_multiple_of(entry) {
            return Err(format!(
                "a push to table {table:?} is entries of {entry} bytes (a raw id, 8 bytes little-endian, then a row of {row_bytes} bytes): {} bytes are not whole entries (a row of the wrong size?)",
                push.entries.len()
            ));
        }
        let held_row = |row: u64| t.store.local_row(row as i64, row_bytes).expect("checked above");
        let charge = row_bytes as u64 + INDEX_BYTES_PER_ID;
        overlay.push(|current| {
            let (mut raws, mut rows) = (Vec::new(), Vec::new());
            let (mut already_held, mut superseded) = (0u64, 0u64);
            let mut new = RawIds::default();
            for entry in push.entries.chunks_exact(entry) {
                let (raw, row) = (i64::from_le_bytes(entry[..8].try_into().expect("8 bytes")), &entry[8..]);
                if let Some(why) = invalid_row(storage, row) {
                    return Err(format!("raw id {raw}: {why}; nothing pushed"));
                }
                let held = match (map.row(raw), current.get(raw), new.get(&raw)) {
                    (Some(r), _, _) => Some((held_row(r), format!("in its id map (row {r})"))),
                    (None, Some(k), _) => Some((current.row(k), "pushed before".to_string())),
                    (None, None, Some(&i)) => {
                        let at = i as usize * row_bytes;
                        Some((&rows[at..at + row_bytes], "earlier in this push".to_string()))
                    }
                    (None, None, None) => None,
                };
                // Values only: padding is not a row's (a table laid out by
                // its map keeps raw ids there).
                let values = storage.value_bytes(t.spec.dim);
                match held {
                    Some((held, _)) if held[..values] == row[..values] => already_held += 1,
                    Some(_) if push.mode == PushMode::Replay => superseded += 1,
                    Some((_, where_)) => {
                        return Err(format!(
                            "raw id {raw} is already held by table {table:?} ({where_}) with another row: a push adds new ids, it does not change a held id's row (publish a new model version for that); nothing pushed"
                        ));
                    }
                    None => {
                        new.insert(raw, raws.len() as u32);
                        raws.push(raw);
                        rows.extend_from_slice(row);
                    }
                }
            }
            let (held, added) = (current.len(), raws.len() as u64);
            if held + added > MAX_PUSHED_IDS {
                return Err(format!(
                    "table {table:?} holds {held} pushed ids: {added} more would pass the {MAX_PUSHED_IDS} a table may hold; publish a new model version with them in its map"
                ));
            }
            let bytes = (held + added) * charge;
            if added > 0 && bytes > push.max_bytes {
                t.counters.pushes_over_bound.inc();
                return Err(format!(
                    "table {table:?} holds {held} pushed ids ({} bytes: their rows and {INDEX_BYTES_PER_ID} bytes of index each): {added} more would hold {bytes} bytes, past {} ({} bytes a table); nothing pushed (publish a new model version with them in its map, or raise the bound)",
                    held * charge,
                    push.bound_name,
                    push.max_bytes
                ));
            }
            let answer = IdsPushed { added, already_held, superseded, pushed: held + added, bytes };
            if push.mode == PushMode::Check || added == 0 {
                return Ok((answer, None));
            }
            // Inside the push: pushes set them in the order they land.
            t.counters.pushed_ids.set(answer.pushed as i64);
            t.counters.pushed_bytes.set(bytes as i64);
            Ok((answer, Some(current.with(&raws, rows))))
        })
    }
}

/// A table's rows' format as push logs name it: `STORAGE-DIM-ROW_BYTES`
/// (`int8_rowwise-64-80`; two dims may pad to the same row bytes).
fn row_format(spec: &TableSpec) -> String {
    let storage = match spec.storage {
        Storage::Int8Rowwise => "int8_rowwise",
        Storage::Fp32 => "fp32",
    };
    format!("{storage}-{}-{}", spec.dim, spec.row_bytes)
}

/// Why a table in a store of kind `kind` takes no pushed ids (its rows are
/// not in this process).
fn store_refusal(kind: &str) -> String {
    let publish = "to serve new ids, publish a new model version whose tables and id maps hold them (the repository switches to it live)";
    match kind {
        "disk" => format!(
            "the disk store reads its rows from the table's file by direct I/O, and pushed rows are held beside rows in this process only (the memory and mmap stores): {publish}"
        ),
        "redis" => format!(
            "its rows are on a Redis Cluster, but its id map is a local file of the model version and pushing map entries to a cluster is not built: {publish}, its rows loaded with `narsil tables load` (`narsil tables push` changes rows of ids the map already holds)"
        ),
        other => format!("the {other} store does not hold its rows in this process: {publish}"),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use narsil_core::{IdMapTable, IdPush, IdsPushed, KeyedBatch, PushMode};

    use super::super::fixtures::{
        batch, pooled_bits_both_ways, requests, rows, schema, wide_rows, LocalRows,
    };
    use super::super::pooling::tests::Fetching;
    use super::super::{EmbeddingStage, StageScratch, StageTable};
    use super::store_refusal;
    use crate::id_map::{build, IdMap, SlottedMap};
    use crate::schema::{IdMapSpec, SplitSchema, TableIds};
    use crate::stores::local::table::Table;
    use crate::stores::row_store::RowStore;

    /// Row `row`'s raw id in the tests' maps.
    fn raw(table: usize, row: i64) -> i64 {
        ((table as i64 + 1) * 1_000_003 + row).wrapping_mul(0x5851_f42d_4c95_7f2d)
    }

    /// A never-seen raw id for table `table`: `n`th of them.
    fn fresh(table: usize, n: i64) -> i64 {
        -(9_000_000_000 + table as i64 * 1_000_000 + n)
    }

    /// The fixtures' schema with a map per table holding every row but
    /// the last (its default row), and the maps.
    fn mapped() -> (SplitSchema, Vec<Option<Arc<IdMap>>>) {
        let mut schema = schema();
        let mut maps = Vec::new();
        for (t, table) in schema.tables.iter_mut().enumerate() {
            let pairs: Vec<(i64, u64)> = (0..table.rows as i64 - 1).map(|r| (raw(t, r), r as u64)).collect();
            maps.push(Some(Arc::new(
                IdMap::from_bytes(build(&pairs, table.rows).unwrap(), table.rows).unwrap(),
            )));
            table.ids = TableIds::Map(IdMapSpec {
                file: "unused".into(),
                sha256: "00".repeat(32),
                default_row: table.rows - 1,
            });
        }
        (schema, maps)
    }

    /// `batch` with its ids raw: `replace(table, row)` where it gives one,
    /// else the row's raw id.
    fn raw_batch(
        schema: &SplitSchema,
        batch: &KeyedBatch,
        replace: impl Fn(usize, i64) -> Option<i64>,
    ) -> KeyedBatch {
        let mut sent = batch.clone();
        for (f, feature) in schema.features.iter().enumerate() {
            let t = schema.tables.iter().position(|t| t.name == feature.table).unwrap();
            for id in &mut sent.ids[batch.feature_offsets[f]..batch.feature_offsets[f + 1]] {
                *id = replace(t, *id).unwrap_or(raw(t, *id));
            }
        }
        sent
    }

    /// Pushes `body` to `table` of `stage`, applied, without a bound.
    fn push(stage: &EmbeddingStage, table: &str, body: &[u8]) -> Result<IdsPushed, String> {
        stage.push_ids(&IdPush::apply(table, body, u64::MAX, "no bound"))
    }

    /// Entries of a push: each raw id with the row `row` of `table`.
    fn entries(table: &Table, row_bytes: usize, pairs: &[(i64, u64)]) -> Vec<u8> {
        let mut body = Vec::new();
        for &(raw, row) in pairs {
            body.extend_from_slice(&raw.to_le_bytes());
            body.extend_from_slice(&table.bytes()[row as usize * row_bytes..(row as usize + 1) * row_bytes]);
        }
        body
    }

    #[test]
    fn a_pushed_id_pools_the_same_bits_as_the_row_it_copies_in_memory_and_laid_out() {
        let (mapped, maps) = mapped();
        let plain = schema();
        let tables: Vec<Table> = plain.tables.iter().enumerate().map(|(i, t)| rows(t, 3 + i as u8)).collect();
        let rows_batch = batch();
        let mut expected = Vec::new();
        let stores =
            plain.tables.iter().enumerate().map(|(i, t)| Arc::new(rows(t, 3 + i as u8)) as _).collect();
        EmbeddingStage::new(&plain, stores)
            .pool(&rows_batch, &mut StageScratch::default(), &mut expected)
            .unwrap();
        // Row 9 of "shared" and row 4 of "own" sent as ids never seen.
        let new = |t: usize, row: i64| ((t, row) == (0, 9) || (t, row) == (1, 4)).then(|| fresh(t, row));
        let sent = raw_batch(&mapped, &rows_batch, new);
        for laid_out in [false, true] {
            let stores: Vec<Arc<dyn RowStore>> = plain
                .tables
                .iter()
                .zip(&tables)
                .enumerate()
                .map(|(i, (spec, table))| match laid_out {
                    false => Arc::new(rows(spec, 3 + i as u8)) as Arc<dyn RowStore>,
                    true => Arc::new(LocalRows::laid_out(table, spec.rows as usize, 16)),
                })
                .collect();
            let stage = EmbeddingStage::with_id_maps(&mapped, stores, maps.clone());
            let (mut scratch, mut pooled) = (StageScratch::default(), Vec::new());
            stage.pool(&sent, &mut scratch, &mut pooled).unwrap();
            assert_ne!(pooled, expected, "never seen: the default rows");
            let before = pooled.clone();
            let unmapped = stage.metrics().table("shared").unmapped_ids.get();
            assert_eq!(
                push(&stage, "shared", &entries(&tables[0], 16, &[(fresh(0, 9), 9)])).unwrap().added,
                1
            );
            assert_eq!(push(&stage, "own", &entries(&tables[1], 16, &[(fresh(1, 4), 4)])).unwrap().added, 1);
            assert_eq!((stage.pushed("shared"), stage.pushed("own")), (Some(1), Some(1)));
            for _ in 0..2 {
                stage.pool(&sent, &mut scratch, &mut pooled).unwrap();
                assert_eq!(
                    pooled.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    expected.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "laid out {laid_out}"
                );
                // The same scratch, a batch that finds no pushed id.
                let mut other = Vec::new();
                stage.pool(&raw_batch(&mapped, &rows_batch, |_, _| None), &mut scratch, &mut other).unwrap();
                assert_eq!(other, expected);
            }
            // Pushed ids are not unmapped; the shared table's id 9 is sent
            // three times a batch.
            assert_eq!(stage.metrics().table("shared").unmapped_ids.get(), unmapped);
            assert_ne!(before, expected);
        }
    }

    #[test]
    fn a_table_laid_out_by_its_id_map_pools_held_new_and_pushed_ids_as_its_hash_table_does() {
        // Rows of 32 bytes: 12 of values, 20 of padding (a raw id's room).
        let (mut mapped, maps) = mapped();
        let mut plain = schema();
        for spec in mapped.tables.iter_mut().chain(plain.tables.iter_mut()) {
            spec.row_bytes = 32;
        }
        let wide = |t: usize| wide_rows(&plain.tables[t], 3 + t as u8);
        let stores = || (0..2).map(|t| Arc::new(wide(t)) as Arc<dyn RowStore>).collect::<Vec<_>>();
        let hashed = EmbeddingStage::with_id_maps(&mapped, stores(), maps.clone());
        let mut laid_out = EmbeddingStage::with_id_maps(&mapped, stores(), maps);
        assert_eq!(laid_out.lay_out_mapped_tables(), 2);
        let moved = |t: &StageTable| t.laid_out().is_some_and(SlottedMap::moved_in_place);
        assert!(laid_out.tables.iter().all(moved), "held by the stage only: rows moved in place, not copied");
        // Row 9 of "shared" and row 4 of "own" sent as ids never seen, row
        // 40 of "shared" as an id pushed with its row.
        let new = |t: usize, row: i64| [(0, 9), (1, 4), (0, 40)].contains(&(t, row)).then(|| fresh(t, row));
        let sent = raw_batch(&mapped, &batch(), new);
        let tables = [wide(0), wide(1)];
        let pushed = [(fresh(0, 40), 40)];
        let pool = |stage: &EmbeddingStage| {
            let mut pooled = Vec::new();
            stage.pool(&sent, &mut StageScratch::default(), &mut pooled).unwrap();
            pooled.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let before = pool(&laid_out);
        for stage in [&hashed, &laid_out] {
            assert_eq!(push(stage, "shared", &entries(&tables[0], 32, &pushed)).unwrap().added, 1);
        }
        let unmapped = |stage: &EmbeddingStage| {
            ["shared", "own"].map(|table| stage.metrics().table(table).unmapped_ids.get())
        };
        let counted_before = unmapped(&laid_out);
        let after = pool(&laid_out);
        assert_ne!(before, after, "the pushed id's row replaces the default row");
        assert_eq!(after, pool(&hashed));
        let counted = unmapped(&laid_out).map(|n| n as i64);
        let counted = [counted[0] - counted_before[0] as i64, counted[1] - counted_before[1] as i64];
        assert_eq!(counted, unmapped(&hashed).map(|n| n as i64));
        assert!(counted.iter().all(|&n| n > 0), "{counted:?}");
        // A held id pushed with its own row is held already (its raw id in
        // the laid-out row's padding is not the row's); with another, refused.
        let held = push(&laid_out, "shared", &entries(&tables[0], 32, &[(raw(0, 5), 5)])).unwrap();
        assert_eq!((held.added, held.already_held), (0, 1));
        let error = push(&laid_out, "shared", &entries(&tables[0], 32, &[(raw(0, 5), 6)])).unwrap_err();
        assert!(error.contains("already held") && error.contains("another row"), "{error}");
        assert_eq!(pooled_bits_both_ways(&laid_out, &sent), after, "bags pooled again, in bf16 too");
    }

    #[test]
    fn bags_of_a_laid_out_table_pooled_again_allocate_nothing_per_bag() {
        let (mut mapped, maps) = mapped();
        mapped.tables.iter_mut().for_each(|spec| spec.row_bytes = 32);
        let wide = |t: usize| Arc::new(wide_rows(&mapped.tables[t], 3 + t as u8)) as Arc<dyn RowStore>;
        let mut stage = EmbeddingStage::with_id_maps(&mapped, vec![wide(0), wide(1)], maps);
        assert_eq!(stage.lay_out_mapped_tables(), 2);
        // Every id never seen: each bag is pooled again from default rows.
        let fused = |copies: usize| {
            let requests = requests();
            let sent = narsil_core::assemble(1, 3, (0..copies).flat_map(|_| &requests));
            raw_batch(&mapped, &sent, |t, row| Some(fresh(t, row)))
        };
        let allocations = |sent: &KeyedBatch| {
            let (mut scratch, mut pooled) = (StageScratch::default(), Vec::new());
            stage.pool(sent, &mut scratch, &mut pooled).unwrap();
            let mut bf16: Vec<crate::pooled_value::Bf16> = Vec::new();
            stage.pool_into(sent, &mut StageScratch::default(), &mut bf16).unwrap();
            // Buffers warmed: what a batch of this size allocates.
            let mut bf16_scratch = StageScratch::default();
            stage.pool_into(sent, &mut bf16_scratch, &mut bf16).unwrap();
            crate::counted_allocations::during(|| {
                stage.pool(sent, &mut scratch, &mut pooled).unwrap();
                stage.pool_into(sent, &mut bf16_scratch, &mut bf16).unwrap();
            })
        };
        let (few, many) = (fused(1), fused(16));
        assert!(
            many.lengths.len() >= 8 * few.lengths.len(),
            "{} bags vs {}",
            many.lengths.len(),
            few.lengths.len()
        );
        assert_eq!(allocations(&many), allocations(&few), "allocations grow with the bags pooled again");
    }

    /// The mapped schema, the plain one, its tables (rows seeded 3, 4, ...
    /// per table) and a stage over them with the mapped schema's id maps.
    fn pushable_stage() -> (SplitSchema, SplitSchema, Vec<Table>, EmbeddingStage) {
        let (mapped, maps) = mapped();
        let plain = schema();
        let tables: Vec<Table> = plain.tables.iter().enumerate().map(|(i, t)| rows(t, 3 + i as u8)).collect();
        let stores =
            plain.tables.iter().enumerate().map(|(i, t)| Arc::new(rows(t, 3 + i as u8)) as _).collect();
        let stage = EmbeddingStage::with_id_maps(&mapped, stores, maps);
        (mapped, plain, tables, stage)
    }

    /// The pooled input of the fixtures' batch sent as rows, its shared
    /// table's ids `defaulted` pooled as the default row (the last).
    fn expected_pool(plain: &SplitSchema, defaulted: &[i64]) -> Vec<f32> {
        let mut rows_batch = batch();
        let shared = plain.features.iter().enumerate().filter(|(_, f)| f.table == "shared");
        for (f, _) in shared {
            for id in &mut rows_batch.ids[rows_batch.feature_offsets[f]..rows_batch.feature_offsets[f + 1]] {
                if defaulted.contains(id) {
                    *id = plain.tables[0].rows as i64 - 1;
                }
            }
        }
        let stores =
            plain.tables.iter().enumerate().map(|(i, t)| Arc::new(rows(t, 3 + i as u8)) as _).collect();
        let mut pooled = Vec::new();
        EmbeddingStage::new(plain, stores)
            .pool(&rows_batch, &mut StageScratch::default(), &mut pooled)
            .unwrap();
        pooled
    }

    #[test]
    fn a_batch_pools_the_pushed_ids_of_the_snapshot_it_mapped_with_never_those_of_a_later_push() {
        let (mapped, plain, tables, stage) = pushable_stage();
        // The shared table's ids 3, 4, 9 and 40 sent as new ids: 4 and 9
        // pushed before the batch is mapped, 3 and 40 after.
        let new = |t: usize, row: i64| (t == 0 && [3, 4, 9, 40].contains(&row)).then(|| fresh(t, row));
        let sent = raw_batch(&mapped, &batch(), new);
        push(&stage, "shared", &entries(&tables[0], 16, &[(fresh(0, 4), 4), (fresh(0, 9), 9)])).unwrap();
        let (mut scratch, mut mapped_batch, mut pushed, mut laid_out) =
            (StageScratch::default(), KeyedBatch::default(), Vec::new(), Vec::new());
        let batch = stage.map_batch(&sent, &mut mapped_batch, Some((&mut pushed, &mut laid_out))).clone();
        (scratch.pushed, scratch.laid_out_pushed) = (pushed, laid_out);
        // The later push holds the batch's ids 3 and 40, and is large
        // enough to merge the segment the batch's snapshot holds.
        let mut later: Vec<(i64, u64)> = vec![(fresh(0, 3), 3), (fresh(0, 40), 40)];
        later.extend((0..40).map(|n| (fresh(0, 100 + n), n as u64)));
        push(&stage, "shared", &entries(&tables[0], 16, &later)).unwrap();
        let mut pooled = Vec::new();
        stage.pool_rows(&batch, &mut scratch, &mut pooled).unwrap();
        let (mapped_before, every_id) = (expected_pool(&plain, &[3, 40]), expected_pool(&plain, &[]));
        assert_ne!(mapped_before, every_id, "the later push changes the batch's pool");
        assert_eq!(pooled, mapped_before, "pooled with ids of a push that landed after the batch was mapped");
        // Mapped again, the batch finds every id.
        stage.pool(&sent, &mut StageScratch::default(), &mut pooled).unwrap();
        assert_eq!(pooled, every_id);
    }

    #[test]
    fn under_pushes_a_batch_pools_all_of_a_push_or_none_and_sees_it_once_answered() {
        let (mapped, plain, tables, stage) = pushable_stage();
        let expected = expected_pool(&plain, &[]);
        // Pushes of 50 new ids at a time while lanes pool batches whose
        // shared ids are all new ids of one push (the 8th).
        let chunk = 7;
        let ids_of =
            |chunk: i64| move |t: usize, row: i64| (t == 0).then(|| fresh(0, 1000 + chunk * 64 + row));
        let sent = raw_batch(&mapped, &batch(), ids_of(chunk));
        let mut before = Vec::new();
        stage.pool(&sent, &mut StageScratch::default(), &mut before).unwrap();
        assert_ne!(before, expected);
        let done = AtomicBool::new(false);
        let deadline = Instant::now() + Duration::from_secs(60);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                for c in 0..20 {
                    let pairs: Vec<(i64, u64)> =
                        (0..50).map(|row| (ids_of(c)(0, row).unwrap(), row as u64)).collect();
                    push(&stage, "shared", &entries(&tables[0], 16, &pairs)).unwrap();
                    std::thread::sleep(Duration::from_millis(1));
                }
                done.store(true, Ordering::Release);
            });
            let lanes: Vec<_> = (0..2)
                .map(|_| {
                    scope.spawn(|| {
                        let (mut scratch, mut pooled, mut seen) =
                            (StageScratch::default(), Vec::new(), [0; 2]);
                        // Until the pushes are done and a batch found them,
                        // or the deadline: a push that never becomes
                        // visible fails here instead of hanging.
                        while !done.load(Ordering::Acquire) || seen[1] == 0 {
                            assert!(
                                Instant::now() < deadline,
                                "no batch pooled the pushed ids within 60 s (pushes done: {}; batches without them, with them: {seen:?})",
                                done.load(Ordering::Acquire)
                            );
                            stage.pool(&sent, &mut scratch, &mut pooled).unwrap();
                            match (pooled == before, pooled == expected) {
                                (true, _) => seen[0] += 1,
                                (_, true) => seen[1] += 1,
                                _ => panic!("a batch pooled some of a push's ids and not others"),
                            }
                        }
                        seen
                    })
                })
                .collect();
            for lane in lanes {
                let seen = lane.join().unwrap();
                assert!(seen[1] > 0, "{seen:?}");
            }
        });
    }

    #[test]
    fn pushes_are_refused_naming_why_and_a_refused_push_changes_nothing() {
        let (mapped, maps) = mapped();
        let plain = schema();
        let table = rows(&plain.tables[0], 3);
        let local = |seed| -> Vec<Arc<dyn RowStore>> {
            plain.tables.iter().map(|t| Arc::new(rows(t, seed)) as Arc<dyn RowStore>).collect()
        };
        let refused =
            |stage: &EmbeddingStage, table: &str, body: &[u8]| push(stage, table, body).unwrap_err();
        let one = entries(&table, 16, &[(fresh(0, 1), 3)]);
        // No map.
        let error = refused(&EmbeddingStage::new(&plain, local(3)), "shared", &one);
        assert!(error.contains("declares no id map"), "{error}");
        // Rows not in this process.
        let fetching: Vec<Arc<dyn RowStore>> =
            plain.tables.iter().map(|t| Arc::new(Fetching(rows(t, 3))) as Arc<dyn RowStore>).collect();
        let error = refused(&EmbeddingStage::with_id_maps(&mapped, fetching, maps.clone()), "shared", &one);
        assert!(error.contains("does not hold its rows in this process"), "{error}");
        assert!(error.contains("publish a new model version"), "{error}");
        for kind in ["disk", "redis"] {
            let why = store_refusal(kind);
            assert!(why.contains("publish a new model version"), "{why}");
        }
        assert!(store_refusal("redis").contains("not built"));
        assert!(store_refusal("disk").contains("direct I/O"));
        // Tables on a device.
        let mut stage = EmbeddingStage::with_id_maps(&mapped, local(3), maps.clone());
        stage.refuse_pushes("the tables are on the device");
        assert!(refused(&stage, "shared", &one).contains("on the device"));

        let stage = EmbeddingStage::with_id_maps(&mapped, local(3), maps);
        assert!(refused(&stage, "nope", &one).contains("no table \"nope\""));
        let error = refused(&stage, "shared", &one[..one.len() - 1]);
        assert!(error.contains("24 bytes") && error.contains("not whole entries"), "{error}");
        // Held by the map: with its own row, left as is; with another,
        // refused.
        let held = entries(&table, 16, &[(raw(0, 5), 5)]);
        assert_eq!(
            push(&stage, "shared", &held).unwrap(),
            IdsPushed { added: 0, already_held: 1, pushed: 0, ..Default::default() }
        );
        let mut other = entries(&table, 16, &[(fresh(0, 2), 2), (raw(0, 5), 6)]);
        let error = refused(&stage, "shared", &other);
        assert!(
            error.contains(&format!("raw id {}", raw(0, 5))) && error.contains("id map (row 5)"),
            "{error}"
        );
        // A row that is no number.
        other = entries(&table, 16, &[(fresh(0, 2), 2)]);
        other[8 + 1] = 0x7c;
        assert!(refused(&stage, "shared", &other).contains("not a finite number"));
        // Twice in one push with two rows.
        let twice = entries(&table, 16, &[(fresh(0, 2), 2), (fresh(0, 2), 3)]);
        assert!(refused(&stage, "shared", &twice).contains("earlier in this push"));
        assert_eq!(stage.pushed("shared"), Some(0), "refused pushes changed nothing");
        // Pushed, then sent again: the same; with another row: refused.
        let pushed = entries(&table, 16, &[(fresh(0, 2), 2), (fresh(0, 3), 3), (fresh(0, 2), 2)]);
        assert_eq!(
            push(&stage, "shared", &pushed).unwrap(),
            IdsPushed { added: 2, already_held: 1, pushed: 2, superseded: 0, bytes: 2 * (16 + 32) }
        );
        assert_eq!(
            push(&stage, "shared", &pushed).unwrap(),
            IdsPushed { added: 0, already_held: 3, pushed: 2, superseded: 0, bytes: 2 * (16 + 32) }
        );
        let error = refused(&stage, "shared", &entries(&table, 16, &[(fresh(0, 3), 4)]));
        assert!(error.contains("pushed before"), "{error}");
        assert_eq!(stage.metrics().table("shared").pushed_ids.get(), 2);
    }

    #[test]
    fn a_push_past_the_byte_bound_is_refused_naming_it_counted_and_changes_nothing() {
        let (_, _, tables, stage) = pushable_stage();
        let table = &tables[0];
        // 48 bytes an id (a 16-byte row, 32 of index): three fit in 150.
        let bounded = |body: &[u8]| stage.push_ids(&IdPush::apply("shared", body, 150, "--max-pushed-bytes"));
        let three = entries(table, 16, &[(fresh(0, 1), 1), (fresh(0, 2), 2), (fresh(0, 3), 3)]);
        assert_eq!(bounded(&three).unwrap().bytes, 144);
        let error = bounded(&entries(table, 16, &[(fresh(0, 4), 4)])).unwrap_err();
        assert!(
            error.contains("--max-pushed-bytes (150 bytes a table)")
                && error.contains("holds 3 pushed ids (144 bytes")
                && error.contains("1 more would hold 192 bytes"),
            "{error}"
        );
        let counters = stage.metrics().table("shared");
        assert_eq!((counters.pushes_over_bound.get(), counters.pushed_bytes.get()), (1, 144));
        assert_eq!(stage.pushed("shared"), Some(3));
        // Ids already held add nothing: sent again, taken.
        assert_eq!(bounded(&three).unwrap().already_held, 3);
    }

    #[test]
    fn a_checked_push_says_what_it_would_do_and_changes_nothing() {
        let (_, _, tables, stage) = pushable_stage();
        let table = &tables[0];
        let body = entries(table, 16, &[(fresh(0, 1), 1), (raw(0, 5), 5)]);
        let check = IdPush::apply("shared", &body, u64::MAX, "no bound").in_mode(PushMode::Check);
        let checked = stage.push_ids(&check).unwrap();
        assert_eq!((checked.added, checked.already_held, checked.pushed), (1, 1, 1));
        assert_eq!(stage.pushed("shared"), Some(0));
        assert_eq!(stage.metrics().table("shared").pushed_ids.get(), 0);
        let conflict = entries(table, 16, &[(raw(0, 5), 6)]);
        assert!(stage
            .push_ids(&IdPush { entries: &conflict, ..check })
            .unwrap_err()
            .contains("id map (row 5)"));
        assert_eq!(push(&stage, "shared", &body).unwrap(), checked);
    }

    #[test]
    fn a_replayed_push_keeps_the_rows_a_version_holds_and_adds_the_rest() {
        let (mapped, plain, tables, stage) = pushable_stage();
        push(&stage, "shared", &entries(&tables[0], 16, &[(fresh(0, 4), 4)])).unwrap();
        // The log's rows for: an id its map holds (row 9: the log says row
        // 2), an id pushed before (row 4: the log says row 7), a new id.
        let log = entries(&tables[0], 16, &[(raw(0, 9), 2), (fresh(0, 4), 7), (fresh(0, 9), 9)]);
        let replay = IdPush::apply("shared", &log, u64::MAX, "no bound").in_mode(PushMode::Replay);
        let replayed = stage.push_ids(&replay).unwrap();
        assert_eq!((replayed.added, replayed.superseded, replayed.pushed), (1, 2, 2));
        // Applied, the same entries are refused: the held rows differ.
        assert!(push(&stage, "shared", &log).unwrap_err().contains("with another row"));
        // Every id pools its own row: the map's 9, the first pushed 4.
        let sent = raw_batch(&mapped, &batch(), |t, row| (t == 0 && row == 4).then(|| fresh(0, 4)));
        let mut pooled = Vec::new();
        stage.pool(&sent, &mut StageScratch::default(), &mut pooled).unwrap();
        assert_eq!(pooled, expected_pool(&plain, &[]));
    }

    #[test]
    fn the_mapped_tables_are_listed_with_their_row_format_and_why_they_take_no_pushes() {
        let (mapped, maps) = mapped();
        let plain = schema();
        let local: Vec<Arc<dyn RowStore>> =
            plain.tables.iter().map(|t| Arc::new(rows(t, 3)) as Arc<dyn RowStore>).collect();
        let listed = |stage: &EmbeddingStage| stage.id_map_tables();
        let table = |name: &str, refused: Option<String>| IdMapTable {
            name: name.into(),
            row_format: "int8_rowwise-8-16".into(),
            refused,
        };
        let stage = EmbeddingStage::with_id_maps(&mapped, local.clone(), maps.clone());
        assert_eq!(listed(&stage), [table("shared", None), table("own", None)]);
        assert!(listed(&EmbeddingStage::new(&plain, local.clone())).is_empty());
        let mut on_device = EmbeddingStage::with_id_maps(&mapped, local, maps);
        on_device.refuse_pushes("the tables are on the device");
        let refused = listed(&on_device);
        assert!(refused[1].refused.as_ref().unwrap().contains("\"own\": the tables are on the device"));
    }
}
