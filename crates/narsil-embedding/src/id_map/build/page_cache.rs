//! Files a map's build (`narsil tables map`) streams through without filling the page
//! cache: the map and the runs written ([`DropBehind`]: handed to the disk
//! and dropped as they grow), the map read back to hash it
//! ([`ReadBehind`]). So the pages of a map larger than RAM are neither held
//! dirty nor charged to a small memory cgroup for long.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use anyhow::Context;

/// Bytes written through it between two hand-offs to the disk.
const DROP_BEHIND_BYTES: u64 = 16 << 20;

/// A file written front to back (seeks back aside) whose pages are handed
/// to the disk every [`DROP_BEHIND_BYTES`] and, once written, dropped from
/// the page cache: what it writes is never held in memory (nor charged to
/// the process's memory cgroup) more than two windows at a time.
pub struct DropBehind {
    file: File,
    /// Where the next write lands.
    at: u64,
    /// Bytes before it were handed to the disk (and the window before
    /// them, `dropped..started`, is being written).
    started: u64,
    dropped: u64,
}

impl DropBehind {
    /// Writes through `file`, from its start.
    pub fn new(file: File) -> Self {
        Self { file, at: 0, started: 0, dropped: 0 }
    }

    /// The file written.
    pub fn into_inner(self) -> File {
        self.file
    }

    /// Starts writing `started..at` back, waits for the window before it
    /// and drops that window's pages.
    fn hand_off(&mut self) {
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            let fd = self.file.as_raw_fd();
            // SAFETY: plain syscalls on a file descriptor this owns; they
            // change no memory of the process. Failures only leave pages in
            // the cache (the final sync reports real write errors).
            unsafe {
                libc::sync_file_range(
                    fd,
                    self.started as i64,
                    (self.at - self.started) as i64,
                    libc::SYNC_FILE_RANGE_WRITE,
                );
                if self.started > self.dropped {
                    let (from, len) = (self.dropped as i64, (self.started - self.dropped) as i64);
                    libc::sync_file_range(
                        fd,
                        from,
                        len,
                        libc::SYNC_FILE_RANGE_WAIT_BEFORE
                            | libc::SYNC_FILE_RANGE_WRITE
                            | libc::SYNC_FILE_RANGE_WAIT_AFTER,
                    );
                    libc::posix_fadvise(fd, from, len, libc::POSIX_FADV_DONTNEED);
                }
            }
        }
        (self.dropped, self.started) = (self.started, self.at);
    }
}

impl Write for DropBehind {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.at += n as u64;
        if self.at >= self.started + DROP_BEHIND_BYTES {
            self.hand_off();
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

impl Seek for DropBehind {
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        self.at = self.file.seek(to)?;
        // A write back at the start (the map's header) hands nothing off.
        self.started = self.started.min(self.at);
        self.dropped = self.dropped.min(self.started);
        Ok(self.at)
    }
}

/// A file read front to back whose pages are dropped from the page cache
/// once read (the hash of a map larger than RAM).
pub struct ReadBehind {
    file: File,
    at: u64,
    dropped: u64,
}

impl ReadBehind {
    /// Opens `path` to be read front to back.
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        let file = File::open(path).with_context(|| format!("{}", path.display()))?;
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            // SAFETY: an advice syscall on a descriptor this owns.
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_SEQUENTIAL) };
        }
        Ok(Self { file, at: 0, dropped: 0 })
    }
}

impl Read for ReadBehind {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.file.read(buf)?;
        self.at += n as u64;
        if self.at >= self.dropped + DROP_BEHIND_BYTES {
            #[cfg(target_os = "linux")]
            {
                use std::os::fd::AsRawFd;
                // SAFETY: an advice syscall on a descriptor this owns.
                unsafe {
                    libc::posix_fadvise(
                        self.file.as_raw_fd(),
                        self.dropped as i64,
                        (self.at - self.dropped) as i64,
                        libc::POSIX_FADV_DONTNEED,
                    )
                };
            }
            self.dropped = self.at;
        }
        Ok(n)
    }
}
