//! An embedding table's rows, from its file in a split model's `tables/`,
//! checked against the schema: a file that is truncated, too long, or
//! missing fails with the table's name and the file's path.
//!
//! Two local stores (`narsil serve --table-store`, [`crate::stores::config`];
//! the third, `redis`, is [`crate::stores::redis`]):
//!
//! * `memory` (default): the file is read into the process once; every
//!   lookup is a memory read. Needs the tables' size in RAM.
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
//! A table file is checked against the SHA-256 its schema names before it
//! serves (by every local store: [`checked_file`] and [`Table::load`]): a
//! file whose bytes differ (a torn copy, two writers mixing two models,
//! blocks a power cut left unwritten) fails the load naming the table, the
//! file, and both hashes. Hashing costs a pass over the file. Measured
//! (`hashing_cost_of_26_tables_of_1m_rows`, release, this crate's `sha2`
//! with SHA-NI, 2-vCPU AMD EPYC Zen 5 (family 26), one core): 26 tables of
//! 1M rows of 68 bytes (1.65 GiB) hash in 0.98 s from the page cache
//! (1.68 GiB/s) and 1.05 s in memory (1.56 GiB/s). A file not cached is
//! read from disk first (this VM's: 1.4 GB/s direct), and a table larger
//! than RAM, which is what `mmap` and `disk` serve, would be read end to
//! end at every load, its reads evicting the hot rows. So the check is
//! done where a model is published, and the load trusts a stamp of it: a
//! model `narsil tables order` publishes carries [`STAMP_FILE`], for each
//! table file the hash checked then with the file's size, modification
//! time (ns), inode and device. A file whose metadata still match its
//! stamp is trusted without reading it (26 tables: 0.4 ms); one rewritten
//! in place (a new mtime), replaced or copied (a new inode), moved to
//! another file system, or not stamped (the exporters write none), is
//! hashed at load. The memory store hashes the bytes it reads anyway, so
//! there the check costs only the hashing. The stamp guards against
//! accidents, not forgery (a file rewritten with its old mtime restored
//! is trusted); ctime is left out because hard-linking a file into an
//! ordered copy changes it, which would unstamp the source. A `sha256`
//! that is not a SHA-256 (64 hex digits: empty, or a label some tests and
//! benchmarks give their tables) names the table's identity only and is
//! not checked.

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use sha2::{Digest, Sha256};

use crate::layout::SlotIndex;
use crate::schema::{Storage, TableSpec};
use crate::stores::row_store::{FetchError, Fetched, RowStore};

/// Where a local table's rows live (`--table-store memory` or `mmap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum LocalRows {
    /// Read into process memory.
    #[default]
    Memory,
    /// Mapped from the file; the page cache holds the hot rows.
    Mmap,
}

/// A table's rows, in memory or mapped.
enum Rows {
    Memory(Vec<u8>),
    Mapped(memmap2::Mmap),
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

/// Why a table cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    /// The file cannot be read.
    #[error("table {table:?}: cannot read {}: {source}", path.display())]
    Read {
        /// The table.
        table: String,
        /// Its file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file's size is not the schema's rows times row bytes.
    #[error("table {table:?}: {} holds {actual} bytes, but {rows} rows of {row_bytes} bytes take {expected} (truncated, or not this schema's table)", path.display())]
    Size {
        /// The table.
        table: String,
        /// Its file.
        path: PathBuf,
        /// Bytes in the file.
        actual: u64,
        /// Bytes the schema implies.
        expected: u64,
        /// Rows in the schema.
        rows: u64,
        /// Bytes per row.
        row_bytes: usize,
    },
    /// The file's bytes are not the ones the schema's `sha256` names.
    #[error("table {table:?}: {} has SHA-256 {actual}, but schema.json names {expected} (changed since it was published, or not this schema's table): not served", path.display())]
    Hash {
        /// The table.
        table: String,
        /// Its file.
        path: PathBuf,
        /// The schema's hash.
        expected: String,
        /// The file's.
        actual: String,
    },
    /// The slot index of a table in popularity order cannot be used.
    #[error("table {table:?}: slot index {}: {why}", path.display())]
    Layout {
        /// The table.
        table: String,
        /// The index's file.
        path: PathBuf,
        /// Why.
        why: String,
    },
    /// The table is not in the store that holds it elsewhere (or that
    /// store cannot be reached).
    #[error("table {table:?}: {source}")]
    Store {
        /// The table.
        table: String,
        /// Why.
        source: FetchError,
    },
}

/// The slot index of `spec`'s table in model directory `dir`, if it is laid
/// out in popularity order ([`crate::layout`]), streamed from its file into
/// the compact index ([`SlotIndex::read`]: ~0.14 bytes per row + ~4 per hot
/// id at its peak). A file of the wrong size, one that is not a permutation
/// of the rows, or one whose SHA-256 is not the one the schema names (a
/// swapped pair of slots would serve both ids each other's row, without a
/// word) fails naming the table and the file. The index is read whole
/// anyway, so it is always hashed (one pass over 4 bytes a row), stamp or
/// not (a table file is hashed unless its stamp vouches for it: module
/// docs).
pub fn slot_index(dir: &Path, spec: &TableSpec) -> Result<Option<SlotIndex>, TableError> {
    let Some(layout) = &spec.layout else { return Ok(None) };
    let path = dir.join(&layout.slots);
    let error = |why: String| TableError::Layout { table: spec.name.clone(), path: path.clone(), why };
    let (index, sha256) =
        SlotIndex::read(|| std::fs::File::open(&path), spec.rows).map_err(|e| error(e.to_string()))?;
    if sha256 != layout.sha256 {
        return Err(error(format!(
            "its SHA-256 is {sha256}, but schema.json names {:?} (changed since `narsil tables order` wrote it, or not this table's index)",
            layout.sha256
        )));
    }
    Ok(Some(index))
}

/// The path of `spec`'s file in the model directory `dir`, once its size is
/// checked to be the schema's rows times row bytes and its bytes to be the
/// ones its `sha256` names (unless [`STAMP_FILE`] vouches for the file as
/// it is: module docs).
pub fn checked_file(dir: &Path, spec: &TableSpec) -> Result<PathBuf, TableError> {
    let (path, metadata) = sized_file(dir, spec)?;
    if !vouched_for(dir, spec, &metadata) {
        let read_error = |source| TableError::Read { table: spec.name.clone(), path: path.clone(), source };
        let file = std::fs::File::open(&path).map_err(read_error)?;
        check_hash(spec, &path, sha256_of(&file).map_err(read_error)?)?;
    }
    Ok(path)
}

/// The path of `spec`'s file in `dir` and its metadata, once its size is
/// checked to be the schema's rows times row bytes.
fn sized_file(dir: &Path, spec: &TableSpec) -> Result<(PathBuf, std::fs::Metadata), TableError> {
    let path = dir.join(&spec.file);
    let expected = spec.rows * spec.row_bytes as u64;
    let metadata = std::fs::metadata(&path).map_err(|source| TableError::Read {
        table: spec.name.clone(),
        path: path.clone(),
        source,
    })?;
    let actual = metadata.len();
    if actual != expected {
        return Err(TableError::Size {
            table: spec.name.clone(),
            path,
            actual,
            expected,
            rows: spec.rows,
            row_bytes: spec.row_bytes,
        });
    }
    Ok((path, metadata))
}

/// The stamp `narsil tables order` writes into the model it publishes,
/// beside `schema.json`: each table file's SHA-256 as checked then, with
/// the file's identity (module docs).
pub const STAMP_FILE: &str = "tables.verified.json";

/// [`Stamp::format`].
const STAMP_FORMAT: &str = "narsil-verified-1";

/// [`STAMP_FILE`]'s contents.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Stamp {
    /// `narsil-verified-1`.
    pub format: String,
    /// The table files it vouches for.
    pub tables: Vec<StampedFile>,
}

/// One table file's hash, as checked, and the file's identity then: a
/// file whose size, modification time, inode and device are still these
/// holds the bytes that were hashed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StampedFile {
    /// The file, relative to the model directory.
    pub file: PathBuf,
    /// Its SHA-256, hex.
    pub sha256: String,
    /// Its size.
    pub bytes: u64,
    /// Its modification time: seconds since the epoch...
    pub mtime_s: i64,
    /// ...and nanoseconds.
    pub mtime_ns: i64,
    /// Its inode.
    pub inode: u64,
    /// The device holding it.
    pub device: u64,
}

impl StampedFile {
    /// `file` (relative to `dir`) as it is now, vouched for as holding the
    /// bytes of hash `sha256` (which the caller has checked).
    pub fn of(dir: &Path, file: &Path, sha256: &str) -> std::io::Result<Self> {
        let metadata = std::fs::metadata(dir.join(file))?;
        Ok(Self {
            file: file.to_owned(),
            sha256: sha256.to_owned(),
            bytes: metadata.len(),
            mtime_s: metadata.mtime(),
            mtime_ns: metadata.mtime_nsec(),
            inode: metadata.ino(),
            device: metadata.dev(),
        })
    }

    /// Whether it vouches for `spec`'s file, whose metadata are `metadata`.
    fn vouches(&self, spec: &TableSpec, metadata: &std::fs::Metadata) -> bool {
        self.file == spec.file
            && self.sha256.eq_ignore_ascii_case(&spec.sha256)
            && (self.bytes, self.mtime_s, self.mtime_ns, self.inode, self.device)
                == (metadata.len(), metadata.mtime(), metadata.mtime_nsec(), metadata.ino(), metadata.dev())
    }
}

impl Stamp {
    /// A stamp of `tables`.
    pub fn new(tables: Vec<StampedFile>) -> Self {
        Self { format: STAMP_FORMAT.into(), tables }
    }

    /// `dir`'s stamp, if it has one that can be read (one that cannot
    /// vouches for nothing: the files are hashed).
    pub fn read(dir: &Path) -> Option<Self> {
        let text = std::fs::read(dir.join(STAMP_FILE)).ok()?;
        let stamp: Self = serde_json::from_slice(&text).ok()?;
        (stamp.format == STAMP_FORMAT).then_some(stamp)
    }
}

/// Whether `spec`'s file (in `dir`, of `metadata`) needs no hashing: its
/// `sha256` is no SHA-256, or `dir`'s stamp vouches for it as it is.
fn vouched_for(dir: &Path, spec: &TableSpec, metadata: &std::fs::Metadata) -> bool {
    !is_sha256(&spec.sha256)
        || Stamp::read(dir).is_some_and(|stamp| stamp.tables.iter().any(|f| f.vouches(spec, metadata)))
}

/// Whether `text` is a SHA-256 in hex (64 hex digits).
pub fn is_sha256(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Fails unless `actual` is the hash `spec` names for its file `path`.
fn check_hash(spec: &TableSpec, path: &Path, actual: String) -> Result<(), TableError> {
    if actual.eq_ignore_ascii_case(&spec.sha256) {
        return Ok(());
    }
    Err(TableError::Hash {
        table: spec.name.clone(),
        path: path.to_owned(),
        expected: spec.sha256.clone(),
        actual,
    })
}

/// The SHA-256 (hex, lowercase) of everything `read` yields, read through
/// a 1 MiB buffer.
pub fn sha256_of(mut read: impl Read) -> std::io::Result<String> {
    let mut sha = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        match read.read(&mut buffer) {
            Ok(0) => return Ok(hex(sha)),
            Ok(n) => sha.update(&buffer[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// The SHA-256 (hex, lowercase) of `bytes`.
fn sha256_of_bytes(bytes: &[u8]) -> String {
    let mut sha = Sha256::new();
    sha.update(bytes);
    hex(sha)
}

/// A finished hash as the schema writes it: 64 lowercase hex digits.
fn hex(sha: Sha256) -> String {
    sha.finalize().iter().map(|byte| format!("{byte:02x}")).collect()
}

impl Table {
    /// Opens the table `spec` describes in the model directory `dir`, its
    /// rows read into memory or mapped (`store`). A table laid out in
    /// popularity order ([`crate::layout`]) is read back into id order, or
    /// mapped as it is with its slot index.
    pub fn load(dir: &Path, spec: &TableSpec, store: LocalRows) -> Result<Self, TableError> {
        let (path, metadata) = sized_file(dir, spec)?;
        // Checked against its hash below, as it is read (module docs).
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
                let mut rows = std::fs::read(&path).map_err(read_error)?;
                if rows.len() as u64 != expected {
                    return Err(size_error(rows.len() as u64));
                }
                if !vouched {
                    check_hash(spec, &path, sha256_of_bytes(&rows))?;
                }
                // In place: the table once, and a bit per row.
                if let Some(index) = slots.take() {
                    index.to_id_order(&mut rows, spec.row_bytes);
                }
                Rows::Memory(rows)
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
    /// `rows * row_bytes`).
    pub fn from_rows(spec: &TableSpec, data: Vec<u8>) -> Self {
        assert_eq!(data.len() as u64, spec.rows * spec.row_bytes as u64, "table {:?} rows", spec.name);
        Self::with_rows(spec, Rows::Memory(data))
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
            Rows::Memory(_) => LocalRows::Memory,
            Rows::Mapped(_) => LocalRows::Mmap,
        }
    }

    /// Row `id`'s bytes, whatever the layout.
    pub fn row(&self, id: u64) -> &[u8] {
        let at = self.slots.as_ref().map_or(id as i64, |index| index.slot(id as i64)) as usize;
        &self.bytes()[at * self.row_bytes..(at + 1) * self.row_bytes]
    }

    /// Every row, end to end, in the file's layout (see [`RowStore::slots`]).
    pub fn bytes(&self) -> &[u8] {
        match &self.rows_data {
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

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn may_fault(&self) -> bool {
        self.store() == LocalRows::Mmap
    }

    fn slots(&self) -> Option<&SlotIndex> {
        self.slots.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(rows: u64) -> TableSpec {
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
        }
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

    /// `tables/cat_3.bin` holding `rows` in `dir`; the spec names `sha256`.
    fn hashed_table(dir: &Path, rows: &[u8], sha256: &str) -> TableSpec {
        std::fs::create_dir_all(dir.join("tables")).unwrap();
        std::fs::write(dir.join("tables/cat_3.bin"), rows).unwrap();
        TableSpec { sha256: sha256.into(), ..spec(rows.len() as u64 / 16) }
    }

    fn sha256(bytes: &[u8]) -> String {
        sha256_of(bytes).unwrap()
    }

    /// Every way a local table is opened: read, mapped, and the checked
    /// path the `disk` store and `narsil tables` open.
    fn open_every_way(dir: &Path, spec: &TableSpec) -> Vec<Result<(), TableError>> {
        vec![
            Table::load(dir, spec, LocalRows::Memory).map(drop),
            Table::load(dir, spec, LocalRows::Mmap).map(drop),
            checked_file(dir, spec).map(drop),
        ]
    }

    #[test]
    fn a_table_file_whose_bytes_are_not_its_sha256_is_refused_naming_the_file_and_both_hashes() {
        let dir = tempfile::tempdir().unwrap();
        let rows: Vec<u8> = (0..16 * 9).map(|i| (i * 7) as u8).collect();
        let mut torn = rows.clone();
        torn[16 * 4..].fill(0);
        let spec = hashed_table(dir.path(), &torn, &sha256(&rows));
        for opened in open_every_way(dir.path(), &spec) {
            let error = opened.unwrap_err().to_string();
            assert!(
                error.contains("cat_3")
                    && error.contains("tables/cat_3.bin")
                    && error.contains(&sha256(&rows))
                    && error.contains(&sha256(&torn))
                    && error.contains("not served"),
                "{error}"
            );
        }
        std::fs::write(dir.path().join("tables/cat_3.bin"), &rows).unwrap();
        assert!(open_every_way(dir.path(), &spec).into_iter().all(|opened| opened.is_ok()));
        // Upper-case hex is the same hash.
        let upper = TableSpec { sha256: sha256(&rows).to_uppercase(), ..spec.clone() };
        assert!(open_every_way(dir.path(), &upper).into_iter().all(|opened| opened.is_ok()));
    }

    #[test]
    fn a_sha256_that_is_not_a_sha256_is_an_identity_only_and_is_not_checked() {
        let dir = tempfile::tempdir().unwrap();
        for label in ["", "a new table", "ab12"] {
            let spec = hashed_table(dir.path(), &[5u8; 32], label);
            assert!(open_every_way(dir.path(), &spec).into_iter().all(|opened| opened.is_ok()), "{label:?}");
        }
    }

    #[test]
    fn a_stamp_vouches_for_a_file_only_as_it_was_stamped() {
        let dir = tempfile::tempdir().unwrap();
        let rows: Vec<u8> = (0..16 * 9).map(|i| (i * 3) as u8).collect();
        let spec = hashed_table(dir.path(), &rows, &sha256(&rows));
        let path = dir.path().join("tables/cat_3.bin");
        // A time long past, so that a write now gives the file a new one
        // whatever the file system's clock granularity.
        let past = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000_000);
        std::fs::File::options().write(true).open(&path).unwrap().set_modified(past).unwrap();
        let stamped = StampedFile::of(dir.path(), &spec.file, &spec.sha256).unwrap();
        let stamp = Stamp::new(vec![stamped.clone()]);
        std::fs::write(dir.path().join(STAMP_FILE), serde_json::to_vec(&stamp).unwrap()).unwrap();
        assert_eq!(Stamp::read(dir.path()), Some(stamp));
        let metadata = std::fs::metadata(&path).unwrap();
        assert!(vouched_for(dir.path(), &spec, &metadata));
        // Not for another hash, nor another file of the same hash.
        let other = TableSpec { sha256: sha256(b"other"), ..spec.clone() };
        assert!(!vouched_for(dir.path(), &other, &metadata));
        let elsewhere = TableSpec { file: "tables/cat_4.bin".into(), ..spec.clone() };
        assert!(!vouched_for(dir.path(), &elsewhere, &metadata));
        assert!(open_every_way(dir.path(), &spec).into_iter().all(|opened| opened.is_ok()));
        // Rewritten in place, same size and inode: a new mtime, so hashed.
        use std::io::Write;
        let mut file = std::fs::File::options().write(true).open(&path).unwrap();
        file.write_all(&[0xff; 16]).unwrap();
        drop(file);
        assert!(!vouched_for(dir.path(), &spec, &std::fs::metadata(&path).unwrap()));
        for opened in open_every_way(dir.path(), &spec) {
            let error = opened.unwrap_err().to_string();
            assert!(error.contains("tables/cat_3.bin") && error.contains(&spec.sha256), "{error}");
        }
        // A stamp that cannot be read vouches for nothing.
        std::fs::write(dir.path().join(STAMP_FILE), b"{").unwrap();
        assert_eq!(Stamp::read(dir.path()), None);
    }

    /// The cost of the check at load without a stamp: 26 tables of 1M rows
    /// of 68 bytes (DLRM's int8 rows of 64 values: 80 bytes; 68 is what a
    /// row of 64 values takes unpadded), hashed from the page cache, and
    /// the same bytes hashed in memory (the memory store's case). Run with
    /// `cargo test -p narsil-embedding --release -- --ignored hashing_cost --nocapture`.
    #[test]
    #[ignore = "writes 1.6 GiB; a measurement"]
    fn hashing_cost_of_26_tables_of_1m_rows() {
        let dir = tempfile::tempdir().unwrap();
        let rows: Vec<u8> = (0..68u64 << 20).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        let rows = &rows[..68 * 1_000_000];
        let sha = sha256(rows);
        let specs: Vec<TableSpec> = (0..26)
            .map(|t| {
                let file = PathBuf::from(format!("tables/t{t}.bin"));
                std::fs::create_dir_all(dir.path().join("tables")).unwrap();
                std::fs::write(dir.path().join(&file), rows).unwrap();
                TableSpec {
                    name: format!("t{t}"),
                    rows: 1_000_000,
                    dim: 64,
                    storage: Storage::Fp32,
                    row_bytes: 68,
                    file,
                    sha256: sha.clone(),
                    redis: None,
                    layout: None,
                }
            })
            .collect();
        let gib = 26.0 * rows.len() as f64 / (1u64 << 30) as f64;
        let started = Instant::now();
        for spec in &specs {
            checked_file(dir.path(), spec).unwrap();
        }
        let files = started.elapsed().as_secs_f64();
        let started = Instant::now();
        for _ in &specs {
            assert_eq!(sha256_of_bytes(rows), sha);
        }
        let memory = started.elapsed().as_secs_f64();
        let stamp = Stamp::new(
            specs.iter().map(|spec| StampedFile::of(dir.path(), &spec.file, &spec.sha256).unwrap()).collect(),
        );
        std::fs::write(dir.path().join(STAMP_FILE), serde_json::to_vec(&stamp).unwrap()).unwrap();
        let started = Instant::now();
        for spec in &specs {
            checked_file(dir.path(), spec).unwrap();
        }
        let stamped = started.elapsed().as_secs_f64();
        eprintln!(
            "{gib:.2} GiB: files {files:.2} s ({:.2} GiB/s), in memory {memory:.2} s ({:.2} GiB/s), stamped {:.2} ms",
            gib / files,
            gib / memory,
            stamped * 1e3
        );
    }
}
