//! The process's scratch directory: where libtorch extracts what it loads
//! from a file (an AOTInductor package's kernels and weights, ~4-65 MiB a
//! `.pt2`, in `$TMPDIR/aotinductor_*`). libtorch removes such a directory
//! when the package is dropped, so a process that is killed (SIGKILL, the
//! OOM killer, a crash) leaves it behind, and a server restarted in a loop
//! fills its temporary directory (on tmpfs, its memory) a model at a time.
//!
//! So `main` gives the process a directory of its own, `narsil-<pid>` under
//! the operator's `TMPDIR` (or `/tmp`), and points `TMPDIR` at it before any
//! thread starts (libtorch reads it when it extracts). The process holds an
//! exclusive `flock` on the directory's `.held` for its whole life; at start
//! it removes every `narsil-*` directory beside its own whose lock nobody
//! holds (a process that ended without removing it: locks end with their
//! process, in any pid namespace sharing the filesystem), and at a normal
//! exit it removes its own. A directory is named `narsil-<pid>` only once
//! its lock is held (made as `.narsil-<pid>-new`, locked, then renamed), so
//! a starting process never removes another's that is being set up.
//! `NARSIL_SCRATCH_DIR=off` leaves `TMPDIR` as it is.

use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// The directory's lock file.
const HELD: &str = ".held";
/// The prefix of every process's directory.
const PREFIX: &str = "narsil-";

/// This process's scratch directory, locked while it lives.
pub(crate) struct ScratchDir {
    dir: PathBuf,
    /// Holds the lock (closing it releases the lock).
    _held: File,
    /// What the start removed: directories and bytes.
    swept: (usize, u64),
}

impl ScratchDir {
    /// Makes this process's directory under `TMPDIR` (or `/tmp`), removes
    /// the ones of processes gone, and points `TMPDIR` at it. `None` where
    /// the operator turned it off or it cannot be made (said on stderr
    /// then: logging starts later): `TMPDIR` is left as it was.
    ///
    /// Call first thing in `main`, before any thread exists: it sets the
    /// environment.
    pub(crate) fn create() -> Option<Self> {
        if std::env::var_os("NARSIL_SCRATCH_DIR").is_some_and(|v| v == "off") {
            return None;
        }
        let base = std::env::var_os("TMPDIR").map_or_else(std::env::temp_dir, PathBuf::from);
        match Self::under(&base) {
            Ok(scratch) => {
                // SAFETY: called first thing in `main`, before any thread
                // exists that could read the environment at the same time.
                unsafe { std::env::set_var("TMPDIR", &scratch.dir) };
                Some(scratch)
            }
            Err(e) => {
                eprintln!(
                    "narsil: no scratch directory under {} ({e}); libtorch extracts into it directly, and a \
                     killed process leaves what it extracted there",
                    base.display()
                );
                None
            }
        }
    }

    /// [`Self::create`] under `base`, without touching the environment.
    fn under(base: &Path) -> io::Result<Self> {
        let pid = std::process::id();
        let staging = base.join(format!(".{PREFIX}{pid}-new"));
        let dir = base.join(format!("{PREFIX}{pid}"));
        // A directory of this pid's is a dead process's (pids are reused):
        // nothing of it is held by this one yet.
        for stale in [&staging, &dir] {
            remove(stale)?;
        }
        fs::DirBuilder::new().mode(0o700).create(&staging)?;
        let held = File::create(staging.join(HELD))?;
        if !try_lock(&held)? {
            return Err(io::Error::other("its new lock file is locked by another process"));
        }
        fs::rename(&staging, &dir)?;
        let swept = sweep(base, &dir);
        Ok(Self { dir, _held: held, swept })
    }

    /// Says where libtorch extracts, and what the start removed.
    pub(crate) fn log(&self) {
        let (dirs, bytes) = self.swept;
        tracing::debug!(dir = %self.dir.display(), "scratch directory (TMPDIR) for what libtorch extracts");
        if dirs > 0 {
            tracing::info!(
                removed = dirs,
                mib = bytes >> 20,
                "removed the scratch directories of Narsil processes that ended without removing theirs"
            );
        }
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// `flock`s `file` exclusively without waiting; `false` where another
/// holds it.
fn try_lock(file: &File) -> io::Result<bool> {
    // SAFETY: `flock` takes a file descriptor and an operation and touches
    // no memory; the descriptor is `file`'s, open for this call.
    match unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } {
        0 => Ok(true),
        _ => match io::Error::last_os_error() {
            e if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(false),
            e => Err(e),
        },
    }
}

/// Removes every `narsil-*` directory in `base` but `own` whose lock
/// nobody holds; returns how many, and their bytes. Others' directories
/// (no permission), ones without a lock file, and ones that fail to be
/// removed are left alone.
fn sweep(base: &Path, own: &Path) -> (usize, u64) {
    let Ok(entries) = fs::read_dir(base) else { return (0, 0) };
    let mut swept = (0, 0);
    for entry in entries.flatten() {
        let path = entry.path();
        let ours = entry.file_name().to_str().is_some_and(|n| n.starts_with(PREFIX));
        if !ours || path == own || !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let Ok(held) = File::open(path.join(HELD)) else { continue };
        if try_lock(&held).unwrap_or(false) {
            let bytes = size(&path);
            if fs::remove_dir_all(&path).is_ok() {
                swept = (swept.0 + 1, swept.1 + bytes);
            }
        }
    }
    swept
}

/// Bytes of the files under `path`.
fn size(path: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(path) else { return 0 };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => size(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// Removes `path` if it exists.
fn remove(path: &Path) -> io::Result<()> {
    match fs::remove_dir_all(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_removes_the_directories_of_processes_gone_and_leaves_held_ones() {
        let base = tempfile::tempdir().unwrap();
        // A process gone: its directory, its lock file unheld, what it extracted.
        let gone = base.path().join("narsil-4000001");
        fs::create_dir_all(gone.join("aotinductor_x")).unwrap();
        File::create(gone.join(HELD)).unwrap();
        fs::write(gone.join("aotinductor_x/model.so"), vec![0u8; 4096]).unwrap();
        // A process alive: its lock held.
        let alive = base.path().join("narsil-4000002");
        fs::create_dir_all(&alive).unwrap();
        let holder = File::create(alive.join(HELD)).unwrap();
        assert!(try_lock(&holder).unwrap());
        // One being set up (no lock file yet), and what is not Narsil's.
        let starting = base.path().join("narsil-4000003");
        fs::create_dir_all(&starting).unwrap();
        let other = base.path().join("aotinductor_y");
        fs::create_dir_all(&other).unwrap();
        let scratch = ScratchDir::under(base.path()).unwrap();
        assert_eq!(scratch.swept, (1, 4096));
        assert!(!gone.exists());
        for kept in [&alive, &starting, &other, &scratch.dir] {
            assert!(kept.is_dir(), "{}", kept.display());
        }
        // Its own lock is held: a second start beside it leaves it.
        assert!(!try_lock(&File::open(scratch.dir.join(HELD)).unwrap()).unwrap());
        drop(holder);
        let dir = scratch.dir.clone();
        drop(scratch);
        assert!(!dir.exists(), "removed at a normal end");
        // Now unheld, the other is removed by the next start.
        let next = ScratchDir::under(base.path()).unwrap();
        assert_eq!(next.swept.0, 1);
        assert!(!alive.exists());
    }
}
