//! A push log's bytes: its 64-byte header (a magic that says the record
//! layout, the row format, NUL-padded, and in [`Layout::Guarded`] logs a
//! 16-byte nonce of the file's own, which tells a log from one written
//! again at its path even where the new file takes the old one's inode)
//! and its records, and the scan that tells whole records, a torn tail and
//! damage apart.
//!
//! A record: the payload's length (8 bytes, little-endian), in
//! [`Layout::Guarded`] logs that length's bitwise complement (8 bytes), the
//! first 16 bytes of the payload's SHA-256, then the payload.
//! [`Layout::Unguarded`] is the first layout's (`NARSIL-PUSHLOG1`), still
//! read and appended to; new logs are guarded (`NARSIL-PUSHLOG2`), so that a
//! flipped bit in a length is damage, not a record that seems to run past
//! the end of the file.
//!
//! What the scan stops at ([`Stop`]):
//! * the end of the file, after a whole record ([`Stop::Clean`]);
//! * a **torn tail**: a final record the file ends inside of (fewer bytes
//!   than a record header left, or a header whose declared length runs past
//!   the end), or zeros from a record's start to the end (what a file
//!   system may show of an append a power cut stopped): an append that
//!   never finished, so a push never answered ([`Stop::Torn`]);
//! * **damage**: anything else that is not a whole record (a whole-length
//!   record whose checksum differs, a length whose guard differs, a length
//!   no push can have): answered pushes may be in it or after it, so it is
//!   never cut ([`Stop::Damaged`]).

use std::io::Read;

use sha2::{Digest, Sha256};

/// Header bytes: the magic and the row format.
pub const HEADER_BYTES: u64 = 64;
const MAGIC_UNGUARDED: &[u8; 16] = b"NARSIL-PUSHLOG1\n";
const MAGIC_GUARDED: &[u8; 16] = b"NARSIL-PUSHLOG2\n";
/// Largest payload a record holds: a push's body is at most this; a
/// declared length past it is damage, not a torn tail.
pub const MAX_PAYLOAD_BYTES: u64 = super::super::control::MAX_PUSH_BODY_BYTES as u64;

/// How a log's records are laid out (its header's magic says which).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Length, checksum, payload (`NARSIL-PUSHLOG1`, logs written before the guard).
    Unguarded,
    /// Length, its complement, checksum, payload (`NARSIL-PUSHLOG2`).
    Guarded,
}

impl Layout {
    /// Bytes before a record's payload.
    pub fn record_header_bytes(self) -> u64 {
        match self {
            Self::Unguarded => 24,
            Self::Guarded => 32,
        }
    }

    fn magic(self) -> &'static [u8; 16] {
        match self {
            Self::Unguarded => MAGIC_UNGUARDED,
            Self::Guarded => MAGIC_GUARDED,
        }
    }
}

/// Where a guarded header's nonce starts (the row format's room ends).
const NONCE_AT: usize = 48;

/// The header of a new log of rows in `format`, of `layout` (a guarded
/// one with `nonce`).
pub fn header(format: &str, layout: Layout, nonce: [u8; 16]) -> Result<[u8; HEADER_BYTES as usize], String> {
    let mut header = [0u8; HEADER_BYTES as usize];
    header[..16].copy_from_slice(layout.magic());
    let room = format_room(layout) - 16;
    if format.len() > room || format.contains('\0') {
        return Err(format!("row format {format:?} does not fit a push log's header ({room} bytes)"));
    }
    header[16..16 + format.len()].copy_from_slice(format.as_bytes());
    if layout == Layout::Guarded {
        header[NONCE_AT..].copy_from_slice(&nonce);
    }
    Ok(header)
}

/// Where the row format's room in a header of `layout` ends.
fn format_room(layout: Layout) -> usize {
    match layout {
        Layout::Unguarded => HEADER_BYTES as usize,
        Layout::Guarded => NONCE_AT,
    }
}

/// The layout and nonce of a log whose header is `head`, if it is a log of
/// rows in `format` (an unguarded log's nonce is zeros).
pub fn layout_of(head: &[u8; HEADER_BYTES as usize], format: &str) -> Option<(Layout, [u8; 16])> {
    let layout = [Layout::Guarded, Layout::Unguarded].into_iter().find(|&layout| {
        let room = format_room(layout);
        header(format, layout, [0; 16]).is_ok_and(|h| h[..room] == head[..room])
    })?;
    let nonce = match layout {
        Layout::Guarded => head[NONCE_AT..].try_into().expect("16 bytes"),
        Layout::Unguarded => [0; 16],
    };
    Some((layout, nonce))
}

/// A nonce for a new log: no two logs this process or another writes
/// share one (the hash of the process, the time, a count and `path`).
pub fn fresh_nonce(path: &std::path::Path) -> [u8; 16] {
    static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let mut hash = Sha256::new();
    hash.update(std::process::id().to_le_bytes());
    hash.update(now.as_nanos().to_le_bytes());
    hash.update(MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed).to_le_bytes());
    hash.update(path.as_os_str().as_encoded_bytes());
    hash.finalize()[..16].try_into().expect("16 of 32 bytes")
}

fn checksum(payload: &[u8]) -> [u8; 16] {
    Sha256::digest(payload)[..16].try_into().expect("16 of 32 bytes")
}

/// The record of `payload` in `layout`.
pub fn record(layout: Layout, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u64;
    let mut record = Vec::with_capacity(layout.record_header_bytes() as usize + payload.len());
    record.extend_from_slice(&len.to_le_bytes());
    if layout == Layout::Guarded {
        record.extend_from_slice(&(!len).to_le_bytes());
    }
    record.extend_from_slice(&checksum(payload));
    record.extend_from_slice(payload);
    record
}

/// Where a scan is: the offset after the last whole record, and the whole
/// records it read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub end: u64,
    pub records: u64,
}

/// What a scan stopped at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// The end of the file.
    Clean,
    /// A final record the file ends inside of: `bytes` of an unfinished append.
    Torn { bytes: u64 },
    /// A record at `at` that is neither whole nor torn; `why`, in words.
    Damaged { at: u64, why: String },
}

/// Why a scan did not reach a [`Stop`].
#[derive(Debug)]
pub enum ScanError {
    /// Reading failed (or the file shrank under a scan that holds no lock).
    Io(std::io::Error),
    /// The record handler refused a record (its error).
    Refused(String),
}

/// Scans the records of a log of `layout` from `progress.end` (where
/// `reader` is) to `length`, handing each whole record's payload to `each`;
/// `progress` follows the whole records read, whatever the outcome.
pub fn scan(
    reader: &mut impl Read,
    layout: Layout,
    length: u64,
    progress: &mut Progress,
    each: &mut dyn FnMut(&[u8]) -> Result<(), String>,
) -> Result<Stop, ScanError> {
    let header_bytes = layout.record_header_bytes();
    let mut payload = Vec::new();
    loop {
        let left = length.saturating_sub(progress.end);
        if left == 0 {
            return Ok(Stop::Clean);
        }
        if left < header_bytes {
            return Ok(Stop::Torn { bytes: left });
        }
        let mut head = [0u8; 32];
        let head = &mut head[..header_bytes as usize];
        reader.read_exact(head).map_err(ScanError::Io)?;
        let len = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
        let bad_length = if layout == Layout::Guarded
            && u64::from_le_bytes(head[8..16].try_into().expect("8 bytes")) != !len
        {
            Some(format!("its length field ({len}) does not match its guard"))
        } else if len > MAX_PAYLOAD_BYTES {
            Some(format!("it declares {len} bytes, more than a push can hold ({MAX_PAYLOAD_BYTES})"))
        } else {
            None
        };
        if let Some(why) = bad_length {
            let zeros = left <= header_bytes + MAX_PAYLOAD_BYTES
                && head.iter().all(|&b| b == 0)
                && zeros_to_end(reader, left - header_bytes).map_err(ScanError::Io)?;
            return Ok(if zeros {
                Stop::Torn { bytes: left }
            } else {
                Stop::Damaged { at: progress.end, why }
            });
        }
        if len > left - header_bytes {
            return Ok(Stop::Torn { bytes: left });
        }
        payload.resize(len as usize, 0);
        reader.read_exact(&mut payload).map_err(ScanError::Io)?;
        if checksum(&payload) != head[header_bytes as usize - 16..] {
            let after = left - header_bytes - len;
            let zeros = head.iter().chain(&payload).all(|&b| b == 0)
                && after <= MAX_PAYLOAD_BYTES
                && zeros_to_end(reader, after).map_err(ScanError::Io)?;
            if zeros {
                return Ok(Stop::Torn { bytes: left });
            }
            let why = format!(
                "its checksum differs from its {len} bytes (a whole-length record; {after} bytes follow it)"
            );
            return Ok(Stop::Damaged { at: progress.end, why });
        }
        each(&payload).map_err(ScanError::Refused)?;
        progress.end += header_bytes + len;
        progress.records += 1;
    }
}

/// Whether the next `bytes` of `reader` are all zeros.
fn zeros_to_end(reader: &mut impl Read, mut bytes: u64) -> std::io::Result<bool> {
    let mut chunk = vec![0u8; 64 << 10];
    while bytes > 0 {
        let part = &mut chunk[..bytes.min(64 << 10) as usize];
        reader.read_exact(part)?;
        if part.iter().any(|&b| b != 0) {
            return Ok(false);
        }
        bytes -= part.len() as u64;
    }
    Ok(true)
}
