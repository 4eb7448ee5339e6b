//! Whether a model's table files still read: the disk store's answer to
//! [`RowStore::watch_reachability`](crate::stores::row_store::RowStore::watch_reachability).
//! A disk that fails or turns slow fails or stalls batches, but only those
//! with rows missing the row cache: the engine's idle-lane probe (a
//! one-row forward of id 0, usually cached) would still succeed and turn
//! health SERVING again every probe interval. So every
//! [`PROBE_INTERVAL`] a thread makes one direct read (`O_DIRECT`: through
//! neither the row cache nor the page cache) of one block of each table
//! file of the model, a different block each round; a read that fails, or
//! that has not come back within [`PROBE_LIMIT`], makes the store
//! unreachable until a whole round reads again. The reads are made on a
//! reader thread of the prober's, so a read stuck in the kernel never stops
//! the prober from saying so (while it stays stuck, the rounds fail without
//! reading). The watcher is told at the first round and at each change;
//! the prober stops when it declines (its engine is gone) or, at once,
//! when the model's tables are dropped. It logs nothing (the engine logs
//! each change).

use std::fs::File;
use std::io;
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use narsil_core::DependencyWatcher;

use super::reads::{read_blocks, AlignedBuf, BLOCK};

/// How often the table files are probed: NOT_SERVING follows a failing disk
/// within about a second, a stuck one within [`PROBE_LIMIT`] more.
pub const PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// How long a probe's read of one block may take before the disk counts as
/// unreachable (a healthy disk answers one 4 KiB read in well under a
/// millisecond; a batch's deadline is usually shorter than this).
pub const PROBE_LIMIT: Duration = Duration::from_secs(1);

/// How a probe reads `buf.len()` bytes (one block) of a file at an offset,
/// of which `needed` must exist: [`read_blocks`], or in tests a read that
/// fails or hangs.
pub(crate) type ProbeRead = Arc<dyn Fn(&File, u64, &mut [u8], usize) -> io::Result<usize> + Send + Sync>;

/// The probe's read: a direct read of the block, as the store's own reads.
pub(crate) fn direct_read() -> ProbeRead {
    Arc::new(|file: &File, offset, buf: &mut [u8], needed| read_blocks(file, offset, buf, needed))
}

/// When the prober reads, and how long a read may take.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    pub interval: Duration,
    pub limit: Duration,
}

impl Timing {
    /// [`PROBE_INTERVAL`] and [`PROBE_LIMIT`].
    pub(crate) const SERVING: Self = Self { interval: PROBE_INTERVAL, limit: PROBE_LIMIT };
}

/// One table file to probe.
pub(crate) struct ProbedFile {
    pub file: Arc<File>,
    /// Bytes of rows in it (the blocks a probe picks from).
    pub len: u64,
}

/// The table files opened together (one model version's), shared by their
/// tables: what their prober reads. Dropped with the last of the tables,
/// which stops their probers at once.
pub(crate) struct ProbeTargets {
    files: Vec<ProbedFile>,
    /// One per prober: dropping it wakes the prober, which then stops.
    stops: Mutex<Vec<mpsc::Sender<()>>>,
}

impl ProbeTargets {
    pub(crate) fn new(files: Vec<ProbedFile>) -> Arc<Self> {
        Arc::new(Self { files, stops: Mutex::new(Vec::new()) })
    }

    /// The files probed, in order.
    #[cfg(test)]
    pub(crate) fn files(&self) -> impl Iterator<Item = &Arc<File>> {
        self.files.iter().map(|f| &f.file)
    }
}

/// Tells `watcher` whether every file of `targets` reads, at once (after
/// the first round) and at each change, probing each `timing.interval`
/// with `read` until `watcher` declines or `targets` is dropped. Returns
/// the prober thread.
pub(crate) fn watch(
    targets: &Arc<ProbeTargets>,
    watcher: DependencyWatcher,
    timing: Timing,
    read: ProbeRead,
) -> io::Result<JoinHandle<()>> {
    let (jobs, job_queue) = mpsc::channel::<Job>();
    let (answer, answers) = mpsc::channel();
    std::thread::Builder::new().name("narsil-disk-probe-read".into()).spawn(move || {
        let mut buf = AlignedBuf::new(BLOCK as usize);
        for Job { file, offset, needed } in job_queue {
            let result = read(&file, offset, buf.as_mut_slice(), needed).map(drop);
            if answer.send(result).is_err() {
                break;
            }
        }
    })?;
    let (stop, stopped) = mpsc::channel();
    targets.stops.lock().unwrap_or_else(|e| e.into_inner()).push(stop);
    let prober = Prober {
        targets: Arc::downgrade(targets),
        stopped,
        timing,
        jobs,
        answers,
        waiting: false,
        round: 0,
        watcher,
    };
    std::thread::Builder::new().name("narsil-disk-probe".into()).spawn(move || prober.run())
}

/// A read for the reader thread.
struct Job {
    file: Arc<File>,
    offset: u64,
    needed: usize,
}

struct Prober {
    targets: Weak<ProbeTargets>,
    /// Disconnected once `targets` is dropped.
    stopped: mpsc::Receiver<()>,
    timing: Timing,
    jobs: mpsc::Sender<Job>,
    answers: mpsc::Receiver<io::Result<()>>,
    /// A read was given up on and has not come back yet.
    waiting: bool,
    round: u64,
    watcher: DependencyWatcher,
}

impl Prober {
    fn run(mut self) {
        let mut told = None;
        loop {
            let Some(files) = self
                .targets
                .upgrade()
                .map(|targets| targets.files.iter().map(|f| (f.file.clone(), f.len)).collect::<Vec<_>>())
            else {
                return;
            };
            let reads = self.round(&files);
            drop(files);
            if told != Some(reads) {
                told = Some(reads);
                if !(self.watcher)(reads) {
                    return;
                }
            }
            match self.stopped.recv_timeout(self.timing.interval) {
                Err(RecvTimeoutError::Timeout) => {}
                Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    /// Reads one block of each file: whether every read came back, whole,
    /// within the limit.
    fn round(&mut self, files: &[(Arc<File>, u64)]) -> bool {
        self.round += 1;
        if self.waiting {
            match self.answers.try_recv() {
                // Late, whatever it says: this round reads afresh.
                Ok(_) => self.waiting = false,
                // Still stuck in the kernel.
                Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => return false,
            }
        }
        for (i, (file, len)) in files.iter().enumerate() {
            let offset = block_of(self.round, i, len.div_ceil(BLOCK).max(1)) * BLOCK;
            let needed = len.saturating_sub(offset).min(BLOCK) as usize;
            if self.jobs.send(Job { file: file.clone(), offset, needed }).is_err() {
                return false;
            }
            match self.answers.recv_timeout(self.timing.limit) {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(RecvTimeoutError::Disconnected) => return false,
                Err(RecvTimeoutError::Timeout) => {
                    self.waiting = true;
                    return false;
                }
            }
        }
        true
    }
}

/// Which of `blocks` blocks file `file` is probed at in round `round`:
/// scattered (splitmix64), so that rounds read different blocks and never
/// only what a disk's own cache holds.
fn block_of(round: u64, file: usize, blocks: u64) -> u64 {
    let mut z = round.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (file as u64).rotate_left(32);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) % blocks
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU8, Ordering};
    use std::sync::Condvar;
    use std::time::Instant;

    use super::*;

    const FAST: Timing = Timing { interval: Duration::from_millis(20), limit: Duration::from_millis(150) };

    /// How the injected read behaves.
    const READS: u8 = 0;
    const FAILS: u8 = 1;
    const HANGS: u8 = 2;

    /// An injected disk: each read does what `mode` says (a hanging read
    /// waits until the mode changes), and is recorded (file length, offset).
    struct Disk {
        mode: Mutex<u8>,
        changed: Condvar,
        reads: Mutex<Vec<(u64, u64)>>,
        hanging: AtomicU8,
    }

    impl Disk {
        fn new() -> Arc<Self> {
            Arc::new(Self {
                mode: Mutex::new(READS),
                changed: Condvar::new(),
                reads: Mutex::new(Vec::new()),
                hanging: AtomicU8::new(0),
            })
        }

        fn set(&self, mode: u8) {
            *self.mode.lock().unwrap() = mode;
            self.changed.notify_all();
        }

        fn read(self: &Arc<Self>) -> ProbeRead {
            let disk = self.clone();
            Arc::new(move |file: &File, offset, buf: &mut [u8], needed| {
                assert_eq!(buf.len(), BLOCK as usize);
                assert_eq!(buf.as_ptr() as usize % BLOCK as usize, 0, "a direct read's buffer is aligned");
                disk.reads.lock().unwrap().push((file.metadata().unwrap().len(), offset));
                let mut mode = disk.mode.lock().unwrap();
                while *mode == HANGS {
                    disk.hanging.store(1, Ordering::Relaxed);
                    mode = disk.changed.wait(mode).unwrap();
                }
                disk.hanging.store(0, Ordering::Relaxed);
                match *mode {
                    FAILS => Err(io::Error::from_raw_os_error(libc::EIO)),
                    _ => Ok(needed),
                }
            })
        }
    }

    /// Table files of `lens` bytes (plain files: the read is injected).
    fn targets(lens: &[u64]) -> Arc<ProbeTargets> {
        ProbeTargets::new(
            lens.iter()
                .map(|&len| {
                    let file = tempfile::tempfile().unwrap();
                    file.set_len(len).unwrap();
                    ProbedFile { file: Arc::new(file), len }
                })
                .collect(),
        )
    }

    /// What a watcher was told, with when.
    type Heard = Arc<Mutex<Vec<(bool, Instant)>>>;

    /// A watcher that records what it is told, with when.
    fn recorder() -> (DependencyWatcher, Heard) {
        let heard = Arc::new(Mutex::new(Vec::new()));
        let h = heard.clone();
        (
            Box::new(move |reads| {
                h.lock().unwrap().push((reads, Instant::now()));
                true
            }),
            heard,
        )
    }

    /// Waits up to 5 s for the `n`th thing `heard`, and returns it.
    fn nth(heard: &Mutex<Vec<(bool, Instant)>>, n: usize) -> (bool, Instant) {
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(&told) = heard.lock().unwrap().get(n) {
                return told;
            }
            assert!(Instant::now() < until, "nothing told after {:?}", heard.lock().unwrap());
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn finishes(prober: &JoinHandle<()>) -> bool {
        let until = Instant::now() + Duration::from_secs(2);
        while !prober.is_finished() {
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        true
    }

    #[test]
    fn a_probe_read_failing_with_eio_turns_the_watcher_false_and_reads_that_succeed_turn_it_true() {
        let (disk, files) = (Disk::new(), targets(&[1 << 20, 1 << 20]));
        let (watcher, heard) = recorder();
        let prober = watch(&files, watcher, FAST, disk.read()).unwrap();
        assert!(nth(&heard, 0).0, "the first round reads: told at once");
        disk.set(FAILS);
        assert!(!nth(&heard, 1).0, "EIO: unreachable");
        std::thread::sleep(FAST.interval * 5);
        assert_eq!(heard.lock().unwrap().len(), 2, "told at each change only");
        disk.set(READS);
        assert!(nth(&heard, 2).0, "reads again: reachable");
        drop(files);
        assert!(finishes(&prober));
    }

    #[test]
    fn a_read_hanging_past_the_limit_turns_the_watcher_false_while_it_is_still_stuck() {
        let (disk, files) = (Disk::new(), targets(&[1 << 20]));
        let (watcher, heard) = recorder();
        let prober = watch(&files, watcher, FAST, disk.read()).unwrap();
        assert!(nth(&heard, 0).0);
        let hung = Instant::now();
        disk.set(HANGS);
        let (reads, when) = nth(&heard, 1);
        assert!(!reads, "a read stuck past the limit: unreachable");
        let took = when - hung;
        assert!(took <= FAST.limit + FAST.interval + Duration::from_millis(500), "told after {took:?}");
        assert!(took >= FAST.limit, "not before the limit: {took:?}");
        let until = Instant::now() + Duration::from_secs(5);
        while disk.hanging.load(Ordering::Relaxed) != 1 {
            assert!(Instant::now() < until, "the read is stuck");
            std::thread::sleep(Duration::from_millis(2));
        }
        // Rounds while it stays stuck read nothing more (no pile of stuck
        // reads), and stay unreachable.
        let reads_while_stuck = disk.reads.lock().unwrap().len();
        std::thread::sleep(FAST.interval * 5);
        assert_eq!(disk.reads.lock().unwrap().len(), reads_while_stuck, "no read behind a stuck one");
        assert_eq!(heard.lock().unwrap().len(), 2);
        disk.set(READS);
        assert!(nth(&heard, 2).0, "the stuck read came back and the next round read: reachable");
        drop(files);
        assert!(finishes(&prober));
    }

    #[test]
    fn every_round_reads_one_block_of_every_file_and_rounds_read_different_blocks() {
        let (disk, files) = (Disk::new(), targets(&[100 * BLOCK, 3 * BLOCK + 80]));
        let (watcher, heard) = recorder();
        let prober = watch(&files, watcher, FAST, disk.read()).unwrap();
        nth(&heard, 0);
        while disk.reads.lock().unwrap().len() < 20 {
            std::thread::sleep(FAST.interval);
        }
        drop(files);
        assert!(finishes(&prober));
        let reads = disk.reads.lock().unwrap().clone();
        for (round, pair) in reads.chunks_exact(2).enumerate() {
            assert_eq!(
                (pair[0].0, pair[1].0),
                (100 * BLOCK, 3 * BLOCK + 80),
                "round {round}: both files in order"
            );
        }
        assert!(reads.iter().all(|&(len, offset)| offset % BLOCK == 0 && offset < len), "{reads:?}");
        let large: std::collections::HashSet<u64> =
            reads.iter().filter(|r| r.0 == 100 * BLOCK).map(|r| r.1).collect();
        assert!(large.len() >= 8, "10 rounds, mostly different blocks: {large:?}");
    }

    #[test]
    fn the_prober_stops_when_its_watcher_declines() {
        let (disk, files) = (Disk::new(), targets(&[1 << 20]));
        let told = Arc::new(Mutex::new(Vec::new()));
        let t = told.clone();
        let watcher: DependencyWatcher = Box::new(move |reads| {
            t.lock().unwrap().push(reads);
            false
        });
        let prober = watch(&files, watcher, FAST, disk.read()).unwrap();
        assert!(finishes(&prober), "its engine is gone: the prober stops");
        let reads = disk.reads.lock().unwrap().len();
        std::thread::sleep(FAST.interval * 5);
        assert_eq!(disk.reads.lock().unwrap().len(), reads, "and reads no more");
        assert_eq!(*told.lock().unwrap(), [true]);
    }

    #[test]
    fn the_prober_stops_at_once_when_the_tables_are_dropped_even_with_a_read_stuck() {
        let (disk, files) = (Disk::new(), targets(&[1 << 20]));
        let (watcher, heard) = recorder();
        let slow = Timing { interval: Duration::from_secs(60), limit: Duration::from_millis(50) };
        let prober = watch(&files, watcher, slow, disk.read()).unwrap();
        assert!(nth(&heard, 0).0);
        let dropped = Instant::now();
        drop(files);
        assert!(finishes(&prober), "not after its 60 s interval");
        assert!(dropped.elapsed() < Duration::from_secs(1));

        // A read stuck in the kernel does not keep the prober either.
        let (disk, files) = (Disk::new(), targets(&[1 << 20]));
        disk.set(HANGS);
        let (watcher, heard) = recorder();
        let prober = watch(&files, watcher, FAST, disk.read()).unwrap();
        assert!(!nth(&heard, 0).0);
        drop(files);
        assert!(finishes(&prober));
        disk.set(READS);
    }
}
