//! The crate's rooms import one way (the table in `src/lib.rs`): each
//! top-level module of `src/` may name only the rooms listed for it, so no
//! import circle can come back unnoticed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Each room and the rooms it may use (`cli` may use all of them).
const ALLOWED: &[(&str, &[&str])] = &[
    ("wire", &[]),
    ("lifecycle", &[]),
    ("flags", &["lifecycle"]),
    ("protocols", &["wire", "lifecycle", "flags"]),
    ("server", &["protocols", "lifecycle", "wire"]),
    ("load", &["wire"]),
    ("forward_bench", &["flags", "lifecycle", "protocols", "load", "wire"]),
    ("cli", &["wire", "lifecycle", "flags", "protocols", "server", "load", "forward_bench"]),
];

/// The room a `crate::NAME` path lands in (the root re-exports `wire`'s
/// generated code).
fn room_of(name: &str) -> &str {
    match name {
        "proto" | "torchrec_proto" | "kserve_proto" => "wire",
        other => other,
    }
}

fn rust_files(dir: &Path, found: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, found);
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
}

/// Every room a file names through `crate::`.
fn named_rooms(text: &str) -> BTreeSet<String> {
    let mut rooms = BTreeSet::new();
    for (at, _) in text.match_indices("crate::") {
        let preceded = text[..at].chars().next_back();
        if preceded.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `narsil_crate::`, not ours
        }
        let rest = &text[at + "crate::".len()..];
        let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        if rest.starts_with('{') {
            // `crate::{a, b::c}`: each first segment.
            let group = &rest[1..rest.find('}').unwrap_or(rest.len())];
            for part in group.split(',') {
                let first = part.trim().split("::").next().unwrap_or("").trim();
                if !first.is_empty() {
                    rooms.insert(room_of(first).to_string());
                }
            }
        } else if !name.is_empty() {
            rooms.insert(room_of(&name).to_string());
        }
    }
    rooms
}

#[test]
fn every_room_imports_only_the_rooms_below_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let allowed: BTreeMap<&str, &[&str]> = ALLOWED.iter().copied().collect();
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut wrong = Vec::new();
    let mut seen = BTreeSet::new();
    for file in files {
        let relative = file.strip_prefix(&src).unwrap();
        let first = relative.components().next().unwrap().as_os_str().to_str().unwrap();
        let room = first.trim_end_matches(".rs");
        if room == "lib" || room == "main" {
            continue;
        }
        seen.insert(room.to_string());
        let Some(may_use) = allowed.get(room) else {
            wrong.push(format!("{}: room `{room}` is not in the layout table", relative.display()));
            continue;
        };
        let text = std::fs::read_to_string(&file).unwrap();
        for named in named_rooms(&text) {
            if named != room && !may_use.contains(&named.as_str()) {
                wrong.push(format!("{}: `{room}` uses `{named}`", relative.display()));
            }
        }
    }
    assert!(wrong.is_empty(), "imports against the layout:\n{}", wrong.join("\n"));
    let missing: Vec<_> = allowed.keys().filter(|room| !seen.contains(**room)).collect();
    assert!(missing.is_empty(), "rooms in the table but not in src/: {missing:?}");
}

#[test]
fn the_check_sees_every_way_of_naming_a_room() {
    let named = named_rooms("use crate::{flags::x, server};\nlet a = crate::proto::A; narsil_crate::no");
    assert_eq!(named, BTreeSet::from(["flags".into(), "server".into(), "wire".into()]));
}
