//! Pushing raw ids with their rows to a mapped table while it serves
//! ([`EmbeddingStage::push_ids`]): which pushes are refused and why, and
//! how a push's entries are checked against what the table holds before
//! its new ids are swapped in at once ([`super::pushed_ids`]).

use narsil_core::IdsPushed;

use super::map_ids::IdMapping;
use super::pushed_ids::{invalid_row, RawIds};
use super::EmbeddingStage;

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

    /// Adds raw ids to table `table`'s id map with their rows
    /// ([`narsil_core::BackendFactory::push_ids`]: `entries` back to back,
    /// an 8-byte little-endian raw id then the table's `row_bytes` of its
    /// row). Every new id becomes servable at once, with the next batch,
    /// or none does.
    ///
    /// Refused, naming why, for a table without an id map, a store that does
    /// not hold its rows in this process, a stage that refuses pushes, a
    /// body that is not whole entries, a row whose numbers are not finite,
    /// and a raw id the table already holds (in its map or pushed) with
    /// another row. An id it already holds with the same row is left as it
    /// is and counted (`already_held`): a push sent twice changes nothing.
    pub fn push_ids(&self, table: &str, entries: &[u8]) -> Result<IdsPushed, String> {
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
        if let Some(why) = &self.push_refusal {
            return Err(format!("table {table:?}: {why}"));
        }
        if t.store.local_rows().is_none() {
            return Err(format!("table {table:?}: {}", store_refusal(t.store.kind())));
        }
        let (row_bytes, storage) = (t.spec.row_bytes, t.spec.storage);
        let entry = 8 + row_bytes;
        if !entries.len().is_multiple_of(entry) {
            return Err(format!(
                "a push to table {table:?} is entries of {entry} bytes (a raw id, 8 bytes little-endian, then a row of {row_bytes} bytes): {} bytes are not whole entries (a row of the wrong size?)",
                entries.len()
            ));
        }
        let held_row = |row: u64| t.store.local_row(row as i64, row_bytes).expect("checked above");
        overlay.push(|current| {
            let (mut raws, mut rows, mut already_held) = (Vec::new(), Vec::new(), 0u64);
            let mut new = RawIds::default();
            for entry in entries.chunks_exact(entry) {
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
                match held {
                    Some((held, _)) if held == row => already_held += 1,
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
            if current.len() + raws.len() as u64 > MAX_PUSHED_IDS {
                return Err(format!(
                    "table {table:?} holds {} pushed ids: {} more would pass the {MAX_PUSHED_IDS} a table may hold; publish a new model version with them in its map",
                    current.len(),
                    raws.len()
                ));
            }
            let added = raws.len() as u64;
            let answer = IdsPushed { added, already_held, pushed: current.len() + added };
            // Inside the push: pushes set it in the order they land.
            t.counters.pushed_ids.set(answer.pushed as i64);
            Ok((answer, (added > 0).then(|| current.with(&raws, rows))))
        })
    }
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

    use narsil_core::{IdsPushed, KeyedBatch};

    use super::super::fixtures::{batch, rows, schema, LocalRows};
    use super::super::pooling::tests::Fetching;
    use super::super::{EmbeddingStage, StageScratch};
    use super::store_refusal;
    use crate::id_map::{build, IdMap};
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
                stage.push_ids("shared", &entries(&tables[0], 16, &[(fresh(0, 9), 9)])).unwrap().added,
                1
            );
            assert_eq!(
                stage.push_ids("own", &entries(&tables[1], 16, &[(fresh(1, 4), 4)])).unwrap().added,
                1
            );
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
    fn a_batch_reads_the_pushed_rows_of_the_snapshot_it_mapped_with_never_a_later_one() {
        let (mapped, maps) = mapped();
        let plain = schema();
        let tables: Vec<Table> = plain.tables.iter().enumerate().map(|(i, t)| rows(t, 3 + i as u8)).collect();
        let stores =
            plain.tables.iter().enumerate().map(|(i, t)| Arc::new(rows(t, 3 + i as u8)) as _).collect();
        let stage = EmbeddingStage::with_id_maps(&mapped, stores, maps);
        let rows_batch = batch();
        let mut expected = Vec::new();
        let plain_stores =
            plain.tables.iter().enumerate().map(|(i, t)| Arc::new(rows(t, 3 + i as u8)) as _).collect();
        EmbeddingStage::new(&plain, plain_stores)
            .pool(&rows_batch, &mut StageScratch::default(), &mut expected)
            .unwrap();
        // Shared ids 4 and 9 sent as new ids, pushed in one push: a batch
        // pools both from them or neither.
        let new = |t: usize, row: i64| (t == 0 && (row == 4 || row == 9)).then(|| fresh(t, row));
        let sent = raw_batch(&mapped, &rows_batch, new);
        let mut all_default = Vec::new();
        stage.pool(&sent, &mut StageScratch::default(), &mut all_default).unwrap();
        // Mapped with the first push; a second lands before its rows are
        // read: they are still the first snapshot's.
        stage.push_ids("shared", &entries(&tables[0], 16, &[(fresh(0, 4), 4), (fresh(0, 9), 9)])).unwrap();
        let mut scratch = StageScratch::default();
        let mut mapped_batch = KeyedBatch::default();
        let mut pushed = Vec::new();
        let batch = stage.map_batch(&sent, &mut mapped_batch, Some(&mut pushed)).clone();
        scratch.pushed = pushed;
        let later: Vec<(i64, u64)> = (0..40).map(|n| (fresh(0, 100 + n), n as u64)).collect();
        stage.push_ids("shared", &entries(&tables[0], 16, &later)).unwrap();
        let mut pooled = Vec::new();
        stage.pool_rows(&batch, &mut scratch, &mut pooled).unwrap();
        assert_eq!(pooled, expected);

        // Under load: pushes of five new ids at a time while lanes pool
        // batches whose shared ids are all new ids of one push.
        let stage = Arc::new(stage);
        let chunk = 7;
        let ids_of =
            |chunk: i64| move |t: usize, row: i64| (t == 0).then(|| fresh(0, 1000 + chunk * 64 + row));
        let sent = raw_batch(&mapped, &rows_batch, ids_of(chunk));
        let mut before = Vec::new();
        stage.pool(&sent, &mut StageScratch::default(), &mut before).unwrap();
        let done = AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                for c in 0..20 {
                    let pairs: Vec<(i64, u64)> =
                        (0..50).map(|row| (ids_of(c)(0, row).unwrap(), row as u64)).collect();
                    stage.push_ids("shared", &entries(&tables[0], 16, &pairs)).unwrap();
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                done.store(true, Ordering::Release);
            });
            let lanes: Vec<_> = (0..2)
                .map(|_| {
                    scope.spawn(|| {
                        let (mut scratch, mut pooled, mut seen) =
                            (StageScratch::default(), Vec::new(), [0; 2]);
                        while !done.load(Ordering::Acquire) || seen[1] == 0 {
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
            |stage: &EmbeddingStage, table: &str, body: &[u8]| stage.push_ids(table, body).unwrap_err();
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
            stage.push_ids("shared", &held).unwrap(),
            IdsPushed { added: 0, already_held: 1, pushed: 0 }
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
            stage.push_ids("shared", &pushed).unwrap(),
            IdsPushed { added: 2, already_held: 1, pushed: 2 }
        );
        assert_eq!(
            stage.push_ids("shared", &pushed).unwrap(),
            IdsPushed { added: 0, already_held: 3, pushed: 2 }
        );
        let error = refused(&stage, "shared", &entries(&table, 16, &[(fresh(0, 3), 4)]));
        assert!(error.contains("pushed before"), "{error}");
        assert_eq!(stage.metrics().table("shared").pushed_ids.get(), 2);
    }
}
