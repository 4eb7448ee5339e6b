//! A table of a split model's `schema.json` ([`TableSpec`]): its shape and
//! storage, its file and the SHA-256 the file is checked against, where
//! else its rows are (a Redis Cluster, a popularity layout), how its ids
//! become rows, and the rules a table keeps on its own
//! ([`TableSpec::check`]).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::ids::TableIds;
use crate::sha256::is_sha256;

/// How a table's rows are stored in its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Storage {
    /// FBGEMM's row-wise INT8 inference layout: an fp16 scale and an fp16
    /// bias, then `dim` uint8 values, padded to a multiple of 16 bytes.
    Int8Rowwise,
    /// `dim` little-endian FP32 values.
    Fp32,
}

impl Storage {
    /// Bytes of a row's values (and an INT8 row's scale and bias): the
    /// rest of [`Self::row_bytes`] is padding.
    pub fn value_bytes(self, dim: usize) -> usize {
        match self {
            Self::Int8Rowwise => 4 + dim,
            Self::Fp32 => 4 * dim,
        }
    }

    /// Bytes of one row of `dim` values.
    pub fn row_bytes(self, dim: usize) -> usize {
        match self {
            Self::Int8Rowwise => (4 + dim).div_ceil(16) * 16,
            Self::Fp32 => 4 * dim,
        }
    }
}

/// One table.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TableSpec {
    /// Its name (features name it).
    pub name: String,
    /// Rows (valid ids are `0..rows`).
    pub rows: u64,
    /// Values per row.
    pub dim: usize,
    /// How rows are stored.
    pub storage: Storage,
    /// Bytes per row in the file.
    pub row_bytes: usize,
    /// The file, relative to the model directory.
    pub file: PathBuf,
    /// SHA-256 of the file's contents, hex: checked at load, and a table's
    /// identity, so that two model versions with the same table share it.
    /// Empty (or absent): the file is not checked, nor shared (logged when
    /// the table is opened); anything else that is not 64 hex digits is
    /// refused ([`TableSpec::check`]).
    #[serde(default)]
    pub sha256: String,
    /// Where `narsil tables load` put the rows on a Redis Cluster (the
    /// `redis` store reads them there).
    #[serde(default)]
    pub redis: Option<RedisTableSpec>,
    /// Rows in popularity order, found through a slot index (`narsil
    /// tables order`); absent: row `id` is the file's row `id`.
    #[serde(default)]
    pub layout: Option<Layout>,
    /// How the ids requests send become its rows; absent: they are rows.
    #[serde(default)]
    pub ids: TableIds,
}

/// A table's rows on a Redis Cluster (see [`crate::stores::redis`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Deserialize, serde::Serialize)]
pub struct RedisTableSpec {
    /// Every row key starts with it: `narsil/MODEL/VERSION/TABLE`.
    pub prefix: String,
    /// Hash-tag buckets the rows are spread over (`id % buckets`).
    pub buckets: u32,
}

impl RedisTableSpec {
    /// The bucket (the hash tag, so the hash slot) of row `id`: ids of one
    /// bucket can share one multi-key command.
    pub fn bucket(&self, id: u64) -> u64 {
        id % u64::from(self.buckets)
    }
}

/// A table's layout: its rows in popularity order, found through a slot
/// index ([`crate::popularity_order`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Deserialize, serde::Serialize)]
pub struct Layout {
    /// The slot index's file, relative to the model directory.
    pub slots: PathBuf,
    /// SHA-256 of the index file, hex (with the table file's, the table's
    /// identity).
    pub sha256: String,
}

impl TableSpec {
    /// The rules a table keeps on its own: some rows of some values, the
    /// row size its storage gives them, and a SHA-256 (64 hex digits) for
    /// every file checked against one at load: its id map's and its slot
    /// index's, and its own file's unless empty (not checked).
    pub fn check(&self) -> Result<(), String> {
        if self.rows == 0 || self.dim == 0 {
            return Err(format!("table {:?} has {} rows of {} values", self.name, self.rows, self.dim));
        }
        let expected = self.storage.row_bytes(self.dim);
        if self.row_bytes != expected {
            return Err(format!(
                "table {:?}: row_bytes {} but {:?} rows of {} values take {expected}",
                self.name, self.row_bytes, self.storage, self.dim
            ));
        }
        if !self.sha256.is_empty() {
            self.check_sha256("its", &self.sha256, "its file", &self.file)?;
        }
        if let TableIds::Map(map) = &self.ids {
            self.check_sha256("its id map's", &map.sha256, "the map", &map.file)?;
            if map.default_row >= self.rows {
                return Err(format!(
                    "table {:?}: its id map's default_row {} is past its {} rows",
                    self.name, map.default_row, self.rows
                ));
            }
        }
        if let Some(layout) = &self.layout {
            self.check_sha256("its layout's", &layout.sha256, "the slot index", &layout.slots)?;
        }
        Ok(())
    }

    /// That `sha256`, which `whose` names for the file `file` (`what`), is
    /// a SHA-256.
    fn check_sha256(&self, whose: &str, sha256: &str, what: &str, file: &Path) -> Result<(), String> {
        if is_sha256(sha256) {
            return Ok(());
        }
        Err(format!(
            "table {:?}: {whose} sha256 {sha256:?} is not a SHA-256 (64 hex digits{}): {what} {} is checked against it at load",
            self.name,
            if whose == "its" { ", or empty to leave the file unchecked" } else { "" },
            file.display()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_sha256_that_is_not_64_hex_digits_is_refused_naming_the_table_and_an_empty_one_is_unchecked() {
        // Absent: as empty.
        let mut table: TableSpec = serde_json::from_str(
            r#"{"name": "t", "rows": 10, "dim": 64, "storage": "int8_rowwise", "row_bytes": 80,
                "file": "tables/t.bin"}"#,
        )
        .unwrap();
        assert_eq!((table.sha256.as_str(), table.check()), ("", Ok(())));
        for sha256 in [String::new(), "ab".repeat(32), "AB".repeat(32)] {
            table.sha256 = sha256;
            assert_eq!(table.check(), Ok(()));
        }
        let hex = "ab".repeat(32);
        for sha256 in
            [format!("sha256:{hex}"), "00".into(), "a new table".into(), "xy".repeat(32), hex.clone() + "0"]
        {
            table.sha256 = sha256.clone();
            let error = table.check().unwrap_err();
            assert!(
                error.contains("table \"t\"")
                    && error.contains(&format!("{sha256:?}"))
                    && error.contains("64 hex digits")
                    && error.contains("tables/t.bin"),
                "{sha256:?}: {error}"
            );
        }
    }
}
