//! The choice of table store (`narsil serve --table-store`): where a split
//! model's rows are read from. `memory` and `mmap` keep them in this
//! process ([`crate::table`]); `redis://…` reads them from a Redis Cluster
//! ([`crate::redis_store`]).

use crate::redis_store::{RedisSeeds, RedisStoreConfig};
use crate::table::LocalRows;

/// Where a table's rows live.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum TableStore {
    /// Read into process memory.
    #[default]
    Memory,
    /// Mapped from the file; the page cache holds the hot rows.
    Mmap,
    /// On a Redis Cluster, where `narsil tables load` put them, through a
    /// hot-row cache.
    Redis(RedisStoreConfig),
}

impl std::str::FromStr for TableStore {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "memory" => Ok(Self::Memory),
            "mmap" => Ok(Self::Mmap),
            _ if text.starts_with("redis://") => {
                Ok(Self::Redis(RedisStoreConfig::new(RedisSeeds::parse(text)?)))
            }
            _ => Err(format!(
                "`{text}` is not a table store: use `memory`, `mmap` or `redis://HOST:PORT[,HOST:PORT...]`"
            )),
        }
    }
}

impl std::fmt::Display for TableStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Memory => f.write_str("memory"),
            Self::Mmap => f.write_str("mmap"),
            Self::Redis(config) => config.fmt(f),
        }
    }
}

impl TableStore {
    /// How a local store holds a table's rows; `None` for a store on other
    /// machines.
    pub fn local(&self) -> Option<LocalRows> {
        match self {
            Self::Memory => Some(LocalRows::Memory),
            Self::Mmap => Some(LocalRows::Mmap),
            Self::Redis(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_parse_by_name_and_unknown_ones_name_the_choices() {
        assert_eq!("mmap".parse(), Ok(TableStore::Mmap));
        assert_eq!("memory".parse::<TableStore>().unwrap().local(), Some(LocalRows::Memory));
        assert!("disk".parse::<TableStore>().unwrap_err().contains("memory"));
    }
}
