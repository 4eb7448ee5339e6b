//! Reading rows of a table file with direct I/O (`O_DIRECT`): never through
//! the page cache, so the process's memory is its own row cache and
//! nothing else. Direct reads must start at a block boundary and cover
//! whole blocks, into a block-aligned buffer; [`plan`] turns a batch's rows
//! (sorted by offset) into such reads, one per run of blocks that touch,
//! so rows that share a block are read once.

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::time::Instant;

use crate::metrics::DiskCounters;

/// The unit of direct reads: offsets, lengths and buffer addresses are
/// multiples of it (4 KiB covers the logical block size of every disk and
/// file system Narsil runs on).
pub const BLOCK: u64 = 4096;

/// One direct read: whole blocks from `offset`, holding the rows
/// `rows` (indexes into the offsets [`plan`] was given).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    /// Where it starts in the file (a multiple of [`BLOCK`]).
    pub offset: u64,
    /// Bytes (a multiple of [`BLOCK`]).
    pub len: usize,
    /// The rows it holds.
    pub rows: Range<usize>,
}

/// The reads for rows of `row_bytes` at `offsets` (ascending): rows whose
/// blocks overlap or touch share a read, up to `max_read` bytes (a row
/// larger than that gets a read of its own).
pub fn plan(offsets: &[u64], row_bytes: usize, max_read: usize) -> Vec<Read> {
    let blocks = |offset: u64| {
        let start = offset / BLOCK * BLOCK;
        let end = (offset + row_bytes as u64).div_ceil(BLOCK) * BLOCK;
        (start, end)
    };
    let mut reads: Vec<Read> = Vec::new();
    for (i, &offset) in offsets.iter().enumerate() {
        let (start, end) = blocks(offset);
        if let Some(last) = reads.last_mut() {
            let last_end = last.offset + last.len as u64;
            if start <= last_end && (end - last.offset) as usize <= max_read {
                last.len = (end.max(last_end) - last.offset) as usize;
                last.rows.end = i + 1;
                continue;
            }
        }
        reads.push(Read { offset: start, len: (end - start) as usize, rows: i..i + 1 });
    }
    reads
}

/// A block-aligned buffer, made without unsafe code: a vector one block
/// longer than needed, used from its first aligned byte.
pub struct AlignedBuf {
    data: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuf {
    /// `len` zero bytes at a [`BLOCK`]-aligned address.
    pub fn new(len: usize) -> Self {
        let data = vec![0u8; len + BLOCK as usize];
        let start = data.as_ptr().align_offset(BLOCK as usize);
        Self { data, start, len }
    }

    /// The aligned bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.data[self.start..self.start + self.len]
    }

    /// The aligned bytes, to read into.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.data[self.start..self.start + self.len]
    }
}

/// One read to make: whole blocks of `file` from `offset` into a buffer of
/// `len`, of which at least `needed` bytes must exist; counted in
/// `counters`.
pub struct BlockRead<'a> {
    pub file: &'a File,
    pub offset: u64,
    pub len: usize,
    pub needed: usize,
    pub counters: &'a DiskCounters,
}

/// Makes every read of `reads` with `pread` on up to `threads` threads,
/// each into one buffer of its own reused read after read, calling
/// `land(i, bytes)` with read `i`'s bytes as each completes; no read starts
/// after `deadline` ([`deadline_passed`]). Once every thread has stopped,
/// the failure (with the index of its read): the disk's own error wins over
/// the deadline ([`first_failure`]: a read that fails after the deadline
/// passed is still the disk failing), else the first in thread order.
pub fn read_on_threads(
    reads: &[BlockRead<'_>],
    threads: usize,
    deadline: Option<Instant>,
    land: impl Fn(usize, &[u8]) + Sync,
) -> Result<(), (usize, std::io::Error)> {
    read_on_threads_with(reads, threads, deadline, land, |_, read, buf| {
        read_blocks(read.file, read.offset, buf, read.needed)
    })
}

/// [`read_on_threads`], each read made by `read_one(i, read, buf)`
/// (returning the bytes read): [`read_blocks`], or in tests a read that
/// is slow or fails.
fn read_on_threads_with(
    reads: &[BlockRead<'_>],
    threads: usize,
    deadline: Option<Instant>,
    land: impl Fn(usize, &[u8]) + Sync,
    read_one: impl Fn(usize, &BlockRead<'_>, &mut [u8]) -> std::io::Result<usize> + Sync,
) -> Result<(), (usize, std::io::Error)> {
    let threads = threads.min(reads.len()).max(1);
    let read_share = |thread: usize| -> Result<(), (usize, std::io::Error)> {
        let mine = || (thread..reads.len()).step_by(threads);
        let Some(largest) = mine().map(|i| reads[i].len).max() else { return Ok(()) };
        let mut buf = AlignedBuf::new(largest);
        for i in mine() {
            if deadline.is_some_and(|deadline| Instant::now() >= deadline) {
                return Err((i, deadline_passed()));
            }
            let read = &reads[i];
            let slice = &mut buf.as_mut_slice()[..read.len];
            read.counters.in_flight.inc();
            let started = Instant::now();
            let result = read_one(i, read, slice);
            read.counters.in_flight.dec();
            read.counters.read_seconds.observe(started.elapsed().as_secs_f64());
            let filled = result.map_err(|e| (i, e))?;
            read.counters.bytes_read.inc_by(read.len as u64);
            land(i, &slice[..filled]);
        }
        Ok(())
    };
    if threads == 1 {
        return read_share(0);
    }
    std::thread::scope(|scope| {
        let read_share = &read_share;
        let handles: Vec<_> = (0..threads).map(|thread| scope.spawn(move || read_share(thread))).collect();
        // Every thread is joined before the failure is returned.
        let results = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err((0, std::io::Error::other("a disk reader panicked")))));
        first_failure(results.filter_map(Result::err)).map_or(Ok(()), Err)
    })
}

/// The failure a batch's reads end with, of those its reads met (in the
/// order given): the first of the disk's own errors, or else the first
/// [`deadline_passed`]. A deadline never hides a read that failed: a disk
/// that is slow and then fails (the way disks die) is a failing store, not
/// a batch its callers gave up on.
pub fn first_failure(
    failures: impl IntoIterator<Item = (usize, std::io::Error)>,
) -> Option<(usize, std::io::Error)> {
    let mut first: Option<(usize, std::io::Error)> = None;
    for failure in failures {
        match &first {
            Some((_, kept)) if !is_deadline_passed(kept) || is_deadline_passed(&failure.1) => {}
            _ => first = Some(failure),
        }
    }
    first
}

/// Why reads stopped when every caller of their batch had left
/// ([`is_deadline_passed`] tells it from the disk's own errors).
pub fn deadline_passed() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::TimedOut, DeadlinePassed)
}

/// Whether `error` is [`deadline_passed`]'s, not the disk's.
pub fn is_deadline_passed(error: &std::io::Error) -> bool {
    error.get_ref().is_some_and(|inner| inner.is::<DeadlinePassed>())
}

/// The reads of a batch stopped at its deadline.
#[derive(Debug)]
struct DeadlinePassed;

impl std::fmt::Display for DeadlinePassed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("every caller's deadline passed before its rows were read")
    }
}

impl std::error::Error for DeadlinePassed {}

/// The error of a read that found the file shorter than its rows.
pub fn cut_short(needed: usize, offset: u64, got: usize) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::UnexpectedEof,
        format!("{needed} bytes at offset {offset} hold only {got} (the file was cut short)"),
    )
}

/// Reads `buf.len()` bytes (whole blocks, `buf` block-aligned) of `file`
/// from `offset`, of which at least `needed` must exist (the last block may
/// pass the end of the file; a file cut shorter than the rows fails).
/// Returns the bytes read.
pub fn read_blocks(file: &File, offset: u64, buf: &mut [u8], needed: usize) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read_at(&mut buf[filled..], offset + filled as u64) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        // A direct read returns whole blocks until the end of the file.
        if filled % BLOCK as usize != 0 {
            break;
        }
    }
    if filled < needed {
        return Err(cut_short(needed, offset, filled));
    }
    Ok(filled)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_in_one_block_share_a_read_and_rows_blocks_apart_do_not() {
        // 80-byte rows: ids 0 and 1 share block 0; id 100 (offset 8000)
        // is in block 1, which touches block 0; id 1000 is far away.
        let reads = plan(&[0, 80, 8000, 80_000], 80, 1 << 20);
        assert_eq!(
            reads,
            vec![Read { offset: 0, len: 8192, rows: 0..3 }, Read { offset: 77_824, len: 4096, rows: 3..4 }]
        );
    }

    #[test]
    fn a_row_across_a_block_boundary_reads_both_blocks() {
        assert_eq!(plan(&[4090], 80, 1 << 20), vec![Read { offset: 0, len: 8192, rows: 0..1 }]);
    }

    #[test]
    fn reads_stop_growing_at_the_bound() {
        let offsets: Vec<u64> = (0..4).map(|block| block * BLOCK).collect();
        let reads = plan(&offsets, 80, 2 * BLOCK as usize);
        assert_eq!(reads.len(), 2);
        assert!(reads.iter().all(|r| r.len == 2 * BLOCK as usize), "{reads:?}");
        assert_eq!(plan(&[0], 3 * BLOCK as usize, BLOCK as usize)[0].len, 3 * BLOCK as usize);
    }

    #[test]
    fn a_deadline_is_told_from_the_disk_s_own_timeouts() {
        assert!(is_deadline_passed(&deadline_passed()));
        assert!(!is_deadline_passed(&std::io::Error::from(std::io::ErrorKind::TimedOut)));
        assert!(!is_deadline_passed(&std::io::Error::from_raw_os_error(libc::ETIMEDOUT)));
    }

    #[test]
    fn a_read_that_fails_after_a_slow_read_on_threads_is_the_disk_s_error_not_the_deadline() {
        // 300 reads on 16 threads, each read 5 ms, but read 17 (thread 1's
        // second) takes 150 ms and then fails with EIO. The deadline (20
        // ms) stops every other thread, thread 0 first, with most reads not
        // started: the EIO, which comes later from a later thread, is still
        // what the batch reports (a disk slow and then failing is a failing
        // disk).
        let file = tempfile::tempfile().unwrap();
        let counters = DiskCounters::default();
        let reads: Vec<BlockRead<'_>> = (0..300)
            .map(|b| BlockRead {
                file: &file,
                offset: b * BLOCK,
                len: BLOCK as usize,
                needed: 80,
                counters: &counters,
            })
            .collect();
        let deadline = Some(Instant::now() + std::time::Duration::from_millis(20));
        let landed = std::sync::atomic::AtomicUsize::new(0);
        let land = |_: usize, _: &[u8]| {
            landed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        };
        let (i, error) = read_on_threads_with(&reads, 16, deadline, land, |i, _, buf| {
            let slow = i == 17;
            std::thread::sleep(std::time::Duration::from_millis(if slow { 150 } else { 5 }));
            if slow {
                return Err(std::io::Error::from_raw_os_error(libc::EIO));
            }
            Ok(buf.len())
        })
        .unwrap_err();
        assert_eq!((i, error.raw_os_error()), (17, Some(libc::EIO)), "{error}");
        assert!(!is_deadline_passed(&error));
        let landed = landed.into_inner();
        assert!(landed < 299, "the deadline stopped reads: {landed} landed");
        assert_eq!(counters.in_flight.get(), 0);
    }

    #[test]
    fn the_disk_s_error_wins_over_the_deadline_whatever_their_order() {
        let eio = || (3, std::io::Error::from_raw_os_error(libc::EIO));
        let (i, error) = first_failure([(0, deadline_passed()), eio(), (5, deadline_passed())]).unwrap();
        assert_eq!((i, error.raw_os_error()), (3, Some(libc::EIO)));
        let (i, error) = first_failure([eio(), (0, deadline_passed())]).unwrap();
        assert_eq!((i, error.raw_os_error()), (3, Some(libc::EIO)));
        let cut = (7, cut_short(80, 0, 0));
        let (i, _) = first_failure([(0, deadline_passed()), cut, eio()]).unwrap();
        assert_eq!(i, 7, "the first of the disk's errors");
        let (i, error) = first_failure([(4, deadline_passed()), (1, deadline_passed())]).unwrap();
        assert!(i == 4 && is_deadline_passed(&error));
        assert!(first_failure([]).is_none());
    }

    #[test]
    fn buffers_are_block_aligned() {
        for len in [4096, 8192, 12_288] {
            let buf = AlignedBuf::new(len);
            assert_eq!(buf.as_slice().as_ptr() as usize % BLOCK as usize, 0);
            assert_eq!(buf.as_slice().len(), len);
        }
    }
}
