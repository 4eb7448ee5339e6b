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
//! The file: a header, then one record per push that added ids, appended
//! and fsynced before the push is answered ([`format`]: the push's body,
//! entries of a raw id, 8 bytes little-endian, and a row; its length and
//! checksum). The rules that keep an answered push:
//! * **Only a torn tail is cut**: a final record the file ends inside of,
//!   which is an append that never finished, so a push never answered. It
//!   is cut by the next append, or by a version's catch-up, under the
//!   exclusive lock, with a warning that says how many bytes.
//! * **Damage refuses**: a record that is neither whole nor torn (a
//!   whole-length record whose checksum differs, a damaged length) fails
//!   the read naming the file and the byte offset, and a push to the log is
//!   refused; the file is left as it is. Refusing, not moving the file
//!   aside: a version that loaded without the log would serve its answered
//!   pushes from its default row with nothing but a log line to say so,
//!   while the version serving before keeps serving them.
//! * **Locked** ([`locked`]): appends, cuts and creation hold an advisory
//!   lock, so replicas on one repository never cut each other's append in
//!   flight nor both create a log, and a read never sees a failed append
//!   half rolled back (it waits for it).
//! * **The same file** ([`Position`]): a read that goes on from where an
//!   earlier one stopped checks the log is still that file (device, inode
//!   and its header's nonce) and no shorter; a log removed or replaced is
//!   [`Read::Replaced`], which its reader reads again from the start.

use std::fs::File;
use std::io::{BufReader, Read as _, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

mod format;
mod locked;

pub use format::HEADER_BYTES;
use format::{Layout, Progress, ScanError, Stop};
use locked::{FileId, Lock, Locked};

/// The directory of a model's push logs, inside the model's directory.
pub const LOG_DIR: &str = ".pushed-ids";

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

/// Which log a file is: its device and inode, and the nonce its header
/// was written with (a log written again at its path may take the inode of
/// the one removed, never its nonce).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    file: FileId,
    nonce: [u8; 16],
}

/// Where a reader or writer of a log got to: the offset after the last
/// whole record it read or wrote, and which file that was (none before it
/// found one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    pub end: u64,
    pub identity: Option<Identity>,
}

impl Position {
    /// Before the first record of whatever log is at the path.
    pub const START: Self = Self { end: HEADER_BYTES, identity: None };
}

/// What follows the last whole record read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tail {
    /// Nothing: the log ends there.
    Clean,
    /// `bytes` of an unfinished append (a final record the file ends
    /// inside of): left by a read, cut by [`read_and_cut`].
    Torn { bytes: u64 },
}

/// How far a read got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadTo {
    /// After the last whole record read, in the file read.
    pub at: Position,
    /// Records read.
    pub records: u64,
    /// What followed `at`.
    pub tail: Tail,
}

/// A read's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Read {
    /// Read to the end of the log (or of its whole records).
    To(ReadTo),
    /// The log at the path is not the file read before (why, in words):
    /// read it again from [`Position::START`] (records of the file it
    /// replaced may have been handed on before it was found replaced).
    Replaced(String),
}

/// Reads the log at `path` (of rows in `format`) from `from` (where an
/// earlier read stopped, or [`Position::START`]), handing each whole
/// record's payload to `each`, which may refuse it (the read fails with its
/// error). A log that does not exist reads as empty; damage fails the read,
/// naming the file and the offset; a torn tail is left as it is.
pub fn read(
    path: &Path,
    format: &str,
    from: Position,
    mut each: impl FnMut(&[u8]) -> Result<(), String>,
) -> Result<Read, String> {
    read_with(path, format, from, false, &mut each)
}

/// [`read`], and a torn tail cut (under the exclusive lock, which a
/// read's shared one is not), with a warning.
pub fn read_and_cut(
    path: &Path,
    format: &str,
    from: Position,
    mut each: impl FnMut(&[u8]) -> Result<(), String>,
) -> Result<Read, String> {
    read_with(path, format, from, true, &mut each)
}

fn read_with(
    path: &Path,
    format: &str,
    from: Position,
    cut: bool,
    each: &mut dyn FnMut(&[u8]) -> Result<(), String>,
) -> Result<Read, String> {
    let io = |e: std::io::Error| format!("cannot read the push log {}: {e}", path.display());
    let Some(Locked { file, file_id, length }) = locked::open(path, Lock::Shared).map_err(io)? else {
        return Ok(match from.identity {
            Some(_) => Read::Replaced("it was removed".into()),
            None => Read::To(ReadTo { at: from, records: 0, tail: Tail::Clean }),
        });
    };
    let (layout, nonce) = layout(&file, path, format)?;
    let identity = Identity { file: file_id, nonce };
    if let Some(replaced) = replaced(from, identity, length) {
        return Ok(Read::Replaced(replaced));
    }
    // The records up to `length` were whole, or a torn tail, when it was
    // taken under the lock, and whole records never change: read without
    // it, so that a long replay holds off no append. A tail that does not
    // read whole (a torn one another writer may be cutting and appending
    // over) is read again under the lock.
    file.unlock().map_err(io)?;
    let mut progress = Progress { end: from.end.max(HEADER_BYTES), records: 0 };
    match scan_from(&file, layout, length, &mut progress, each) {
        Ok(Stop::Clean) => {
            let at = Position { end: progress.end, identity: Some(identity) };
            return Ok(Read::To(ReadTo { at, records: progress.records, tail: Tail::Clean }));
        }
        Err(ScanError::Refused(why)) => return Err(why),
        Ok(_) | Err(ScanError::Io(_)) => {}
    }
    let locked = if cut { locked::open(path, Lock::Exclusive).map_err(io)? } else { None };
    let (file, length) = match locked {
        Some(locked) if locked.file_id == file_id => (locked.file, locked.length),
        Some(_) | None if cut => {
            return Ok(Read::Replaced("it was removed or replaced while it was read".into()))
        }
        _ => {
            file.lock_shared().map_err(io)?;
            let length = file.metadata().map_err(io)?.len();
            (file, length)
        }
    };
    let tail = match scan_from(&file, layout, length, &mut progress, each) {
        Ok(Stop::Clean) => Tail::Clean,
        Ok(Stop::Torn { bytes }) => {
            if cut {
                cut_torn_tail(&file, path, progress.end, bytes)?;
            }
            Tail::Torn { bytes }
        }
        Ok(Stop::Damaged { at, why }) => return Err(damaged(path, at, &why)),
        Err(ScanError::Refused(why)) => return Err(why),
        Err(ScanError::Io(e)) => return Err(io(e)),
    };
    let at = Position { end: progress.end, identity: Some(identity) };
    Ok(Read::To(ReadTo { at, records: progress.records, tail }))
}

/// Why the log (`identity`, `length` bytes) is not the one read to `from`.
fn replaced(from: Position, identity: Identity, length: u64) -> Option<String> {
    match from.identity {
        Some(read) if read != identity => {
            Some("another file is at its path (its device, inode or header's nonce differs)".into())
        }
        Some(_) if length < from.end => {
            Some(format!("it is {length} bytes, shorter than the {} bytes read before", from.end))
        }
        _ => None,
    }
}

/// The layout and nonce of the open log `file` at `path`, if it holds rows
/// in `format`.
fn layout(file: &File, path: &Path, format: &str) -> Result<(Layout, [u8; 16]), String> {
    let mut head = [0u8; HEADER_BYTES as usize];
    file.read_exact_at(&mut head, 0)
        .map_err(|e| format!("cannot read the header of the push log {}: {e}", path.display()))?;
    format::layout_of(&head, format).ok_or_else(|| {
        format!(
            "{} is not a push log of rows in format {format:?} (its header differs); move it away to serve without it",
            path.display()
        )
    })
}

/// Scans `file` from `progress.end` to `length`.
fn scan_from(
    file: &File,
    layout: Layout,
    length: u64,
    progress: &mut Progress,
    each: &mut dyn FnMut(&[u8]) -> Result<(), String>,
) -> Result<Stop, ScanError> {
    let mut reader = BufReader::with_capacity(1 << 20, file);
    reader.seek(SeekFrom::Start(progress.end)).map_err(ScanError::Io)?;
    format::scan(&mut reader, layout, length, progress, each)
}

/// The error of damage at `at` in the log at `path`.
fn damaged(path: &Path, at: u64, why: &str) -> String {
    let p = path.display();
    format!(
        "the push log {p} is damaged at byte {at}: the record there is not whole and not the torn tail of an \
         unfinished append ({why}). It is left as it is: answered pushes may be in it and after it. Restore \
         the file from a backup; or keep the pushes before the damage with `truncate -s {at} {p}`; or move \
         the file away to load without any of its pushes"
    )
}

/// Cuts the torn tail of the log `file` (at `path`, locked exclusively) at
/// `end`, `bytes` long, synced, with a warning.
fn cut_torn_tail(file: &File, path: &Path, end: u64, bytes: u64) -> Result<(), String> {
    file.set_len(end).and_then(|()| file.sync_all()).map_err(|e| {
        format!("cannot cut the torn tail of the push log {} at byte {end}: {e}", path.display())
    })?;
    tracing::warn!(
        log = %path.display(), offset = end, bytes,
        "{bytes} bytes of an unfinished append cut from the end of the push log (a push whose server stopped \
         while writing it, so never answered)"
    );
    Ok(())
}

/// Appends `payload` to the log at `path` (of rows in `format`) and
/// fsyncs it, under the log's exclusive lock; a new log is created first.
/// `known` is where this process last left the log: what others appended
/// since (all of it, if the log is another file) is scanned, a torn tail
/// cut, and damage refuses the append. On a failed write the file is cut
/// back to its length before it (readers wait for that); `known` then
/// follows the record.
pub fn append(path: &Path, format: &str, payload: &[u8], known: &mut Position) -> Result<(), String> {
    let io = |e: std::io::Error| format!("cannot write the push log {}: {e}", path.display());
    if payload.len() as u64 > format::MAX_PAYLOAD_BYTES {
        return Err(format!("a push body of {} bytes is more than a push log record holds", payload.len()));
    }
    let new = format::header(format, Layout::Guarded, format::fresh_nonce(path))?;
    let Locked { mut file, file_id, length } = locked::open_or_create(path, &new).map_err(io)?;
    let (layout, nonce) = layout(&file, path, format)?;
    let identity = Identity { file: file_id, nonce };
    let mut progress = Progress { end: HEADER_BYTES, records: 0 };
    if known.identity == Some(identity) && known.end <= length {
        progress.end = known.end;
    }
    match scan_from(&file, layout, length, &mut progress, &mut |_| Ok(())) {
        Ok(Stop::Clean) => {}
        Ok(Stop::Torn { bytes }) => cut_torn_tail(&file, path, progress.end, bytes)?,
        Ok(Stop::Damaged { at, why }) => return Err(damaged(path, at, &why)),
        Err(ScanError::Io(e)) => return Err(io(e)),
        Err(ScanError::Refused(why)) => return Err(why),
    }
    let record = format::record(layout, payload);
    let written = std::io::Write::write_all(&mut file, &record).and_then(|()| file.sync_data());
    if let Err(error) = written {
        let _ = file.set_len(progress.end).and_then(|()| file.sync_data());
        return Err(io(error));
    }
    *known = Position { end: progress.end + record.len() as u64, identity: Some(identity) };
    Ok(())
}

/// Payload bytes of the whole records of the log at `path`, whatever its
/// format (each record's length read, its payload skipped; no lock: an
/// estimate for a warning).
pub fn payload_bytes(path: &Path) -> std::io::Result<u64> {
    let mut file = File::open(path)?;
    let length = file.metadata()?.len();
    let mut magic = [0u8; 16];
    file.read_exact(&mut magic)?;
    let layout = if magic[..15] == b"NARSIL-PUSHLOG1"[..] { Layout::Unguarded } else { Layout::Guarded };
    let header_bytes = layout.record_header_bytes();
    let (mut at, mut bytes) = (HEADER_BYTES, 0u64);
    while length.saturating_sub(at) >= header_bytes {
        let mut len = [0u8; 8];
        file.read_exact_at(&mut len, at)?;
        let len = u64::from_le_bytes(len);
        if len > length - at - header_bytes {
            break;
        }
        bytes += len;
        at += header_bytes + len;
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests;
