//! `narsil tables map`: builds a table's id map
//! ([`narsil_embedding::id_map`]) from a vocabulary, the raw id of each of
//! its rows, and names it in the model's `schema.json`.
//!
//! # The vocabulary
//!
//! Row `i`'s raw id is entry `i` of the file (`--vocabulary-format`):
//! `text`, line `i + 1` holds one decimal 64-bit id, signed or unsigned (an
//! unsigned value above `i64::MAX` is taken as its two's complement `i64`,
//! as KServe's UINT64 sends it; spaces around it and a `\r` before the
//! `\n` are allowed, a blank line or anything else is refused naming the
//! line); `i64le`, bytes `8i..8i+8` are the id as a little-endian `i64`
//! (the file's size a multiple of 8). More ids than the table's rows are
//! refused; fewer are fine (the rows past them are no raw id's). A raw id
//! given twice is refused naming both places.
//!
//! # Memory: an external sort
//!
//! A map's writer takes its entries in `(home slot, raw id)` order
//! ([`SortedWriter`]), and the home slots depend on how many ids the map
//! holds, so the vocabulary is read twice: once to count it (a `text`
//! file's lines; an `i64le` file's size says it), once in chunks of at
//! most `--memory-bytes` (24 bytes an id: home slot, raw id, row), each
//! sorted and spilled to a run file (16 bytes an id) beside the map (or in
//! `--tmp-dir`). The runs are then merged (a buffer of [`RUN_BUFFER_BYTES`]
//! each; more runs than the budget holds buffers for are merged in rounds
//! first) into the map's writer, which writes the map front to back. The
//! files it writes are flushed to disk and dropped from the page cache as
//! they grow ([`DropBehind`]), so that the dirty pages of a map larger than
//! RAM neither fill the page cache nor get charged to a small memory
//! cgroup. The peak is `--memory-bytes` and a few MiB of buffers, whatever
//! the vocabulary's size; the table's rows are never read.
//!
//! # Publishing
//!
//! The map is written into `tables/NAME.idmap.tmp` (created exclusively:
//! one that exists is another run's or a crash's, refused and left as it
//! is), synced, hashed, renamed to `tables/NAME.idmap`, its directory
//! synced, and then the table's `ids` in `schema.json` is set to `{"map":
//! {"file", "sha256", "default_row"}}` (written through a temporary file,
//! synced and renamed, every other field as it was). Run files are removed
//! whether the run succeeds or fails.

use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, ValueEnum};
use narsil_embedding::id_map::{home, home_slots_for, SortedWriter};
use narsil_embedding::SplitSchema;

/// `--memory-bytes` when not given.
pub const DEFAULT_MEMORY_BYTES: u64 = 64 << 20;
/// Bytes of the budget kept for the file buffers of the sort phase (the
/// vocabulary's reader and a run's writer).
const IO_BYTES: u64 = 3 << 20;
/// Bytes held per id while the vocabulary is sorted: home slot, raw id, row.
const SORT_ENTRY_BYTES: u64 = 24;
/// Bytes per id in a run file: raw id, row (the home slot is recomputed).
const RUN_ENTRY_BYTES: usize = 16;
/// Each run's read buffer while the runs are merged.
pub const RUN_BUFFER_BYTES: usize = 256 << 10;
/// Buffer of the vocabulary's reader and of each file written.
const FILE_BUFFER_BYTES: usize = 1 << 20;
/// How often progress is printed.
const PROGRESS_EVERY: Duration = Duration::from_millis(500);

/// How a vocabulary file holds its raw ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum VocabularyFormat {
    /// One decimal 64-bit id a line, signed or unsigned (above i64::MAX:
    /// its two's complement i64).
    Text,
    /// Little-endian i64s, 8 bytes each.
    I64le,
}

/// `narsil tables map`.
#[derive(Debug, Args)]
pub struct MapTablesArgs {
    /// The split model directory (its schema.json; the map is written into
    /// its tables/, the table's rows are not read).
    model: PathBuf,
    /// The table the map is for.
    #[arg(long)]
    table: String,
    /// The raw id of each row, row 0 first (--vocabulary-format). At most
    /// the table's rows; the rows past the file's end are no raw id's.
    #[arg(long)]
    vocabulary: PathBuf,
    /// How --vocabulary holds the ids: `text`, one decimal id a line (a
    /// blank or malformed line is refused, naming it); `i64le`, 8 bytes a
    /// little-endian id.
    #[arg(long, value_enum, default_value_t = VocabularyFormat::Text)]
    vocabulary_format: VocabularyFormat,
    /// The row that ids the map does not hold are served from (below the
    /// table's rows): a trained "unknown" row, or a row of zeros.
    #[arg(long)]
    default_row: u64,
    /// The sort's memory: ids are sorted this many bytes (24 an id) at a
    /// time and spilled to disk; the command's peak is this and a few MiB,
    /// whatever the vocabulary's size.
    #[arg(long, default_value_t = DEFAULT_MEMORY_BYTES, value_parser = clap::value_parser!(u64).range(16 << 20..))]
    memory_bytes: u64,
    /// Where the sorted runs are spilled (16 bytes an id in all; removed
    /// at the end). Default: the model's tables/ directory.
    #[arg(long)]
    tmp_dir: Option<PathBuf>,
}

/// How the work is cut to fit the memory budget.
#[derive(Debug, Clone, Copy)]
struct Limits {
    /// Ids sorted in memory at once (one run each).
    chunk_ids: usize,
    /// Runs merged at once.
    fan_in: usize,
    /// Read buffer per run while merging.
    run_buffer: usize,
}

impl Limits {
    fn of(memory_bytes: u64) -> Self {
        let usable = memory_bytes.saturating_sub(IO_BYTES);
        Self {
            chunk_ids: (usable / SORT_ENTRY_BYTES).max(1) as usize,
            fan_in: (usable / RUN_BUFFER_BYTES as u64).max(2) as usize,
            run_buffer: RUN_BUFFER_BYTES,
        }
    }
}

/// Runs `narsil tables map`.
pub fn map(args: &MapTablesArgs) -> anyhow::Result<()> {
    let report = map_within(args, Limits::of(args.memory_bytes))?;
    println!(
        "table {:?} of {}: {} raw ids of {} mapped to their rows (default row {}) in {} \
         ({:.1} MiB, {} slots, sha256 {}); {} sorted runs of at most {} ids; {:.1} s; peak RSS {} \
         (VmHWM); {} names it",
        args.table,
        args.model.display(),
        report.entries,
        args.vocabulary.display(),
        args.default_row,
        args.model.join(&report.file).display(),
        report.bytes as f64 / (1 << 20) as f64,
        report.slots,
        report.sha256,
        report.runs,
        Limits::of(args.memory_bytes).chunk_ids,
        report.seconds,
        peak_rss_mib().map_or_else(|| "unknown".into(), |mib| format!("{mib:.1} MiB")),
        args.model.join("schema.json").display()
    );
    Ok(())
}

/// What a run wrote.
#[derive(Debug)]
struct MapReport {
    entries: u64,
    /// The map's file, relative to the model.
    file: PathBuf,
    bytes: u64,
    slots: u64,
    sha256: String,
    /// Sorted runs spilled (before any merge rounds).
    runs: usize,
    seconds: f64,
}

/// [`map`], cut to `limits`.
fn map_within(args: &MapTablesArgs, limits: Limits) -> anyhow::Result<MapReport> {
    let started = Instant::now();
    let schema = SplitSchema::read(&args.model).with_context(|| format!("{}", args.model.display()))?;
    let spec = schema.table(&args.table).with_context(|| {
        let names: Vec<&str> = schema.tables.iter().map(|t| t.name.as_str()).collect();
        format!("--table {:?}: the model has no such table (its tables: {})", args.table, names.join(", "))
    })?;
    let rows = spec.rows;
    anyhow::ensure!(
        args.default_row < rows,
        "--default-row {} is past table {:?}'s {rows} rows",
        args.default_row,
        args.table
    );
    let vocabulary = Vocabulary { path: &args.vocabulary, format: args.vocabulary_format };
    let entries = vocabulary.count()?;
    anyhow::ensure!(entries > 0, "--vocabulary {} holds no ids", args.vocabulary.display());
    anyhow::ensure!(
        entries <= rows,
        "--vocabulary {} holds {entries} ids, more than table {:?}'s {rows} rows (one id a row, row 0 first)",
        args.vocabulary.display(),
        args.table
    );
    let home_slots = home_slots_for(entries);
    let file = PathBuf::from("tables").join(format!("{}.idmap", args.table));
    let (path, partial) = (args.model.join(&file), args.model.join(format!("{}.tmp", file.display())));
    let tmp_dir = args.tmp_dir.clone().unwrap_or_else(|| args.model.join("tables"));
    // Claims the map's temporary name before the long work: a second run
    // for the same table is refused here, not after its sort.
    let map_file = Partial::create(&partial, &args.table)?;
    let mut temporaries =
        Temporaries { dir: tmp_dir, stem: format!("{}.idmap", args.table), paths: Vec::new() };

    let runs = vocabulary.sort_into_runs(entries, home_slots, limits, &mut temporaries)?;
    let spilled = runs.len();
    // The sort's memory back to the OS before the merge's buffers.
    narsil_engine::release_freed_memory();
    let runs = merge_rounds(runs, home_slots, limits, &vocabulary, &mut temporaries)?;

    let mut progress = Progress::new(format!("{}: merge", args.table));
    let writer = BufWriter::with_capacity(FILE_BUFFER_BYTES, DropBehind::new(map_file.file()?));
    let mut writer = SortedWriter::new(writer, entries, rows)?;
    let mut merged = 0u64;
    merge(&runs, home_slots, limits, &vocabulary, |_, raw, row| {
        writer.push(raw, row)?;
        merged += 1;
        progress.tick(|| format!("{merged}/{entries} ids ({:.0}%)", merged as f64 * 100.0 / entries as f64));
        Ok(())
    })?;
    let (out, slots) = writer.finish()?;
    let file_out = out.into_inner().map_err(|e| e.into_error())?.into_inner();
    file_out.sync_all().with_context(|| format!("writing {}", partial.display()))?;
    drop(file_out);
    progress.done(format!("{merged} ids in {slots} slots"));
    temporaries.remove_all();

    let progress = Progress::new(format!("{}: sha256", args.table));
    let sha256 = narsil_embedding::stores::table_file::sha256_of(ReadBehind::open(&partial)?)
        .with_context(|| format!("hashing {}", partial.display()))?;
    let bytes = std::fs::metadata(&partial)?.len();
    progress.done(sha256.clone());
    map_file.publish(&path)?;
    let ids = serde_json::json!({"map": {"file": file, "sha256": sha256, "default_row": args.default_row}});
    super::edit_tables(&args.model, &args.model, |name, table| {
        if name == args.table {
            table["ids"] = ids.clone();
        }
        Ok(())
    })?;
    Ok(MapReport {
        entries,
        file,
        bytes,
        slots,
        sha256,
        runs: spilled,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// The vocabulary file and how it holds its ids.
struct Vocabulary<'a> {
    path: &'a Path,
    format: VocabularyFormat,
}

impl Vocabulary<'_> {
    fn open(&self) -> anyhow::Result<File> {
        File::open(self.path).with_context(|| format!("--vocabulary {}", self.path.display()))
    }

    /// Where row `row`'s id is in the file, as an error names it.
    fn place(&self, row: u64) -> String {
        match self.format {
            VocabularyFormat::Text => format!("line {}", row + 1),
            VocabularyFormat::I64le => format!("id {} (byte {})", row + 1, row * 8),
        }
    }

    /// How many ids it holds: an `i64le` file's size says it, a `text`
    /// file's lines are counted.
    fn count(&self) -> anyhow::Result<u64> {
        let file = self.open()?;
        let size = file.metadata()?.len();
        match self.format {
            VocabularyFormat::I64le => {
                anyhow::ensure!(
                    size.is_multiple_of(8),
                    "--vocabulary {}: {size} bytes, not a whole number of 8-byte ids (i64le)",
                    self.path.display()
                );
                Ok(size / 8)
            }
            VocabularyFormat::Text => {
                let mut progress = Progress::new("vocabulary: count".into());
                let mut reader = BufReader::with_capacity(FILE_BUFFER_BYTES, file);
                let (mut lines, mut last) = (0u64, b'\n');
                loop {
                    let buffer = reader.fill_buf()?;
                    let Some(&end) = buffer.last() else { break };
                    lines += buffer.iter().filter(|&&b| b == b'\n').count() as u64;
                    last = end;
                    let n = buffer.len();
                    reader.consume(n);
                    progress.tick(|| format!("{lines} lines"));
                }
                let lines = lines + u64::from(last != b'\n');
                progress.done(format!("{lines} lines"));
                Ok(lines)
            }
        }
    }

    /// Reads every id, row by row, into `entry(row, raw)`.
    fn read(&self, mut entry: impl FnMut(u64, i64) -> anyhow::Result<()>) -> anyhow::Result<()> {
        let mut reader = BufReader::with_capacity(FILE_BUFFER_BYTES, self.open()?);
        let mut row = 0u64;
        match self.format {
            VocabularyFormat::I64le => {
                let mut id = [0u8; 8];
                while !reader.fill_buf()?.is_empty() {
                    reader.read_exact(&mut id)?;
                    entry(row, i64::from_le_bytes(id))?;
                    row += 1;
                }
            }
            VocabularyFormat::Text => {
                let mut line = Vec::with_capacity(32);
                loop {
                    line.clear();
                    if reader.read_until(b'\n', &mut line)? == 0 {
                        break;
                    }
                    let raw = parse_id(&line).with_context(|| {
                        format!(
                            "--vocabulary {}: {} ({:?}): {}",
                            self.path.display(),
                            self.place(row),
                            String::from_utf8_lossy(&line).trim_end_matches(['\n', '\r']),
                            if line.trim_ascii().is_empty() {
                                "a blank line (each line is the raw id of one row)"
                            } else {
                                "not a decimal 64-bit id"
                            }
                        )
                    })?;
                    entry(row, raw)?;
                    row += 1;
                }
            }
        }
        Ok(())
    }

    /// Reads it in chunks of `limits.chunk_ids` ids, each sorted by `(home
    /// slot, raw id)` and spilled to a run file; returns the runs.
    fn sort_into_runs(
        &self,
        entries: u64,
        home_slots: u64,
        limits: Limits,
        temporaries: &mut Temporaries,
    ) -> anyhow::Result<Vec<PathBuf>> {
        let mut chunk: Vec<(u64, i64, u64)> = Vec::with_capacity(limits.chunk_ids.min(entries as usize));
        let mut runs = Vec::new();
        let mut progress = Progress::new("vocabulary: sort".into());
        let mut read = 0u64;
        self.read(|row, raw| {
            chunk.push((home(raw, home_slots), raw, row));
            read += 1;
            if chunk.len() == limits.chunk_ids {
                runs.push(spill(&mut chunk, temporaries)?);
            }
            progress.tick(|| format!("{read}/{entries} ids read, {} runs", runs.len()));
            Ok(())
        })?;
        anyhow::ensure!(
            read == entries,
            "--vocabulary {} changed while read: {read} ids, {entries} counted",
            self.path.display()
        );
        if !chunk.is_empty() {
            runs.push(spill(&mut chunk, temporaries)?);
        }
        progress.done(format!("{read} ids in {} sorted runs", runs.len()));
        Ok(runs)
    }
}

/// The id a text line holds (its `\n`, `\r` and spaces around it aside).
fn parse_id(line: &[u8]) -> Option<i64> {
    let text = std::str::from_utf8(line.trim_ascii()).ok()?;
    if text.starts_with('-') {
        text.parse::<i64>().ok()
    } else {
        // Above i64::MAX: the two's complement, as KServe's UINT64 sends it.
        text.parse::<u64>().ok().map(|id| id as i64)
    }
}

/// Sorts `chunk`, writes it to a new run file, and empties it.
fn spill(chunk: &mut Vec<(u64, i64, u64)>, temporaries: &mut Temporaries) -> anyhow::Result<PathBuf> {
    chunk.sort_unstable();
    let path = temporaries.create()?;
    let file = std::fs::OpenOptions::new().write(true).open(&path)?;
    let mut out = BufWriter::with_capacity(FILE_BUFFER_BYTES, DropBehind::new(file));
    for &(_, raw, row) in chunk.iter() {
        out.write_all(&raw.to_le_bytes())?;
        out.write_all(&row.to_le_bytes())?;
    }
    out.flush().with_context(|| format!("writing {}", path.display()))?;
    chunk.clear();
    Ok(path)
}

/// Merges runs `limits.fan_in` at a time into new runs until at most that
/// many are left.
fn merge_rounds(
    mut runs: Vec<PathBuf>,
    home_slots: u64,
    limits: Limits,
    vocabulary: &Vocabulary,
    temporaries: &mut Temporaries,
) -> anyhow::Result<Vec<PathBuf>> {
    while runs.len() > limits.fan_in {
        // Just enough at once that the next round (or the map) takes the rest.
        let take = limits.fan_in.min(runs.len() - limits.fan_in + 1);
        let inputs: Vec<PathBuf> = runs.drain(..take).collect();
        let path = temporaries.create()?;
        let file = std::fs::OpenOptions::new().write(true).open(&path)?;
        let mut out = BufWriter::with_capacity(FILE_BUFFER_BYTES, DropBehind::new(file));
        merge(&inputs, home_slots, limits, vocabulary, |_, raw, row| {
            out.write_all(&raw.to_le_bytes())?;
            out.write_all(&row.to_le_bytes())?;
            Ok(())
        })?;
        out.flush().with_context(|| format!("writing {}", path.display()))?;
        eprintln!("merged {take} runs into one, {} left", runs.len() + 1);
        for input in &inputs {
            temporaries.remove(input);
        }
        runs.push(path);
    }
    Ok(runs)
}

/// Calls `out(home, raw, row)` for every entry of `runs` (each sorted) in
/// `(home, raw id)` order; a raw id given twice is an error naming both of
/// its places in the vocabulary.
fn merge(
    runs: &[PathBuf],
    home_slots: u64,
    limits: Limits,
    vocabulary: &Vocabulary,
    mut out: impl FnMut(u64, i64, u64) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let mut readers = Vec::with_capacity(runs.len());
    let mut heap = BinaryHeap::with_capacity(runs.len());
    for (i, path) in runs.iter().enumerate() {
        let file = File::open(path).with_context(|| format!("{}", path.display()))?;
        let mut reader = RunReader { reader: BufReader::with_capacity(limits.run_buffer, file), home_slots };
        if let Some(entry) = reader.next()? {
            heap.push(std::cmp::Reverse((entry, i)));
        }
        readers.push(reader);
    }
    let mut previous: Option<(i64, u64)> = None;
    while let Some(std::cmp::Reverse(((home, raw, row), i))) = heap.pop() {
        if let Some((_, before_row)) = previous.filter(|&(before, _)| before == raw) {
            anyhow::bail!(
                "--vocabulary {}: raw id {raw} is given twice, at {} and at {} (each raw id names one row)",
                vocabulary.path.display(),
                vocabulary.place(before_row.min(row)),
                vocabulary.place(before_row.max(row))
            );
        }
        previous = Some((raw, row));
        out(home, raw, row)?;
        if let Some(entry) = readers[i].next()? {
            heap.push(std::cmp::Reverse((entry, i)));
        }
    }
    Ok(())
}

/// A run file's entries, in order.
struct RunReader {
    reader: BufReader<File>,
    home_slots: u64,
}

impl RunReader {
    fn next(&mut self) -> std::io::Result<Option<(u64, i64, u64)>> {
        if self.reader.fill_buf()?.is_empty() {
            return Ok(None);
        }
        let mut entry = [0u8; RUN_ENTRY_BYTES];
        self.reader.read_exact(&mut entry)?;
        let raw = i64::from_le_bytes(entry[..8].try_into().expect("8 bytes"));
        let row = u64::from_le_bytes(entry[8..].try_into().expect("8 bytes"));
        Ok(Some((home(raw, self.home_slots), raw, row)))
    }
}

/// The run files of one run, removed when it ends (whether it succeeds).
struct Temporaries {
    dir: PathBuf,
    stem: String,
    paths: Vec<PathBuf>,
}

impl Temporaries {
    /// A new, empty run file.
    fn create(&mut self) -> anyhow::Result<PathBuf> {
        let path = self.dir.join(format!("{}.run-{}-{}", self.stem, std::process::id(), self.paths.len()));
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .with_context(|| format!("creating the sorted run {}", path.display()))?;
        self.paths.push(path.clone());
        Ok(path)
    }

    fn remove(&mut self, path: &Path) {
        let _ = std::fs::remove_file(path);
    }

    fn remove_all(&mut self) {
        for path in self.paths.drain(..) {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Drop for Temporaries {
    fn drop(&mut self) {
        self.remove_all();
    }
}

/// The map's temporary file, created by this run: removed if the run stops
/// before [`Partial::publish`], left behind only by a crash.
struct Partial {
    path: PathBuf,
    published: bool,
}

impl Partial {
    fn create(path: &Path, table: &str) -> anyhow::Result<Self> {
        match std::fs::OpenOptions::new().write(true).create_new(true).open(path) {
            Ok(_) => Ok(Self { path: path.to_owned(), published: false }),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => anyhow::bail!(
                "{} exists: another `narsil tables map --table {table}` is writing it, or one was stopped by a \
                 crash and left it (it is left as it is). Once no run is writing it, remove it and run again",
                path.display()
            ),
            Err(e) => Err(e).with_context(|| format!("creating {}", path.display())),
        }
    }

    fn file(&self) -> anyhow::Result<File> {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.path)
            .with_context(|| format!("{}", self.path.display()))
    }

    /// Renames it to `path` and syncs their directory.
    fn publish(mut self, path: &Path) -> anyhow::Result<()> {
        std::fs::rename(&self.path, path)
            .with_context(|| format!("renaming {} to {}", self.path.display(), path.display()))?;
        self.published = true;
        let dir = path.parent().unwrap_or(Path::new("."));
        File::open(dir).and_then(|d| d.sync_all()).with_context(|| format!("syncing {}", dir.display()))
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        if !self.published {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Bytes written through it between two hand-offs to the disk.
const DROP_BEHIND_BYTES: u64 = 16 << 20;

/// A file written front to back (seeks back aside) whose pages are handed
/// to the disk every [`DROP_BEHIND_BYTES`] and, once written, dropped from
/// the page cache: what it writes is never held in memory (nor charged to
/// the process's memory cgroup) more than two windows at a time.
struct DropBehind {
    file: File,
    /// Where the next write lands.
    at: u64,
    /// Bytes before it were handed to the disk (and the window before
    /// them, `dropped..started`, is being written).
    started: u64,
    dropped: u64,
}

impl DropBehind {
    fn new(file: File) -> Self {
        Self { file, at: 0, started: 0, dropped: 0 }
    }

    fn into_inner(self) -> File {
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
struct ReadBehind {
    file: File,
    at: u64,
    dropped: u64,
}

impl ReadBehind {
    fn open(path: &Path) -> anyhow::Result<Self> {
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

/// A step's progress on stderr: a line rewritten at most every
/// [`PROGRESS_EVERY`], then its last word.
struct Progress {
    label: String,
    started: Instant,
    printed: Instant,
    ticks: u32,
}

impl Progress {
    fn new(label: String) -> Self {
        let now = Instant::now();
        Self { label, started: now, printed: now, ticks: 0 }
    }

    /// Prints `what()` if the last print is old enough (looked at every
    /// 4096 calls: the clock is not read per id).
    fn tick(&mut self, what: impl FnOnce() -> String) {
        self.ticks = self.ticks.wrapping_add(1);
        if self.ticks.is_multiple_of(4096) && self.printed.elapsed() >= PROGRESS_EVERY {
            eprint!("\r{}: {}", self.label, what());
            let _ = std::io::stderr().flush();
            self.printed = Instant::now();
        }
    }

    fn done(self, what: String) {
        eprintln!("\r{}: {what} in {:.1} s", self.label, self.started.elapsed().as_secs_f64());
    }
}

/// The process's peak resident set (`VmHWM`), MiB.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

#[cfg(test)]
mod tests {
    use narsil_embedding::id_map::{build, IdMap};
    use narsil_embedding::schema::TableIds;

    use super::*;

    /// A split model of two tables (`rows` and 50 rows) in `dir`: no table
    /// files (`tables map` never reads them).
    fn model(dir: &Path, rows: u64) {
        std::fs::create_dir_all(dir.join("tables")).unwrap();
        let table = |name: &str, rows: u64| {
            format!(
                r#"{{"name": "{name}", "rows": {rows}, "dim": 8, "storage": "int8_rowwise", "row_bytes": 16,
                    "file": "tables/{name}.bin", "sha256": "", "extra": "kept"}}"#
            )
        };
        let schema = format!(
            r#"{{"format": "narsil-split-1", "name": "m", "version": "1", "num_dense": 1,
                "tables": [{}, {}],
                "features": [{{"name": "a", "table": "items", "pooling": "sum", "weighted": false}},
                             {{"name": "b", "table": "other", "pooling": "sum", "weighted": false}}],
                "outputs": ["default"], "dense_network": "dense.pt"}}"#,
            table("items", rows),
            table("other", 50)
        );
        std::fs::write(dir.join("schema.json"), schema).unwrap();
    }

    fn args(dir: &Path, vocabulary: PathBuf, format: VocabularyFormat, default_row: u64) -> MapTablesArgs {
        MapTablesArgs {
            model: dir.to_owned(),
            table: "items".into(),
            vocabulary,
            vocabulary_format: format,
            default_row,
            memory_bytes: DEFAULT_MEMORY_BYTES,
            tmp_dir: None,
        }
    }

    /// Seven ids sorted at once, three runs merged at once: many runs and
    /// merge rounds from a small vocabulary.
    const TINY: Limits = Limits { chunk_ids: 7, fan_in: 3, run_buffer: 64 };

    /// Raw ids as production sends them: large, negative, the extremes.
    fn raw_ids(n: usize) -> Vec<i64> {
        let mut ids: Vec<i64> =
            (1..=n as i64 - 3).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15u64 as i64)).collect();
        ids.extend([i64::MIN, i64::MAX, -1]);
        ids
    }

    /// `ids` as a text vocabulary, the ones past i64::MAX written unsigned
    /// (as KServe's UINT64 names them).
    fn text(ids: &[i64]) -> String {
        ids.iter()
            .enumerate()
            .map(|(i, &id)| if i.is_multiple_of(2) { format!("{}\n", id as u64) } else { format!("{id}\n") })
            .collect()
    }

    fn no_files_left_but(dir: &Path, kept: &[&str]) {
        let mut names: Vec<String> = std::fs::read_dir(dir.join("tables"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, kept, "files left in tables/");
    }

    #[test]
    fn a_text_vocabulary_sorted_in_many_runs_maps_every_raw_id_to_its_row_byte_for_byte_as_built_in_memory() {
        let dir = tempfile::tempdir().unwrap();
        model(dir.path(), 120);
        let ids = raw_ids(100);
        let vocabulary = dir.path().join("vocabulary.txt");
        std::fs::write(&vocabulary, text(&ids).replacen('\n', " \r\n", 3)).unwrap();
        let report = map_within(&args(dir.path(), vocabulary, VocabularyFormat::Text, 110), TINY).unwrap();
        assert_eq!((report.entries, report.runs), (100, 15));

        let schema = SplitSchema::read(dir.path()).unwrap();
        let TableIds::Map(spec) = &schema.table("items").unwrap().ids else { panic!("no map named") };
        assert_eq!((spec.file.as_path(), spec.default_row), (Path::new("tables/items.idmap"), 110));
        assert_eq!(schema.table("other").unwrap().ids, TableIds::Identity);
        let (map, sha) = IdMap::open(&dir.path().join(&spec.file), 120).unwrap();
        assert_eq!((&sha, &report.sha256), (&spec.sha256, &spec.sha256));
        for (row, &raw) in ids.iter().enumerate() {
            assert_eq!(map.row(raw), Some(row as u64), "raw id {raw}");
        }
        for raw in [0i64, 1, 2, -2, 12345678901234] {
            assert_eq!(map.row(raw), None, "{raw}");
        }
        let pairs: Vec<(i64, u64)> = ids.iter().enumerate().map(|(row, &raw)| (raw, row as u64)).collect();
        assert_eq!(std::fs::read(dir.path().join(&spec.file)).unwrap(), build(&pairs, 120).unwrap());
        // Every other field of the schema as it was.
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join("schema.json")).unwrap()).unwrap();
        assert!(json["tables"].as_array().unwrap().iter().all(|t| t["extra"] == "kept"));
        no_files_left_but(dir.path(), &["items.idmap"]);
    }

    #[test]
    fn an_i64le_vocabulary_gives_the_map_a_text_one_gives_and_a_vocabulary_shorter_than_the_table_is_fine() {
        let dir = tempfile::tempdir().unwrap();
        model(dir.path(), 1000);
        let ids = raw_ids(300);
        let (text_file, binary) = (dir.path().join("v.txt"), dir.path().join("v.i64"));
        std::fs::write(&text_file, text(&ids)).unwrap();
        std::fs::write(&binary, ids.iter().flat_map(|id| id.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        // The default row is one no raw id names.
        map_within(&args(dir.path(), text_file, VocabularyFormat::Text, 999), TINY).unwrap();
        let from_text = std::fs::read(dir.path().join("tables/items.idmap")).unwrap();
        let mut binary_args = args(dir.path(), binary, VocabularyFormat::I64le, 999);
        let runs = dir.path().join("runs");
        std::fs::create_dir(&runs).unwrap();
        binary_args.tmp_dir = Some(runs.clone());
        let report = map_within(&binary_args, Limits { chunk_ids: 64, fan_in: 2, run_buffer: 16 }).unwrap();
        assert_eq!((report.entries, report.runs), (300, 5));
        assert_eq!(std::fs::read(dir.path().join("tables/items.idmap")).unwrap(), from_text);
        assert_eq!(std::fs::read_dir(&runs).unwrap().count(), 0, "runs left in --tmp-dir");
        // The default limits: one run.
        let report = map_within(&binary_args, Limits::of(DEFAULT_MEMORY_BYTES)).unwrap();
        assert_eq!(report.runs, 1);
        assert_eq!(std::fs::read(dir.path().join("tables/items.idmap")).unwrap(), from_text);
    }

    /// The error `tables map` gives for `vocabulary` (text) on a table of
    /// 10 rows, and that it left the model as it was.
    fn refused(vocabulary: &str, default_row: u64) -> String {
        let dir = tempfile::tempdir().unwrap();
        model(dir.path(), 10);
        let path = dir.path().join("v.txt");
        std::fs::write(&path, vocabulary).unwrap();
        let schema = std::fs::read(dir.path().join("schema.json")).unwrap();
        let error =
            map_within(&args(dir.path(), path, VocabularyFormat::Text, default_row), TINY).unwrap_err();
        assert_eq!(std::fs::read(dir.path().join("schema.json")).unwrap(), schema);
        no_files_left_but(dir.path(), &[]);
        format!("{error:#}")
    }

    #[test]
    fn a_raw_id_given_twice_is_refused_naming_it_and_both_lines() {
        // Lines 2 and 9, in different runs of seven.
        let error = refused("1\n-5\n3\n4\n5\n6\n7\n8\n18446744073709551611\n", 0);
        assert!(error.contains("raw id -5 is given twice, at line 2 and at line 9"), "{error}");
        let error = refused("1\n2\n2\n", 0);
        assert!(error.contains("raw id 2 is given twice, at line 2 and at line 3"), "{error}");
    }

    #[test]
    fn more_ids_than_rows_a_junk_or_blank_line_and_a_default_row_past_the_table_are_refused() {
        let eleven: String = (0..11).map(|i| format!("{i}\n")).collect();
        let error = refused(&eleven, 0);
        assert!(error.contains("holds 11 ids, more than table \"items\"'s 10 rows"), "{error}");
        let error = refused("1\n2\nthree\n", 0);
        assert!(error.contains("line 3 (\"three\"): not a decimal 64-bit id"), "{error}");
        let error = refused("1\n18446744073709551616\n", 0);
        assert!(error.contains("line 2") && error.contains("not a decimal 64-bit id"), "{error}");
        let error = refused("1\n\n2\n", 0);
        assert!(error.contains("line 2 (\"\"): a blank line"), "{error}");
        let error = refused("1\n2\n", 10);
        assert!(error.contains("--default-row 10 is past table \"items\"'s 10 rows"), "{error}");
        let error = refused("", 0);
        assert!(error.contains("holds no ids"), "{error}");
    }

    #[test]
    fn an_i64le_vocabulary_that_is_not_whole_ids_is_refused_naming_its_size() {
        let dir = tempfile::tempdir().unwrap();
        model(dir.path(), 10);
        let path = dir.path().join("v.i64");
        std::fs::write(&path, [0u8; 12]).unwrap();
        let error = map_within(&args(dir.path(), path, VocabularyFormat::I64le, 0), TINY).unwrap_err();
        assert!(format!("{error:#}").contains("12 bytes, not a whole number of 8-byte ids"), "{error:#}");
        // A duplicate names the ids' places.
        let path = dir.path().join("dup.i64");
        std::fs::write(&path, [7i64, 8, 7].iter().flat_map(|id| id.to_le_bytes()).collect::<Vec<u8>>())
            .unwrap();
        let error = map_within(&args(dir.path(), path, VocabularyFormat::I64le, 0), TINY).unwrap_err();
        let error = format!("{error:#}");
        assert!(error.contains("raw id 7 is given twice, at id 1 (byte 0) and at id 3 (byte 16)"), "{error}");
    }

    #[test]
    fn a_map_being_written_is_refused_and_left_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        model(dir.path(), 10);
        let path = dir.path().join("v.txt");
        std::fs::write(&path, "1\n2\n").unwrap();
        std::fs::write(dir.path().join("tables/items.idmap.tmp"), b"half").unwrap();
        let error = map_within(&args(dir.path(), path.clone(), VocabularyFormat::Text, 0), TINY).unwrap_err();
        assert!(format!("{error:#}").contains("items.idmap.tmp exists"), "{error:#}");
        assert_eq!(std::fs::read(dir.path().join("tables/items.idmap.tmp")).unwrap(), b"half");
        std::fs::remove_file(dir.path().join("tables/items.idmap.tmp")).unwrap();
        map_within(&args(dir.path(), path, VocabularyFormat::Text, 0), TINY).unwrap();
        no_files_left_but(dir.path(), &["items.idmap"]);
    }

    #[test]
    fn the_command_line_names_the_formats_and_a_budget_below_16_mib_is_refused() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            map: MapTablesArgs,
        }
        let parse = |extra: &[&str]| {
            let base = ["narsil", "m/3", "--table", "items", "--vocabulary", "v", "--default-row", "7"];
            Cli::try_parse_from(base.iter().chain(extra)).map(|cli| cli.map)
        };
        let args = parse(&[]).unwrap();
        assert_eq!(
            (args.vocabulary_format, args.memory_bytes, args.default_row, args.tmp_dir),
            (VocabularyFormat::Text, DEFAULT_MEMORY_BYTES, 7, None)
        );
        let args = parse(&["--vocabulary-format", "i64le", "--memory-bytes", "16777216"]).unwrap();
        assert_eq!((args.vocabulary_format, args.memory_bytes), (VocabularyFormat::I64le, 16 << 20));
        assert!(parse(&["--memory-bytes", "1000"]).is_err());
        assert!(parse(&["--vocabulary-format", "csv"]).is_err());
        // The default budget's sort chunk and merge fan-in.
        let limits = Limits::of(DEFAULT_MEMORY_BYTES);
        assert_eq!((limits.chunk_ids, limits.fan_in), (2_665_130, 244));
    }

    #[test]
    fn text_ids_are_signed_or_unsigned_64_bit_decimals() {
        assert_eq!(parse_id(b"42\n"), Some(42));
        assert_eq!(parse_id(b" -9223372036854775808\r\n"), Some(i64::MIN));
        assert_eq!(parse_id(b"18446744073709551615"), Some(-1));
        assert_eq!(parse_id(b"9223372036854775808"), Some(i64::MIN));
        for junk in [&b"\n"[..], b"1.5", b"0x10", b"-9223372036854775809", b"1 2", b"\xff"] {
            assert_eq!(parse_id(junk), None, "{:?}", String::from_utf8_lossy(junk));
        }
    }
}
