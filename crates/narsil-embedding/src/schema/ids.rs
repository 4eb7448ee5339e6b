//! How a table's ids become its rows: the `ids` of a table in
//! `schema.json` ([`TableIds`]), with the id map it may name
//! ([`IdMapSpec`]). `docs/guide/production-ids.md` says when to use each.

use std::path::PathBuf;

use narsil_core::ids::Modulo;
use serde::Deserialize;

/// How a table's ids become rows (`"ids"` in a table of `schema.json`).
///
/// Read from `"identity"`, `"modulo"`, `{"modulo": "signed"}`,
/// `{"modulo": "unsigned"}` or `{"map": {...}}`: `"modulo"` alone is
/// `{"modulo": "signed"}` (how schemas named it before the convention was
/// stated, read as they were served).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(try_from = "serde_json::Value")]
pub enum TableIds {
    /// `"identity"` (the default): ids are rows, `0..rows`; others are
    /// refused (or wrapped, with `--id-policy modulo`).
    #[default]
    Identity,
    /// `{"modulo": "signed" | "unsigned"}`: any 64-bit id, row `id mod
    /// rows` in the convention named ([`Modulo`]: ids hashed into the
    /// table, collisions and all), whichever protocol sent the id.
    Modulo(Modulo),
    /// `{"map": {...}}`: any 64-bit id, through the table's id map; ids it
    /// does not hold get the default row.
    Map(IdMapSpec),
}

impl TableIds {
    /// Whether ids are raw 64-bit values that the stage maps to rows.
    pub fn are_raw(&self) -> bool {
        !matches!(self, Self::Identity)
    }
}

/// What a table's `ids` may be, for the error that names another value.
const EXPECTED: &str = r#"expected "identity", "modulo" (signed), {"modulo": "signed"}, {"modulo": "unsigned"} or {"map": {"file", "sha256", "default_row"}}"#;

impl TryFrom<serde_json::Value> for TableIds {
    type Error = String;

    fn try_from(value: serde_json::Value) -> Result<Self, String> {
        use serde_json::Value;
        match &value {
            Value::String(name) if name == "identity" => Ok(Self::Identity),
            Value::String(name) if name == "modulo" => Ok(Self::Modulo(Modulo::Signed)),
            Value::Object(fields) if fields.len() == 1 => match fields.iter().next() {
                Some((key, convention)) if key == "modulo" => Modulo::deserialize(convention)
                    .map(Self::Modulo)
                    .map_err(|_| format!(r#"ids {value}: the modulo convention is "signed" or "unsigned""#)),
                Some((key, map)) if key == "map" => {
                    IdMapSpec::deserialize(map).map(Self::Map).map_err(|e| format!("ids: map: {e}"))
                }
                _ => Err(format!("ids {value}: {EXPECTED}")),
            },
            _ => Err(format!("ids {value}: {EXPECTED}")),
        }
    }
}

/// A table's id map ([`crate::id_map`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Deserialize, serde::Serialize)]
pub struct IdMapSpec {
    /// The map file, relative to the model directory.
    pub file: PathBuf,
    /// SHA-256 of the map file, hex (checked at load).
    pub sha256: String,
    /// The row ids the map does not hold are served from: a trained
    /// "unknown" row, or a row of zeros the table holds for them.
    pub default_row: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(json: &str) -> Result<TableIds, String> {
        serde_json::from_str(json).map_err(|e| e.to_string())
    }

    #[test]
    fn modulo_alone_is_signed_and_either_convention_can_be_named() {
        assert_eq!(read(r#""identity""#), Ok(TableIds::Identity));
        assert_eq!(read(r#""modulo""#), Ok(TableIds::Modulo(Modulo::Signed)));
        assert_eq!(read(r#"{"modulo": "signed"}"#), Ok(TableIds::Modulo(Modulo::Signed)));
        assert_eq!(read(r#"{"modulo": "unsigned"}"#), Ok(TableIds::Modulo(Modulo::Unsigned)));
        let map = read(r#"{"map": {"file": "tables/t.idmap", "sha256": "ab", "default_row": 3}}"#).unwrap();
        assert_eq!(
            map,
            TableIds::Map(IdMapSpec { file: "tables/t.idmap".into(), sha256: "ab".into(), default_row: 3 })
        );
        assert!(map.are_raw() && !TableIds::Identity.are_raw());
    }

    #[test]
    fn an_ids_declaration_that_is_none_of_the_forms_is_refused_naming_the_forms() {
        for bad in [
            r#""modular""#,
            r#"{"modulo": "two's complement"}"#,
            r#"{"hash": 3}"#,
            "7",
            r#"{"modulo": "signed", "map": {}}"#,
        ] {
            let error = read(bad).unwrap_err();
            assert!(
                error.contains("ids") && (error.contains(EXPECTED) || error.contains("\"unsigned\"")),
                "{bad}: {error}"
            );
        }
        let error = read(r#"{"map": {"file": "m"}}"#).unwrap_err();
        assert!(error.contains("ids: map: missing field"), "{error}");
    }
}
