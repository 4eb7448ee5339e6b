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
    files_ending(dir, "rs", found)
}

/// Every file below `dir` whose extension is `extension`.
fn files_ending(dir: &Path, extension: &str, found: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files_ending(&path, extension, found);
        } else if path.extension().is_some_and(|e| e == extension) {
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

/// One source file's module path inside its crate: `src/a/b.rs` and
/// `src/a/b/mod.rs` are `a::b`; the crate root is the empty path.
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let relative = file.strip_prefix(src).unwrap();
    let mut parts: Vec<String> =
        relative.iter().map(|part| part.to_str().unwrap().trim_end_matches(".rs").to_string()).collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib" | "main")) {
        parts.pop();
    }
    parts
}

/// The paths a use tree names: `a::{b, c::d}` gives `a::b` and `a::c::d`.
fn use_tree(rest: &str, prefix: Vec<String>, found: &mut Vec<Vec<String>>) -> usize {
    let mut path = prefix;
    let mut at = 0;
    loop {
        let tail = &rest[at..];
        if let Some(group) = tail.strip_prefix('{') {
            at += 1;
            let mut consumed = 0;
            loop {
                let inner = group[consumed..].trim_start();
                consumed = group.len() - inner.len();
                if inner.starts_with('}') || inner.is_empty() {
                    return at + consumed + 1;
                }
                consumed += use_tree(&group[consumed..], path.clone(), found);
                let next = group[consumed..].trim_start();
                consumed = group.len() - next.len();
                if next.starts_with(',') {
                    consumed += 1;
                }
            }
        }
        let name: String = tail.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        if name.is_empty() {
            found.push(path);
            return at;
        }
        at += name.len();
        path.push(name);
        if rest[at..].starts_with("::") {
            at += 2;
        } else {
            found.push(path);
            return at;
        }
    }
}

/// The byte length of the item at the start of `code`: up to its first `;`
/// outside braces (`use …;`, `mod tests;`) or the `}` that closes its
/// first brace (`mod tests { … }`, `fn …() { … }`), braces inside
/// comments, strings and character literals not counted. All of `code`
/// when it never ends.
fn item_len(code: &str) -> usize {
    let bytes = code.as_bytes();
    let mut depth = 0usize;
    let mut i = 0;
    while i < bytes.len() {
        let rest = &code[i..];
        let ident_before = i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        if rest.starts_with("//") {
            i += rest.find('\n').unwrap_or(rest.len());
        } else if rest.starts_with("/*") {
            i += rest.find("*/").map_or(rest.len(), |end| end + 2);
        } else if let Some(raw) =
            rest.strip_prefix('r').filter(|r| !ident_before && r.trim_start_matches('#').starts_with('"'))
        {
            // r"…", r#"…"#: ends at a quote followed by as many hashes.
            let hashes = raw.len() - raw.trim_start_matches('#').len();
            let close = format!("\"{}", "#".repeat(hashes));
            let body = 1 + hashes + 1;
            i += body + rest[body..].find(&close).map_or(rest.len() - body, |end| end + close.len());
        } else if bytes[i] == b'"' {
            let mut j = i + 1;
            while j < bytes.len() && bytes[j] != b'"' {
                j += if bytes[j] == b'\\' { 2 } else { 1 };
            }
            i = j + 1;
        } else if bytes[i] == b'\'' {
            // A character literal ('{', '\''), or a lifetime ('a), left as is.
            let mut chars = rest[1..].char_indices();
            match (chars.next(), chars.next()) {
                // '\'', '\n', '\u{7b}': the quote after the escaped character.
                (Some((_, '\\')), _) => {
                    i += 3 + rest.get(3..).and_then(|r| r.find('\'')).map_or(0, |end| end + 1)
                }
                (Some(_), Some((at, '\''))) => i += 1 + at + 1,
                _ => i += 1,
            }
        } else {
            match bytes[i] {
                b'{' => depth += 1,
                b'}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        return i + 1;
                    }
                }
                b';' if depth == 0 => return i + 1,
                _ => {}
            }
            i += rest.chars().next().map_or(1, char::len_utf8);
        }
    }
    code.len()
}

/// `text` without its `#[cfg(test)]` items (a line of its own, then the
/// item: a `mod tests { … }` block, a `use`), the code after each kept.
fn without_test_items(text: &str) -> String {
    let mut kept = String::new();
    let mut rest = text;
    while let Some(at) = rest.match_indices("#[cfg(test)]").map(|(at, _)| at).find(|&at| {
        let line_start = rest[..at].rfind('\n').map_or(0, |n| n + 1);
        let line_end = rest[at..].find('\n').map_or(rest.len(), |n| at + n);
        rest[line_start..line_end].trim() == "#[cfg(test)]"
    }) {
        kept.push_str(&rest[..at]);
        let item = &rest[at + "#[cfg(test)]".len()..];
        rest = &item[item_len(item)..];
    }
    kept.push_str(rest);
    kept
}

/// The module paths a file names (`crate::…`, `super::…`) outside comments
/// and its `#[cfg(test)]` items (what tests use is not a dependency of the
/// module; the code after them is read).
fn named_modules(text: &str, here: &[String], is_mod_file: bool) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let code = without_test_items(text);
    for line in code.lines().map(|line| line.split("//").next().unwrap_or("")) {
        for (keyword, base) in [("crate::", Vec::new()), ("super::", Vec::new())] {
            for (at, _) in line.match_indices(keyword) {
                let preceded = line[..at].chars().next_back();
                if preceded.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':' || c == '$') {
                    continue;
                }
                let mut prefix = base.clone();
                let mut rest = &line[at + keyword.len()..];
                if keyword == "super::" {
                    // `super` is the parent of this module; a `mod.rs` or
                    // `lib.rs` is its module, not a child of it.
                    let mut levels = 1;
                    while let Some(more) = rest.strip_prefix("super::") {
                        levels += 1;
                        rest = more;
                    }
                    let depth = here.len() + usize::from(is_mod_file);
                    prefix = here[..depth.saturating_sub(levels).min(here.len())].to_vec();
                }
                use_tree(rest, prefix, &mut found);
            }
        }
    }
    found
}

/// Circles among one crate's source files: each file depends on the
/// longest module path it names that is a file of the crate. A module naming
/// its own ancestors (a child using what its parent declares) is not a
/// dependency between rooms and is left out.
fn import_circles(crate_dir: &Path) -> Vec<String> {
    circles_at(crate_dir, usize::MAX)
}

/// [`import_circles`] with each module cut to its first `depth` names: at
/// depth 1, circles between a crate's top-level modules (an import from a
/// lower room back up to one that uses it, though no two files name each
/// other).
fn circles_at(crate_dir: &Path, depth: usize) -> Vec<String> {
    let src = crate_dir.join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let modules: BTreeMap<Vec<String>, std::path::PathBuf> =
        files.iter().map(|file| (module_path(&src, file), file.clone())).collect();
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (module, file) in &modules {
        let is_mod_file = file.file_name().is_some_and(|name| name == "mod.rs");
        let text = std::fs::read_to_string(file).unwrap();
        for named in named_modules(&text, module, is_mod_file) {
            let target =
                (0..=named.len()).rev().map(|n| named[..n].to_vec()).find(|p| modules.contains_key(p));
            if let Some(target) = target {
                let ancestor_or_self = module.starts_with(&target);
                let descendant = target.starts_with(module);
                let cut = |m: &[String]| m[..m.len().min(depth)].to_vec();
                let (from, to) = (cut(module), cut(&target));
                if !ancestor_or_self && !descendant && from != to && !from.is_empty() && !to.is_empty() {
                    edges.entry(from).or_default().insert(to);
                }
            }
        }
    }
    circles(&edges, |module| {
        format!("{}::{}", crate_dir.file_name().unwrap().to_str().unwrap(), module.join("::"))
    })
}

/// Each circle in a dependency graph, once, as `a -> b -> a`.
fn circles<N: Ord + Clone>(edges: &BTreeMap<N, BTreeSet<N>>, name: impl Fn(&N) -> String) -> Vec<String> {
    let mut found = BTreeSet::new();
    for start in edges.keys() {
        // Depth-first from `start`, through nodes greater than it only, so
        // each circle is reported from its smallest node.
        let mut stack = vec![(start.clone(), vec![start.clone()])];
        while let Some((node, path)) = stack.pop() {
            for next in edges.get(&node).into_iter().flatten() {
                if next == start {
                    let names: Vec<String> = path.iter().chain([start]).map(&name).collect();
                    found.insert(names.join(" -> "));
                } else if next > start && !path.contains(next) {
                    let mut longer = path.clone();
                    longer.push(next.clone());
                    stack.push((next.clone(), longer));
                }
            }
        }
    }
    found.into_iter().collect()
}

#[test]
fn no_crate_has_an_import_circle_between_its_top_level_modules() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut crates = vec![root.to_path_buf()];
    for entry in std::fs::read_dir(root.join("crates")).unwrap() {
        crates.push(entry.unwrap().path());
    }
    let found: Vec<String> = crates.iter().flat_map(|dir| circles_at(dir, 1)).collect();
    assert!(found.is_empty(), "imports back up between top-level modules:\n{}", found.join("\n"));
}

#[test]
fn no_crate_has_an_import_circle_between_its_files() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut crates = vec![root.to_path_buf()];
    for entry in std::fs::read_dir(root.join("crates")).unwrap() {
        crates.push(entry.unwrap().path());
    }
    let found: Vec<String> = crates.iter().flat_map(|dir| import_circles(dir)).collect();
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

/// Python modules of the repository's scripts each `import` or
/// `from … import` (anywhere in the file, functions included) names.
fn python_imports(text: &str) -> BTreeSet<String> {
    let mut named = BTreeSet::new();
    for line in text.lines().map(str::trim_start) {
        let modules = if let Some(rest) = line.strip_prefix("from ") {
            vec![rest.split_whitespace().next().unwrap_or("")]
        } else if let Some(rest) = line.strip_prefix("import ") {
            rest.split(',').map(|part| part.split_whitespace().next().unwrap_or("")).collect()
        } else {
            continue;
        };
        named.extend(modules.into_iter().map(|m| m.split('.').next().unwrap_or("").to_string()));
    }
    named
}

#[test]
fn no_python_script_has_an_import_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut scripts = BTreeMap::new();
    for dir in ["models", "benchmarks", "benchmarks/baselines", "benchmarks/torchrec_cpp", "tests/python"] {
        for entry in std::fs::read_dir(root.join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "py") {
                scripts.insert(path.file_stem().unwrap().to_str().unwrap().to_string(), path);
            }
        }
    }
    let edges: BTreeMap<String, BTreeSet<String>> = scripts
        .iter()
        .map(|(name, path)| {
            let text = std::fs::read_to_string(path).unwrap();
            let ours =
                python_imports(&text).into_iter().filter(|m| m != name && scripts.contains_key(m)).collect();
            (name.clone(), ours)
        })
        .collect();
    let found = circles(&edges, |name| format!("{name}.py"));
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

/// The exporters (`models/export_*.py`) share `models/export_common.py`:
/// no module in `models/` imports an exporter, so none runs another's
/// imports (TorchRec's DLRM for a sequence model) or breaks with it.
#[test]
fn no_model_script_imports_an_exporter() {
    let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("models");
    let mut found = Vec::new();
    for entry in std::fs::read_dir(&models).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "py") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for module in python_imports(&text) {
            if module.starts_with("export_") && module != "export_common" {
                found.push(format!("{} imports {module}", path.file_name().unwrap().to_string_lossy()));
            }
        }
    }
    assert!(found.is_empty(), "move what they share into models/export_common.py:\n{}", found.join("\n"));
}

#[test]
fn the_circle_check_reads_use_trees_and_super() {
    let here = vec!["a".to_string(), "b".to_string()];
    let named = named_modules(
        "use crate::{x::{y, z}, w};\nuse super::c::D; // crate::ignored\n#[cfg(test)]\nuse crate::t;",
        &here,
        false,
    );
    let as_text: Vec<String> = named.iter().map(|p| p.join("::")).collect();
    assert_eq!(as_text, ["x::y", "x::z", "w", "a::c::D"]);
    // Only the test module is left out: what follows it is read, whatever
    // braces its strings, characters and comments hold.
    let after_tests = named_modules(
        "use crate::a;\n#[cfg(test)]\nmod tests {\n    use crate::t;\n    fn f<'a>(s: &'a str) {\n        \
         let _ = ('{', '\\'', \"}\", r#\"}\"#, b'}'); // }\n        /* } */\n    }\n}\n\
         pub fn later() { crate::b::f(); }\n#[cfg(test)]\nuse crate::u;\nuse crate::c;\n",
        &here,
        false,
    );
    let as_text: Vec<String> = after_tests.iter().map(|p| p.join("::")).collect();
    assert_eq!(as_text, ["a", "b::f", "c"]);
    let mut edges = BTreeMap::new();
    edges.insert(1, BTreeSet::from([2]));
    edges.insert(2, BTreeSet::from([3]));
    edges.insert(3, BTreeSet::from([1]));
    assert_eq!(circles(&edges, |n| n.to_string()), ["1 -> 2 -> 3 -> 1"]);
    assert_eq!(
        python_imports("import os, json\n    from split_model import X\n"),
        BTreeSet::from(["os".to_string(), "json".to_string(), "split_model".to_string()])
    );
}

/// A protocol is its module in `src/protocols/` declaring `SERVED` (its
/// service name and decode expansion) plus its entry in `PROTOCOLS`: a
/// module that declares one but is missing from the table would be served
/// without its health status or its memory bound.
#[test]
fn every_protocol_that_declares_itself_is_in_the_protocol_table() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/protocols");
    let table = std::fs::read_to_string(dir.join("mod.rs")).unwrap();
    let table =
        table.split("pub const PROTOCOLS").nth(1).and_then(|rest| rest.split("];").next()).unwrap_or("");
    let mut declared = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        // A protocol of several files declares it in its folder's mod.rs.
        let file = if path.is_dir() { path.join("mod.rs") } else { path.clone() };
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        if text.contains("pub const SERVED: ServedProtocol") {
            declared.push(path.file_stem().unwrap().to_str().unwrap().to_string());
        }
    }
    assert!(declared.len() >= 3, "found only {declared:?} declaring SERVED");
    let missing: Vec<_> = declared.iter().filter(|m| !table.contains(&format!("{m}::SERVED"))).collect();
    assert!(missing.is_empty(), "protocols declaring SERVED but not in protocols::PROTOCOLS: {missing:?}");
}

/// The paths a doc names in backticks: those under a top-level folder of
/// the repository (`src/...`, `crates/...`; not `models/generated/...`,
/// which exports write), with `{a,b}` expanded, and bare file names
/// (`queue.rs`), which some file of the repository has.
fn named_paths(text: &str) -> (Vec<String>, Vec<String>) {
    const ROOTS: [&str; 9] =
        ["src/", "crates/", "models/", "scripts/", "benchmarks/", "tests/", "proto/", "examples/", "docs/"];
    let (mut paths, mut names) = (Vec::new(), Vec::new());
    for (i, quoted) in text.split('`').enumerate() {
        let quoted = quoted.trim_end_matches(['.', ',']);
        // Not code, a command line, a pattern, or what an export writes.
        if i % 2 == 0 || quoted.contains([' ', '\n', '*', '<', '$']) || quoted.starts_with("models/generated")
        {
            continue;
        }
        if ROOTS.iter().any(|root| quoted.starts_with(root)) {
            let expanded = match (quoted.find('{'), quoted.find('}')) {
                (Some(open), Some(close)) if open < close => quoted[open + 1..close]
                    .split(',')
                    .map(|part| format!("{}{}{}", &quoted[..open], part.trim(), &quoted[close + 1..]))
                    .collect(),
                _ => vec![quoted.to_string()],
            };
            paths.extend(expanded);
        } else if !quoted.contains('/') && [".rs", ".py", ".sh"].iter().any(|ext| quoted.ends_with(ext)) {
            names.push(quoted.to_string());
        }
    }
    (paths, names)
}

fn file_names(dir: &Path, found: &mut BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if path.is_dir() && !["target", ".git", ".venv", "generated"].contains(&name.as_str()) {
            file_names(&path, found);
        } else {
            found.insert(name);
        }
    }
}

#[test]
fn every_source_path_the_docs_name_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut names_here = BTreeSet::new();
    file_names(root, &mut names_here);
    let mut missing = Vec::new();
    let mut docs = Vec::new();
    files_ending(&root.join("docs"), "md", &mut docs);
    for doc in docs {
        let text = std::fs::read_to_string(&doc).unwrap();
        let (paths, names) = named_paths(&text);
        let doc = doc.strip_prefix(root).unwrap().display().to_string();
        missing.extend(paths.iter().filter(|p| !root.join(p).exists()).map(|p| format!("{doc}: {p}")));
        missing.extend(names.iter().filter(|n| !names_here.contains(*n)).map(|n| format!("{doc}: {n}")));
    }
    assert!(missing.is_empty(), "named in docs/ but not in the repository:\n{}", missing.join("\n"));
}

#[test]
fn the_docs_check_reads_paths_braces_and_bare_names() {
    let (paths, names) = named_paths("a `src/x/{a,b}.rs` and `crates/c/` then `queue.rs`, `not code` `a/b`.");
    assert_eq!(paths, ["src/x/a.rs", "src/x/b.rs", "crates/c/"]);
    assert_eq!(names, ["queue.rs"]);
}
