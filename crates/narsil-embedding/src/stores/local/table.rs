//! An embedding table's rows in this process, from its file in a split
//! model's `tables/`, checked against the schema first
//! ([`crate::stores::table_file`]): a file that is truncated, too long,
//! missing or not the bytes its SHA-256 names fails with the table's name
//! and the file's path.
//!
//! Two local stores (`narsil serve --table-store`, [`crate::stores::table_store`];
//! the third, `redis`, is [`crate::stores::redis`]):
//!
//! * `memory` (default): the file is read into the process once; every
//!   lookup is a memory read. Needs the tables' size in RAM. A table of at
//!   least 2 MiB is read into memory of its own on 2 MiB pages
//!   ([`crate::stores::local::huge_pages`]).
//! * `mmap`: the file is mapped read-only and the kernel's page cache holds
//!   the rows that are read, so tables larger than RAM are served, at the
//!   cost of a page fault (a disk read) when a row is not cached. The map is
//!   advised `MADV_RANDOM`: lookups hit rows at random, so the kernel's
//!   read-ahead would fill the cache with neighbours nobody asked for and
//!   evict hot rows.
//!
//! A mapped file must keep its bytes for as long as it is mapped (the
//! contract of [`memmap2::MmapOptions`]): truncated, a lookup of a row past
//! its new end kills the process with `SIGBUS`; written, rows change under
//! a lookup that holds them as `&[u8]`. Narsil never writes a table file:
//! it opens them read-only, maps each file at the length it has when
//! opened, and checks that length against the schema first. Model versions
//! are published by renaming a complete directory into place and are
//! immutable from then on (docs/guide/model-repository.md): a table is
//! replaced by publishing a new version with new files. Deleting or
//! renaming a served file is harmless (the map keeps its inode); copying
//! over it in place is not (`cp` truncates the target first).
//!
//! The file's check (its size, and its SHA-256 unless a stamp vouches for
//! it) is [`crate::stores::table_file`]'s, shared with the `disk` store and
//! `narsil tables`; the error every store's open returns is
//! [`crate::stores::table_error`]'s. Both are still reachable here, where
//! they lived before.

use std::path::Path;
use std::time::Instant;

use crate::popularity_order::SlotIndex;
use crate::schema::{Storage, TableSpec};
use crate::sha256::{sha256_of, sha256_of_bytes};
use crate::stores::local::huge_pages::{worth_huge_pages, HugePageRows};
use crate::stores::row_store::{FetchError, Fetched, RowStore};
use crate::stores::table_error::TableError;
use crate::stores::table_file::{check_hash, sized_file, slot_index, vouched_for};

/// Where a local table's rows live (`--table-store memory` or `mmap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum LocalRows {
    /// Read into process memory.
    #[default]
    Memory,
    /// Mapped from the file; the page cache holds the hot rows.
    Mmap,
}

/// A table's rows, in memory (on huge pages, or the heap) or mapped.
enum Rows {
    Huge(HugePageRows),
    Memory(Vec<u8>),
    Mapped(memmap2::Mmap),
}

/// `len` bytes from `fill` on huge pages when worth it
/// ([`huge_pages`](crate::stores::local::huge_pages)), else on the heap;
/// `fill` writes every byte.
fn in_memory(len: usize, fill: impl FnOnce(&mut [u8]) -> Result<(), TableError>) -> Result<Rows, TableError> {
    if worth_huge_pages(len) {
        if let Ok(mut rows) = HugePageRows::zeroed(len) {
            fill(&mut rows)?;
            return Ok(Rows::Huge(rows));
        }
    }
    let mut rows = vec![0; len];
    fill(&mut rows)?;
    Ok(Rows::Memory(rows))
}

/// Maps the whole of `file` read-only and private (`PROT_READ`,
/// `MAP_PRIVATE`), advised `MADV_RANDOM`.
fn map(file: &std::fs::File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: memmap2 requires that the file is neither truncated nor
    // written while mapped. Narsil writes no table file, and a published
    // model version's files are never changed in place (module docs).
    let map = unsafe { memmap2::MmapOptions::new().map_copy_read_only(file)? };
    // Only a hint: where the kernel refuses it, the same rows are served.
    let _ = map.advise(memmap2::Advice::Random);
    Ok(map)
}

/// A table's rows and shape.
pub struct Table {
    /// Its name.
    pub name: String,
    /// Rows.
    pub rows: u64,
    /// Values per row.
    pub dim: usize,
    /// Bytes per row.
    pub row_bytes: usize,
    /// How rows are stored.
    pub storage: Storage,
    rows_data: Rows,
    /// A mapped table laid out in popularity order: where each id's row is
    /// (a table read into memory is put back in id order instead).
    slots: Option<SlotIndex>,
}

impl std::fmt::Debug for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Table")
            .field("name", &self.name)
            .field("rows", &self.rows)
            .field("store", &self.store())
            .finish()
    }
}

impl Table {
    /// Opens the table `spec` describes in the model directory `dir`, its
    /// rows read into memory or mapped (`store`). A table laid out in
    /// popularity order ([`crate::popularity_order`]) is read back into id order, or
    /// mapped as it is with its slot index.
    pub fn load(dir: &Path, spec: &TableSpec, store: LocalRows) -> Result<Self, TableError> {
        let (path, metadata) = sized_file(dir, spec)?;
        // Checked against its hash below, as it is read (`table_file`'s docs).
        let vouched = vouched_for(dir, spec, &metadata);
        let read_error = |source| TableError::Read { table: spec.name.clone(), path: path.clone(), source };
        let expected = spec.rows * spec.row_bytes as u64;
        let size_error = |actual| TableError::Size {
            table: spec.name.clone(),
            path: path.clone(),
            actual,
            expected,
            rows: spec.rows,
            row_bytes: spec.row_bytes,
        };
        let mut slots = slot_index(dir, spec)?;
        let rows_data = match store {
            LocalRows::Memory => {
                // `sized_file` checked the length; a file that changes
                // length meanwhile fails the read, naming the table.
                let mut file = std::fs::File::open(&path).map_err(read_error)?;
                in_memory(expected as usize, |bytes| {
                    use std::io::Read;
                    file.read_exact(bytes).map_err(read_error)?;
                    if file.read(&mut [0u8; 1]).map_err(read_error)? > 0 {
                        return Err(read_error(std::io::Error::other("the file grew while it was read")));
                    }
                    if !vouched {
                        check_hash(spec, &path, sha256_of_bytes(bytes))?;
                    }
                    // In place: the table once, and a bit per row.
                    if let Some(index) = slots.take() {
                        index.to_id_order(bytes, spec.row_bytes);
                    }
                    Ok(())
                })?
            }
            LocalRows::Mmap => {
                if expected == 0 {
                    return Err(read_error(std::io::Error::other("cannot map an empty file")));
                }
                let file = std::fs::File::open(&path).map_err(read_error)?;
                if !vouched {
                    // Read, not through the map (advised MADV_RANDOM): the
                    // bytes of the file that is then mapped.
                    check_hash(spec, &path, sha256_of(&file).map_err(read_error)?)?;
                }
                let map = map(&file).map_err(read_error)?;
                // The length of the file opened, which is what is mapped.
                if map.len() as u64 != expected {
                    return Err(size_error(map.len() as u64));
                }
                Rows::Mapped(map)
            }
        };
        Ok(Self { slots, ..Self::with_rows(spec, rows_data) })
    }

    /// A table over rows already in memory (`data.len()` must be
    /// `rows * row_bytes`), held as the `memory` store holds a table read
    /// from its file (on huge pages when worth it), so that benches
    /// measure what the server serves.
    pub fn from_rows(spec: &TableSpec, data: Vec<u8>) -> Self {
        assert_eq!(data.len() as u64, spec.rows * spec.row_bytes as u64, "table {:?} rows", spec.name);
        let rows = HugePageRows::copy_if_worth(&data).map_or(Rows::Memory(data), Rows::Huge);
        Self::with_rows(spec, rows)
    }

    /// A table of `spec`'s shape whose rows `fill` writes (every byte,
    /// from zeros), held as [`Self::from_rows`] holds them.
    pub fn filled(spec: &TableSpec, fill: impl FnOnce(&mut [u8])) -> Self {
        let len = spec.rows as usize * spec.row_bytes;
        let rows = in_memory(len, |bytes| {
            fill(bytes);
            Ok(())
        })
        .expect("a fill that cannot fail");
        Self::with_rows(spec, rows)
    }

    /// Its bytes the kernel backs with huge pages, by `smaps`
    /// ([`crate::stores::local::huge_pages::smaps`]; 0 for a table on the
    /// heap or mapped), and whether it was put on memory advised for them.
    pub fn huge_page_bytes(&self, smaps: &str) -> (u64, bool) {
        match &self.rows_data {
            Rows::Huge(rows) => (rows.huge_bytes(smaps).unwrap_or(0), true),
            _ => (0, false),
        }
    }

    fn with_rows(spec: &TableSpec, rows_data: Rows) -> Self {
        Self {
            name: spec.name.clone(),
            rows: spec.rows,
            dim: spec.dim,
            row_bytes: spec.row_bytes,
            storage: spec.storage,
            rows_data,
            slots: None,
        }
    }

    /// Where its rows live.
    pub fn store(&self) -> LocalRows {
        match self.rows_data {
            Rows::Huge(_) | Rows::Memory(_) => LocalRows::Memory,
            Rows::Mapped(_) => LocalRows::Mmap,
        }
    }

    /// Row `id`'s bytes, whatever the layout.
    pub fn row(&self, id: u64) -> &[u8] {
        let at = self.slots.as_ref().map_or(id as i64, |index| index.slot(id as i64)) as usize;
        &self.bytes()[at * self.row_bytes..(at + 1) * self.row_bytes]
    }

    /// Its rows, to rewrite in place, where this process holds them (not
    /// where they are mapped from the file).
    pub fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        match &mut self.rows_data {
            Rows::Huge(rows) => Some(rows),
            Rows::Memory(data) => Some(data),
            Rows::Mapped(_) => None,
        }
    }

    /// Every row, end to end, in the file's layout (see [`RowStore::slots`]).
    pub fn bytes(&self) -> &[u8] {
        match &self.rows_data {
            Rows::Huge(rows) => rows,
            Rows::Memory(data) => data,
            Rows::Mapped(map) => map,
        }
    }
}

impl RowStore for Table {
    fn kind(&self) -> &'static str {
        match self.store() {
            LocalRows::Memory => "memory",
            LocalRows::Mmap => "mmap",
        }
    }

    fn local_rows(&self) -> Option<&[u8]> {
        Some(self.bytes())
    }

    fn fetch(
        &self,
        ids: &[i64],
        row_bytes: usize,
        out: &mut [u8],
        _deadline: Option<Instant>,
    ) -> Result<Fetched, FetchError> {
        debug_assert_eq!(row_bytes, self.row_bytes);
        for (&id, row) in ids.iter().zip(out.chunks_exact_mut(row_bytes)) {
            row.copy_from_slice(self.row(id as u64));
        }
        Ok(Fetched::default())
    }

    fn may_fault(&self) -> bool {
        self.store() == LocalRows::Mmap
    }

    fn slots(&self) -> Option<&SlotIndex> {
        self.slots.as_ref()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn spec(rows: u64) -> TableSpec {
        TableSpec {
            name: "cat_3".into(),
            rows,
            dim: 8,
            storage: Storage::Int8Rowwise,
            row_bytes: 16,
            file: "tables/cat_3.bin".into(),
            sha256: String::new(),
            redis: None,
            layout: None,
            ids: Default::default(),
        }
    }

    #[test]
    fn a_memory_table_of_at_least_a_huge_page_is_read_onto_memory_advised_for_huge_pages() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("tables")).unwrap();
        let rows = 3 * crate::stores::local::huge_pages::HUGE_PAGE as u64 / 16 + 5;
        let bytes: Vec<u8> = (0..rows * 16).map(|i| (i * 31 % 251) as u8).collect();
        std::fs::write(dir.path().join("tables/cat_3.bin"), &bytes).unwrap();
        let table = Table::load(dir.path(), &spec(rows), LocalRows::Memory).unwrap();
        assert_eq!(table.bytes(), &bytes[..], "the file's rows");
        assert_eq!(table.row(rows - 1), &bytes[bytes.len() - 16..]);
        let smaps = crate::stores::local::huge_pages::smaps().unwrap();
        let (huge, advised) = table.huge_page_bytes(&smaps);
        let wanted = crate::stores::local::huge_pages::huge_pages_wanted();
        if !wanted {
            eprintln!("huge pages not checked: NARSIL_TABLE_HUGE_PAGES=off");
        }
        assert!(
            advised == wanted && huge <= bytes.len() as u64,
            "{huge} bytes on huge pages, advised {advised}"
        );
        let from_rows = Table::from_rows(&spec(rows), bytes.clone());
        assert_eq!(from_rows.huge_page_bytes(&smaps).1, wanted, "benches hold tables as the server does");
        // A small table stays on the heap.
        let small = Table::from_rows(&spec(9), vec![1; 9 * 16]);
        assert_eq!(small.huge_page_bytes(&smaps), (0, false));
        // A file one byte short of its schema is refused, naming it.
        std::fs::write(dir.path().join("tables/cat_3.bin"), &bytes[1..]).unwrap();
        let error = Table::load(dir.path(), &spec(rows), LocalRows::Memory).unwrap_err().to_string();
        assert!(error.contains("cat_3") && error.contains("cat_3.bin"), "{error}");
    }

    #[test]
    fn a_truncated_or_missing_file_names_the_table_and_the_file() {
        let dir = std::env::temp_dir().join(format!("narsil-table-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("tables")).unwrap();
        std::fs::write(dir.join("tables/cat_3.bin"), vec![0u8; 16 * 9]).unwrap();
        for store in [LocalRows::Memory, LocalRows::Mmap] {
            let error = Table::load(&dir, &spec(10), store).unwrap_err().to_string();
            assert!(
                error.contains("cat_3") && error.contains("tables/cat_3.bin") && error.contains("144 bytes"),
                "{error}"
            );
        }
        let missing = Table::load(&dir.join("elsewhere"), &spec(9), LocalRows::Mmap).unwrap_err().to_string();
        assert!(missing.contains("cat_3") && missing.contains("cannot read"), "{missing}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn memory_and_mapped_tables_hold_the_same_rows() {
        let dir = std::env::temp_dir().join(format!("narsil-table-rows-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("tables")).unwrap();
        let rows: Vec<u8> = (0..16 * 9).map(|i| (i * 7) as u8).collect();
        std::fs::write(dir.join("tables/cat_3.bin"), &rows).unwrap();
        let memory = Table::load(&dir, &spec(9), LocalRows::Memory).unwrap();
        let mapped = Table::load(&dir, &spec(9), LocalRows::Mmap).unwrap();
        assert_eq!(memory.bytes(), &rows[..]);
        assert_eq!(mapped.bytes(), &rows[..]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// `tables/cat_3.bin` of 3 rows of 16 bytes in `dir`, laid out by
    /// `slots`, with its index; the spec names the index's SHA-256.
    fn ordered_table(dir: &Path, rows: &[u8], slots: &[u32]) -> TableSpec {
        std::fs::create_dir_all(dir.join("tables")).unwrap();
        let mut file = vec![0u8; rows.len()];
        for (id, &slot) in slots.iter().enumerate() {
            file[slot as usize * 16..][..16].copy_from_slice(&rows[id * 16..][..16]);
        }
        std::fs::write(dir.join("tables/cat_3.bin"), file).unwrap();
        let index: Vec<u8> = slots.iter().flat_map(|s| s.to_le_bytes()).collect();
        std::fs::write(dir.join("tables/cat_3.slots"), &index).unwrap();
        let (_, sha256) = SlotIndex::read(|| Ok(index.as_slice()), slots.len() as u64).unwrap();
        let layout = crate::schema::Layout { slots: "tables/cat_3.slots".into(), sha256 };
        TableSpec { layout: Some(layout), ..spec(slots.len() as u64) }
    }

    #[test]
    fn a_table_in_popularity_order_reads_by_id_and_a_bad_index_names_the_table_and_the_file() {
        let dir = std::env::temp_dir().join(format!("narsil-table-layout-{}", std::process::id()));
        let rows: Vec<u8> = (0..16 * 3).map(|i| i as u8).collect();
        let ordered = ordered_table(&dir, &rows, &[2, 0, 1]);
        let memory = Table::load(&dir, &ordered, LocalRows::Memory).unwrap();
        assert_eq!(memory.bytes(), &rows[..], "read back into id order");
        assert!(memory.slots().is_none());
        let mapped = Table::load(&dir, &ordered, LocalRows::Mmap).unwrap();
        for id in 0..3 {
            assert_eq!(mapped.row(id), &rows[id as usize * 16..(id as usize + 1) * 16], "id {id}");
        }
        let index = std::fs::read(dir.join("tables/cat_3.slots")).unwrap();
        std::fs::write(dir.join("tables/cat_3.slots"), &index[..8]).unwrap();
        for store in [LocalRows::Memory, LocalRows::Mmap] {
            let error = Table::load(&dir, &ordered, store).unwrap_err().to_string();
            assert!(
                error.contains("cat_3") && error.contains("tables/cat_3.slots") && error.contains("holds 8"),
                "{error}"
            );
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_slot_index_with_two_slots_swapped_fails_the_load_naming_the_file_and_both_hashes() {
        let dir = std::env::temp_dir().join(format!("narsil-table-swapped-{}", std::process::id()));
        let rows: Vec<u8> = (0..16 * 3).map(|i| i as u8).collect();
        let ordered = ordered_table(&dir, &rows, &[2, 0, 1]);
        // Still a permutation: only the hash tells ids 0 and 1 apart.
        let swapped: Vec<u8> = [0u32, 2, 1].iter().flat_map(|s| s.to_le_bytes()).collect();
        std::fs::write(dir.join("tables/cat_3.slots"), &swapped).unwrap();
        let (_, actual) = SlotIndex::read(|| Ok(swapped.as_slice()), 3).unwrap();
        let expected = &ordered.layout.as_ref().unwrap().sha256;
        for store in [LocalRows::Memory, LocalRows::Mmap] {
            let error = Table::load(&dir, &ordered, store).unwrap_err().to_string();
            assert!(
                error.contains("cat_3")
                    && error.contains("tables/cat_3.slots")
                    && error.contains(&actual)
                    && error.contains(expected.as_str()),
                "{store:?}: {error}"
            );
        }
        // The disk store reads its index through the same function.
        let error = slot_index(&dir, &ordered).unwrap_err().to_string();
        assert!(error.contains("SHA-256") && error.contains("tables/cat_3.slots"), "{error}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
