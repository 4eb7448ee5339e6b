//! Publishing a new id map into a model that may be loaded at any moment:
//! the map under a file name of its own ([`map_file`]: the old map is never
//! overwritten), then `schema.json` naming it (written through a temporary
//! file and renamed), then the map the schema named before removed. After
//! every step, `schema.json` on disk names a map file that is there and
//! whose SHA-256 it names: a load, or a crash, between any two steps finds
//! a whole version, the old map's or the new one's. A crash leaves at most
//! a file no schema names (the new map before the schema's rename, the old
//! one after it).

use std::path::{Component, Path, PathBuf};

use narsil_embedding::publish::{sync_directory, Claimed};
use narsil_embedding::schema::edit::edit_tables;

/// The steps of [`publish_map`], in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// The new map is in place under its own name; the schema still names
    /// the old one, which is still there.
    MapInPlace,
    /// `schema.json` names the new map.
    SchemaNamesIt,
    /// The map the schema named before is removed (where it was another
    /// file, inside the model, that no other table names).
    OldMapRemoved,
}

/// The file a map of SHA-256 `sha256` of table `table` is published as,
/// relative to the model: `tables/TABLE.HASH16.idmap` (the hash's first 16
/// digits), a name no other map of the table takes.
pub(super) fn map_file(table: &str, sha256: &str) -> PathBuf {
    PathBuf::from("tables").join(format!("{table}.{}.idmap", &sha256[..16.min(sha256.len())]))
}

/// Publishes `partial`, table `table`'s new map (written and synced, of
/// SHA-256 `sha256`), into the model in `model`, ids it does not hold
/// served from `default_row`; returns its file, relative to the model.
/// `after(step)` is called after each step: an error from it stops the
/// publication there, as a crash would (the tests' window between the
/// steps), except that a new map the schema does not name is removed.
pub(super) fn publish_map(
    model: &Path,
    table: &str,
    partial: Claimed,
    sha256: &str,
    default_row: u64,
    mut after: impl FnMut(Step) -> anyhow::Result<()>,
) -> anyhow::Result<PathBuf> {
    let file = map_file(table, sha256);
    let path = model.join(&file);
    partial.publish(&path)?;
    let ids = serde_json::json!({"map": {"file": file, "sha256": sha256, "default_row": default_row}});
    // The map file the table named before, and those the other tables name.
    let (mut previous, mut others) = (None, Vec::new());
    let named = after(Step::MapInPlace).and_then(|()| {
        edit_tables(model, model, |name, spec| {
            let named = spec["ids"]["map"]["file"].as_str().map(PathBuf::from);
            if name == table {
                previous = named;
                spec["ids"] = ids.clone();
            } else {
                others.extend(named);
            }
            Ok(())
        })
    });
    if let Err(e) = named {
        if !names(model, table, &file) {
            let _ = std::fs::remove_file(&path);
        }
        return Err(e);
    }
    after(Step::SchemaNamesIt)?;
    if let Some(previous) = previous.filter(|p| *p != file && inside(p) && !others.contains(p)) {
        let old = model.join(&previous);
        match std::fs::remove_file(&old) {
            Ok(()) => sync_directory(old.parent().unwrap_or(model))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            // The version is whole: the old file is only left behind.
            Err(e) => eprintln!(
                "the previous map {} is no longer named; it could not be removed: {e}",
                old.display()
            ),
        }
    }
    after(Step::OldMapRemoved)?;
    Ok(file)
}

/// Whether `model`'s schema.json (as on disk) names `file` as table
/// `table`'s map.
fn names(model: &Path, table: &str, file: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(model.join("schema.json")) else { return false };
    let Ok(schema) = serde_json::from_str::<serde_json::Value>(&text) else { return false };
    let tables = schema["tables"].as_array().map(Vec::as_slice).unwrap_or_default();
    tables.iter().any(|t| t["name"] == table && t["ids"]["map"]["file"].as_str() == file.to_str())
}

/// Whether `file` (as a schema names it) is inside the model: relative,
/// down only. A map named elsewhere is never removed.
fn inside(file: &Path) -> bool {
    file.components().all(|c| matches!(c, Component::Normal(_)))
}

#[cfg(test)]
mod tests {
    use narsil_embedding::id_map::build;
    use narsil_embedding::sha256::sha256_of_bytes;

    use super::super::tests::{args, model, named_map, no_files_left_but, raw_ids, TINY};
    use super::super::VocabularyFormat;
    use super::*;

    fn file_name(file: &Path) -> String {
        file.file_name().unwrap().to_string_lossy().into_owned()
    }

    #[test]
    fn the_schema_names_a_whole_map_after_every_step_and_wherever_the_publication_stops() {
        let old = raw_ids(100);
        let new: Vec<i64> = old.iter().map(|id| id.wrapping_add(1)).collect();
        let pairs: Vec<(i64, u64)> = new.iter().enumerate().map(|(row, &raw)| (raw, row as u64)).collect();
        let bytes = build(&pairs, 120).unwrap();
        let sha256 = sha256_of_bytes(&bytes);
        let new_name = file_name(&map_file("items", &sha256));
        let steps = [Step::MapInPlace, Step::SchemaNamesIt, Step::OldMapRemoved];
        for stop in steps.iter().copied().map(Some).chain([None]) {
            let dir = tempfile::tempdir().unwrap();
            model(dir.path(), 120);
            let vocabulary = dir.path().join("old.txt");
            std::fs::write(&vocabulary, old.iter().map(|id| format!("{id}\n")).collect::<String>()).unwrap();
            super::super::map_within(&args(dir.path(), vocabulary, VocabularyFormat::Text, 110), TINY)
                .unwrap();
            let old_name = file_name(&named_map(dir.path()).1.file);
            let partial = Claimed::file(&dir.path().join("tables/items.idmap.tmp"), "`test`").unwrap();
            std::fs::write(partial.path(), &bytes).unwrap();
            let mut seen = Vec::new();
            let published = publish_map(dir.path(), "items", partial, &sha256, 110, |step| {
                // What a load would find now.
                let (map, spec) = named_map(dir.path());
                let serves_new = map.row(new[0]) == Some(0);
                assert_eq!(serves_new, step != Step::MapInPlace, "{step:?}: {}", spec.file.display());
                seen.push(step);
                match Some(step) == stop {
                    true => anyhow::bail!("stopped after {step:?}"),
                    false => Ok(()),
                }
            });
            assert_eq!(published.is_err(), stop.is_some(), "{stop:?}");
            assert_eq!(seen, steps[..=steps.iter().position(|&s| Some(s) == stop).unwrap_or(2)], "{stop:?}");
            // Where it stopped: a whole version, and only the files it names
            // or that a crash there would leave.
            let (map, spec) = named_map(dir.path());
            let (serves_old, left) = match stop {
                Some(Step::MapInPlace) => (true, vec![old_name.as_str()]),
                Some(Step::SchemaNamesIt) => (false, vec![new_name.as_str(), old_name.as_str()]),
                _ => (false, vec![new_name.as_str()]),
            };
            assert_eq!((map.row(old[0]) == Some(0), map.row(new[0]) == Some(0)), (serves_old, !serves_old));
            assert_eq!(&file_name(&spec.file), if serves_old { &old_name } else { &new_name }, "{stop:?}");
            let mut left = left;
            left.sort();
            no_files_left_but(dir.path(), &left);
        }
    }

    #[test]
    fn a_map_named_outside_the_model_or_by_another_table_is_never_removed() {
        assert!(inside(Path::new("tables/items.idmap")));
        for outside in
            ["/maps/items.idmap", "../shared/items.idmap", "tables/../../items.idmap", "./items.idmap"]
        {
            assert!(!inside(Path::new(outside)), "{outside}");
        }
        let dir = tempfile::tempdir().unwrap();
        model(dir.path(), 120);
        let ids: Vec<i64> = (1..=10).collect();
        let pairs: Vec<(i64, u64)> = ids.iter().map(|&raw| (raw, raw as u64)).collect();
        let bytes = build(&pairs, 120).unwrap();
        let shared = dir.path().join("tables/shared.idmap");
        std::fs::write(&shared, &bytes).unwrap();
        // Both tables name the same map file.
        let sha256 = sha256_of_bytes(&bytes);
        edit_tables(dir.path(), dir.path(), |_, spec| {
            spec["ids"] = serde_json::json!({"map": {"file": "tables/shared.idmap", "sha256": sha256, "default_row": 0}});
            Ok(())
        })
        .unwrap();
        let partial = Claimed::file(&dir.path().join("tables/items.idmap.tmp"), "`test`").unwrap();
        let rebuilt = build(&pairs[1..], 120).unwrap();
        std::fs::write(partial.path(), &rebuilt).unwrap();
        publish_map(dir.path(), "items", partial, &sha256_of_bytes(&rebuilt), 0, |_| Ok(())).unwrap();
        assert_eq!(std::fs::read(&shared).unwrap(), bytes, "still named by table other");
    }
}
