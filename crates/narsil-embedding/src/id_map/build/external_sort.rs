//! The external sort of a map's build ([`super`]): the vocabulary read in chunks
//! that fit the memory budget ([`Limits`]), each sorted by `(home slot,
//! raw id)` and spilled to a run file, then the runs merged (in rounds
//! where there are more than the budget holds buffers for) into one
//! ordered stream, a raw id given twice refused naming both its places.

use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;

use super::page_cache::DropBehind;
use super::vocabulary::Vocabulary;
use super::{Progress, FILE_BUFFER_BYTES};
use crate::id_map::home;

/// Bytes of the budget kept for the file buffers of the sort phase (the
/// vocabulary's reader and a run's writer).
const IO_BYTES: u64 = 3 << 20;
/// Bytes held per id while the vocabulary is sorted: home slot, raw id, row.
const SORT_ENTRY_BYTES: u64 = 24;
/// Bytes per id in a run file: raw id, row (the home slot is recomputed).
const RUN_ENTRY_BYTES: usize = 16;
/// Each run's read buffer while the runs are merged.
const RUN_BUFFER_BYTES: usize = 256 << 10;

/// How the work is cut to fit the memory budget.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Ids sorted in memory at once (one run each).
    pub chunk_ids: usize,
    /// Runs merged at once.
    pub fan_in: usize,
    /// Read buffer per run while merging.
    pub run_buffer: usize,
}

impl Limits {
    /// The cut of a budget of `memory_bytes`.
    pub fn of(memory_bytes: u64) -> Self {
        let usable = memory_bytes.saturating_sub(IO_BYTES);
        Self {
            chunk_ids: (usable / SORT_ENTRY_BYTES).max(1) as usize,
            fan_in: (usable / RUN_BUFFER_BYTES as u64).max(2) as usize,
            run_buffer: RUN_BUFFER_BYTES,
        }
    }
}

/// Reads it in chunks of `limits.chunk_ids` ids, each sorted by `(home
/// slot, raw id)` and spilled to a run file; returns the runs.
pub fn sort_into_runs(
    vocabulary: &Vocabulary,
    entries: u64,
    home_slots: u64,
    limits: Limits,
    runs_made: &mut RunFiles,
    progress: &mut dyn Progress,
) -> anyhow::Result<Vec<PathBuf>> {
    let mut chunk: Vec<(u64, i64, u64)> = Vec::with_capacity(limits.chunk_ids.min(entries as usize));
    let mut runs = Vec::new();
    progress.start("vocabulary: sort".into());
    let mut read = 0u64;
    vocabulary.read(|row, raw| {
        chunk.push((home(raw, home_slots), raw, row));
        read += 1;
        if chunk.len() == limits.chunk_ids {
            runs.push(spill(&mut chunk, runs_made)?);
        }
        progress.tick(&|| format!("{read}/{entries} ids read, {} runs", runs.len()));
        Ok(())
    })?;
    anyhow::ensure!(
        read == entries,
        "--vocabulary {} changed while read: {read} ids, {entries} counted",
        vocabulary.path.display()
    );
    if !chunk.is_empty() {
        runs.push(spill(&mut chunk, runs_made)?);
    }
    progress.done(format!("{read} ids in {} sorted runs", runs.len()));
    Ok(runs)
}

/// Sorts `chunk`, writes it to a new run file, and empties it.
fn spill(chunk: &mut Vec<(u64, i64, u64)>, runs_made: &mut RunFiles) -> anyhow::Result<PathBuf> {
    chunk.sort_unstable();
    let path = runs_made.create()?;
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
pub fn merge_rounds(
    mut runs: Vec<PathBuf>,
    home_slots: u64,
    limits: Limits,
    vocabulary: &Vocabulary,
    runs_made: &mut RunFiles,
    progress: &mut dyn Progress,
) -> anyhow::Result<Vec<PathBuf>> {
    while runs.len() > limits.fan_in {
        // Just enough at once that the next round (or the map) takes the rest.
        let take = limits.fan_in.min(runs.len() - limits.fan_in + 1);
        let inputs: Vec<PathBuf> = runs.drain(..take).collect();
        let path = runs_made.create()?;
        let file = std::fs::OpenOptions::new().write(true).open(&path)?;
        let mut out = BufWriter::with_capacity(FILE_BUFFER_BYTES, DropBehind::new(file));
        merge(&inputs, home_slots, limits, vocabulary, |_, raw, row| {
            out.write_all(&raw.to_le_bytes())?;
            out.write_all(&row.to_le_bytes())?;
            Ok(())
        })?;
        out.flush().with_context(|| format!("writing {}", path.display()))?;
        progress.note(format!("merged {take} runs into one, {} left", runs.len() + 1));
        for input in &inputs {
            runs_made.remove(input);
        }
        runs.push(path);
    }
    Ok(runs)
}

/// Calls `out(home, raw, row)` for every entry of `runs` (each sorted) in
/// `(home, raw id)` order; a raw id given twice is an error naming both of
/// its places in the vocabulary.
pub fn merge(
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
pub struct RunFiles {
    /// Where they are written.
    pub dir: PathBuf,
    /// The start of their names (`STEM.run-PID-N`).
    pub stem: String,
    /// Those made and not yet removed.
    pub paths: Vec<PathBuf>,
}

impl RunFiles {
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

    /// Removes every run file left.
    pub fn remove_all(&mut self) {
        for path in self.paths.drain(..) {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Drop for RunFiles {
    fn drop(&mut self) {
        self.remove_all();
    }
}
