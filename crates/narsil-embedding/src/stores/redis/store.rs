//! The `redis` kind of table store: `--table-store
//! redis://HOST:PORT[,HOST:PORT...]` ([`STORE`]), the store flags it takes
//! (cache bytes, fetch timeout, missing rows), and opening a model's
//! tables on the cluster: each one checked to be loaded there with the
//! schema's row count.

use std::path::Path;
use std::sync::Arc;

use super::cluster::RedisCluster;
use super::config::{RedisSeeds, RedisStoreConfig};
use super::rows::RedisRows;
use crate::schema::SplitSchema;
use crate::stores::row_store::{FetchError, RowStore};
use crate::stores::table_error::TableError;
use crate::stores::table_store::{OpenedTables, StoreConfig, StoreFlags, StoreKind, TableStore};

/// `--table-store redis://HOST:PORT[,HOST:PORT...]`.
pub const STORE: StoreKind = StoreKind { syntax: "redis://HOST:PORT[,HOST:PORT...]", parse };

fn parse(text: &str) -> Option<Result<TableStore, String>> {
    let seeds = text.starts_with("redis://").then(|| RedisSeeds::parse(text))?;
    Some(seeds.map(|seeds| TableStore::new(RedisStoreConfig::new(seeds))))
}

impl StoreConfig for RedisStoreConfig {
    /// Connects to the cluster (or takes the process's connection to it)
    /// and checks each table is loaded there.
    fn open(
        &self,
        dir: &Path,
        schema: &SplitSchema,
    ) -> Result<(Vec<Arc<dyn RowStore>>, OpenedTables), TableError> {
        let mut opened = OpenedTables::default();
        let mut stores: Vec<Arc<dyn RowStore>> = Vec::with_capacity(schema.tables.len());
        let Some(first) = schema.tables.first() else { return Ok((stores, opened)) };
        let cluster = RedisCluster::shared(self)
            .map_err(|source| TableError::Store { table: first.name.clone(), source })?;
        for spec in &schema.tables {
            let store_error = |source| TableError::Store { table: spec.name.clone(), source };
            let redis = spec.redis.as_ref().ok_or_else(|| {
                store_error(FetchError::failed(format!(
                    "schema.json names no Redis location for it: load the tables first \
                     (`narsil tables load {} --store {}`)",
                    dir.display(),
                    self.seeds
                )))
            })?;
            stores.push(Arc::new(
                RedisRows::open(&spec.name, redis, spec.rows, cluster.clone()).map_err(store_error)?,
            ));
            opened.read += 1;
        }
        Ok((stores, opened))
    }

    fn with_flags(&self, flags: &StoreFlags) -> Option<TableStore> {
        Some(TableStore::new(RedisStoreConfig {
            seeds: self.seeds.clone(),
            cache_bytes: flags.cache_bytes,
            fetch_timeout: flags.fetch_timeout,
            missing_rows: flags.missing_rows,
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::stores::row_store::MissingRows;

    #[test]
    fn redis_values_parse_into_the_default_config_and_others_are_left_to_other_kinds() {
        let store = (STORE.parse)("redis://127.0.0.1:7000,127.0.0.1:7001").unwrap().unwrap();
        assert_eq!(
            store.to_string(),
            "redis://127.0.0.1:7000,127.0.0.1:7001 (cache 256 MiB, fetch timeout 250ms, missing rows: error)"
        );
        assert!((STORE.parse)("redis://127.0.0.1").unwrap().unwrap_err().contains("no :PORT"));
        assert!((STORE.parse)("memory").is_none());
    }

    #[test]
    fn every_store_flag_reaches_the_config_and_the_seeds_stay() {
        let config = RedisStoreConfig::new(RedisSeeds::parse("redis://h:1").unwrap());
        let flags = StoreFlags {
            cache_bytes: 0,
            fetch_timeout: Duration::from_millis(40),
            missing_rows: MissingRows::Zero,
        };
        let store = config.with_flags(&flags).unwrap();
        assert_eq!(store.to_string(), "redis://h:1 (cache 0 MiB, fetch timeout 40ms, missing rows: zero)");
    }

    #[test]
    fn a_model_with_no_tables_opens_without_connecting() {
        let config = RedisStoreConfig::new(RedisSeeds::parse("redis://127.0.0.1:1").unwrap());
        let schema = SplitSchema::one_table_per_feature("m", "1", 0, Vec::new(), Vec::new());
        let (stores, opened) = config.open(Path::new("."), &schema).unwrap();
        assert!(stores.is_empty());
        assert_eq!(opened, OpenedTables::default());
    }
}
