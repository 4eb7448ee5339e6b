//! `narsil tables order`: writes a copy of a split model whose tables are
//! laid out in popularity order ([`narsil_embedding::popularity_order`]) from an id
//! log, each with the slot index that finds an id's row. The copy serves
//! the same scores from every store; on `mmap` and `disk` its hot rows
//! share pages and blocks. How the order is computed and written is
//! [`narsil_embedding::popularity_order::writer`].
//!
//! The copy never shares a written file with its source: files it does not
//! write are hard-linked (model versions are immutable), and every file it
//! writes (the reordered tables, their slot indexes, schema.json) is
//! created new beside its place and renamed into it, so ordering an
//! ordered model leaves that model as it was. The source's tables and
//! slot indexes are checked against their SHA-256 as the stores check them
//! (a source table that is not the one its schema names is not copied).
//!
//! Publishing, safe with runs beside it and against a power cut: the copy
//! is written into `OUT.partial` (the whole `--out` name plus `.partial`,
//! so `--out m/v.a` and `--out m/v.b` never share it), created exclusively:
//! if it exists (a run writing it, or one a crash left behind) the command
//! refuses, names it, and leaves it as it is. Every file written is synced,
//! then every directory of the copy, then the copy is renamed to `--out`
//! and `--out`'s parent directory is synced: once the command has said so,
//! the model is on disk whole, and before, `--out` does not exist (a
//! `.partial` directory is not a version a repository serves). A run that
//! fails removes its own `OUT.partial` (the way every `narsil tables`
//! command publishes: [`narsil_embedding::publish`]).
//!
//! The copy carries a stamp ([`STAMP_FILE`]): each table file's SHA-256
//! (those it wrote, as it wrote them; the others checked in the source)
//! with the file's size, modification time, inode and device, which the
//! stores trust at load instead of hashing the file again while the file
//! is as it was (`narsil_embedding::stores::local::table` says why: a
//! table larger than RAM would be read end to end at every load).
//!
//! Memory: the command streams, so its peak does not grow with the tables
//! (but for a bit per row of the table being written): while the log is
//! read, ~25 bytes per distinct id it names (a hash map per table); then 4
//! bytes per logged id of every table, and for the table being written a
//! bit per row, 8 bytes per logged id while its index is written, the
//! source's slot index if the source is itself ordered (~0.14 bytes per
//! row + 4 per hot id), and a buffer of [`BUFFER_BYTES`] of rows with 8
//! bytes per row it holds. Measured: 26 tables of 4M rows of 80 bytes (7.9
//! GiB, 305 MiB a table) by a log of 4.6M lines (56k distinct ids a table),
//! 58 MiB peak RSS in 34 s under a 256 MiB memory cgroup, 63 MiB in 41 s
//! under 96 MiB (2-vCPU AMD EPYC); the page cache keeps what the limit
//! allows of the files.

use std::io::BufRead;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use narsil_embedding::popularity_order::{
    slots_file, write_rows_in_order, write_slot_index, Popularity, SlotOrder,
};
use narsil_embedding::sha256::is_sha256;
use narsil_embedding::stores::table_file::{checked_file, slot_index, Stamp, StampedFile, STAMP_FILE};
use narsil_embedding::{Layout, SplitSchema, TableSpec};

use narsil_embedding::publish::{rename_into_place, Claimed};
use narsil_embedding::schema::edit::edit_tables;

/// Rows a reordered table is written through: at most this many bytes of
/// them are held at once.
pub const BUFFER_BYTES: usize = 32 << 20;

/// `narsil tables order`.
#[derive(Debug, Args)]
pub struct OrderTablesArgs {
    /// The split model directory (its schema.json and tables/).
    model: PathBuf,
    /// Ids looked up, one per line: `NAME ID`, NAME a feature or a table
    /// (lines starting with `#` and blank lines are skipped). Each table
    /// is laid out with the ids it names most first (ties in the order
    /// first named, so a list naming each id once is taken as given), then
    /// the ids it never names in id order. Tables the log never names are
    /// left as they are.
    #[arg(long)]
    id_log: PathBuf,
    /// Where the copy goes: a directory that does not exist yet (written
    /// beside it into OUT.partial, which must not exist either, synced,
    /// then renamed into place). Files other than the tables and
    /// schema.json are hard-linked (copied across file systems).
    #[arg(long)]
    out: PathBuf,
}

/// Runs `narsil tables order`.
pub fn order(args: &OrderTablesArgs) -> anyhow::Result<()> {
    order_through(args, BUFFER_BYTES)
}

/// [`order`], with a buffer of `buffer_bytes` of rows per table.
fn order_through(args: &OrderTablesArgs, buffer_bytes: usize) -> anyhow::Result<()> {
    let schema = SplitSchema::read(&args.model).with_context(|| format!("{}", args.model.display()))?;
    anyhow::ensure!(!args.out.exists(), "--out {} exists: name a new directory", args.out.display());
    let logs = read_id_log(&args.id_log, &schema)?;
    let started = Instant::now();
    // Each logged table's ids, slot by slot (4 bytes an id; the counts go
    // as each is ranked); the order's bit per row is made at its turn.
    let mut ranked = Vec::with_capacity(logs.len());
    for (spec, log) in schema.tables.iter().zip(logs) {
        ranked.push((log.distinct() > 0).then(|| log.ranked(spec.rows)));
    }
    // The counts' memory back to the OS before the rows' buffer is taken.
    narsil_engine::release_freed_memory();
    let partial = Claimed::directory(
        &partial_path(&args.out),
        &format!("`narsil tables order --out {}`", args.out.display()),
    )?;
    // What this command writes, and the temporary names it writes them
    // under: never linked from the source.
    let mut written: Vec<PathBuf> = vec!["schema.json".into(), "schema.json.tmp".into()];
    written.extend([PathBuf::from(STAMP_FILE), temporary(Path::new(STAMP_FILE))]);
    for (spec, _) in schema.tables.iter().zip(&ranked).filter(|(_, hot)| hot.is_some()) {
        for path in [spec.file.clone(), slots_file(&spec.file)] {
            written.push(temporary(&path));
            written.push(path);
        }
    }
    link_tree(&args.model, partial.path(), Path::new(""), &written)?;
    let mut layouts = Vec::new();
    for (i, (spec, hot)) in schema.tables.iter().zip(ranked).enumerate() {
        let label = format!("[{}/{}] {}", i + 1, schema.tables.len(), spec.name);
        let Some(hot) = hot else {
            eprintln!("{label}: not in the id log, left as it is");
            continue;
        };
        let table_started = Instant::now();
        let order = SlotOrder::new(spec.rows, hot);
        let (table_sha, layout) = write_table(&args.model, partial.path(), spec, &order, buffer_bytes)?;
        eprintln!(
            "{label}: {} of {} ids named, hottest first; {:.1} MiB in {:.1} s",
            order.logged(),
            spec.rows,
            (spec.rows * spec.row_bytes as u64) as f64 / (1 << 20) as f64,
            table_started.elapsed().as_secs_f64()
        );
        layouts.push((spec.name.clone(), table_sha, layout));
    }
    write_schema(&args.model, partial.path(), &layouts)?;
    write_stamp(&args.model, partial.path(), &schema, &layouts)?;
    partial.publish(&args.out)?;
    println!(
        "{} of {} tables laid out in popularity order in {} ({:.1} s)",
        layouts.len(),
        schema.tables.len(),
        args.out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The directory a copy is written into before it is renamed to `out`:
/// `out`'s whole name plus `.partial` (never `with_extension`, which gives
/// `m/v.a` and `m/v.b` the same one).
fn partial_path(out: &Path) -> PathBuf {
    let mut name = out.as_os_str().to_owned();
    name.push(".partial");
    name.into()
}

/// Writes the copy `to`'s [`STAMP_FILE`]: each table file with a SHA-256 as
/// it is now, the ones written (`layouts`) with the hash of what was
/// written, the others once checked in the source `from` (as the stores
/// check them: its stamp, else hashed) and, where a link could not be made
/// and the file was copied, in the copy too.
fn write_stamp(
    from: &Path,
    to: &Path,
    schema: &SplitSchema,
    layouts: &[(String, String, Layout)],
) -> anyhow::Result<()> {
    let mut stamped = Vec::new();
    for spec in &schema.tables {
        let sha = match layouts.iter().find(|(name, _, _)| *name == spec.name) {
            Some((_, sha, _)) => sha.clone(),
            None if is_sha256(&spec.sha256) => {
                let source = checked_file(from, spec)?;
                let linked = |path: &Path| std::fs::metadata(path).map(|m| (m.dev(), m.ino()));
                if linked(&source)? != linked(&to.join(&spec.file))? {
                    checked_file(to, spec)?;
                }
                spec.sha256.clone()
            }
            None => continue,
        };
        stamped.push(
            StampedFile::of(to, &spec.file, &sha)
                .with_context(|| format!("{}", to.join(&spec.file).display()))?,
        );
    }
    let json = serde_json::to_string_pretty(&Stamp::new(stamped))? + "\n";
    write_new(&to.join(STAMP_FILE), |out| {
        use std::io::Write;
        out.write_all(json.as_bytes()).map(|()| String::new())
    })?;
    Ok(())
}

/// Writes `spec`'s table of model `from` into the copy `to` in `order`, and
/// its slot index; returns the table's new SHA-256 and its layout.
fn write_table(
    from: &Path,
    to: &Path,
    spec: &TableSpec,
    order: &SlotOrder,
    buffer_bytes: usize,
) -> anyhow::Result<(String, Layout)> {
    let source_path = checked_file(from, spec)?;
    let source = std::fs::File::open(&source_path).with_context(|| format!("{}", source_path.display()))?;
    // A source in popularity order is read through its index (checked
    // against its hash, as at load).
    let source_slots = slot_index(from, spec)?;
    let table_sha = write_new(&to.join(&spec.file), |out| {
        write_rows_in_order(&source, source_slots.as_ref(), spec.row_bytes, order, buffer_bytes, out)
    })
    .with_context(|| format!("table {:?} from {}", spec.name, source_path.display()))?;
    let slots = slots_file(&spec.file);
    let slots_sha = write_new(&to.join(&slots), |out| write_slot_index(order, out))?;
    Ok((table_sha, Layout { slots, sha256: slots_sha }))
}

/// The name a file is written under before it is renamed into place.
fn temporary(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".partial");
    name.into()
}

/// Writes a new file at `path` with `write` (which returns its hash): into
/// a file created new beside it (never through an existing or linked
/// file), synced, then renamed over `path`.
fn write_new(
    path: &Path,
    write: impl FnOnce(&mut std::fs::File) -> std::io::Result<String>,
) -> anyhow::Result<String> {
    let partial = temporary(path);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&partial)
        .with_context(|| format!("creating {}", partial.display()))?;
    let sha = write(&mut file).with_context(|| format!("writing {}", partial.display()))?;
    file.sync_all().with_context(|| format!("writing {}", partial.display()))?;
    rename_into_place(&partial, path)?;
    Ok(sha)
}

/// Per table of `schema`: how often the log names each of its ids.
fn read_id_log(path: &Path, schema: &SplitSchema) -> anyhow::Result<Vec<Popularity>> {
    let file = std::fs::File::open(path).with_context(|| format!("--id-log {}", path.display()))?;
    let mut logs: Vec<Popularity> = schema.tables.iter().map(|_| Popularity::default()).collect();
    let table_of = |name: &str| {
        let table = schema.features.iter().find(|f| f.name == name).map_or(name, |f| f.table.as_str());
        schema.tables.iter().position(|t| t.name == table)
    };
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("--id-log {}: line {}", path.display(), n + 1))?;
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = || format!("--id-log {}: line {} ({line:?})", path.display(), n + 1);
        let (name, id) =
            line.split_once(char::is_whitespace).with_context(|| format!("{}: not `NAME ID`", at()))?;
        let t = table_of(name)
            .with_context(|| format!("{}: {name:?} is no feature or table of the model", at()))?;
        let id: u64 = id.trim().parse().with_context(|| format!("{}: the id is not a number", at()))?;
        let rows = schema.tables[t].rows;
        anyhow::ensure!(
            id < rows,
            "{}: id {id} is past table {:?}'s {rows} rows",
            at(),
            schema.tables[t].name
        );
        anyhow::ensure!(
            rows <= u64::from(u32::MAX),
            "{}: table {:?} has over 2^32 rows, more than a slot index holds",
            at(),
            schema.tables[t].name
        );
        logs[t].add(id as u32);
    }
    Ok(logs)
}

/// Hard-links (or copies) every file under `from/relative` into
/// `to/relative`, but the files in `skip` (paths relative to `from`).
fn link_tree(from: &Path, to: &Path, relative: &Path, skip: &[PathBuf]) -> anyhow::Result<()> {
    let dir = to.join(relative);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for entry in std::fs::read_dir(from.join(relative))? {
        let entry = entry?;
        let path = relative.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            link_tree(from, to, &path, skip)?;
        } else if !skip.contains(&path) {
            let (source, target) = (from.join(&path), to.join(&path));
            if std::fs::hard_link(&source, &target).is_err() {
                // A copy is new data: synced, as a written file is.
                std::fs::copy(&source, &target)
                    .and_then(|_| std::fs::File::open(&target)?.sync_all())
                    .with_context(|| format!("copying {} to {}", source.display(), target.display()))?;
            }
        }
    }
    Ok(())
}

/// `from`'s schema.json into `to`, each table of `layouts` with its new
/// file hash and its layout.
fn write_schema(from: &Path, to: &Path, layouts: &[(String, String, Layout)]) -> anyhow::Result<()> {
    edit_tables(from, to, |name, table| {
        if let Some((_, sha256, layout)) = layouts.iter().find(|(n, _, _)| n == name) {
            table["sha256"] = serde_json::Value::String(sha256.clone());
            table["layout"] = serde_json::to_value(layout)?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::os::unix::fs::MetadataExt;

    use narsil_embedding::{LocalRows, Table};

    use super::*;

    /// A split model of two tables (300 and 50 rows of 16 bytes) in `dir`.
    fn model(dir: &Path) -> Vec<Vec<u8>> {
        std::fs::create_dir_all(dir.join("tables")).unwrap();
        let tables: Vec<Vec<u8>> = [300usize, 50]
            .iter()
            .map(|&rows| (0..rows * 16).map(|i| (i * 7 % 253) as u8).collect())
            .collect();
        for (t, rows) in tables.iter().enumerate() {
            std::fs::write(dir.join(format!("tables/t{t}.bin")), rows).unwrap();
        }
        std::fs::write(dir.join("dense.pt"), b"dense").unwrap();
        let table = |t: usize, rows: usize| {
            format!(
                r#"{{"name": "t{t}", "rows": {rows}, "dim": 8, "storage": "int8_rowwise", "row_bytes": 16,
                    "file": "tables/t{t}.bin", "sha256": ""}}"#
            )
        };
        let schema = format!(
            r#"{{"format": "narsil-split-1", "name": "m", "version": "1", "num_dense": 1,
                "tables": [{}, {}],
                "features": [{{"name": "a", "table": "t0", "pooling": "sum", "weighted": false}},
                             {{"name": "b", "table": "t1", "pooling": "sum", "weighted": false}}],
                "outputs": ["default"], "dense_network": "dense.pt"}}"#,
            table(0, 300),
            table(1, 50)
        );
        std::fs::write(dir.join("schema.json"), schema).unwrap();
        tables
    }

    /// Every file under `dir`, by path, with its bytes.
    fn files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
        let mut found = BTreeMap::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                found.extend(files(&path));
            } else {
                found.insert(path.clone(), std::fs::read(&path).unwrap());
            }
        }
        found
    }

    #[test]
    fn ordering_an_ordered_model_leaves_it_as_it_was_and_both_copies_serve_every_row_by_id() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b, c) = (dir.path().join("a"), dir.path().join("b"), dir.path().join("c"));
        let tables = model(&a);
        let log = |name: &str, lines: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, lines).unwrap();
            path
        };
        let first = log("first.log", "a 7\na 299\nt0 7\na 12\n");
        let second = log("second.log", "a 299\na 3\na 3\nb 49\nb 0\nb 49\n");
        let args = |model: &Path, id_log: PathBuf, out: &Path| OrderTablesArgs {
            model: model.to_owned(),
            id_log,
            out: out.to_owned(),
        };
        // Three rows of 16 bytes a buffer: many chunks per table.
        order_through(&args(&a, first, &b), 3 * 16).unwrap();
        let before = files(&b);
        assert!(
            before.contains_key(&b.join("tables/t0.slots"))
                && !before.contains_key(&b.join("tables/t1.slots"))
        );
        order_through(&args(&b, second, &c), 3 * 16).unwrap();
        assert!(files(&b) == before, "ordering B changed B's files");
        for written in ["tables/t0.bin", "tables/t0.slots", "tables/t1.bin", "tables/t1.slots", "schema.json"]
        {
            let inode = std::fs::metadata(c.join(written)).unwrap().ino();
            for source in [&a, &b] {
                if let Ok(meta) = std::fs::metadata(source.join(written)) {
                    assert_ne!(
                        meta.ino(),
                        inode,
                        "{written} of {} is linked into the copy",
                        source.display()
                    );
                }
            }
        }
        assert_eq!(
            std::fs::metadata(c.join("dense.pt")).unwrap().ino(),
            std::fs::metadata(a.join("dense.pt")).unwrap().ino(),
            "files it does not write are linked"
        );
        for model in [&b, &c] {
            let schema = SplitSchema::read(model).unwrap();
            for (spec, rows) in schema.tables.iter().zip(&tables) {
                for store in [LocalRows::Memory, LocalRows::Mmap] {
                    let table = Table::load(model, spec, store).unwrap();
                    for id in 0..spec.rows {
                        let want = &rows[id as usize * 16..][..16];
                        assert_eq!(table.row(id), want, "{}: {} id {id}", model.display(), spec.name);
                    }
                }
            }
        }
        let schema = SplitSchema::read(&c).unwrap();
        assert!(schema.tables.iter().all(|t| t.layout.is_some()));
        assert_ne!(std::fs::read(c.join("tables/t1.bin")).unwrap(), tables[1], "t1's rows moved");
    }

    /// A log naming ids of both tables of [`model`], most often `hot`.
    fn log(dir: &Path, name: &str, hot: u64) -> PathBuf {
        let path = dir.join(name);
        let lines: String =
            (0..40).map(|i| format!("a {}\nb {}\na {hot}\n", (i * 7 + hot) % 300, i % 50)).collect();
        std::fs::write(&path, lines).unwrap();
        path
    }

    fn args(model: &Path, id_log: PathBuf, out: &Path) -> OrderTablesArgs {
        OrderTablesArgs { model: model.to_owned(), id_log, out: out.to_owned() }
    }

    /// Every table of the split model in `dir` serves `tables`' rows by id,
    /// from each local store (each checked against its hash).
    fn serves(dir: &Path, tables: &[Vec<u8>]) {
        let schema = SplitSchema::read(dir).unwrap();
        for (spec, rows) in schema.tables.iter().zip(tables) {
            for store in [LocalRows::Memory, LocalRows::Mmap] {
                let table = Table::load(dir, spec, store).unwrap();
                for id in 0..spec.rows {
                    assert_eq!(table.row(id), &rows[id as usize * 16..][..16], "{}: id {id}", dir.display());
                }
            }
        }
    }

    #[test]
    fn two_runs_to_different_outputs_write_through_different_temporary_directories() {
        let dir = tempfile::tempdir().unwrap();
        let (a, versions) = (dir.path().join("a"), dir.path().join("m"));
        let (first, second) = (versions.join("v.a"), versions.join("v.b"));
        assert_eq!(partial_path(&first), versions.join("v.a.partial"));
        assert_ne!(partial_path(&first), partial_path(&second));
        let tables = model(&a);
        std::fs::create_dir(&versions).unwrap();
        let logs = [log(dir.path(), "one.log", 3), log(dir.path(), "two.log", 250)];
        // At once, each with a buffer of three rows (many writes each).
        std::thread::scope(|scope| {
            let runs: Vec<_> = [(&first, &logs[0]), (&second, &logs[1])]
                .into_iter()
                .map(|(out, log)| scope.spawn(|| order_through(&args(&a, log.clone(), out), 3 * 16)))
                .collect();
            for run in runs {
                run.join().unwrap().unwrap();
            }
        });
        for out in [&first, &second] {
            serves(out, &tables);
            assert!(!partial_path(out).exists());
        }
        assert_ne!(
            std::fs::read(first.join("tables/t0.bin")).unwrap(),
            std::fs::read(second.join("tables/t0.bin")).unwrap()
        );
    }

    #[test]
    fn an_existing_partial_directory_is_refused_named_and_left_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let (a, out) = (dir.path().join("a"), dir.path().join("3"));
        model(&a);
        // What a crash left: a copy half written.
        let partial = dir.path().join("3.partial");
        std::fs::create_dir_all(partial.join("tables")).unwrap();
        std::fs::write(partial.join("tables/t0.bin"), b"half").unwrap();
        let error = order_through(&args(&a, log(dir.path(), "ids.log", 3), &out), 3 * 16).unwrap_err();
        let error = format!("{error:#}");
        assert!(error.contains(&partial.display().to_string()) && error.contains("remove it"), "{error}");
        assert_eq!(std::fs::read(partial.join("tables/t0.bin")).unwrap(), b"half", "left as it was");
        assert!(!out.exists());
        // Not a version a repository serves.
        assert_eq!(crate::lifecycle::repository::version_number("3.partial"), None);
        // Once removed, the run goes through.
        std::fs::remove_dir_all(&partial).unwrap();
        order_through(&args(&a, log(dir.path(), "ids.log", 3), &out), 3 * 16).unwrap();
        assert!(out.join("schema.json").exists() && !partial.exists());
    }

    /// `dir`'s schema.json with table `t`'s `sha256` set to `sha256`.
    fn name_hash(dir: &Path, t: usize, sha256: &str) {
        let path = dir.join("schema.json");
        let mut schema: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        schema["tables"][t]["sha256"] = sha256.into();
        std::fs::write(path, schema.to_string()).unwrap();
    }

    #[test]
    fn a_source_table_that_is_not_its_sha256_is_not_copied_and_the_run_removes_its_own_partial() {
        let dir = tempfile::tempdir().unwrap();
        let (a, out) = (dir.path().join("a"), dir.path().join("4"));
        let tables = model(&a);
        // t1 is not in the log: linked, so checked in the source.
        for (t, file) in [(0, "tables/t0.bin"), (1, "tables/t1.bin")] {
            let wrong = narsil_embedding::sha256::sha256_of(&b"other rows"[..]).unwrap();
            name_hash(&a, t, &wrong);
            let log = dir.path().join("t0.log");
            std::fs::write(&log, "a 3\na 9\n").unwrap();
            let error = format!("{:#}", order_through(&args(&a, log, &out), 3 * 16).unwrap_err());
            assert!(error.contains(file) && error.contains(&wrong), "{error}");
            assert!(!out.exists() && !partial_path(&out).exists());
            let right = narsil_embedding::sha256::sha256_of(&tables[t][..]).unwrap();
            name_hash(&a, t, &right);
        }
    }

    #[test]
    fn a_published_copy_is_stamped_and_a_table_replaced_after_is_refused_at_load() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        let tables = model(&a);
        // t1's hash is named: it is linked into the copy, checked, stamped.
        name_hash(&a, 1, &narsil_embedding::sha256::sha256_of(&tables[1][..]).unwrap());
        let log = dir.path().join("t0.log");
        std::fs::write(&log, "a 3\na 9\n").unwrap();
        order_through(&args(&a, log, &b), 3 * 16).unwrap();
        let stamp = Stamp::read(&b).unwrap();
        let stamped: Vec<_> = stamp.tables.iter().map(|f| f.file.clone()).collect();
        assert_eq!(stamped, [PathBuf::from("tables/t0.bin"), PathBuf::from("tables/t1.bin")]);
        let schema = SplitSchema::read(&b).unwrap();
        for (spec, file) in schema.tables.iter().zip(&stamp.tables) {
            assert_eq!(spec.sha256, file.sha256);
            // Still as stamped once renamed into place: trusted at load.
            assert_eq!(&StampedFile::of(&b, &file.file, &file.sha256).unwrap(), file);
        }
        serves(&b, &tables);
        // What a power cut could leave of a file not synced: its blocks
        // zeroed. Written as a new file renamed over the old (a new inode).
        let (path, spare) = (b.join("tables/t0.bin"), b.join("tables/t0.bin.new"));
        std::fs::write(&spare, vec![0u8; tables[0].len()]).unwrap();
        std::fs::rename(&spare, &path).unwrap();
        for store in [LocalRows::Memory, LocalRows::Mmap] {
            let error = Table::load(&b, &schema.tables[0], store).unwrap_err().to_string();
            assert!(
                error.contains(&path.display().to_string()) && error.contains(&schema.tables[0].sha256),
                "{error}"
            );
        }
    }
}
