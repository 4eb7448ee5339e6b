//! The choice of table store (`narsil serve --table-store`): where a split
//! model's rows are read from. The kinds are an open set, each in a file of
//! its own: `memory` and `mmap` keep the rows in this process
//! ([`crate::stores::local`]); `redis://…` reads them from a Redis Cluster
//! ([`crate::stores::redis`]). A kind declares:
//!
//! * its [`StoreKind`]: how `--table-store` names it (the syntax shown
//!   when a value names no kind) and the parser of its values, listed in
//!   [`crate::stores::registry::STORE_KINDS`];
//! * its configuration, a [`StoreConfig`]: how it opens a model's tables
//!   into [`RowStore`]s, how it prints (logs, `--help`), and which of the
//!   store flags ([`StoreFlags`]) it takes.
//!
//! A [`TableStore`] is one chosen store: what the loaders carry and
//! [`crate::EmbeddingStage::open`] opens tables in.

use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::schema::SplitSchema;
use crate::stores::row_store::{MissingRows, RowStore};
use crate::stores::table_error::TableError;

/// One kind of table store, as [`crate::stores::registry::STORE_KINDS`] lists it.
#[derive(Debug, Clone, Copy)]
pub struct StoreKind {
    /// How `--table-store` names it (`memory`,
    /// `redis://HOST:PORT[,HOST:PORT...]`): the choices a value that names
    /// no kind is told.
    pub syntax: &'static str,
    /// The store `text` chooses; `None` when `text` names another kind (the
    /// next one is asked), an error when it names this kind wrongly.
    pub parse: fn(&str) -> Option<Result<TableStore, String>>,
}

/// The store flags of `narsil serve` (`--table-cache-bytes`,
/// `--table-fetch-timeout-ms`, `--missing-rows`): each store takes those
/// that concern it ([`StoreConfig::with_flags`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreFlags {
    /// The bound of a store's cache of rows in this process.
    pub cache_bytes: u64,
    /// The longest one batch's fetch may take.
    pub fetch_timeout: Duration,
    /// What a row the store lacks becomes.
    pub missing_rows: MissingRows,
}

/// How a model's tables were opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpenedTables {
    /// Tables read (or mapped, or checked on their store) now.
    pub read: usize,
    /// Tables another live model version already held.
    pub shared: usize,
    /// Bytes of every table held in this process.
    pub bytes: u64,
}

/// A table store as `--table-store` and the store flags configured it.
/// Its `Display` is the flag's value (with the settings that matter), for
/// logs.
pub trait StoreConfig: fmt::Debug + fmt::Display + Send + Sync + 'static {
    /// Opens every table of the split model in `dir` (`schema`'s tables,
    /// one store each, in schema order), with errors naming the table and
    /// the store.
    fn open(
        &self,
        dir: &Path,
        schema: &SplitSchema,
    ) -> Result<(Vec<Arc<dyn RowStore>>, OpenedTables), TableError>;

    /// This store with `flags` applied; `None` when no store flag concerns
    /// it.
    fn with_flags(&self, _flags: &StoreFlags) -> Option<TableStore> {
        None
    }

    /// Whether a batch's fetch mostly waits (on the disk), so that running
    /// the embedding stage one batch ahead fills the wait with the previous
    /// batch's dense network: what `narsil serve --stage-ahead auto` asks.
    fn fetches_wait(&self) -> bool {
        false
    }
}

/// A chosen table store. Parsed from `--table-store` (`"mmap".parse()`),
/// or made from a kind's configuration ([`TableStore::new`]); the local
/// ones are also constants (`TableStore::Memory`, `TableStore::Mmap`).
#[derive(Clone)]
pub struct TableStore(Chosen);

/// A configuration that lives for the whole program (a constant), or one
/// made at run time.
#[derive(Clone)]
enum Chosen {
    Static(&'static dyn StoreConfig),
    Made(Arc<dyn StoreConfig>),
}

impl TableStore {
    /// The store `config` describes.
    pub fn new(config: impl StoreConfig) -> Self {
        Self(Chosen::Made(Arc::new(config)))
    }

    /// The store a constant configuration describes (for a kind's
    /// constants, such as `TableStore::Memory`).
    pub const fn of(config: &'static dyn StoreConfig) -> Self {
        Self(Chosen::Static(config))
    }

    fn config(&self) -> &dyn StoreConfig {
        match &self.0 {
            Chosen::Static(config) => *config,
            Chosen::Made(config) => config.as_ref(),
        }
    }

    /// Opens every table of the split model in `dir` (see
    /// [`StoreConfig::open`]).
    pub fn open(
        &self,
        dir: &Path,
        schema: &SplitSchema,
    ) -> Result<(Vec<Arc<dyn RowStore>>, OpenedTables), TableError> {
        self.config().open(dir, schema)
    }

    /// This store with the store flags applied (itself when none concerns
    /// it).
    pub fn with_flags(&self, flags: &StoreFlags) -> Self {
        self.config().with_flags(flags).unwrap_or_else(|| self.clone())
    }

    /// See [`StoreConfig::fetches_wait`].
    pub fn fetches_wait(&self) -> bool {
        self.config().fetches_wait()
    }
}

impl fmt::Display for TableStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self.config(), f)
    }
}

impl fmt::Debug for TableStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("TableStore").field(&self.config()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kind with a setting, for what the seam does with any kind.
    #[derive(Debug)]
    struct Counted(u64);

    impl fmt::Display for Counted {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "counted:{}", self.0)
        }
    }

    impl StoreConfig for Counted {
        fn open(
            &self,
            _: &Path,
            _: &SplitSchema,
        ) -> Result<(Vec<Arc<dyn RowStore>>, OpenedTables), TableError> {
            Ok((Vec::new(), OpenedTables { read: self.0 as usize, ..OpenedTables::default() }))
        }

        fn with_flags(&self, flags: &StoreFlags) -> Option<TableStore> {
            Some(TableStore::new(Counted(flags.cache_bytes)))
        }
    }

    #[derive(Debug)]
    struct Plain;

    impl fmt::Display for Plain {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("plain")
        }
    }

    impl StoreConfig for Plain {
        fn open(
            &self,
            _: &Path,
            _: &SplitSchema,
        ) -> Result<(Vec<Arc<dyn RowStore>>, OpenedTables), TableError> {
            Ok((Vec::new(), OpenedTables::default()))
        }
    }

    const FLAGS: StoreFlags = StoreFlags {
        cache_bytes: 7,
        fetch_timeout: Duration::from_millis(5),
        missing_rows: MissingRows::Zero,
    };

    #[test]
    fn a_store_prints_as_its_configuration_and_opens_through_it() {
        let store = TableStore::new(Counted(3));
        assert_eq!(store.to_string(), "counted:3");
        assert_eq!(format!("{store:?}"), "TableStore(Counted(3))");
        let schema = SplitSchema::one_table_per_feature("m", "1", 0, Vec::new(), Vec::new());
        assert_eq!(store.open(Path::new("."), &schema).unwrap().1.read, 3);
    }

    #[test]
    fn store_flags_reach_a_kind_that_takes_them_and_leave_others_as_they_are() {
        assert_eq!(TableStore::new(Counted(3)).with_flags(&FLAGS).to_string(), "counted:7");
        const PLAIN: TableStore = TableStore::of(&Plain);
        assert_eq!(PLAIN.with_flags(&FLAGS).to_string(), "plain");
    }
}
