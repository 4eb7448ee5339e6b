//! Mapped tables in this process's memory laid out by their id maps at
//! load ([`crate::id_map::SlottedMap`]): each raw id's row where a perfect
//! hash of the map's ids puts it, so that mapping a batch reads the rows
//! pooling reads next instead of a hash table as large again. The table's
//! rows are moved in place where the stage alone holds it (a table is held
//! once while it is laid out). The laid-out table replaces the table's
//! store and its map in the stage, and
//! is shared with any live version whose table, map and default row are
//! the same (a reload that keeps them holds them once, once loaded: the
//! new version's store has read the table's file by then, and drops it
//! here).
//!
//! `NARSIL_ID_MAP_LAYOUT=off` keeps every map a hash table (to measure what
//! the layout brings, or to hold a version's tables shared with another).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::map_ids::{IdMapping, MapLookup};
use super::{EmbeddingStage, StageTable};
use crate::id_map::SlottedMap;
use crate::schema::{TableIds, TableSpec};
use crate::stores::local::shared::{live, live_tables, share, Registry};
use crate::stores::local::table::Table;

/// Tables laid out by their id maps ([`SlottedMap`]) that some live
/// version holds, by what they were laid out from (the table's identity,
/// its map's and its default row).
static LAID_OUT: Registry<String, SlottedMap> = Mutex::new(None);

/// The table `spec` describes laid out by its id map: the one a live
/// version holds where the table, its map and its default row are the
/// same (by their SHA-256s), else `lay_out`'s, then shared (a table or map
/// without a SHA-256 is never shared); and whether it was shared.
fn laid_out_shared<E>(
    spec: &TableSpec,
    map_sha256: &str,
    default_row: u64,
    lay_out: impl FnOnce() -> Result<SlottedMap, E>,
) -> Result<(Arc<SlottedMap>, bool), E> {
    if spec.sha256.is_empty() || map_sha256.is_empty() {
        return Ok((Arc::new(lay_out()?), false));
    }
    let key = format!(
        "{}/{}/{}/{}/{:?}/{map_sha256}/{default_row}",
        spec.sha256, spec.rows, spec.row_bytes, spec.dim, spec.storage
    );
    share(&LAID_OUT, key, lay_out)
}

/// Tables the process holds for its live model versions, each shared
/// table once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    /// Tables.
    pub tables: usize,
    /// Their bytes (in memory, or mapped).
    pub bytes: u64,
}

/// What the live model versions hold now: the tables read from files
/// ([`crate::stores::local::shared`]) and those laid out by their maps
/// (tables without an identity are not counted: they are never shared).
pub fn held() -> Held {
    let laid_out: Vec<Arc<Table>> = live(&LAID_OUT).iter().map(|laid_out| laid_out.table()).collect();
    live_tables().iter().chain(&laid_out).fold(Held::default(), |held, table| Held {
        tables: held.tables + 1,
        bytes: held.bytes + table.bytes().len() as u64,
    })
}

/// Whether mapped tables are laid out by their maps (the default), or
/// keep their maps as hash tables (`NARSIL_ID_MAP_LAYOUT=off`).
fn layout_wanted() -> bool {
    std::env::var("NARSIL_ID_MAP_LAYOUT").map_or(true, |v| v != "off")
}

impl EmbeddingStage {
    /// Lays out every mapped table in this process's memory (the `memory`
    /// store, INT8 rows with 8 spare bytes, a map giving each row at most
    /// one raw id) by its map; logs the others' reasons once each. Only
    /// for a stage that looks its rows up itself: a table already copied
    /// elsewhere (a device) is looked up in the map's row order. Returns
    /// how many tables it laid out.
    pub fn lay_out_mapped_tables(&mut self) -> usize {
        if !layout_wanted() {
            return 0;
        }
        let (started, mut laid_out, mut shared, mut in_place, mut hash_bytes) = (Instant::now(), 0, 0, 0, 0);
        let kept = |table: &StageTable, why: &str| {
            tracing::info!(
                table = %table.spec.name,
                %why,
                "id map kept as a hash table: each raw id reads one of its slots before its row"
            )
        };
        let mut tables = Vec::with_capacity(self.tables.len());
        for mut table in std::mem::take(&mut self.tables) {
            let (IdMapping::Map { map: MapLookup::Hashed(map), default_row, .. }, TableIds::Map(declared)) =
                (&mut table.mapping, &table.spec.ids)
            else {
                tables.push(table);
                continue;
            };
            // Checked before a live version's copy is shared: a table on
            // another store stays there.
            if let Some(why) = SlottedMap::unsuited(&table.spec, &*table.store) {
                kept(&table, &why);
                tables.push(table);
                continue;
            }
            // The stage's hold on the table goes into the layout, so that
            // where nothing else holds it its rows move in place.
            let (spec, store) = (&table.spec, table.store);
            let lay_out = || SlottedMap::lay_out(spec, store, map, *default_row);
            match laid_out_shared(spec, &declared.sha256, *default_row, lay_out) {
                Ok((slotted, was_shared)) => {
                    table.store = slotted.table();
                    *default_row = slotted.default_row();
                    hash_bytes += slotted.hash_bytes();
                    shared += usize::from(was_shared);
                    in_place += usize::from(!was_shared && slotted.moved_in_place());
                    if let IdMapping::Map { map, .. } = &mut table.mapping {
                        *map = MapLookup::Slotted(slotted);
                    }
                    laid_out += 1;
                }
                Err((why, store)) => {
                    table.store = store;
                    kept(&table, &why);
                }
            }
            tables.push(table);
        }
        self.tables = tables;
        if laid_out > 0 {
            tracing::info!(
                tables = laid_out,
                shared_with_a_live_version = shared,
                rows_moved_in_place = in_place,
                hash_kib = hash_bytes >> 10,
                elapsed_ms = started.elapsed().as_millis() as u64,
                "mapped tables laid out by their id maps: a raw id's lookup reads its row and no map slot"
            );
        }
        laid_out
    }
}
