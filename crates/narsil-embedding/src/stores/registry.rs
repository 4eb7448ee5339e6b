//! Every kind of table store `--table-store` can name ([`STORE_KINDS`]),
//! and parsing the flag's value by asking each kind in turn. A new kind is
//! its file (its [`StoreKind`] and [`crate::stores::table_store::StoreConfig`])
//! plus its line here.

use crate::stores::table_store::{StoreKind, TableStore};

/// The table stores, in the order `--table-store`'s choices are told.
pub const STORE_KINDS: &[StoreKind] = &[
    crate::stores::local::MEMORY,
    crate::stores::local::MMAP,
    crate::stores::disk::store::STORE,
    crate::stores::redis::store::STORE,
];

impl std::str::FromStr for TableStore {
    type Err = String;

    /// The store of the first kind that takes `text`.
    fn from_str(text: &str) -> Result<Self, String> {
        STORE_KINDS
            .iter()
            .find_map(|kind| (kind.parse)(text))
            .unwrap_or_else(|| Err(format!("`{text}` is not a table store: use {}", choices(STORE_KINDS))))
    }
}

/// `` `a`, `b` or `c` ``.
fn choices(kinds: &[StoreKind]) -> String {
    let names: Vec<String> = kinds.iter().map(|kind| format!("`{}`", kind.syntax)).collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => names.concat(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_parse_by_name_and_print_back() {
        for text in ["memory", "mmap"] {
            assert_eq!(text.parse::<TableStore>().unwrap().to_string(), text);
        }
        for (text, reads) in
            [("disk", "io_uring where allowed"), ("disk:threads", "threads"), ("disk:io_uring", "io_uring")]
        {
            let store = text.parse::<TableStore>().unwrap().to_string();
            assert!(store.starts_with("disk (") && store.contains(&format!("reads on {reads}")), "{store}");
        }
        assert!("disk:aio".parse::<TableStore>().unwrap_err().contains("disk:threads"));
        let redis = "redis://h:1,h:2".parse::<TableStore>().unwrap().to_string();
        assert!(redis.starts_with("redis://h:1,h:2 "), "{redis}");
    }

    #[test]
    fn an_unknown_store_is_told_every_choice() {
        assert_eq!(
            "tape".parse::<TableStore>().unwrap_err(),
            "`tape` is not a table store: use `memory`, `mmap`, `disk[:io_uring|:threads]` or `redis://HOST:PORT[,HOST:PORT...]`"
        );
    }

    #[test]
    fn a_kind_that_takes_a_value_but_finds_it_wrong_says_why() {
        assert!("redis://nowhere".parse::<TableStore>().unwrap_err().contains("no :PORT"));
    }

    #[test]
    fn the_kinds_names_are_distinct_and_each_parses_its_own_name_only() {
        for (i, kind) in STORE_KINDS.iter().enumerate() {
            for (j, other) in STORE_KINDS.iter().enumerate() {
                let taken = (other.parse)(kind.syntax).is_some();
                assert_eq!(taken, i == j, "{} taken by {}", kind.syntax, other.syntax);
            }
        }
    }

    /// A kind is its file declaring a `StoreKind` plus its line in
    /// `STORE_KINDS`: one declared but not listed could never be chosen.
    #[test]
    fn every_declared_store_kind_is_in_the_table() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let table = std::fs::read_to_string(src.join("stores/registry.rs")).unwrap();
        let table = table.split("pub const STORE_KINDS").nth(1).and_then(|t| t.split("];").next()).unwrap();
        let mut files = vec![src.clone()];
        let mut declared = Vec::new();
        while let Some(dir) = files.pop() {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    files.push(path);
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap();
                let kinds = text
                    .lines()
                    .filter(|line| line.starts_with("pub const ") && line.contains(": StoreKind ="));
                for line in kinds {
                    let name = line["pub const ".len()..].split(':').next().unwrap().trim();
                    let module = path.strip_prefix(&src).unwrap().with_extension("");
                    let module = module.to_str().unwrap().replace('/', "::").replace("::mod", "");
                    declared.push(format!("{module}::{name}"));
                }
            }
        }
        assert!(declared.len() >= 3, "found only {declared:?}");
        let missing: Vec<_> = declared.iter().filter(|kind| !table.contains(kind.as_str())).collect();
        assert!(missing.is_empty(), "store kinds declared but not in STORE_KINDS: {missing:?}");
    }
}
