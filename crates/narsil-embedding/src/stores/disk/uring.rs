//! A batch's direct reads through io_uring: every read of the batch
//! queued on one ring (up to [`DEPTH`] in flight and [`MAX_BYTES_IN_FLIGHT`]
//! of buffers), submitted together, each read's rows handed on as it lands.
//! One thread keeps the disk busier than a pool of `pread` threads can on
//! few cores (fio on a 2-vCPU VM: 122k 4 KiB reads/s at 64 in flight on
//! a ring against 63k from 16 threads), and spends no thread per read.
//!
//! Each thread that reads gets a ring of its own, made at its first batch
//! and kept while every batch on it ends with no read in flight. A batch
//! whose reads could not all be waited for (the kernel may still write into
//! their buffers, which are then leaked) gives its ring up: the next batch
//! makes a new one, so no completion of an earlier batch can land in a
//! later one. A kernel that refuses rings (too old, or `io_uring_disabled`,
//! or a seccomp profile, or a memlock limit too small for a ring of
//! [`DEPTH`] entries) is detected once ([`available`], which makes a ring
//! of the size reads use), and the store reads with threads instead.

use std::cell::RefCell;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::OnceLock;

use io_uring::{opcode, types, IoUring};

use std::time::Instant;

use super::reads::{cut_short, deadline_passed, first_failure, is_deadline_passed, AlignedBuf, BlockRead};

/// Most reads in flight on a ring (and its entries).
pub const DEPTH: usize = 128;

/// Most bytes of buffers in flight at once (one read at a time may pass it).
const MAX_BYTES_IN_FLIGHT: usize = 8 << 20;

/// The largest buffer a slot keeps between its reads.
const KEPT_BUFFER: usize = 16 << 10;

thread_local! {
    static RING: RefCell<Option<IoUring>> = const { RefCell::new(None) };
}

/// A ring of the size reads use.
fn new_ring() -> io::Result<IoUring> {
    #[cfg(test)]
    tests::RINGS_MADE.with(|made| made.set(made.get() + 1));
    IoUring::new(DEPTH as u32)
}

/// Whether this kernel lets the process make a ring of [`DEPTH`] entries
/// (asked once; the answer, or why not).
pub fn available() -> Result<(), String> {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    PROBE.get_or_init(|| new_ring().map(drop).map_err(|e| format!("io_uring refused: {e}"))).clone()
}

/// Makes every read of `reads` on this thread's ring, calling `land(i,
/// bytes)` with read `i`'s bytes (its `len`, or fewer at the end of the
/// file) as each completes, in completion order. The first failure, or
/// `deadline` passing, stops new reads and is returned, with the index of
/// the read it concerns (0 for the ring's own), once every read already
/// submitted has completed (or, where waiting for them failed, once the
/// ring has been given up). Every completion is looked at, those after the
/// deadline passed too: a read that fails then (EIO from a disk that was
/// slow and then failed, the way disks die) is the failure returned, never
/// hidden behind the deadline ([`super::reads::first_failure`]).
pub fn read_all(
    reads: &[BlockRead<'_>],
    deadline: Option<Instant>,
    mut land: impl FnMut(usize, &[u8]),
) -> Result<(), (usize, io::Error)> {
    RING.with(|kept| {
        let taken = kept.borrow_mut().take();
        let mut ring = match taken {
            Some(ring) => ring,
            None => new_ring().map_err(|e| (0, e))?,
        };
        let mut flight =
            Flight { ring: &mut ring, reads, slots: Vec::new(), free: Vec::new(), count: 0, torn: false };
        let result = flight.run(deadline, &mut land);
        let torn = flight.finish();
        drop(flight);
        if torn {
            tracing::warn!("io_uring: a batch's reads could not all be waited for; its ring is given up");
        } else {
            *kept.borrow_mut() = Some(ring);
        }
        result
    })
}

/// A place for one read in flight: which read, since when, and the buffer
/// the kernel writes (kept for the slot's next read).
struct Slot {
    read: usize,
    submitted: Instant,
    buf: AlignedBuf,
    /// Whether the kernel has a read of this slot's not yet reaped.
    in_flight: bool,
}

/// The reads on a ring not yet completed. Its buffers are the kernel's
/// until their completions are reaped, so finishing or dropping it (on any
/// path, a panic included) first waits for every read in flight; where
/// that wait fails, the buffers are leaked and the flight is `torn`: its
/// ring must not be used again. Every read it submitted leaves
/// `narsil_table_disk_reads_in_flight` when reaped, or when given up.
struct Flight<'r, 'f> {
    ring: &'r mut IoUring,
    reads: &'f [BlockRead<'f>],
    slots: Vec<Slot>,
    /// Slots with no read in flight.
    free: Vec<usize>,
    count: usize,
    torn: bool,
}

impl Flight<'_, '_> {
    fn run(
        &mut self,
        deadline: Option<Instant>,
        land: &mut impl FnMut(usize, &[u8]),
    ) -> Result<(), (usize, io::Error)> {
        let reads = self.reads;
        let (mut next, mut bytes, mut failed) = (0, 0, None);
        loop {
            if failed.is_none() && next < reads.len() && deadline.is_some_and(|d| Instant::now() >= d) {
                failed = Some((next, deadline_passed()));
            }
            while failed.is_none()
                && next < reads.len()
                && self.count < DEPTH
                && (self.count == 0 || bytes + reads[next].len <= MAX_BYTES_IN_FLIGHT)
            {
                let read = &reads[next];
                let slot = self.free.pop().unwrap_or_else(|| {
                    let buf = AlignedBuf::new(read.len);
                    let submitted = Instant::now();
                    self.slots.push(Slot { read: next, submitted, buf, in_flight: false });
                    self.slots.len() - 1
                });
                let place = &mut self.slots[slot];
                if place.buf.as_slice().len() < read.len {
                    place.buf = AlignedBuf::new(read.len);
                }
                (place.read, place.submitted, place.in_flight) = (next, Instant::now(), true);
                let entry = opcode::Read::new(
                    types::Fd(read.file.as_raw_fd()),
                    place.buf.as_mut_slice().as_mut_ptr(),
                    read.len as u32,
                )
                .offset(read.offset)
                .build()
                .user_data(slot as u64);
                // SAFETY: the buffer (a heap block, which does not move when
                // the slots' vector grows) and the file (borrowed for the
                // whole call) outlive the read: a slot's buffer is neither
                // replaced nor freed while its read is in flight (the slot
                // is off the free list until its completion is reaped), and
                // `Flight` reaps every read in flight before it is dropped (or
                // leaks the buffers where it cannot, and its ring is given
                // up). The queue
                // has room: at most DEPTH reads are in flight on a ring of
                // DEPTH entries, and each is submitted before the next wait.
                unsafe { self.ring.submission().push(&entry) }.expect("the submission queue has room");
                read.counters.in_flight.inc();
                self.count += 1;
                bytes += read.len;
                next += 1;
            }
            if self.count == 0 {
                break;
            }
            if let Err(e) = self.wait(1) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                // `finish` waits for the reads in flight.
                return Err((0, e));
            }
            let done: Vec<(usize, i32)> =
                self.ring.completion().map(|cqe| (cqe.user_data() as usize, cqe.result())).collect();
            for (slot, result) in done {
                if !self.slots.get(slot).is_some_and(|s| s.in_flight) {
                    // Not a read of this flight: the ring cannot be trusted.
                    self.torn = true;
                    let what = format!("io_uring: a completion for slot {slot}, which has no read in flight");
                    return Err((0, io::Error::other(what)));
                }
                self.slots[slot].in_flight = false;
                self.free.push(slot);
                let Slot { read: i, submitted, ref buf, .. } = self.slots[slot];
                let read = &reads[i];
                self.count -= 1;
                bytes -= read.len;
                read.counters.in_flight.dec();
                read.counters.read_seconds.observe(submitted.elapsed().as_secs_f64());
                #[cfg(test)]
                let result = tests::injected(i, result);
                // After a failure of the disk nothing lands; after the
                // deadline, reads already submitted still land (their rows
                // go to the cache) and one that fails replaces it.
                if failed.as_ref().is_none_or(|(_, e)| is_deadline_passed(e)) {
                    let failure = match usize::try_from(result) {
                        Err(_) => Some((i, io::Error::from_raw_os_error(-result))),
                        Ok(n) if n < read.needed => Some((i, cut_short(read.needed, read.offset, n))),
                        // A direct read stops early only at the end of the file.
                        Ok(n) => {
                            read.counters.bytes_read.inc_by(read.len as u64);
                            land(i, &buf.as_slice()[..n.min(read.len)]);
                            None
                        }
                    };
                    failed = first_failure(failed.take().into_iter().chain(failure));
                }
                // A slot keeps a small buffer for its next read, not a large
                // one: the buffers stay within MAX_BYTES_IN_FLIGHT plus
                // DEPTH small ones.
                if self.slots[slot].buf.as_slice().len() > KEPT_BUFFER {
                    self.slots[slot].buf = AlignedBuf::new(KEPT_BUFFER);
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Waits for `want` completions (the ring's own wait; in tests, one
    /// that can be told to fail).
    fn wait(&mut self, want: usize) -> io::Result<usize> {
        #[cfg(test)]
        if tests::FAILED_WAITS.with(|left| left.replace(left.get().saturating_sub(1))) > 0 {
            // The reads queued reach the kernel first, as they would
            // before a real wait fails.
            self.ring.submit()?;
            return Err(io::Error::other("an injected failure to wait"));
        }
        self.ring.submit_and_wait(want)
    }

    /// Waits for every read still in flight; true when that failed and the
    /// ring must be given up (the buffers are then leaked: the kernel may
    /// still write into them). Either way no read of the flight is left
    /// counted in flight.
    fn finish(&mut self) -> bool {
        while self.count > 0 && !self.torn {
            match self.wait(self.count) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!(
                        "io_uring: waiting for reads in flight failed ({e}); leaking their buffers"
                    );
                    self.torn = true;
                    break;
                }
            }
            let done: Vec<usize> = self.ring.completion().map(|cqe| cqe.user_data() as usize).collect();
            for slot in done {
                match self.slots.get_mut(slot) {
                    Some(place) if place.in_flight => {
                        place.in_flight = false;
                        self.free.push(slot);
                        self.count -= 1;
                        self.reads[place.read].counters.in_flight.dec();
                    }
                    // Not a read of this flight: the ring cannot be trusted.
                    _ => self.torn = true,
                }
            }
        }
        if self.torn {
            for slot in std::mem::take(&mut self.slots) {
                if slot.in_flight {
                    self.reads[slot.read].counters.in_flight.dec();
                }
                std::mem::forget(slot);
            }
            self.count = 0;
        }
        self.torn
    }
}

impl Drop for Flight<'_, '_> {
    /// On a panic between submitting and reaping too: the buffers outlive
    /// the kernel's use of them.
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::fs::File;
    use std::os::unix::fs::OpenOptionsExt;

    use super::*;
    use crate::metrics::DiskCounters;
    use crate::stores::disk::reads::BLOCK;

    thread_local! {
        /// Rings this thread made.
        pub(super) static RINGS_MADE: Cell<usize> = const { Cell::new(0) };
        /// Waits on this thread's rings that fail, from the next one on.
        pub(super) static FAILED_WAITS: Cell<usize> = const { Cell::new(0) };
        /// Reads (by index) whose completion on this thread says this
        /// errno, whatever the kernel said.
        pub(super) static FAILED_READS: RefCell<Vec<(usize, i32)>> = const { RefCell::new(Vec::new()) };
    }

    /// The completion `result` of read `i`, or the failure
    /// [`FAILED_READS`] injects for it.
    pub(super) fn injected(i: usize, result: i32) -> i32 {
        FAILED_READS.with(|failed| {
            failed.borrow().iter().find(|&&(read, _)| read == i).map_or(result, |&(_, errno)| -errno)
        })
    }

    /// A pipe's ends: its reads wait until something is written.
    fn pipe() -> (File, File) {
        let (reader, writer) = std::io::pipe().unwrap();
        (File::from(std::os::fd::OwnedFd::from(reader)), File::from(std::os::fd::OwnedFd::from(writer)))
    }

    /// A file of `blocks` blocks, block `b` filled with `b as u8`, opened
    /// for direct reads on a file system that takes them.
    fn block_file(test: &str, blocks: u64) -> Option<(tempfile::TempDir, File)> {
        if let Err(why) = available() {
            crate::stores::disk::skip_or_fail(test, &why);
            return None;
        }
        let dir = crate::stores::disk::direct_io_dir(test)?;
        let path = dir.path().join("blocks");
        let data: Vec<u8> = (0..blocks * BLOCK).map(|i| (i / BLOCK) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&path).unwrap();
        Some((dir, file))
    }

    fn read<'a>(file: &'a File, counters: &'a DiskCounters, block: u64) -> BlockRead<'a> {
        BlockRead { file, offset: block * BLOCK, len: BLOCK as usize, needed: 80, counters }
    }

    #[test]
    fn reads_land_with_their_bytes_and_a_cut_file_fails_after_every_read_completes() {
        let test = "reads_land_with_their_bytes_and_a_cut_file_fails_after_every_read_completes";
        let Some((_dir, file)) = block_file(test, 300) else { return };
        let counters = DiskCounters::default();
        let reads: Vec<BlockRead<'_>> = (0..300u64).rev().map(|b| read(&file, &counters, b)).collect();
        let mut landed = vec![false; reads.len()];
        read_all(&reads, None, |i, bytes| {
            assert_eq!(bytes.len(), BLOCK as usize);
            assert!(bytes.iter().all(|&b| b == (299 - i) as u8), "read {i}");
            landed[i] = true;
        })
        .unwrap();
        assert!(landed.iter().all(|&l| l), "{DEPTH} in flight at most, all 300 landed");
        assert_eq!(counters.bytes_read.get(), 300 * BLOCK);
        assert_eq!(counters.in_flight.get(), 0);

        let (i, error) =
            read_all(&[read(&file, &counters, 1), read(&file, &counters, 300)], None, |_, _| {}).unwrap_err();
        assert_eq!(i, 1, "the read past the end");
        assert!(error.to_string().contains("cut short"), "{error}");

        let passed = Some(Instant::now());
        let (i, error) = read_all(&reads, passed, |_, _| panic!("nothing is read")).unwrap_err();
        assert_eq!(i, 0);
        assert!(error.to_string().contains("deadline passed"), "{error}");
    }

    #[test]
    fn a_ring_whose_reads_could_not_be_waited_for_is_never_used_again() {
        let test = "a_ring_whose_reads_could_not_be_waited_for_is_never_used_again";
        let Some((_dir, file)) = block_file(test, 64) else { return };
        let counters = DiskCounters::default();
        let reads: Vec<BlockRead<'_>> = (0..64u64).map(|b| read(&file, &counters, b)).collect();
        read_all(&reads, None, |_, _| {}).unwrap();
        let made = RINGS_MADE.with(Cell::get);
        read_all(&reads, None, |_, _| {}).unwrap();
        assert_eq!(RINGS_MADE.with(Cell::get), made, "a ring whose batch ended cleanly is kept");
        // The batch's wait fails once its 64 reads reached the kernel
        // ([`Flight::wait`] submits them before its injected failure), then
        // so does waiting for them: their completions may still come.
        FAILED_WAITS.with(|left| left.set(2));
        let (_, error) = read_all(&reads, None, |_, _| {}).unwrap_err();
        assert!(error.to_string().contains("injected"), "{error}");
        assert_eq!(counters.in_flight.get(), 0, "reads given up with their ring are not left in flight");
        // The next batch is on a new ring, and reads its own bytes only.
        let mut landed = 0;
        read_all(&reads, None, |i, bytes| {
            assert!(bytes.iter().all(|&b| b == i as u8), "read {i} landed another's bytes");
            landed += 1;
        })
        .unwrap();
        assert_eq!(landed, 64);
        assert_eq!(RINGS_MADE.with(Cell::get), made + 1, "the torn ring was given up");
    }

    #[test]
    fn a_batch_whose_wait_failed_leaves_no_read_counted_in_flight_and_keeps_its_ring() {
        let test = "a_batch_whose_wait_failed_leaves_no_read_counted_in_flight_and_keeps_its_ring";
        let Some((_dir, file)) = block_file(test, 64) else { return };
        let counters = DiskCounters::default();
        let reads: Vec<BlockRead<'_>> = (0..64u64).map(|b| read(&file, &counters, b)).collect();
        read_all(&reads, None, |_, _| {}).unwrap();
        let made = RINGS_MADE.with(Cell::get);
        // The batch's wait fails with its 64 reads in the kernel; waiting
        // for them afterwards works: they are reaped, and leave the gauge.
        FAILED_WAITS.with(|left| left.set(1));
        let (_, error) =
            read_all(&reads, None, |_, _| panic!("nothing lands after a failed wait")).unwrap_err();
        assert!(error.to_string().contains("injected"), "{error}");
        assert_eq!(counters.in_flight.get(), 0, "every read reaped after the failed wait left the gauge");
        read_all(&reads, None, |_, _| {}).unwrap();
        assert_eq!(RINGS_MADE.with(Cell::get), made, "every read was reaped: the ring was kept");
        assert_eq!(counters.in_flight.get(), 0);
    }

    #[test]
    fn a_read_that_fails_after_the_deadline_with_reads_unsubmitted_is_the_disk_s_error() {
        let test = "a_read_that_fails_after_the_deadline_with_reads_unsubmitted_is_the_disk_s_error";
        let Some((_dir, file)) = block_file(test, 298) else { return };
        let counters = DiskCounters::default();
        // Reads 0 and 1 are slow (pipes written to 100 and 200 ms in) and
        // large: together they take every byte a ring may have in flight,
        // so the 298 reads behind them are still unsubmitted when the
        // deadline (20 ms) passes. Read 0 lands after the deadline; read 1
        // then fails with EIO.
        let ((slow_a, mut write_a), (slow_b, mut write_b)) = (pipe(), pipe());
        let half = MAX_BYTES_IN_FLIGHT / 2;
        let slow = |file| BlockRead { file, offset: 0, len: half, needed: 1, counters: &counters };
        let reads: Vec<BlockRead<'_>> = [slow(&slow_a), slow(&slow_b)]
            .into_iter()
            .chain((0..298).map(|b| read(&file, &counters, b)))
            .collect();
        let writer = std::thread::spawn(move || {
            use std::io::Write;
            std::thread::sleep(std::time::Duration::from_millis(100));
            write_a.write_all(&[1; BLOCK as usize]).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(100));
            write_b.write_all(&[2; BLOCK as usize]).unwrap();
        });
        FAILED_READS.with(|failed| *failed.borrow_mut() = vec![(1, libc::EIO)]);
        let deadline = Some(Instant::now() + std::time::Duration::from_millis(20));
        let mut landed = Vec::new();
        let result = read_all(&reads, deadline, |i, _| landed.push(i));
        FAILED_READS.with(|failed| failed.borrow_mut().clear());
        writer.join().unwrap();
        let (i, error) = result.unwrap_err();
        assert_eq!((i, error.raw_os_error()), (1, Some(libc::EIO)), "{error}");
        assert_eq!(landed, vec![0], "read 0 landed; none started after the deadline");
        assert_eq!(counters.in_flight.get(), 0, "every read submitted was reaped");
        // Every completion was reaped: the ring is kept for the next batch.
        let made = RINGS_MADE.with(Cell::get);
        read_all(&reads[2..], None, |_, _| {}).unwrap();
        assert_eq!(RINGS_MADE.with(Cell::get), made, "the ring was kept");
    }
}
