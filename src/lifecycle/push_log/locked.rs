//! A push log opened under its advisory lock, and a new log created.
//!
//! The lock is `flock`'s (std's [`File::lock`]): it belongs to one open
//! file, so two opens in one process exclude each other as two processes
//! on one repository (replicas) do. Appends and cuts hold it exclusively,
//! readers shared while they take a log's length and while they read a tail
//! that is not whole records: so no reader or writer ever sees another's
//! append half done, or a failed append being rolled back, and no one cuts
//! another's append in flight. A log opened is checked, once locked, to be
//! the file at its path still (not one removed or replaced meanwhile).
//!
//! A new log is created under the exclusive lock of its directory (so two
//! creators never both create it, and one never renames over another's
//! log), written whole under a unique temporary name claimed with
//! `O_EXCL`, synced, then renamed into place and its directory synced
//! (the shared publication rule, [`narsil_embedding::publish`]): a log
//! either has its header or does not exist.

use std::fs::{File, Metadata, OpenOptions};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use narsil_embedding::publish::{sync_directory, Claimed};

/// Which file an open log is: its device and inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileId {
    dev: u64,
    ino: u64,
}

impl FileId {
    fn of(meta: &Metadata) -> Self {
        Self { dev: meta.dev(), ino: meta.ino() }
    }
}

/// How a log is locked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lock {
    /// Shared, read-only: readers.
    Shared,
    /// Exclusive, to append and cut.
    Exclusive,
}

/// A log open and locked, the file at its path once locked.
pub struct Locked {
    pub file: File,
    pub file_id: FileId,
    /// Its length, once locked.
    pub length: u64,
}

/// Opens the log at `path` and locks it (`None`: there is none).
pub fn open(path: &Path, lock: Lock) -> std::io::Result<Option<Locked>> {
    loop {
        let opened = match lock {
            Lock::Shared => File::open(path),
            Lock::Exclusive => OpenOptions::new().read(true).append(true).open(path),
        };
        let file = match opened {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        match lock {
            Lock::Shared => file.lock_shared()?,
            Lock::Exclusive => file.lock()?,
        }
        let meta = file.metadata()?;
        let file_id = FileId::of(&meta);
        match std::fs::metadata(path) {
            Ok(now) if FileId::of(&now) == file_id => {
                return Ok(Some(Locked { file, file_id, length: meta.len() }))
            }
            // Removed or replaced between the open and the lock: again.
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
}

/// Opens the log at `path` locked exclusively, creating it with `header`
/// first if there is none.
pub fn open_or_create(path: &Path, header: &[u8]) -> std::io::Result<Locked> {
    loop {
        if let Some(locked) = open(path, Lock::Exclusive)? {
            return Ok(locked);
        }
        create(path, header)?;
    }
}

/// Creates the log at `path` holding `header`, unless one is there.
fn create(path: &Path, header: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().expect("a log lives in a directory");
    if !dir.is_dir() {
        std::fs::create_dir_all(dir)?;
        if let Some(model) = dir.parent() {
            sync_directory(model).map_err(std::io::Error::other)?;
        }
    }
    let directory = File::open(dir)?;
    directory.lock()?;
    if path.exists() {
        return Ok(());
    }
    static CREATED: AtomicU64 = AtomicU64::new(0);
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let unique = format!("{}-{}", std::process::id(), CREATED.fetch_add(1, Ordering::Relaxed));
    let staging = Claimed::file(&dir.join(format!(".{name}.{unique}.new")), "push log creation")
        .map_err(|e| std::io::Error::other(format!("{e:#}")))?;
    let mut file = OpenOptions::new().write(true).open(staging.path())?;
    file.write_all(header)?;
    file.sync_all()?;
    staging.publish(path).map_err(|e| std::io::Error::other(format!("{e:#}")))
}
