//! The one way a table's files are opened: checked against the schema (its
//! size, and the SHA-256 it names) before any store serves them. Every store
//! that reads files checks them here: `memory` and `mmap` through
//! [`Table::load`], `disk` and `narsil tables` through [`checked_file`]; the
//! slot index of a table in popularity order is read and checked by
//! [`slot_index`].
//!
//! [`Table::load`]: crate::stores::local::table::Table::load
//!
//! A table file is checked against the SHA-256 its schema names before it
//! serves: a
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
//! ordered copy changes it, which would unstamp the source. An empty
//! `sha256` leaves the file unchecked (logged once per table as it is
//! opened); any other `sha256` that is not 64 hex digits is refused when
//! the schema is read ([`crate::schema`]).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::popularity_order::SlotIndex;
use crate::schema::TableSpec;
use crate::sha256::sha256_of;
use crate::stores::table_error::TableError;

/// The slot index of `spec`'s table in model directory `dir`, if it is laid
/// out in popularity order ([`crate::popularity_order`]), streamed from its file into
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
pub(crate) fn sized_file(dir: &Path, spec: &TableSpec) -> Result<(PathBuf, std::fs::Metadata), TableError> {
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

/// Whether `spec`'s file (in `dir`, of `metadata`) needs no hashing: the
/// schema names no `sha256` for it (logged, once per table opened), or
/// `dir`'s stamp vouches for it as it is.
pub(crate) fn vouched_for(dir: &Path, spec: &TableSpec, metadata: &std::fs::Metadata) -> bool {
    if spec.sha256.is_empty() {
        tracing::warn!(
            table = %spec.name,
            file = %dir.join(&spec.file).display(),
            "schema.json names no sha256 for the table: its file is served unchecked (a torn or swapped \
             copy would serve without a word) and is not shared between versions; name its SHA-256 to check it"
        );
        return true;
    }
    Stamp::read(dir).is_some_and(|stamp| stamp.tables.iter().any(|f| f.vouches(spec, metadata)))
}

/// Fails unless `actual` is the hash `spec` names for its file `path`.
pub(crate) fn check_hash(spec: &TableSpec, path: &Path, actual: String) -> Result<(), TableError> {
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

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::schema::Storage;
    use crate::sha256::sha256_of_bytes;
    use crate::stores::local::table::tests::spec;
    use crate::stores::local::table::{LocalRows, Table};

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
    fn an_empty_sha256_leaves_the_file_unchecked_and_a_label_is_no_hash_of_it() {
        let dir = tempfile::tempdir().unwrap();
        let spec = hashed_table(dir.path(), &[5u8; 32], "");
        assert!(open_every_way(dir.path(), &spec).into_iter().all(|opened| opened.is_ok()));
        // The schema refuses a label when read; a spec made in code that
        // carries one is checked as a hash, and fails.
        for label in ["a new table", "ab12"] {
            let spec = hashed_table(dir.path(), &[5u8; 32], label);
            assert!(open_every_way(dir.path(), &spec).into_iter().all(|opened| opened.is_err()), "{label:?}");
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
                    ids: Default::default(),
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
