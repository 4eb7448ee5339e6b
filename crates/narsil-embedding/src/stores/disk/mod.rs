//! The `disk` table store, for tables larger than the memory the server
//! may use: rows read from the table files with direct I/O (never through
//! the page cache) into a row cache in RAM bounded in bytes
//! (`--table-cache-bytes`, the same [`crate::stores::row_cache::RowCache`] as the
//! `redis` store's, one per process, shared by every table of every model
//! version). Per fused batch and table the distinct ids that miss the
//! cache are sorted by file offset, rows that share a block are read once,
//! and every read of the batch is in flight at once (on an io_uring, or on
//! a pool of `pread` threads where the kernel refuses rings).
//!
//! * [`reads`]: planning direct reads of whole blocks, and making them on
//!   threads.
//! * [`uring`]: making them on an io_uring.
//! * [`store`]: the store kind, its configuration and a table's rows (a
//!   batch's fetch: `store/fetch.rs`).
//! * [`probe`]: whether a model's table files still read (the serving
//!   health follows it).

pub mod probe;
pub mod reads;
pub mod store;
pub mod uring;

/// For tests that need direct I/O: a directory on a file system that takes
/// it (beside the sources: a tmpfs `/tmp` takes none), or `None` after
/// printing `skipped: TEST: why`. Under `NARSIL_REQUIRE_DIRECT_IO=1` (CI
/// sets it) a skip fails the test instead: a direct-I/O test never passes
/// by not running.
#[cfg(test)]
pub(crate) fn direct_io_dir(test: &str) -> Option<tempfile::TempDir> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
    let probe = dir.path().join("probe");
    std::fs::write(&probe, [0u8; 4096]).unwrap();
    match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&probe) {
        Ok(_) => Some(dir),
        Err(e) => {
            let why = format!("{} refuses direct reads ({e})", dir.path().display());
            skip_or_fail(test, &why);
            None
        }
    }
}

/// Prints that `test` is skipped and why, or fails it where
/// `NARSIL_REQUIRE_DIRECT_IO=1` says this machine must run it.
#[cfg(test)]
pub(crate) fn skip_or_fail(test: &str, why: &str) {
    narsil_core::skip::skip_or_fail("NARSIL_REQUIRE_DIRECT_IO", test, why);
}
