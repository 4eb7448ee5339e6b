//! The `redis` store's configuration: the cluster's seeds as
//! `--table-store redis://HOST:PORT[,HOST:PORT...]` names them, and the
//! hot-row cache, fetch timeout and missing-rows policy the store flags
//! set ([`RedisStoreConfig`]), with their defaults.

use std::sync::Arc;
use std::time::Duration;

use crate::stores::row_store::MissingRows;

/// The hot-row cache's bound unless `--table-cache-bytes` says otherwise.
pub const DEFAULT_CACHE_BYTES: u64 = 256 << 20;

/// How long a fetch (every table of one batch, retries included) may take
/// before the batch fails, unless `--table-fetch-timeout-ms` says
/// otherwise or the batch's deadline comes first: a fetch takes about a
/// millisecond, so this only bounds how long a batch waits on a node that
/// stopped answering (5 failed batches in a row turn health NOT_SERVING,
/// `--unhealthy-after-failures`).
pub const DEFAULT_FETCH_TIMEOUT: Duration = Duration::from_millis(250);

/// The cluster's seed nodes, as given to `--table-store`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RedisSeeds(Arc<[(String, u16)]>);

impl RedisSeeds {
    /// Parses `redis://HOST:PORT[,HOST:PORT...]` (later seeds may omit the
    /// scheme).
    pub fn parse(text: &str) -> Result<Self, String> {
        let rest =
            text.strip_prefix("redis://").ok_or_else(|| format!("`{text}` does not start with redis://"))?;
        let seeds: Vec<(String, u16)> = rest
            .split(',')
            .map(|seed| seed.trim().trim_start_matches("redis://").trim_end_matches('/'))
            .map(|seed| {
                let (host, port) =
                    seed.rsplit_once(':').ok_or_else(|| format!("seed `{seed}` has no :PORT"))?;
                match port.parse::<u16>() {
                    Ok(port) if !host.is_empty() => Ok((host.to_string(), port)),
                    _ => Err(format!("seed `{seed}` is not HOST:PORT")),
                }
            })
            .collect::<Result<_, _>>()?;
        Ok(Self(seeds.into()))
    }

    /// The seeds as (host, port).
    pub fn hosts(&self) -> &[(String, u16)] {
        &self.0
    }
}

impl std::fmt::Display for RedisSeeds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hosts: Vec<String> = self.0.iter().map(|(host, port)| format!("{host}:{port}")).collect();
        write!(f, "redis://{}", hosts.join(","))
    }
}

/// The `redis` store as `--table-store`, `--table-cache-bytes`,
/// `--table-fetch-timeout-ms` and `--missing-rows` chose it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RedisStoreConfig {
    /// The cluster's seed nodes.
    pub seeds: RedisSeeds,
    /// The hot-row cache's bound (0: no cache).
    pub cache_bytes: u64,
    /// The longest a batch's fetch may take when its callers' deadlines
    /// allow more (or some caller set none).
    pub fetch_timeout: Duration,
    /// What a row the cluster lacks becomes.
    pub missing_rows: MissingRows,
}

impl RedisStoreConfig {
    /// The cluster at `seeds` with the default cache, timeout and policy.
    pub fn new(seeds: RedisSeeds) -> Self {
        Self {
            seeds,
            cache_bytes: DEFAULT_CACHE_BYTES,
            fetch_timeout: DEFAULT_FETCH_TIMEOUT,
            missing_rows: MissingRows::Error,
        }
    }
}

impl std::fmt::Display for RedisStoreConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (cache {} MiB, fetch timeout {:?}, missing rows: {})",
            self.seeds,
            self.cache_bytes >> 20,
            self.fetch_timeout,
            self.missing_rows
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_parse_from_the_flag_and_print_back() {
        let seeds = RedisSeeds::parse("redis://127.0.0.1:7000,127.0.0.1:7001").unwrap();
        assert_eq!(seeds.hosts(), [("127.0.0.1".to_string(), 7000), ("127.0.0.1".to_string(), 7001)]);
        assert_eq!(seeds.to_string(), "redis://127.0.0.1:7000,127.0.0.1:7001");
        assert!(RedisSeeds::parse("127.0.0.1:7000").unwrap_err().contains("redis://"));
        assert!(RedisSeeds::parse("redis://127.0.0.1").unwrap_err().contains("no :PORT"));
        assert!(RedisSeeds::parse("redis://h:x").unwrap_err().contains("not HOST:PORT"));
    }

    #[test]
    fn later_seeds_may_repeat_the_scheme_and_spaces_and_slashes_are_dropped() {
        let seeds = RedisSeeds::parse("redis://a:1/, redis://b:2/").unwrap();
        assert_eq!(seeds.hosts(), [("a".to_string(), 1), ("b".to_string(), 2)]);
        assert_eq!(seeds.to_string(), "redis://a:1,b:2");
    }

    #[test]
    fn a_seed_without_a_host_or_with_a_port_out_of_range_is_refused() {
        assert!(RedisSeeds::parse("redis://:7000").unwrap_err().contains("not HOST:PORT"));
        assert!(RedisSeeds::parse("redis://a:70000").unwrap_err().contains("not HOST:PORT"));
        assert!(RedisSeeds::parse("redis://a:1,").unwrap_err().contains("no :PORT"), "an empty seed");
    }

    #[test]
    fn an_ipv6_seed_splits_at_its_last_colon() {
        let seeds = RedisSeeds::parse("redis://::1:7000").unwrap();
        assert_eq!(seeds.hosts(), [("::1".to_string(), 7000)]);
    }

    #[test]
    fn a_new_config_has_the_flag_defaults_and_prints_them() {
        let config = RedisStoreConfig::new(RedisSeeds::parse("redis://h:7000").unwrap());
        assert_eq!(config.cache_bytes, DEFAULT_CACHE_BYTES);
        assert_eq!(config.fetch_timeout, DEFAULT_FETCH_TIMEOUT);
        assert_eq!(config.missing_rows, MissingRows::Error);
        assert_eq!(
            config.to_string(),
            "redis://h:7000 (cache 256 MiB, fetch timeout 250ms, missing rows: error)"
        );
    }
}
