//! The `memory` and `mmap` table stores: a model's tables read into this
//! process (on huge pages: [`huge_pages`]) or mapped from their files
//! ([`table`]), shared by content with the model versions that already
//! hold them ([`shared`]). No store flag concerns them.

pub mod huge_pages;
pub mod shared;
pub mod table;

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use crate::schema::SplitSchema;
use crate::stores::local::huge_pages::HUGE_PAGE;
use crate::stores::local::shared::open_shared;
use crate::stores::local::table::{LocalRows, Table};
use crate::stores::row_store::RowStore;
use crate::stores::table_error::TableError;
use crate::stores::table_store::{OpenedTables, StoreConfig, StoreKind, TableStore};

/// `--table-store memory`.
pub const MEMORY: StoreKind =
    StoreKind { syntax: "memory", parse: |text| local(text, "memory", TableStore::Memory) };

/// `--table-store mmap`.
pub const MMAP: StoreKind = StoreKind { syntax: "mmap", parse: |text| local(text, "mmap", TableStore::Mmap) };

fn local(text: &str, name: &str, store: TableStore) -> Option<Result<TableStore, String>> {
    (text == name).then_some(Ok(store))
}

#[allow(non_upper_case_globals, reason = "named as the choices they are, as enum variants are")]
impl TableStore {
    /// Tables read into process memory (the default).
    pub const Memory: TableStore = TableStore::of(&LocalStore(LocalRows::Memory));
    /// Tables mapped from their files; the page cache holds the hot rows.
    pub const Mmap: TableStore = TableStore::of(&LocalStore(LocalRows::Mmap));
}

impl Default for TableStore {
    fn default() -> Self {
        Self::Memory
    }
}

/// A store in this process: how it holds a table's rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LocalStore(LocalRows);

impl fmt::Display for LocalStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            LocalRows::Memory => MEMORY.syntax,
            LocalRows::Mmap => MMAP.syntax,
        })
    }
}

impl StoreConfig for LocalStore {
    /// Reads (or maps) each table, or takes it from a live model version
    /// that holds the same file contents in the same way.
    fn open(
        &self,
        dir: &Path,
        schema: &SplitSchema,
    ) -> Result<(Vec<Arc<dyn RowStore>>, OpenedTables), TableError> {
        let mut opened = OpenedTables::default();
        let mut stores: Vec<Arc<dyn RowStore>> = Vec::with_capacity(schema.tables.len());
        for spec in &schema.tables {
            let table = open_shared(dir, spec, self.0)?;
            if table.shared {
                opened.shared += 1;
            } else {
                opened.read += 1;
            }
            opened.bytes += table.table.bytes().len() as u64;
            stores.push(table.table);
        }
        if self.0 == LocalRows::Memory {
            report_huge_pages(&stores);
        }
        Ok((stores, opened))
    }
}

/// Logs the share of a model's memory tables of at least one huge page
/// that the kernel put on huge pages, and, once per process, why when it
/// is under 95%.
fn report_huge_pages(stores: &[Arc<dyn RowStore>]) {
    let large: Vec<&Table> = stores
        .iter()
        .filter_map(|s| s.downcast_ref::<Table>())
        .filter(|t| t.bytes().len() >= HUGE_PAGE)
        .collect();
    let bytes: u64 = large.iter().map(|t| t.bytes().len() as u64).sum();
    if bytes == 0 {
        return;
    }
    let smaps = huge_pages::smaps().unwrap_or_default();
    let (huge, advised) = large
        .iter()
        .map(|t| t.huge_page_bytes(&smaps))
        .fold((0, 0), |(huge, advised), (h, a)| (huge + h, advised + usize::from(a)));
    let share = huge as f64 / bytes as f64 * 100.0;
    tracing::info!(
        tables = large.len(),
        table_mib = bytes >> 20,
        huge_page_mib = huge >> 20,
        "memory tables of at least 2 MiB: {share:.1}% of their bytes on 2 MiB pages"
    );
    static SAID: std::sync::Once = std::sync::Once::new();
    if share < 95.0 {
        let why = match advised {
            0 if !huge_pages::huge_pages_wanted() => "NARSIL_TABLE_HUGE_PAGES=off".to_string(),
            0 => "no memory could be mapped for them (the tables are on the heap)".to_string(),
            _ => huge_pages::why_not_huge(),
        };
        SAID.call_once(|| {
            tracing::warn!(
                "memory tables: only {share:.1}% on 2 MiB pages ({why}); lookups pay more page walks"
            )
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_local_kind_parses_its_own_name_only() {
        assert_eq!((MEMORY.parse)("memory").unwrap().unwrap().to_string(), "memory");
        assert_eq!((MMAP.parse)("mmap").unwrap().unwrap().to_string(), "mmap");
        assert!((MEMORY.parse)("mmap").is_none());
        assert!((MMAP.parse)("redis://h:1").is_none());
    }

    #[test]
    fn the_default_store_is_memory_and_flags_leave_local_stores_alone() {
        assert_eq!(TableStore::default().to_string(), "memory");
        let flags = crate::stores::table_store::StoreFlags {
            cache_bytes: 1,
            fetch_timeout: std::time::Duration::from_millis(1),
            missing_rows: crate::stores::row_store::MissingRows::Zero,
        };
        assert_eq!(TableStore::Mmap.with_flags(&flags).to_string(), "mmap");
    }
}
