//! `narsil tables order`: writes a copy of a split model whose tables are
//! laid out in popularity order ([`narsil_embedding::layout`]) from an id
//! log, each with the slot index that finds an id's row. The copy serves
//! the same scores from every store; on `mmap` and `disk` its hot rows
//! share pages and blocks.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use narsil_embedding::layout::{in_slot_order, slots_file, Popularity};
use narsil_embedding::{Layout, LocalRows, SplitSchema, Table};
use sha2::{Digest, Sha256};

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
    /// beside it, then renamed into place). Files other than the tables
    /// and schema.json are hard-linked (copied across file systems).
    #[arg(long)]
    out: PathBuf,
}

/// Runs `narsil tables order`.
pub fn order(args: &OrderTablesArgs) -> anyhow::Result<()> {
    let schema = SplitSchema::read(&args.model).with_context(|| format!("{}", args.model.display()))?;
    anyhow::ensure!(!args.out.exists(), "--out {} exists: name a new directory", args.out.display());
    let logs = read_id_log(&args.id_log, &schema)?;
    let started = Instant::now();
    let partial = args.out.with_extension("partial");
    if partial.exists() {
        std::fs::remove_dir_all(&partial).with_context(|| format!("removing {}", partial.display()))?;
    }
    let reordered: Vec<&Path> = schema
        .tables
        .iter()
        .zip(&logs)
        .filter(|(_, log)| log.distinct() > 0)
        .map(|(spec, _)| spec.file.as_path())
        .collect();
    link_tree(&args.model, &partial, Path::new(""), &reordered)?;
    let mut layouts = Vec::new();
    for (i, (spec, log)) in schema.tables.iter().zip(&logs).enumerate() {
        let label = format!("[{}/{}] {}", i + 1, schema.tables.len(), spec.name);
        if log.distinct() == 0 {
            eprintln!("{label}: not in the id log, left in id order");
            continue;
        }
        anyhow::ensure!(spec.rows <= u64::from(u32::MAX), "table {:?}: over 2^32 rows", spec.name);
        let table_started = Instant::now();
        let table = Table::load(&args.model, spec, LocalRows::Memory)?;
        let slots = log.slots(spec.rows);
        let ordered = in_slot_order(table.bytes(), spec.row_bytes, &slots);
        drop(table);
        let index: Vec<u8> = slots.iter().flat_map(|slot| slot.to_le_bytes()).collect();
        let slots_path = slots_file(&spec.file);
        let table_sha = write_hashed(&partial.join(&spec.file), &ordered)?;
        let slots_sha = write_hashed(&partial.join(&slots_path), &index)?;
        eprintln!(
            "{label}: {} of {} ids named, hottest first; {:.1} MiB in {:.1} s",
            log.distinct(),
            spec.rows,
            ordered.len() as f64 / (1 << 20) as f64,
            table_started.elapsed().as_secs_f64()
        );
        layouts.push((spec.name.clone(), table_sha, Layout { slots: slots_path, sha256: slots_sha }));
    }
    write_schema(&args.model, &partial, &layouts)?;
    std::fs::rename(&partial, &args.out)
        .with_context(|| format!("renaming {} to {}", partial.display(), args.out.display()))?;
    println!(
        "{} of {} tables laid out in popularity order in {} ({:.1} s)",
        layouts.len(),
        schema.tables.len(),
        args.out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
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
        logs[t].add(id);
    }
    Ok(logs)
}

/// Hard-links (or copies) every file under `from/relative` into
/// `to/relative`, but `schema.json` and the files in `skip`.
fn link_tree(from: &Path, to: &Path, relative: &Path, skip: &[&Path]) -> anyhow::Result<()> {
    let dir = to.join(relative);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for entry in std::fs::read_dir(from.join(relative))? {
        let entry = entry?;
        let path = relative.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            link_tree(from, to, &path, skip)?;
        } else if path != Path::new("schema.json") && !skip.contains(&path.as_path()) {
            let (source, target) = (from.join(&path), to.join(&path));
            if std::fs::hard_link(&source, &target).is_err() {
                std::fs::copy(&source, &target)
                    .with_context(|| format!("copying {} to {}", source.display(), target.display()))?;
            }
        }
    }
    Ok(())
}

/// Writes `bytes` to `path`; returns their SHA-256, hex.
fn write_hashed(path: &Path, bytes: &[u8]) -> anyhow::Result<String> {
    let mut file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    file.write_all(bytes).with_context(|| format!("writing {}", path.display()))?;
    file.sync_all().with_context(|| format!("writing {}", path.display()))?;
    Ok(Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect())
}

/// `from`'s schema.json into `to`, each table of `layouts` with its new
/// file hash and its layout.
fn write_schema(from: &Path, to: &Path, layouts: &[(String, String, Layout)]) -> anyhow::Result<()> {
    super::edit_tables(from, to, |name, table| {
        if let Some((_, sha256, layout)) = layouts.iter().find(|(n, _, _)| n == name) {
            table["sha256"] = serde_json::Value::String(sha256.clone());
            table["layout"] = serde_json::to_value(layout)?;
        }
        Ok(())
    })
}
