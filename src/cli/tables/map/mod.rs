//! `narsil tables map`: builds a table's id map
//! ([`narsil_embedding::id_map`]) from a vocabulary, the raw id of each of
//! its rows, and names it in the model's `schema.json`.
//!
//! The build itself (the vocabulary read, the external sort, the map
//! written) is the library's: [`narsil_embedding::id_map::build`]; this
//! module keeps the arguments, the progress lines and the publication.
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
//! holds, so the vocabulary is read twice: once to count it, once in
//! chunks of at most `--memory-bytes`, each sorted and spilled to a run
//! file beside the map (or in `--tmp-dir`), merged into the map's writer
//! ([`narsil_embedding::id_map::build::external_sort`]), which writes the
//! map front to back. The files it writes are handed to the disk and
//! dropped from the page cache as they grow
//! ([`narsil_embedding::id_map::build::page_cache`]). The peak is `--memory-bytes` and a few MiB of
//! buffers, whatever the vocabulary's size; the table's rows are never
//! read.
//!
//! # Publishing
//!
//! The map is written into `tables/NAME.idmap.tmp` (claimed exclusively:
//! one that exists is another run's or a crash's, refused and left as it
//! is), synced and hashed, then published so that `schema.json` names a
//! whole map at every moment ([`publication`]): the map under a name of its
//! own, then the schema naming it, then the previous map removed. Run
//! files are removed whether the run succeeds or fails.

mod progress;
mod publication;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::{Args, ValueEnum};
use narsil_embedding::id_map::build::{
    merge_rounds, sort_into_runs, write_merged, Limits, Progress as _, ReadBehind, RunFiles, Vocabulary,
};
use narsil_embedding::id_map::home_slots_for;
use narsil_embedding::SplitSchema;
use progress::{Progress, Stderr};

use narsil_embedding::publish::Claimed;

/// `--memory-bytes` when not given.
pub const DEFAULT_MEMORY_BYTES: u64 = 64 << 20;

/// How a vocabulary file holds its raw ids (`--vocabulary-format`; the
/// library's [`narsil_embedding::id_map::build::VocabularyFormat`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum VocabularyFormat {
    /// One decimal 64-bit id a line, signed or unsigned (above i64::MAX:
    /// its two's complement i64).
    Text,
    /// Little-endian i64s, 8 bytes each.
    I64le,
}

impl From<VocabularyFormat> for narsil_embedding::id_map::build::VocabularyFormat {
    fn from(format: VocabularyFormat) -> Self {
        match format {
            VocabularyFormat::Text => Self::Text,
            VocabularyFormat::I64le => Self::I64le,
        }
    }
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
    let vocabulary = Vocabulary { path: &args.vocabulary, format: args.vocabulary_format.into() };
    let mut stderr = Stderr::default();
    let entries = vocabulary.count(&mut stderr)?;
    anyhow::ensure!(entries > 0, "--vocabulary {} holds no ids", args.vocabulary.display());
    anyhow::ensure!(
        entries <= rows,
        "--vocabulary {} holds {entries} ids, more than table {:?}'s {rows} rows (one id a row, row 0 first)",
        args.vocabulary.display(),
        args.table
    );
    let home_slots = home_slots_for(entries);
    let partial = args.model.join("tables").join(format!("{}.idmap.tmp", args.table));
    let tmp_dir = args.tmp_dir.clone().unwrap_or_else(|| args.model.join("tables"));
    // Claims the map's temporary name before the long work: a second run
    // for the same table is refused here, not after its sort.
    let map_file = Claimed::file(&partial, &format!("`narsil tables map --table {}`", args.table))?;
    let mut runs_made = RunFiles { dir: tmp_dir, stem: format!("{}.idmap", args.table), paths: Vec::new() };

    let runs = sort_into_runs(&vocabulary, entries, home_slots, limits, &mut runs_made, &mut stderr)?;
    let spilled = runs.len();
    // The sort's memory back to the OS before the merge's buffers.
    narsil_engine::release_freed_memory();
    let runs = merge_rounds(runs, home_slots, limits, &vocabulary, &mut runs_made, &mut stderr)?;

    stderr.start(format!("{}: merge", args.table));
    let slots = write_merged(&runs, limits, &vocabulary, &partial, entries, rows, &mut stderr)?;
    runs_made.remove_all();

    let progress = Progress::new(format!("{}: sha256", args.table));
    let sha256 = narsil_embedding::sha256::sha256_of(ReadBehind::open(&partial)?)
        .with_context(|| format!("hashing {}", partial.display()))?;
    let bytes = std::fs::metadata(&partial)?.len();
    progress.done(sha256.clone());
    let file =
        publication::publish_map(&args.model, &args.table, map_file, &sha256, args.default_row, |_| Ok(()))?;
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

/// The process's peak resident set (`VmHWM`), MiB.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use narsil_embedding::id_map::{build, IdMap};
    use narsil_embedding::schema::TableIds;

    use super::*;

    /// A split model of two tables (`rows` and 50 rows) in `dir`: no table
    /// files (`tables map` never reads them).
    pub(super) fn model(dir: &Path, rows: u64) {
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

    pub(super) fn args(
        dir: &Path,
        vocabulary: PathBuf,
        format: VocabularyFormat,
        default_row: u64,
    ) -> MapTablesArgs {
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
    pub(super) const TINY: Limits = Limits { chunk_ids: 7, fan_in: 3, run_buffer: 64 };

    /// Raw ids as production sends them: large, negative, the extremes.
    pub(super) fn raw_ids(n: usize) -> Vec<i64> {
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

    pub(super) fn no_files_left_but(dir: &Path, kept: &[&str]) {
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
        let file = publication::map_file("items", &report.sha256);
        assert_eq!((&spec.file, &report.file, spec.default_row), (&file, &file, 110));
        assert!(file.to_str().unwrap().starts_with("tables/items."), "{}", file.display());
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
        no_files_left_but(dir.path(), &[file.file_name().unwrap().to_str().unwrap()]);
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
        let first = map_within(&args(dir.path(), text_file, VocabularyFormat::Text, 999), TINY).unwrap();
        let from_text = std::fs::read(dir.path().join(&first.file)).unwrap();
        let mut binary_args = args(dir.path(), binary, VocabularyFormat::I64le, 999);
        let runs = dir.path().join("runs");
        std::fs::create_dir(&runs).unwrap();
        binary_args.tmp_dir = Some(runs.clone());
        let report = map_within(&binary_args, Limits { chunk_ids: 64, fan_in: 2, run_buffer: 16 }).unwrap();
        assert_eq!((report.entries, report.runs, &report.file), (300, 5, &first.file));
        assert_eq!(std::fs::read(dir.path().join(&report.file)).unwrap(), from_text);
        assert_eq!(std::fs::read_dir(&runs).unwrap().count(), 0, "runs left in --tmp-dir");
        // The default limits: one run.
        let report = map_within(&binary_args, Limits::of(DEFAULT_MEMORY_BYTES)).unwrap();
        assert_eq!((report.runs, &report.file), (1, &first.file));
        assert_eq!(std::fs::read(dir.path().join(&report.file)).unwrap(), from_text);
        // The same map again: one file, named as before.
        no_files_left_but(dir.path(), &[first.file.file_name().unwrap().to_str().unwrap()]);
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
        let report = map_within(&args(dir.path(), path, VocabularyFormat::Text, 0), TINY).unwrap();
        no_files_left_but(dir.path(), &[report.file.file_name().unwrap().to_str().unwrap()]);
    }

    /// The map `dir`'s schema names for table `items`, once checked to be
    /// a file there whose SHA-256 is the one the schema names (what a load
    /// checks).
    pub(super) fn named_map(dir: &Path) -> (IdMap, narsil_embedding::schema::IdMapSpec) {
        let schema = SplitSchema::read(dir).unwrap();
        let TableIds::Map(spec) = schema.table("items").unwrap().ids.clone() else { panic!("no map named") };
        let (map, sha) = IdMap::open(&dir.join(&spec.file), 120)
            .unwrap_or_else(|e| panic!("the map schema.json names, {}: {e}", spec.file.display()));
        assert_eq!(sha, spec.sha256, "{}: its SHA-256 is not the one schema.json names", spec.file.display());
        (map, spec)
    }

    #[test]
    fn mapping_a_table_again_whose_schema_cannot_be_written_leaves_the_version_naming_its_old_map_whole() {
        let dir = tempfile::tempdir().unwrap();
        model(dir.path(), 120);
        let old = raw_ids(100);
        let new: Vec<i64> = old.iter().map(|id| id.wrapping_add(1)).collect();
        let (old_path, new_path) = (dir.path().join("old.txt"), dir.path().join("new.txt"));
        std::fs::write(&old_path, text(&old)).unwrap();
        std::fs::write(&new_path, text(&new)).unwrap();
        map_within(&args(dir.path(), old_path, VocabularyFormat::Text, 110), TINY).unwrap();
        assert_eq!(named_map(dir.path()).0.row(old[0]), Some(0));
        let schema = std::fs::read(dir.path().join("schema.json")).unwrap();
        // The schema's temporary name taken by a directory: its write fails
        // after the new map is written.
        std::fs::create_dir(dir.path().join("schema.json.tmp")).unwrap();
        map_within(&args(dir.path(), new_path.clone(), VocabularyFormat::Text, 110), TINY).unwrap_err();
        assert_eq!(std::fs::read(dir.path().join("schema.json")).unwrap(), schema);
        let (map, spec) = named_map(dir.path());
        assert_eq!((map.row(old[0]), map.row(new[0])), (Some(0), None), "the old map serves");
        no_files_left_but(dir.path(), &[spec.file.file_name().unwrap().to_str().unwrap()]);

        std::fs::remove_dir(dir.path().join("schema.json.tmp")).unwrap();
        map_within(&args(dir.path(), new_path, VocabularyFormat::Text, 110), TINY).unwrap();
        let (map, spec) = named_map(dir.path());
        assert_eq!((map.row(old[0]), map.row(new[0])), (None, Some(0)), "the new map serves");
        no_files_left_but(dir.path(), &[spec.file.file_name().unwrap().to_str().unwrap()]);
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
}
