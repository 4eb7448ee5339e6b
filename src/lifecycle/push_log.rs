//! A push log: the raw ids pushed to one table of one model, with their
//! rows, as a file beside the model's versions in the repository
//! (`REPO/MODEL/.pushed-ids/TABLE.FORMAT.log`: a dot-name, which the
//! repository's scan never takes for a version), so that a version that
//! loads later, or the same version after a restart, is given them
//! before it serves ([`super::pushes`]).
//!
//! One log per table and row format (`FORMAT` is `STORAGE-DIM-ROW_BYTES`,
//! [`narsil_core::IdMapTable::row_format`]): a version replays the log of
//! its table's format only, so a table retrained with another dim starts a
//! log of its own, and a version of the old format still finds the old one.
//!
//! The file: a 64-byte header (the magic `NARSIL-PUSHLOG1\n`, then the
//! row format, NUL-padded), then one record per push that added ids,
//! appended and fsynced before the push is answered: the payload's length
//! (8 bytes, little-endian), the first 16 bytes of its SHA-256, then the
//! payload (the push's body: entries of a raw id, 8 bytes little-endian,
//! and a row). A record cut short or whose checksum differs is the torn
//! tail of a push that was never answered (the server stopped while
//! writing it): reading stops there ([`Tail::Torn`]), and it is cut off
//! before the next append.

use std::fs::{File, OpenOptions};
use std::io::{BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// The directory of a model's push logs, inside the model's directory.
pub const LOG_DIR: &str = ".pushed-ids";

const MAGIC: &[u8; 16] = b"NARSIL-PUSHLOG1\n";
/// Header bytes: the magic and the row format.
pub const HEADER_BYTES: u64 = 64;
/// Record header bytes: the length and the checksum.
const RECORD_HEADER_BYTES: u64 = 24;
/// Largest record read back: a push body is at most 16 MiB, and a length
/// past this is read as a torn record, not allocated.
const MAX_RECORD_BYTES: u64 = 1 << 30;

/// The log of `table` in `format`, in the model directory `model_dir`.
pub fn path(model_dir: &Path, table: &str, format: &str) -> PathBuf {
    model_dir.join(LOG_DIR).join(format!("{}.{format}.log", file_stem(table)))
}

/// The logs of `table` in any format in `model_dir`, with their formats.
pub fn logs_of(model_dir: &Path, table: &str) -> Vec<(String, PathBuf)> {
    let prefix = format!("{}.", file_stem(table));
    let Ok(entries) = std::fs::read_dir(model_dir.join(LOG_DIR)) else { return Vec::new() };
    let mut logs: Vec<(String, PathBuf)> = entries
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            let format = name.strip_prefix(&prefix)?.strip_suffix(".log")?;
            // A table named `a.b` is not table `a` in format `b.…`.
            (!format.contains('.')).then(|| (format.to_owned(), entry.path()))
        })
        .collect();
    logs.sort();
    logs
}

/// A table's name as a file name: letters, digits, `_` and `-` kept, every
/// other byte as `%XX` (no separator, no dot, nothing hidden).
fn file_stem(table: &str) -> String {
    let mut stem = String::with_capacity(table.len());
    for b in table.bytes() {
        match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'-' => stem.push(b as char),
            _ => stem.push_str(&format!("%{b:02X}")),
        }
    }
    stem
}

fn header(format: &str) -> Result<[u8; HEADER_BYTES as usize], String> {
    let mut header = [0u8; HEADER_BYTES as usize];
    header[..16].copy_from_slice(MAGIC);
    let room = HEADER_BYTES as usize - 16;
    if format.len() > room || format.contains('\0') {
        return Err(format!("row format {format:?} does not fit a push log's header ({room} bytes)"));
    }
    header[16..16 + format.len()].copy_from_slice(format.as_bytes());
    Ok(header)
}

fn checksum(payload: &[u8]) -> [u8; 16] {
    Sha256::digest(payload)[..16].try_into().expect("16 of 32 bytes")
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Appends `payload` to the log at `path` (of rows in `format`) and
/// fsyncs it; a new log is created with its header, and its directory
/// fsynced. On a failed write the file is cut back to its length before
/// it, so that a later append does not land behind a partial record.
pub fn append(path: &Path, format: &str, payload: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().expect("a log lives in a directory");
    if !path.exists() {
        std::fs::create_dir_all(dir)?;
        // Written whole under a temporary name, then renamed: a log either
        // has its header or does not exist.
        let staging = dir.join(format!(".{}.new", path.file_name().unwrap_or_default().to_string_lossy()));
        let mut file = File::create(&staging)?;
        file.write_all(&header(format).map_err(std::io::Error::other)?)?;
        file.sync_all()?;
        std::fs::rename(&staging, path)?;
        sync_dir(dir)?;
    }
    let mut file = OpenOptions::new().append(true).open(path)?;
    let before = file.metadata()?.len();
    let mut record = Vec::with_capacity(RECORD_HEADER_BYTES as usize + payload.len());
    record.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    record.extend_from_slice(&checksum(payload));
    record.extend_from_slice(payload);
    let written = file.write_all(&record).and_then(|()| file.sync_data());
    if let Err(error) = written {
        let _ = file.set_len(before).and_then(|()| file.sync_data());
        return Err(error);
    }
    Ok(())
}

/// What follows the last whole record read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tail {
    /// Nothing: the log ends there.
    Clean,
    /// `bytes` that are no whole record (cut short, or a checksum that
    /// differs): a push that was not answered, or one being written now.
    Torn { bytes: u64 },
}

/// How far a read got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadTo {
    /// The offset after the last whole record read.
    pub end: u64,
    /// Records read.
    pub records: u64,
    /// What follows `end`.
    pub tail: Tail,
}

/// Reads the log at `path` (of rows in `format`) from `from` (a record's
/// start; [`HEADER_BYTES`] for the first), handing each whole record's
/// payload to `each`, which may refuse it (the read stops with its
/// error). A log that does not exist reads as empty.
pub fn read(
    path: &Path,
    format: &str,
    from: u64,
    mut each: impl FnMut(&[u8]) -> Result<(), String>,
) -> Result<ReadTo, String> {
    let name = || path.display().to_string();
    let file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(ReadTo { end: from, records: 0, tail: Tail::Clean })
        }
        Err(e) => return Err(format!("cannot read the push log {}: {e}", name())),
    };
    let io = |e: std::io::Error| format!("cannot read the push log {}: {e}", name());
    let length = file.metadata().map_err(io)?.len();
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let mut head = [0u8; HEADER_BYTES as usize];
    match reader.read_exact(&mut head) {
        Ok(()) if head == header(format)? => {}
        Ok(()) => {
            return Err(format!(
                "{} is not a push log of rows in format {format:?} (its header differs); move it away to serve without it",
                name()
            ))
        }
        // Only a log renamed into place is read, header and all.
        Err(e) => return Err(io(e)),
    }
    reader.seek(SeekFrom::Start(from.max(HEADER_BYTES))).map_err(io)?;
    let (mut end, mut records) = (from.max(HEADER_BYTES), 0u64);
    let mut payload = Vec::new();
    loop {
        let left = length - end;
        if left == 0 {
            return Ok(ReadTo { end, records, tail: Tail::Clean });
        }
        let torn = ReadTo { end, records, tail: Tail::Torn { bytes: left } };
        if left < RECORD_HEADER_BYTES {
            return Ok(torn);
        }
        let mut record = [0u8; RECORD_HEADER_BYTES as usize];
        reader.read_exact(&mut record).map_err(io)?;
        let len = u64::from_le_bytes(record[..8].try_into().expect("8 bytes"));
        if len > MAX_RECORD_BYTES || len > left - RECORD_HEADER_BYTES {
            return Ok(torn);
        }
        payload.resize(len as usize, 0);
        reader.read_exact(&mut payload).map_err(io)?;
        if checksum(&payload) != record[8..] {
            return Ok(torn);
        }
        each(&payload)?;
        end += RECORD_HEADER_BYTES + len;
        records += 1;
    }
}

/// Payload bytes of the whole records of the log at `path`, whatever its
/// format (each record's length read, its payload skipped).
pub fn payload_bytes(path: &Path) -> std::io::Result<u64> {
    let mut file = File::open(path)?;
    let length = file.metadata()?.len();
    let (mut at, mut bytes) = (HEADER_BYTES, 0u64);
    while length.saturating_sub(at) >= RECORD_HEADER_BYTES {
        let mut len = [0u8; 8];
        file.seek(SeekFrom::Start(at))?;
        file.read_exact(&mut len)?;
        let len = u64::from_le_bytes(len);
        if len > length - at - RECORD_HEADER_BYTES {
            break;
        }
        bytes += len;
        at += RECORD_HEADER_BYTES + len;
    }
    Ok(bytes)
}

/// Cuts the log at `path` at `end` (after its last whole record), fsynced.
pub fn cut(path: &Path, end: u64) -> std::io::Result<()> {
    let file = OpenOptions::new().write(true).open(path)?;
    file.set_len(end)?;
    file.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(path: &Path, format: &str, from: u64) -> (Vec<Vec<u8>>, ReadTo) {
        let mut read_back = Vec::new();
        let to = read(path, format, from, |payload| {
            read_back.push(payload.to_vec());
            Ok(())
        })
        .unwrap();
        (read_back, to)
    }

    #[test]
    fn appended_records_read_back_in_order_from_any_record_and_a_missing_log_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let log = path(dir.path(), "cat_3", "int8_rowwise-64-80");
        assert_eq!(log, dir.path().join(".pushed-ids/cat_3.int8_rowwise-64-80.log"));
        assert_eq!(records(&log, "int8_rowwise-64-80", HEADER_BYTES).1.records, 0);
        append(&log, "int8_rowwise-64-80", b"first push").unwrap();
        append(&log, "int8_rowwise-64-80", b"").unwrap();
        append(&log, "int8_rowwise-64-80", b"third").unwrap();
        let (all, to) = records(&log, "int8_rowwise-64-80", HEADER_BYTES);
        assert_eq!(all, [b"first push".to_vec(), Vec::new(), b"third".to_vec()]);
        assert_eq!((to.records, to.tail, to.end), (3, Tail::Clean, std::fs::metadata(&log).unwrap().len()));
        let after_first = HEADER_BYTES + RECORD_HEADER_BYTES + 10;
        assert_eq!(records(&log, "int8_rowwise-64-80", after_first).0, [Vec::new(), b"third".to_vec()]);
        assert_eq!(payload_bytes(&log).unwrap(), 15);
        // Another format's reader refuses the file, naming it.
        let error = read(&log, "fp32-16-64", HEADER_BYTES, |_| Ok(())).unwrap_err();
        assert!(
            error.contains("cat_3.int8_rowwise-64-80.log") && error.contains("header differs"),
            "{error}"
        );
        assert_eq!(logs_of(dir.path(), "cat_3"), [("int8_rowwise-64-80".to_owned(), log)]);
        assert!(logs_of(dir.path(), "cat").is_empty());
    }

    #[test]
    fn a_torn_tail_ends_the_read_where_the_last_whole_record_ends_and_is_cut_before_the_next_append() {
        let dir = tempfile::tempdir().unwrap();
        let log = path(dir.path(), "t", "fp32-4-16");
        append(&log, "fp32-4-16", b"whole").unwrap();
        let whole = std::fs::metadata(&log).unwrap().len();
        append(&log, "fp32-4-16", b"cut short by a crash").unwrap();
        let full = std::fs::metadata(&log).unwrap().len();
        for cut_at in [whole + 3, whole + RECORD_HEADER_BYTES + 4, full - 1] {
            std::fs::OpenOptions::new().write(true).open(&log).unwrap().set_len(cut_at).unwrap();
            let (read_back, to) = records(&log, "fp32-4-16", HEADER_BYTES);
            assert_eq!(read_back, [b"whole".to_vec()], "cut at {cut_at}");
            assert_eq!((to.end, to.tail), (whole, Tail::Torn { bytes: cut_at - whole }));
        }
        // A flipped bit in a whole-length record: torn too.
        cut(&log, whole).unwrap();
        append(&log, "fp32-4-16", b"bit flipped").unwrap();
        let mut bytes = std::fs::read(&log).unwrap();
        *bytes.last_mut().unwrap() ^= 1;
        std::fs::write(&log, &bytes).unwrap();
        assert_eq!(records(&log, "fp32-4-16", HEADER_BYTES).1.tail, Tail::Torn { bytes: 24 + 11 });
        cut(&log, whole).unwrap();
        append(&log, "fp32-4-16", b"after the cut").unwrap();
        let (read_back, to) = records(&log, "fp32-4-16", HEADER_BYTES);
        assert_eq!(read_back, [b"whole".to_vec(), b"after the cut".to_vec()]);
        assert_eq!(to.tail, Tail::Clean);
    }

    #[test]
    fn table_names_become_file_names_without_separators_or_dots() {
        assert_eq!(file_stem("cat_3-x"), "cat_3-x");
        assert_eq!(file_stem("../a.b"), "%2E%2E%2Fa%2Eb");
        let dir = tempfile::tempdir().unwrap();
        append(&path(dir.path(), "a.b", "fp32-1-4"), "fp32-1-4", b"x").unwrap();
        assert!(logs_of(dir.path(), "a").is_empty(), "table a.b is not table a");
        assert_eq!(logs_of(dir.path(), "a.b").len(), 1);
    }
}
