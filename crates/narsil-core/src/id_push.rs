//! Raw ids pushed to a served model's id maps, each with its row
//! ([`crate::BackendFactory::push_ids`]): what a push asks for
//! ([`IdPush`]: checked only, applied, or replayed from the model's push
//! log into a version that is loading), what it did ([`IdsPushed`]), and
//! which tables take pushes ([`IdMapTable`]).

/// How a push is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushMode {
    /// Checked as [`PushMode::Apply`] would, nothing changed: the answer
    /// says what applying it would do, or why it would be refused.
    Check,
    /// Added at once, all or nothing. Refused, naming why, for a raw id the
    /// table holds with another row (in its map, or pushed before).
    Apply,
    /// Replayed from the push log into a version before it serves: an id the
    /// version holds already (its own map's row, or a row replayed before)
    /// keeps that row, whatever the log says, and is counted in
    /// [`IdsPushed::superseded`]; the rest is added as by
    /// [`PushMode::Apply`].
    Replay,
}

/// One push to one table.
#[derive(Debug, Clone, Copy)]
pub struct IdPush<'a> {
    /// The table's name.
    pub table: &'a str,
    /// Entries back to back: an 8-byte little-endian raw id, then the
    /// table's `row_bytes` of its row in the table's storage format.
    pub entries: &'a [u8],
    /// Checked, applied or replayed.
    pub mode: PushMode,
    /// Most bytes the table's pushed ids may hold after the push
    /// ([`IdsPushed::bytes`]); a push past it is refused naming it.
    pub max_bytes: u64,
    /// The flag or setting that set `max_bytes`, named in a refusal.
    pub bound_name: &'a str,
}

impl<'a> IdPush<'a> {
    /// A push of `entries` to `table`, applied, bounded by `max_bytes`
    /// (set by `bound_name`).
    pub fn apply(table: &'a str, entries: &'a [u8], max_bytes: u64, bound_name: &'a str) -> Self {
        Self { table, entries, mode: PushMode::Apply, max_bytes, bound_name }
    }

    /// This push in `mode`.
    pub fn in_mode(self, mode: PushMode) -> Self {
        Self { mode, ..self }
    }
}

/// What [`crate::BackendFactory::push_ids`] did (or, checked, would do).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct IdsPushed {
    /// Raw ids added by this push.
    pub added: u64,
    /// Raw ids of the push the table already held with the same row (a push
    /// sent again): left as they were.
    pub already_held: u64,
    /// Replayed only: raw ids the version held already with another row (its
    /// own map's, or one replayed before), which keep it.
    #[serde(skip_serializing_if = "is_zero")]
    pub superseded: u64,
    /// Raw ids pushed to the table so far, this push's included.
    pub pushed: u64,
    /// Bytes the table's pushed ids hold, this push's included: their rows
    /// and [`INDEX_BYTES_PER_ID`] of index each (what
    /// [`IdPush::max_bytes`] bounds).
    pub bytes: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Bytes of index a pushed id is charged beside its row: the hash index
/// holding it takes 20 to 39 bytes an id as it fills, and its entry in the
/// index of rows.
pub const INDEX_BYTES_PER_ID: u64 = 32;

/// A table that declares an id map, as pushes see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdMapTable {
    /// The table's name.
    pub name: String,
    /// Its rows' format, `STORAGE-DIM-ROW_BYTES` (`int8_rowwise-64-80`): a
    /// push log holds rows of one format, replayed only into tables of it.
    pub row_format: String,
    /// Why this version takes no pushes to it (its rows are not in this
    /// process, or on a device), if it takes none.
    pub refused: Option<String>,
}
