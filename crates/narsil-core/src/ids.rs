//! How an id a request sends becomes a row of a table of `rows` rows, where
//! arithmetic decides it: the modulo conventions ([`Modulo`]: a split
//! model's tables declared `modulo`, and `--id-policy modulo`), and the
//! range check every request's ids go through ([`fit_ids`]: its rows in
//! `request.rs`, its request-level block in `request_level.rs`).
//!
//! Every protocol hands ids on as `i64`: `narsil.v1` and TorchRec's send
//! `int64`, KServe v2 may send `UINT64`, whose values above `i64::MAX`
//! keep their bits (two's complement). The bits are the same either way;
//! which row they name is the convention's to say, never the protocol's.

use crate::invalid::IdPolicy;
use crate::schema::SparseFeature;

/// How a 64-bit id is reduced modulo a table's rows (`"ids": {"modulo":
/// "signed"}` or `{"modulo": "unsigned"}` in a split model's
/// `schema.json`; `"ids": "modulo"` is [`Modulo::Signed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Modulo {
    /// The id's bits read as a signed `i64`, reduced to `[0, rows)` as
    /// Python's `id % rows` and PyTorch's `%` on `int64` tensors do (a
    /// floored remainder: `-1` is row `rows - 1`; `2^64 - 1` sent as
    /// `UINT64` is `-1`).
    #[default]
    Signed,
    /// The id's bits read as an unsigned `u64`, reduced as `u64 % rows`
    /// (C's and NumPy's `%` on `uint64`: `-1` sent as `int64` is `2^64 -
    /// 1`).
    Unsigned,
}

impl Modulo {
    /// The row of `id` in a table of `rows` rows (`rows > 0`).
    pub fn row(self, id: i64, rows: u64) -> u64 {
        match self {
            // In i128: a table of more than i64::MAX rows takes every id.
            Self::Signed => (i128::from(id)).rem_euclid(i128::from(rows)) as u64,
            Self::Unsigned => (id as u64) % rows,
        }
    }

    /// How `schema.json` names it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Signed => "signed",
            Self::Unsigned => "unsigned",
        }
    }
}

/// Checks `ids`, the ids of one bag (or run of bags) of `feature`, against
/// its table's rows: a feature whose ids are raw is left as it is (its
/// model maps them), and so is a raw input (never a row); an id outside `[0, num_rows)` is wrapped into range
/// ([`Modulo::Signed`]) under [`IdPolicy::Modulo`], or refused under
/// [`IdPolicy::Reject`]: `Err(position)` of the first refused id in `ids`
/// (so the caller names it). A feature of no rows takes no id.
pub(crate) fn fit_ids(ids: &mut [i64], feature: &SparseFeature, policy: IdPolicy) -> Result<(), usize> {
    if feature.is_unchecked() {
        return Ok(());
    }
    let rows = feature.num_rows;
    for (at, id) in ids.iter_mut().enumerate() {
        if (*id as u64) < rows && *id >= 0 {
            continue;
        }
        match policy {
            IdPolicy::Modulo if rows > 0 => *id = Modulo::Signed.row(*id, rows) as i64,
            _ => return Err(at),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_two_conventions_differ_only_on_ids_whose_sign_bit_is_set() {
        // The example the docs give: 2^64 - 1 (sent as UINT64, or -1 as
        // int64) in a table of 10 rows.
        assert_eq!(Modulo::Signed.row(-1, 10), 9);
        assert_eq!(Modulo::Unsigned.row(-1, 10), 5);
        assert_eq!(Modulo::Signed.row(i64::MIN, 10), 2);
        assert_eq!(Modulo::Unsigned.row(i64::MIN, 10), 8);
        for id in [0, 7, 12345, i64::MAX] {
            assert_eq!(Modulo::Signed.row(id, 10), Modulo::Unsigned.row(id, 10), "{id}");
        }
        // A table of more rows than i64::MAX.
        assert_eq!(Modulo::Signed.row(-1, u64::MAX), u64::MAX - 1);
        assert_eq!(Modulo::Unsigned.row(-1, u64::MAX), 0);
    }

    #[test]
    fn out_of_range_ids_are_wrapped_signed_or_refused_at_their_position_and_raw_ids_are_left_alone() {
        let feature = SparseFeature::new("f", 10);
        let mut ids = [3, -1, 25, i64::MIN];
        fit_ids(&mut ids, &feature, IdPolicy::Modulo).unwrap();
        assert_eq!(ids, [3, 9, 5, 2]);
        let mut ids = [3, 9, 10, 0];
        assert_eq!(fit_ids(&mut ids, &feature, IdPolicy::Reject), Err(2));
        let mut ids = [-1];
        assert_eq!(fit_ids(&mut ids, &feature, IdPolicy::Reject), Err(0));
        let raw = SparseFeature { raw_ids: true, ..feature };
        let mut ids = [-1, i64::MAX];
        fit_ids(&mut ids, &raw, IdPolicy::Reject).unwrap();
        assert_eq!(ids, [-1, i64::MAX]);
        // A raw input: never a row, never wrapped, whatever the policy.
        let input = SparseFeature::raw("t");
        let mut values = [i64::MIN, -1, 0, i64::MAX];
        fit_ids(&mut values, &input, IdPolicy::Modulo).unwrap();
        assert_eq!(values, [i64::MIN, -1, 0, i64::MAX]);
        // No rows: nothing to wrap into (refused, never a division by zero).
        let empty = SparseFeature::new("e", 0);
        assert_eq!(fit_ids(&mut [4], &empty, IdPolicy::Modulo), Err(0));
    }
}
