//! Editing a model's `schema.json` in place for the commands that add to
//! it (`narsil tables load` names each table's keys, `order` its layout,
//! `map` its id map): each table's JSON object edited, every other field
//! kept as it is, the file published by rename.

use std::io::Write;
use std::path::Path;

use anyhow::Context;

/// Writes `from/schema.json` to `to/schema.json` (through a temporary file,
/// synced, renamed into place, and `to` synced: a power cut leaves the old
/// schema or the new one, never an empty one) with `edit(name, table)`
/// applied to each table's JSON object, every other field as it is.
pub fn edit_tables(
    from: &Path,
    to: &Path,
    mut edit: impl FnMut(&str, &mut serde_json::Value) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let path = from.join("schema.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut schema: serde_json::Value = serde_json::from_str(&text)?;
    let tables = schema["tables"].as_array_mut().context("schema.json has no tables")?;
    for table in tables {
        let name = table["name"].as_str().unwrap_or_default().to_owned();
        edit(&name, table)?;
    }
    let (temporary, out) = (to.join("schema.json.tmp"), to.join("schema.json"));
    let text = serde_json::to_string_pretty(&schema)? + "\n";
    std::fs::File::create(&temporary)
        .and_then(|mut file| {
            file.write_all(text.as_bytes())?;
            file.sync_all()
        })
        .with_context(|| format!("writing {}", temporary.display()))?;
    crate::publish::rename_into_place(&temporary, &out)
}
