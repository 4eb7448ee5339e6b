//! `--table-store disk`: its kind, its configuration (the row cache every
//! table it opens shares) and a table's rows read by distinct id.

mod fetch;

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::probe::{self, ProbeTargets, ProbedFile};
use super::reads::{read_blocks, AlignedBuf, BLOCK};
use super::uring;
use crate::popularity_order::SlotIndex;
use crate::schema::{SplitSchema, TableSpec};
use crate::stores::batch::fetch_alone;
use crate::stores::row_cache::RowCache;
use crate::stores::row_store::{BatchFetch, FetchError, Fetched, RowStore};
use crate::stores::table_error::TableError;
use crate::stores::table_file::{checked_file, slot_index};
use crate::stores::table_store::{OpenedTables, StoreConfig, StoreFlags, StoreKind, TableStore};

/// `--table-store disk[:io_uring|:threads]`.
pub const STORE: StoreKind = StoreKind {
    syntax: "disk[:io_uring|:threads]",
    parse: |text| {
        let how = text.strip_prefix("disk")?;
        let reads = match how {
            "" => Reads::Auto,
            ":io_uring" => Reads::IoUring,
            ":threads" => Reads::Threads,
            _ => {
                return Some(Err(format!(
                    "`{text}`: the disk store reads with `disk:io_uring` or `disk:threads`"
                )))
            }
        };
        Some(Ok(TableStore::new(DiskStore::new(crate::stores::redis::DEFAULT_CACHE_BYTES, reads))))
    },
};

/// How the store reads: io_uring where the kernel allows it (`Auto`, the
/// default, falls back to threads elsewhere, saying so once), or one or
/// the other only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reads {
    /// `disk`: io_uring, or threads where the kernel refuses rings.
    Auto,
    /// `disk:io_uring`: io_uring or a load error.
    IoUring,
    /// `disk:threads`: a pool of `pread` threads.
    Threads,
}

/// The `disk` store as configured: its row cache (none at 0 bytes) and the
/// cache's number for each table file it has opened.
pub struct DiskStore {
    cache: Option<Arc<RowCache>>,
    cache_bytes: u64,
    reads: Reads,
    /// By file identity: a file hard-linked into several model versions is
    /// one table in the cache.
    tables: Mutex<HashMap<FileIdentity, u32>>,
}

impl DiskStore {
    /// The store with a row cache of `cache_bytes` (0: every row from the
    /// disk), reading as `reads` says.
    pub fn new(cache_bytes: u64, reads: Reads) -> Self {
        let cache = (cache_bytes > 0).then(|| Arc::new(RowCache::new(cache_bytes)));
        Self { cache, cache_bytes, reads, tables: Mutex::new(HashMap::new()) }
    }

    /// Whether reads go through io_uring: an error where they must and the
    /// kernel refuses.
    fn uses_io_uring(&self) -> std::io::Result<bool> {
        match (self.reads, uring::available()) {
            (Reads::Threads, _) => Ok(false),
            (_, Ok(())) => Ok(true),
            (Reads::IoUring, Err(why)) => {
                Err(std::io::Error::other(format!("{why} (--table-store disk:io_uring)")))
            }
            (Reads::Auto, Err(why)) => {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| tracing::warn!("disk store: {why}; reading with threads instead"));
                Ok(false)
            }
        }
    }

    /// The cache's number for the table `spec` in `file`.
    fn table_key(&self, file: &File, spec: &TableSpec) -> std::io::Result<u32> {
        let meta = file.metadata()?;
        let identity = FileIdentity {
            device: meta.dev(),
            inode: meta.ino(),
            modified: (meta.mtime(), meta.mtime_nsec()),
            len: meta.len(),
            sha256: spec.sha256.clone(),
            layout: spec.layout.as_ref().map(|layout| layout.sha256.clone()),
        };
        let mut tables = self.tables.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let next = tables.len() as u32;
        Ok(*tables.entry(identity).or_insert(next))
    }
}

/// What makes two opened table files the same rows by id: the same inode
/// (hard links share it) that has not been written since (a deleted
/// version's inode number can come back for a new file, with another
/// modification time), the same content hash in the schema, and the same
/// slot index (the cache keeps rows by id, which the index maps to places
/// in the file).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct FileIdentity {
    device: u64,
    inode: u64,
    modified: (i64, i64),
    len: u64,
    sha256: String,
    layout: Option<String>,
}

impl fmt::Debug for DiskStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DiskStore").field("cache_bytes", &self.cache_bytes).finish()
    }
}

impl fmt::Display for DiskStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let reads = match self.reads {
            Reads::Auto => "io_uring where allowed, else threads",
            Reads::IoUring => "io_uring",
            Reads::Threads => "threads",
        };
        write!(f, "disk (row cache {} MiB, reads on {reads})", self.cache_bytes >> 20)
    }
}

impl StoreConfig for DiskStore {
    /// Opens each table's file for direct reads, after checking its size;
    /// the tables share one [`probe`] of all their files.
    fn open(
        &self,
        dir: &Path,
        schema: &SplitSchema,
    ) -> Result<(Vec<Arc<dyn RowStore>>, OpenedTables), TableError> {
        let mut tables = Vec::with_capacity(schema.tables.len());
        for spec in &schema.tables {
            let path = checked_file(dir, spec)?;
            let read_error =
                |source| TableError::Read { table: spec.name.clone(), path: path.clone(), source };
            let slots = slot_index(dir, spec)?;
            tables.push(DiskRows::open(&path, spec, slots, self).map_err(read_error)?);
        }
        let probed = ProbeTargets::new(tables.iter().map(DiskRows::probed).collect());
        let stores = tables
            .into_iter()
            .map(|rows| Arc::new(DiskRows { probe: probed.clone(), ..rows }) as Arc<dyn RowStore>)
            .collect();
        Ok((stores, OpenedTables { read: schema.tables.len(), ..OpenedTables::default() }))
    }

    /// Takes `--table-cache-bytes`.
    fn with_flags(&self, flags: &StoreFlags) -> Option<TableStore> {
        Some(TableStore::new(DiskStore::new(flags.cache_bytes, self.reads)))
    }

    /// A batch's misses wait on the disk (measured: the stage ahead served
    /// 1.07-1.5x the stage on the lane, REPORTS.md#disk-store-2).
    fn fetches_wait(&self) -> bool {
        true
    }
}

/// A table's rows, read from its file by direct I/O.
pub struct DiskRows {
    file: Arc<File>,
    path: PathBuf,
    /// Bytes of rows in the file.
    len: u64,
    row_bytes: usize,
    cache: Option<Arc<RowCache>>,
    /// The table's number in the cache.
    key: u32,
    io_uring: bool,
    /// For a file in popularity order: where each id's row is.
    slots: Option<SlotIndex>,
    /// The files of the tables opened with it (this one alone where it was
    /// opened alone), which its reachability probe reads.
    probe: Arc<ProbeTargets>,
}

impl DiskRows {
    /// Opens `path` (the file of `spec`, its size checked; `slots` its
    /// index if it is in popularity order) for direct reads, and reads its
    /// first block to see that they work here.
    fn open(
        path: &Path,
        spec: &TableSpec,
        slots: Option<SlotIndex>,
        store: &DiskStore,
    ) -> std::io::Result<Self> {
        let file =
            std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path).map_err(|e| {
                if e.raw_os_error() == Some(libc::EINVAL) {
                    std::io::Error::other(format!(
                        "its file system does not take direct reads (O_DIRECT: {e}); \
                     use --table-store mmap for tables there"
                    ))
                } else {
                    e
                }
            })?;
        // The first row, whole (a row may span several blocks).
        let needed = (spec.row_bytes as u64).min(spec.rows * spec.row_bytes as u64) as usize;
        let blocks = (needed as u64).div_ceil(BLOCK).max(1) * BLOCK;
        read_blocks(&file, 0, AlignedBuf::new(blocks as usize).as_mut_slice(), needed)?;
        let key = store.table_key(&file, spec)?;
        let io_uring = store.uses_io_uring()?;
        let (file, len) = (Arc::new(file), spec.rows * spec.row_bytes as u64);
        let alone = ProbedFile { file: file.clone(), len };
        Ok(Self {
            file,
            path: path.to_owned(),
            len,
            row_bytes: spec.row_bytes,
            cache: store.cache.clone(),
            key,
            io_uring,
            slots,
            probe: ProbeTargets::new(vec![alone]),
        })
    }

    /// Its file, for a probe.
    fn probed(&self) -> ProbedFile {
        ProbedFile { file: self.file.clone(), len: self.len }
    }

    /// Where row `id` is in the file, in rows.
    fn slot(&self, id: i64) -> u64 {
        self.slots.as_ref().map_or(id, |index| index.slot(id)) as u64
    }
}

impl RowStore for DiskRows {
    fn kind(&self) -> &'static str {
        "disk"
    }

    fn local_rows(&self) -> Option<&[u8]> {
        None
    }

    fn fetch(
        &self,
        ids: &[i64],
        row_bytes: usize,
        out: &mut [u8],
        deadline: Option<Instant>,
    ) -> Result<Fetched, FetchError> {
        fetch_alone(self, self, ids, row_bytes, out, deadline)
    }

    fn may_fault(&self) -> bool {
        false
    }

    fn batch_fetch(&self) -> Option<&dyn BatchFetch> {
        Some(self)
    }

    /// Probes every file of the tables opened with this one (a model
    /// version's: the stage gives the watcher to its first table), one
    /// direct read of a block each per [`probe::PROBE_INTERVAL`]: false
    /// after a read that fails or takes over [`probe::PROBE_LIMIT`], true
    /// once a round reads again ([`probe`]).
    fn watch_reachability(
        &self,
        watcher: narsil_core::DependencyWatcher,
    ) -> Option<narsil_core::DependencyWatcher> {
        if let Err(e) = probe::watch(&self.probe, watcher, probe::Timing::SERVING, probe::direct_read()) {
            tracing::warn!("disk store: no reachability probe for {}: {e}", self.path.display());
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::Storage;
    use crate::stores::FetchPart;

    /// A table file of `rows` rows of 80 bytes, row `i` filled with bytes
    /// of `i`, on a file system that takes direct reads; `None`, saying the
    /// test is skipped, where there is none ([`super::super::direct_io_dir`]).
    fn table_file(rows: u64) -> Option<(tempfile::TempDir, TableSpec)> {
        table_file_of(rows, 80)
    }

    /// [`table_file`] with rows of `row_bytes` (FP32 rows of `row_bytes /
    /// 4` values).
    fn table_file_of(rows: u64, row_bytes: usize) -> Option<(tempfile::TempDir, TableSpec)> {
        let test = std::thread::current().name().unwrap_or("a disk store test").to_owned();
        let dir = super::super::direct_io_dir(&test)?;
        let (dim, storage) =
            if row_bytes == 80 { (72, Storage::Int8Rowwise) } else { (row_bytes / 4, Storage::Fp32) };
        let spec = TableSpec {
            name: "t".into(),
            rows,
            dim,
            storage,
            row_bytes,
            file: "t.bin".into(),
            sha256: String::new(),
            redis: None,
            layout: None,
            ids: Default::default(),
        };
        let data: Vec<u8> = (0..rows).flat_map(|i| vec![(i % 251) as u8; row_bytes]).collect();
        std::fs::write(dir.path().join("t.bin"), data).unwrap();
        Some((dir, spec))
    }

    /// Both ways of reading, io_uring only where this kernel allows it.
    fn both_reads(test: &str) -> Vec<Reads> {
        match uring::available() {
            Ok(()) => vec![Reads::IoUring, Reads::Threads],
            Err(why) => {
                super::super::skip_or_fail(&format!("{test} with io_uring"), &why);
                vec![Reads::Threads]
            }
        }
    }

    fn fetch(rows: &DiskRows, ids: &[i64]) -> (Vec<u8>, Fetched) {
        let mut out = vec![0u8; ids.len() * 80];
        let fetched = rows.fetch(ids, 80, &mut out, None).unwrap();
        (out, fetched)
    }

    fn expected(ids: &[i64]) -> Vec<u8> {
        ids.iter().flat_map(|&i| [(i % 251) as u8; 80]).collect()
    }

    #[test]
    fn rows_read_from_disk_and_from_the_cache_are_the_files_rows() {
        let Some((dir, spec)) = table_file(10_000) else { return };
        for reads in both_reads("rows_read_from_disk_and_from_the_cache_are_the_files_rows") {
            let store = DiskStore::new(200 * (80 + 16), reads);
            let rows = DiskRows::open(&dir.path().join("t.bin"), &spec, None, &store).unwrap();
            let ids: Vec<i64> = (0..500).map(|i| (i * 7919) % 10_000).rev().collect();
            let (out, fetched) = fetch(&rows, &ids);
            assert_eq!(out, expected(&ids), "{reads:?}");
            assert_eq!(fetched.cached, 0);
            // A cache of 200 rows keeps some of them; the rows are the same.
            let (again, fetched) = fetch(&rows, &ids);
            assert_eq!(again, expected(&ids), "{reads:?}");
            assert!(fetched.cached > 0 && fetched.cached <= 200, "{fetched:?}");
            // The last row, whose block passes the end of the file.
            assert_eq!(fetch(&rows, &[9_999]).0, expected(&[9_999]), "{reads:?}");
        }
    }

    #[test]
    fn a_batch_s_reads_are_counted_in_whole_blocks_and_none_stay_in_flight() {
        let Some((dir, spec)) = table_file(10_000) else { return };
        for reads in both_reads("a_batch_s_reads_are_counted_in_whole_blocks_and_none_stay_in_flight") {
            let store = DiskStore::new(0, reads);
            let rows = DiskRows::open(&dir.path().join("t.bin"), &spec, None, &store).unwrap();
            let counters = crate::metrics::TableCounters::default();
            // Rows 0 and 1 share block 0; row 5,000 (byte 400,000) is in block 97.
            let ids = [0, 1, 5_000];
            let mut out = vec![0u8; ids.len() * 80];
            let part =
                FetchPart { store: &rows, ids: &ids, row_bytes: 80, out: &mut out, counters: &counters };
            rows.fetch_parts(&mut [part], None).unwrap();
            assert_eq!(out, expected(&ids), "{reads:?}");
            assert_eq!(counters.disk.bytes_read.get(), 2 * BLOCK, "{reads:?}");
            assert_eq!(counters.disk.in_flight.get(), 0);
        }
    }

    #[test]
    fn a_file_cut_short_after_opening_fails_the_fetch_naming_the_file() {
        for reads in both_reads("a_file_cut_short_after_opening_fails_the_fetch_naming_the_file") {
            let Some((dir, spec)) = table_file(1_000) else { return };
            let path = dir.path().join("t.bin");
            let rows = DiskRows::open(&path, &spec, None, &DiskStore::new(0, reads)).unwrap();
            std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(40_000).unwrap();
            let mut out = vec![0u8; 80];
            let error = rows.fetch(&[900], 80, &mut out, None).unwrap_err();
            assert!(
                error.message.contains("t.bin") && error.message.contains("cut short"),
                "{reads:?}: {error}"
            );
            assert!(!error.abandoned, "a file cut short is the store's failure");
            assert_eq!(fetch(&rows, &[10]).0, expected(&[10]), "rows before the cut still read");
        }
    }

    #[test]
    fn a_batch_whose_callers_all_left_reads_nothing_and_is_abandoned_not_failed() {
        let Some((dir, spec)) = table_file(1_000) else { return };
        for reads in both_reads("a_batch_whose_callers_all_left_reads_nothing_and_is_abandoned_not_failed") {
            let rows =
                DiskRows::open(&dir.path().join("t.bin"), &spec, None, &DiskStore::new(0, reads)).unwrap();
            let counters = crate::metrics::TableCounters::default();
            let ids = [5, 500, 999];
            let mut out = vec![7u8; ids.len() * 80];
            let part =
                FetchPart { store: &rows, ids: &ids, row_bytes: 80, out: &mut out, counters: &counters };
            let (_, error) = rows.fetch_parts(&mut [part], Some(Instant::now())).unwrap_err();
            assert!(
                error.message.contains("t.bin") && error.message.contains("deadline passed"),
                "{reads:?}: {error}"
            );
            assert!(error.abandoned, "{reads:?}: nobody waits for these rows: not the store's failure");
            assert_eq!(counters.disk.bytes_read.get(), 0, "{reads:?}: no read started");
            assert_eq!(counters.disk.in_flight.get(), 0);
            assert!(out.iter().all(|&b| b == 7), "{reads:?}: nothing landed");
        }
    }

    #[test]
    fn rows_longer_than_a_block_open_and_read_whole() {
        // FP32 rows of dim 1,250 (5,000 bytes: two blocks each, most
        // straddling three).
        let Some((dir, spec)) = table_file_of(40, 5_000) else { return };
        for reads in both_reads("rows_longer_than_a_block_open_and_read_whole") {
            let store = DiskStore::new(1 << 20, reads);
            let rows = DiskRows::open(&dir.path().join("t.bin"), &spec, None, &store).unwrap();
            let ids = [39, 0, 17, 18];
            let expected: Vec<u8> = ids.iter().flat_map(|&i| vec![i as u8; 5_000]).collect();
            for (pass, cached) in [("disk", 0), ("cache", ids.len())] {
                let mut out = vec![0u8; ids.len() * 5_000];
                let fetched = rows.fetch(&ids, 5_000, &mut out, None).unwrap();
                assert!(out == expected, "{reads:?}, from the {pass}");
                assert_eq!(fetched.cached, cached, "{reads:?}, from the {pass}");
            }
        }
    }

    #[test]
    fn a_table_in_popularity_order_opens_by_id_and_two_swapped_slots_fail_the_open() {
        // Ids 0, 1, 2 at slots 2, 0, 1: the file holds row 1, row 2, row 0.
        let Some((dir, spec)) = table_file(3) else { return };
        let index = |slots: [u32; 3]| -> Vec<u8> { slots.iter().flat_map(|s| s.to_le_bytes()).collect() };
        let (right, swapped) = (index([2, 0, 1]), index([0, 2, 1]));
        let (_, sha256) = SlotIndex::read(|| Ok(right.as_slice()), 3).unwrap();
        let (_, swapped_sha256) = SlotIndex::read(|| Ok(swapped.as_slice()), 3).unwrap();
        std::fs::write(dir.path().join("t.slots"), &right).unwrap();
        let layout = crate::schema::Layout { slots: "t.slots".into(), sha256: sha256.clone() };
        let schema = SplitSchema {
            tables: vec![TableSpec { layout: Some(layout), ..spec }],
            ..SplitSchema::one_table_per_feature("m", "1", 1, Vec::new(), Vec::new())
        };
        let store = DiskStore::new(0, Reads::Auto);
        let (stores, _) = store.open(dir.path(), &schema).unwrap();
        let mut out = vec![0u8; 3 * 80];
        stores[0].fetch(&[0, 1, 2], 80, &mut out, None).unwrap();
        assert_eq!(out, expected(&[2, 0, 1]), "id i reads the file's row at slot i");
        // Still a permutation: only the hash tells ids 0 and 1 apart.
        std::fs::write(dir.path().join("t.slots"), &swapped).unwrap();
        let error = store.open(dir.path(), &schema).err().expect("the open fails").to_string();
        assert!(
            error.contains("t.slots") && error.contains(&sha256) && error.contains(&swapped_sha256),
            "{error}"
        );
    }

    #[test]
    fn a_model_s_probe_reads_every_table_file_and_one_cut_short_makes_the_store_unreachable() {
        let Some((dir, spec)) = table_file(1_000) else { return };
        std::fs::copy(dir.path().join("t.bin"), dir.path().join("u.bin")).unwrap();
        let other = TableSpec { name: "u".into(), file: "u.bin".into(), ..spec.clone() };
        let schema = SplitSchema {
            tables: vec![spec, other],
            ..SplitSchema::one_table_per_feature("m", "1", 1, Vec::new(), Vec::new())
        };
        let (stores, _) = DiskStore::new(0, Reads::Threads).open(dir.path(), &schema).unwrap();
        // The stage gives the watcher to the first table: its probe covers
        // both files.
        let rows = |s: &Arc<dyn RowStore>| s.downcast_ref::<DiskRows>().unwrap().file.clone();
        let first = stores[0].downcast_ref::<DiskRows>().unwrap();
        let probed: Vec<Arc<File>> = first.probe.files().cloned().collect();
        assert_eq!(probed.len(), 2);
        assert!(probed.iter().zip(&stores).all(|(file, store)| Arc::ptr_eq(file, &rows(store))));

        // Through the trait, at the serving interval: told at once, and the
        // prober (which owns the watcher) ends when the tables are dropped.
        let (told, token) = (Arc::new(Mutex::new(Vec::new())), Arc::new(()));
        let (t, held) = (told.clone(), token.clone());
        let watcher: narsil_core::DependencyWatcher = Box::new(move |reads| {
            let _ = &held;
            t.lock().unwrap().push(reads);
            true
        });
        assert!(stores[0].watch_reachability(watcher).is_none(), "the disk store takes the watcher");
        let until = Instant::now() + std::time::Duration::from_secs(5);
        while told.lock().unwrap().is_empty() {
            assert!(Instant::now() < until, "told at once");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(*told.lock().unwrap(), [true], "a disk that reads: reachable");

        // Fast, with the real direct read: the second file cut short fails
        // its probe; written back, it reads again.
        let heard = Arc::new(Mutex::new(Vec::new()));
        let fast = probe::Timing {
            interval: std::time::Duration::from_millis(10),
            limit: std::time::Duration::from_secs(1),
        };
        let recorded = heard.clone();
        let watcher: narsil_core::DependencyWatcher = Box::new(move |reads| {
            recorded.lock().unwrap().push(reads);
            true
        });
        let prober = probe::watch(&first.probe, watcher, fast, probe::direct_read()).unwrap();
        let wait_for = |want: &[bool]| {
            let until = Instant::now() + std::time::Duration::from_secs(5);
            while heard.lock().unwrap().as_slice() != want {
                assert!(Instant::now() < until, "{:?}, not {want:?}", heard.lock().unwrap());
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        };
        wait_for(&[true]);
        let u = dir.path().join("u.bin");
        let data = std::fs::read(&u).unwrap();
        std::fs::OpenOptions::new().write(true).open(&u).unwrap().set_len(0).unwrap();
        wait_for(&[true, false]);
        std::fs::write(&u, &data).unwrap();
        wait_for(&[true, false, true]);

        drop(stores);
        let until = Instant::now() + std::time::Duration::from_secs(2);
        while !prober.is_finished() || Arc::strong_count(&token) > 1 {
            assert!(Instant::now() < until, "both probers stop with the tables");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    #[test]
    fn tables_hard_linked_into_two_versions_share_their_cache_number_until_written() {
        let Some((dir, spec)) = table_file(100) else { return };
        std::fs::hard_link(dir.path().join("t.bin"), dir.path().join("u.bin")).unwrap();
        let store = DiskStore::new(1 << 20, Reads::Auto);
        let a = DiskRows::open(&dir.path().join("t.bin"), &spec, None, &store).unwrap();
        let b = DiskRows::open(&dir.path().join("u.bin"), &spec, None, &store).unwrap();
        assert_eq!(a.key, b.key);
        let Some((other_dir, other)) = table_file(100) else { return };
        let c = DiskRows::open(&other_dir.path().join("t.bin"), &other, None, &store).unwrap();
        assert_ne!(a.key, c.key);
        // Written since (a new file that took a deleted one's inode number
        // would be too): other rows, another number.
        let written = std::time::SystemTime::now() + std::time::Duration::from_secs(60);
        std::fs::File::options()
            .write(true)
            .open(dir.path().join("t.bin"))
            .unwrap()
            .set_modified(written)
            .unwrap();
        let d = DiskRows::open(&dir.path().join("t.bin"), &spec, None, &store).unwrap();
        assert_ne!(a.key, d.key);
    }
}
