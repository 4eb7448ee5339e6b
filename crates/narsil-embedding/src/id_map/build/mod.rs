//! Building a map file from a vocabulary larger than memory, for `narsil
//! tables map` (which keeps its arguments, progress lines and the map's
//! publication): the vocabulary, the raw id of each row ([`vocabulary`]),
//! sorted by `(home slot, raw id)` in runs spilled to disk and merged
//! ([`external_sort`]) into a [`SortedWriter`](super::SortedWriter), which
//! writes the map front to back; the files written and read back stream
//! past the page cache ([`page_cache`]). The peak is the budget
//! ([`Limits`]) and a few MiB of buffers, whatever the vocabulary's size.

pub mod external_sort;
pub mod page_cache;
pub mod vocabulary;

use std::io::BufWriter;
use std::path::{Path, PathBuf};

use anyhow::Context;

pub use external_sort::{merge, merge_rounds, sort_into_runs, Limits, RunFiles};
pub use page_cache::{DropBehind, ReadBehind};
pub use vocabulary::{Vocabulary, VocabularyFormat};

use super::{home_slots_for, SortedWriter};

/// Buffer of the vocabulary's reader and of each file written.
pub const FILE_BUFFER_BYTES: usize = 1 << 20;

/// What a long step of the build reports as it goes: the command prints
/// it (the library never does).
pub trait Progress {
    /// A step named `label` begins.
    fn start(&mut self, label: String);
    /// Where the step is: called often (per id), `what` made only when it
    /// is shown.
    fn tick(&mut self, what: &dyn Fn() -> String);
    /// The step ends: its last word.
    fn done(&mut self, what: String);
    /// A line of its own between steps.
    fn note(&mut self, line: String);
}

/// Merges `runs` (each sorted: [`sort_into_runs`], [`merge_rounds`]) into
/// the map written at `partial` (an empty file, claimed), `entries` ids of
/// a table of `rows` rows, then syncs it; returns its slots. Its progress
/// goes to the step its caller has started on `progress`.
pub fn write_merged(
    runs: &[PathBuf],
    limits: Limits,
    vocabulary: &Vocabulary,
    partial: &Path,
    entries: u64,
    rows: u64,
    progress: &mut dyn Progress,
) -> anyhow::Result<u64> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(partial)
        .with_context(|| format!("{}", partial.display()))?;
    let writer = BufWriter::with_capacity(FILE_BUFFER_BYTES, DropBehind::new(file));
    let mut writer = SortedWriter::new(writer, entries, rows)?;
    let mut merged = 0u64;
    merge(runs, home_slots_for(entries), limits, vocabulary, |_, raw, row| {
        writer.push(raw, row)?;
        merged += 1;
        progress.tick(&|| format!("{merged}/{entries} ids ({:.0}%)", merged as f64 * 100.0 / entries as f64));
        Ok(())
    })?;
    let (out, slots) = writer.finish()?;
    let file_out = out.into_inner().map_err(|e| e.into_error())?.into_inner();
    file_out.sync_all().with_context(|| format!("writing {}", partial.display()))?;
    drop(file_out);
    progress.done(format!("{merged} ids in {slots} slots"));
    Ok(slots)
}
