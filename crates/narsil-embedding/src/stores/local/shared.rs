//! Tables shared by content across the model versions of one process: a
//! version whose table has the same identity as a table some live version
//! already holds gets that table, not a second copy. A new dense network,
//! or a version that changes a few tables, reloads only what changed, and
//! a live switch between two such versions holds the shared tables once.
//!
//! A table's identity is its schema's `sha256` (written by the exporter
//! from the file's bytes) with its shape (rows, row bytes, storage), its
//! layout's index (for a table in popularity order) and the store it is
//! held in. A table is checked against its `sha256` when it is read
//! ([`crate::stores::local::table`]), so the one a later version shares
//! holds the rows that hash names; a table without a `sha256` is never
//! shared. The registry is generic: the stage shares the tables it lays
//! out by their id maps the same way ([`crate::stage`]'s `id_map_layout`).

use std::collections::HashMap;
use std::hash::Hash;
use std::path::Path;
use std::sync::{Arc, Mutex, Weak};

use crate::schema::{Storage, TableSpec};
use crate::stores::local::table::{LocalRows, Table};
use crate::stores::table_error::TableError;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Identity {
    sha256: String,
    rows: u64,
    row_bytes: usize,
    storage: Storage,
    store: LocalRows,
    /// The slot index's hash, for a table in popularity order.
    layout: Option<String>,
}

/// What some live model version holds, by key, each once.
pub(crate) type Registry<K, T> = Mutex<Option<HashMap<K, Weak<T>>>>;

/// Tables some live model version holds, by identity.
static LIVE: Registry<Identity, Table> = Mutex::new(None);

/// A table and whether it was already held (shared) or read now.
pub struct Opened {
    /// The table.
    pub table: Arc<Table>,
    /// Whether a live version already held it.
    pub shared: bool,
}

/// What a live version holds under `key` in `registry`, else `make`'s,
/// registered; and whether it was shared. Made without the lock (a table
/// can take seconds): a version that made the same meanwhile wins, and
/// this copy is dropped.
pub(crate) fn share<K: Eq + Hash, T, E>(
    registry: &Registry<K, T>,
    key: K,
    make: impl FnOnce() -> Result<T, E>,
) -> Result<(Arc<T>, bool), E> {
    {
        let mut guard = registry.lock().unwrap_or_else(|e| e.into_inner());
        let map = guard.get_or_insert_with(HashMap::new);
        map.retain(|_, held| held.strong_count() > 0);
        if let Some(held) = map.get(&key).and_then(Weak::upgrade) {
            return Ok((held, true));
        }
    }
    let made = Arc::new(make()?);
    let mut guard = registry.lock().unwrap_or_else(|e| e.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    if let Some(existing) = map.get(&key).and_then(Weak::upgrade) {
        return Ok((existing, true));
    }
    map.insert(key, Arc::downgrade(&made));
    Ok((made, false))
}

/// Everything `registry` holds that a live version still holds.
pub(crate) fn live<K, T>(registry: &Registry<K, T>) -> Vec<Arc<T>> {
    let guard = registry.lock().unwrap_or_else(|e| e.into_inner());
    guard.iter().flat_map(|map| map.values()).filter_map(Weak::upgrade).collect()
}

/// The tables read from files that live versions hold (each shared one
/// once; tables without an identity are not listed: they are never shared).
pub(crate) fn live_tables() -> Vec<Arc<Table>> {
    live(&LIVE)
}

/// Opens the table `spec` describes in model directory `dir`, in `store`,
/// sharing it with any live version that holds the same table.
pub fn open_shared(dir: &Path, spec: &TableSpec, store: LocalRows) -> Result<Opened, TableError> {
    if spec.sha256.is_empty() {
        return Ok(Opened { table: Arc::new(Table::load(dir, spec, store)?), shared: false });
    }
    let identity = Identity {
        sha256: spec.sha256.clone(),
        rows: spec.rows,
        row_bytes: spec.row_bytes,
        storage: spec.storage,
        store,
        layout: spec.layout.as_ref().map(|layout| layout.sha256.clone()),
    };
    let (table, shared) = share(&LIVE, identity, || Table::load(dir, spec, store))?;
    Ok(Opened { table, shared })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sha256::sha256_of_bytes;

    fn spec(file: &str, sha256: &str) -> TableSpec {
        TableSpec {
            name: "t".into(),
            rows: 4,
            dim: 8,
            storage: Storage::Int8Rowwise,
            row_bytes: 16,
            file: file.into(),
            sha256: sha256.into(),
            redis: None,
            layout: None,
            ids: Default::default(),
        }
    }

    #[test]
    fn a_table_with_the_same_identity_is_shared_while_a_version_holds_it() {
        let dir = std::env::temp_dir().join(format!("narsil-shared-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("tables")).unwrap();
        let (rows, other_rows) = (vec![3u8; 64], vec![4u8; 64]);
        std::fs::write(dir.join("tables/t.bin"), &rows).unwrap();
        std::fs::write(dir.join("tables/u.bin"), &other_rows).unwrap();
        let (sha, other_sha) = (sha256_of_bytes(&rows), sha256_of_bytes(&other_rows));
        let first = open_shared(&dir, &spec("tables/t.bin", &sha), LocalRows::Memory).unwrap();
        assert!(!first.shared);
        let second = open_shared(&dir, &spec("tables/t.bin", &sha), LocalRows::Memory).unwrap();
        assert!(second.shared && Arc::ptr_eq(&first.table, &second.table));
        // Another identity, another store, or no identity: a table of its own.
        for (file, sha, store) in [
            ("tables/u.bin", other_sha.as_str(), LocalRows::Memory),
            ("tables/t.bin", sha.as_str(), LocalRows::Mmap),
            ("tables/t.bin", "", LocalRows::Memory),
        ] {
            let other = open_shared(&dir, &spec(file, sha), store).unwrap();
            assert!(!other.shared && !Arc::ptr_eq(&first.table, &other.table), "{sha} {store:?}");
        }
        // Once no version holds it, it is read again.
        drop((first, second));
        assert!(!open_shared(&dir, &spec("tables/t.bin", &sha), LocalRows::Memory).unwrap().shared);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
