//! An embedding table's rows, read from its file in a split model's
//! `tables/` and checked against the schema: a file that is truncated,
//! too long, or missing fails with the table's name and the file's path.

use std::path::{Path, PathBuf};

use crate::schema::{Storage, TableSpec};

/// A table held in process memory.
#[derive(Debug)]
pub struct Table {
    /// Its name.
    pub name: String,
    /// Rows.
    pub rows: u64,
    /// Values per row.
    pub dim: usize,
    /// Bytes per row.
    pub row_bytes: usize,
    /// How rows are stored.
    pub storage: Storage,
    data: Vec<u8>,
}

/// Why a table cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    /// The file cannot be read.
    #[error("table {table:?}: cannot read {}: {source}", path.display())]
    Read {
        /// The table.
        table: String,
        /// Its file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file's size is not the schema's rows times row bytes.
    #[error("table {table:?}: {} holds {actual} bytes, but {rows} rows of {row_bytes} bytes take {expected} (truncated, or not this schema's table)", path.display())]
    Size {
        /// The table.
        table: String,
        /// Its file.
        path: PathBuf,
        /// Bytes in the file.
        actual: u64,
        /// Bytes the schema implies.
        expected: u64,
        /// Rows in the schema.
        rows: u64,
        /// Bytes per row.
        row_bytes: usize,
    },
}

impl Table {
    /// Reads the table `spec` describes from the model directory `dir`.
    pub fn load(dir: &Path, spec: &TableSpec) -> Result<Self, TableError> {
        let path = dir.join(&spec.file);
        let read_error = |source| TableError::Read { table: spec.name.clone(), path: path.clone(), source };
        let expected = spec.rows * spec.row_bytes as u64;
        let actual = std::fs::metadata(&path).map_err(read_error)?.len();
        if actual != expected {
            return Err(TableError::Size {
                table: spec.name.clone(),
                path,
                actual,
                expected,
                rows: spec.rows,
                row_bytes: spec.row_bytes,
            });
        }
        let data = std::fs::read(&path).map_err(read_error)?;
        Ok(Self::from_rows(spec, data))
    }

    /// A table over rows already in memory (`data.len()` must be
    /// `rows * row_bytes`).
    pub fn from_rows(spec: &TableSpec, data: Vec<u8>) -> Self {
        assert_eq!(data.len() as u64, spec.rows * spec.row_bytes as u64, "table {:?} rows", spec.name);
        Self {
            name: spec.name.clone(),
            rows: spec.rows,
            dim: spec.dim,
            row_bytes: spec.row_bytes,
            storage: spec.storage,
            data,
        }
    }

    /// Every row, end to end.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(rows: u64) -> TableSpec {
        TableSpec {
            name: "cat_3".into(),
            rows,
            dim: 8,
            storage: Storage::Int8Rowwise,
            row_bytes: 16,
            file: "tables/cat_3.bin".into(),
            sha256: String::new(),
        }
    }

    #[test]
    fn a_truncated_or_missing_file_names_the_table_and_the_file() {
        let dir = std::env::temp_dir().join(format!("narsil-table-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("tables")).unwrap();
        std::fs::write(dir.join("tables/cat_3.bin"), vec![0u8; 16 * 9]).unwrap();
        let error = Table::load(&dir, &spec(10)).unwrap_err().to_string();
        assert!(
            error.contains("cat_3") && error.contains("tables/cat_3.bin") && error.contains("144 bytes"),
            "{error}"
        );
        assert_eq!(Table::load(&dir, &spec(9)).unwrap().bytes().len(), 144);
        let missing = Table::load(&dir.join("elsewhere"), &spec(9)).unwrap_err().to_string();
        assert!(missing.contains("cat_3") && missing.contains("cannot read"), "{missing}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
