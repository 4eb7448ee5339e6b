//! Sequence features: a user's behaviour history, one embedding per
//! position (unpooled; TorchRec's `EmbeddingCollection`), attended by each
//! candidate. On the wire a sequence is a sparse feature's bag, ids oldest
//! first: on every row (the flat form, TorchRec's) or once in a ranking
//! request's block when its features are request-level. A sequence's
//! features are its aligned channels (an item history and its category
//! history): their bags are the same length in every sample.
//!
//! Validation checks that alignment and cuts a sequence longer than its
//! maximum at the model's end (the most recent positions by default),
//! counting the positions dropped: never refused for its length.
//!
//! A channel may be a raw integer input (`"pooling": "raw"`: a timestamp,
//! an action bitmask), aligned with the others and cut with them, whose
//! values reach the dense network as sent. A sequence may also declare
//! `"request_rows": true`: its network then takes, per unit, the rows of
//! the whole request the unit came from (`docs/guide/sequences.md`).

use serde::Deserialize;

use crate::invalid::{InputField, InvalidInput};
use crate::schema::{sent_once, ModelSchema};
pub use crate::schema::{KeepEnd, SequenceFeature};
use crate::working_set::WorkingSet;

/// A sequence as `schema.json`, `model.json` and `narsil_schema()` declare
/// it: `{"name": "history", "features": ["hist_item", "hist_cat"],
/// "max_len": 256, "keep": "last", "working_set": {...}, "request_rows":
/// false}` (`keep` optional, `last` by default; `working_set` and
/// `package_working_set` optional: [`crate::working_set`]; `request_rows`
/// optional, false by default).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SequenceJson {
    /// Its name.
    pub name: String,
    /// Its channels' feature names.
    pub features: Vec<String>,
    /// Positions kept at most.
    pub max_len: usize,
    /// `last` or `first`.
    #[serde(default)]
    pub keep: Option<String>,
    /// What its dense network allocates per request for it
    /// ([`crate::working_set`]); optional.
    #[serde(default)]
    pub working_set: Option<WorkingSet>,
    /// What a split model's AOTInductor packages allocate per request for
    /// it where they attend otherwise than `dense.pt`
    /// ([`crate::working_set`]); optional.
    #[serde(default)]
    pub package_working_set: Option<WorkingSet>,
    /// Whether its dense network takes each unit's request rows
    /// ([`SequenceFeature::request_rows`]); optional, false.
    #[serde(default)]
    pub request_rows: bool,
}

/// The sequences `declared`, checked against `schema` (whose
/// `request_level` is already set).
pub fn declare(declared: &[SequenceJson], schema: &ModelSchema) -> Result<Vec<SequenceFeature>, String> {
    let mut sequences: Vec<SequenceFeature> = Vec::with_capacity(declared.len());
    for (i, json) in declared.iter().enumerate() {
        if declared[..i].iter().any(|s| s.name == json.name) {
            return Err(format!("sequence {:?} is declared twice", json.name));
        }
        let keep = json.keep.as_deref().map_or(Ok(KeepEnd::Last), KeepEnd::parse)?;
        let mut sequence =
            SequenceFeature::new(&json.name, &json.features, json.max_len, keep, schema, &sequences)?;
        for declared in [json.working_set, json.package_working_set].into_iter().flatten() {
            declared.check().map_err(|e| format!("sequence {:?}: {e}", json.name))?;
        }
        sequence.working_set = json.working_set;
        sequence.package_working_set = json.package_working_set;
        if json.request_rows && !sequence.is_request_level(schema) {
            return Err(format!(
                "sequence {:?} declares \"request_rows\": true, but its features are not all request-level: \
                 only a sequence sent once per ranking request (every channel in \"request_level\") has rows \
                 of a whole request to count; drop \"request_rows\" or declare its channels request-level",
                json.name
            ));
        }
        sequence.request_rows = json.request_rows;
        sequences.push(sequence);
    }
    Ok(sequences)
}

impl SequenceFeature {
    /// A declaration by feature names (checked against `schema`'s sparse
    /// features: each exists, is unweighted and in no other sequence of
    /// `declared`).
    pub fn new(
        name: &str,
        features: &[String],
        max_len: usize,
        keep: KeepEnd,
        schema: &ModelSchema,
        declared: &[SequenceFeature],
    ) -> Result<Self, String> {
        if features.is_empty() {
            return Err(format!("sequence {name:?} names no feature"));
        }
        if max_len == 0 {
            return Err(format!("sequence {name:?}: max_len must be at least 1"));
        }
        let mut indices = Vec::with_capacity(features.len());
        for feature in features {
            let Some(f) = schema.sparse.iter().position(|s| &s.name == feature) else {
                return Err(format!("sequence {name:?} names {feature:?}, which is not a sparse feature"));
            };
            if schema.sparse[f].weighted {
                return Err(format!(
                    "sequence {name:?}: feature {feature:?} is weighted; a position has no weight"
                ));
            }
            if indices.contains(&f) || declared.iter().any(|s| s.features.contains(&f)) {
                return Err(format!("feature {feature:?} is in two sequences"));
            }
            indices.push(f);
        }
        sent_once(name, &indices, &schema.request_level, schema)?;
        let raw_channels = indices.iter().filter(|&&f| schema.sparse[f].raw_input).count();
        Ok(Self {
            name: name.into(),
            features: indices,
            max_len,
            keep,
            width: 0,
            working_set: None,
            package_working_set: None,
            raw_channels,
            request_rows: false,
        })
    }

    /// Bytes one of its positions takes once the stage has laid it out:
    /// its looked-up FP32 values and its raw channels' int64 values.
    pub fn position_bytes(&self) -> usize {
        self.width * std::mem::size_of::<f32>() + self.raw_channels * std::mem::size_of::<i64>()
    }

    /// What its dense network allocates per request for it: as declared,
    /// else [`WorkingSet::undeclared`] for its width.
    pub fn working_set(&self) -> WorkingSet {
        self.working_set.unwrap_or(WorkingSet::undeclared(self.width))
    }

    /// Whether its channels are request-level (sent once in a ranking
    /// request's block): all of them are, or none ([`crate::schema::sent_once`], checked
    /// wherever a schema's request-level inputs are set).
    pub fn is_request_level(&self, schema: &ModelSchema) -> bool {
        self.features.iter().all(|&f| schema.request_level.contains(f))
    }
}

/// Where a request's bags lie, for [`fit_sequences`].
pub(crate) struct BagLayout<'a> {
    /// Samples (1 for a request block).
    pub samples: usize,
    /// The index in `lengths` of (sample, feature)'s bag.
    pub bag: &'a dyn Fn(usize, usize) -> usize,
    /// The feature of bag `b`.
    pub feature: &'a dyn Fn(usize) -> usize,
    /// The field a misaligned sequence is reported under.
    pub field: InputField,
    /// Where a sample is, for a message (`sample 3`, `the request block`).
    pub place: &'a dyn Fn(usize) -> String,
}

/// Checks that each of `sequences`' channels has as many positions as its
/// first channel in every sample, then cuts every bag of a sequence longer
/// than its maximum at its kept end, removing the dropped ids from `ids`
/// (bags end to end in `lengths` order). Returns the positions dropped.
pub(crate) fn fit_sequences(
    sequences: &[&SequenceFeature],
    schema: &ModelSchema,
    lengths: &mut [u32],
    ids: &mut Vec<i64>,
    layout: &BagLayout<'_>,
) -> Result<usize, InvalidInput> {
    let mut sequence_of = vec![None; schema.num_sparse()];
    for (s, sequence) in sequences.iter().enumerate() {
        for &f in &sequence.features {
            sequence_of[f] = Some(s);
        }
    }
    let mut too_long = false;
    for sequence in sequences {
        let first = sequence.features[0];
        for sample in 0..layout.samples {
            let len = lengths[(layout.bag)(sample, first)];
            too_long |= len as usize > sequence.max_len;
            for &f in &sequence.features[1..] {
                let other = lengths[(layout.bag)(sample, f)];
                if other != len {
                    return Err(InvalidInput::new(
                        layout.field,
                        format!(
                            "{}: sequence {:?} has {len} positions in {} but {other} in {}: a sequence's \
                             channels are aligned (as long as each other)",
                            (layout.place)(sample),
                            sequence.name,
                            schema.sparse[first].name,
                            schema.sparse[f].name
                        ),
                    ));
                }
            }
        }
    }
    if !too_long {
        return Ok(0);
    }
    let (mut read, mut write, mut dropped) = (0usize, 0usize, 0usize);
    for (bag, len) in lengths.iter_mut().enumerate() {
        let n = *len as usize;
        let feature = (layout.feature)(bag);
        let kept = match sequence_of[feature].map(|s| sequences[s]) {
            Some(sequence) if n > sequence.max_len => {
                let max = sequence.max_len;
                // A position counts once, whatever its channels.
                if sequence.features[0] == feature {
                    dropped += n - max;
                }
                *len = max as u32;
                match sequence.keep {
                    KeepEnd::Last => read + n - max..read + n,
                    KeepEnd::First => read..read + max,
                }
            }
            _ => read..read + n,
        };
        let kept_len = kept.len();
        ids.copy_within(kept, write);
        write += kept_len;
        read += n;
    }
    ids.truncate(write);
    Ok(dropped)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::request::{IdPolicy, RequestLimits, RequestSamples};
    use crate::request_level::RequestBlock;
    use crate::schema::RequestLevel;

    fn schema() -> ModelSchema {
        let mut s = ModelSchema::dlrm("mock", "cpu", 100);
        s.num_dense = 1;
        s.sparse.truncate(4);
        s.request_level = RequestLevel::parse(["cat_2", "cat_3"], &s).unwrap();
        s
    }

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    const LIMITS: RequestLimits = RequestLimits::new(8, IdPolicy::Reject);

    /// `schema()` with sequence `h` (cat_2, cat_3: request-level) of at
    /// most 3 positions and sequence `r` (cat_1: per row) of at most 2.
    fn with_sequences(keep: KeepEnd) -> ModelSchema {
        let mut s = schema();
        let h = SequenceFeature::new("h", &names(&["cat_2", "cat_3"]), 3, keep, &s, &[]).unwrap();
        let r = SequenceFeature::new("r", &names(&["cat_1"]), 2, keep, &s, std::slice::from_ref(&h)).unwrap();
        s.sequences = vec![h, r];
        s
    }

    /// A flat request: one sample, every feature on the row.
    fn flat(lengths: Vec<u32>, ids: Vec<i64>) -> RequestSamples {
        RequestSamples { num_samples: 1, dense: vec![0.5], lengths, ids, ..Default::default() }
    }

    #[test]
    fn a_longer_sequence_keeps_its_most_recent_positions_and_is_counted() {
        let s = with_sequences(KeepEnd::Last);
        // cat_0: [1]; cat_1 (r, max 2): [10, 11, 12]; cat_2/cat_3 (h, max 3): 5 positions each.
        let mut r = flat(vec![1, 3, 5, 5], vec![1, 10, 11, 12, 20, 21, 22, 23, 24, 30, 31, 32, 33, 34]);
        let validated = r.validate(&s, LIMITS).unwrap();
        assert_eq!(validated.positions_truncated, 1 + 2, "r: 1, h: 2 (positions, not channels' ids)");
        assert_eq!(r.lengths, [1, 2, 3, 3]);
        assert_eq!(r.ids, [1, 11, 12, 22, 23, 24, 32, 33, 34]);
        let s = with_sequences(KeepEnd::First);
        let mut r = flat(vec![1, 3, 5, 5], vec![1, 10, 11, 12, 20, 21, 22, 23, 24, 30, 31, 32, 33, 34]);
        r.validate(&s, LIMITS).unwrap();
        assert_eq!(r.ids, [1, 10, 11, 20, 21, 22, 30, 31, 32]);
        // Within the maximum (empty included): untouched, nothing counted.
        let mut r = flat(vec![1, 0, 3, 3], vec![1, 20, 21, 22, 30, 31, 32]);
        assert_eq!(r.validate(&s, LIMITS).unwrap().positions_truncated, 0);
        assert_eq!(r.ids, [1, 20, 21, 22, 30, 31, 32]);
    }

    #[test]
    fn misaligned_channels_are_refused_naming_the_sequence_and_its_features() {
        let s = with_sequences(KeepEnd::Last);
        let e = flat(vec![1, 0, 2, 1], vec![1, 20, 21, 30]).validate(&s, LIMITS).unwrap_err();
        assert_eq!(e.field, InputField::Lengths);
        assert!(
            e.message.contains("sample 0: sequence \"h\" has 2 positions in cat_2 but 1 in cat_3"),
            "{e}"
        );
    }

    #[test]
    fn a_request_blocks_sequence_is_cut_and_checked_once_for_all_candidates() {
        let s = with_sequences(KeepEnd::Last);
        let ranking = |lengths: Vec<u32>, ids: Vec<i64>| RequestSamples {
            num_samples: 2,
            dense: vec![0.5, 0.5],
            lengths: vec![1, 1, 1, 1],
            ids: vec![1, 10, 2, 11],
            request: Some(Arc::new(RequestBlock { lengths, ids, ..Default::default() })),
            ..Default::default()
        };
        let mut r = ranking(vec![4, 4], vec![20, 21, 22, 23, 30, 31, 32, 33]);
        assert_eq!(r.validate(&s, LIMITS).unwrap().positions_truncated, 1);
        let block = r.request.as_ref().unwrap();
        assert_eq!(
            (block.lengths.as_slice(), block.ids.as_slice()),
            (&[3, 3][..], &[21, 22, 23, 31, 32, 33][..])
        );
        let e = ranking(vec![4, 3], vec![20, 21, 22, 23, 30, 31, 32]).validate(&s, LIMITS).unwrap_err();
        assert_eq!(e.field, InputField::RequestLengths);
        assert!(e.message.contains("the request block: sequence \"h\" has 4 positions"), "{e}");
    }

    #[test]
    fn a_requests_tokens_and_sequence_bytes_count_its_users_history_once() {
        let mut s = with_sequences(KeepEnd::Last);
        s.sequences[0].width = 24; // h: 16 + 8 values per position
        s.sequences[1].width = 8; // r
        let mut r = RequestSamples {
            num_samples: 3,
            dense: vec![0.5; 3],
            // Rows: cat_0 one id, cat_1 (r) 2, 0 and 1 positions.
            lengths: vec![1, 2, 1, 0, 1, 1],
            ids: vec![1, 10, 11, 2, 3, 12],
            request: Some(Arc::new(RequestBlock {
                lengths: vec![3, 3],
                ids: vec![20, 21, 22, 30, 31, 32],
                ..Default::default()
            })),
            ..Default::default()
        };
        r.validate(&s, LIMITS).unwrap();
        // 3 rows, 3 row positions, 3 history positions (once).
        assert_eq!(r.tokens(&s, false), 3 + 3 + 3);
        assert_eq!(r.stage_value_bytes(&s), (3 * 8 * 4, 3 * 24 * 4));
        // Without sequences: tokens are rows.
        assert_eq!(r.tokens(&schema(), false), 3);
    }

    #[test]
    fn a_flat_only_models_tokens_count_the_users_history_on_every_row() {
        // Lanes that take only flat batches get the block copied into each
        // row (KeyedBatch::into_flat): each row looks the history up.
        let s = with_sequences(KeepEnd::Last);
        let mut r = RequestSamples {
            num_samples: 4,
            dense: vec![0.5; 4],
            lengths: vec![1, 1, 1, 0, 1, 0, 1, 2],
            ids: vec![1, 10, 2, 3, 4, 11, 12],
            request: Some(Arc::new(RequestBlock {
                lengths: vec![3, 3],
                ids: vec![20, 21, 22, 30, 31, 32],
                ..Default::default()
            })),
            ..Default::default()
        };
        r.validate(&s, LIMITS).unwrap();
        // 4 rows, 3 row positions; the history's 3 positions once, or on each of the 4 rows.
        assert_eq!(r.tokens(&s, false), 4 + 3 + 3);
        assert_eq!(r.tokens(&s, true), 4 + 3 + 4 * 3);
        // What the flat batch looks up: its rows, and the positions of r's
        // first channel (cat_1) and h's (cat_2) on them.
        let flat = crate::assemble(s.num_dense, s.num_sparse(), [&r]).into_flat();
        let positions: i32 = [1, 2].iter().flat_map(|&f| flat.feature_lengths(f)).sum();
        assert_eq!(flat.rows + positions as usize, r.tokens(&s, true));
    }

    #[test]
    fn a_sequence_is_request_level_when_all_its_channels_are_not_when_none_are_and_else_refused() {
        // h: cat_2, cat_3; r: cat_1.
        let mut s = with_sequences(KeepEnd::Last);
        let level = |names: &[&str], s: &ModelSchema| RequestLevel::parse(names.iter().copied(), s).unwrap();
        let sent = |s: &ModelSchema| s.sequences.iter().map(|q| q.is_request_level(s)).collect::<Vec<_>>();
        assert_eq!(sent(&s), [true, false], "as declared");
        // All of r's channels and none of h's: r once per request, h per row.
        s.set_request_level(level(&["cat_0", "cat_1", "dense"], &s)).unwrap();
        assert_eq!(sent(&s), [false, true]);
        assert_eq!(s.request_level.names(&s), ["cat_0", "cat_1", "dense"]);
        s.set_request_level(level(&["none"], &s)).unwrap();
        assert_eq!(sent(&s), [false, false]);
        // Some of h's channels only: refused, naming the sequence and its
        // channels, and the schema keeps what it had.
        let before = s.clone();
        let e = s.set_request_level(level(&["cat_2", "dense"], &s)).unwrap_err();
        assert!(
            e.contains("sequence \"h\" (channels cat_2, cat_3) is request-level in cat_2 but not in cat_3"),
            "{e}"
        );
        assert_eq!(s, before);
        let e = s.set_request_level(level(&["cat_3", "cat_1"], &s)).unwrap_err();
        assert!(e.contains("request-level in cat_3 but not in cat_2"), "{e}");
    }

    #[test]
    fn a_declaration_names_its_faults() {
        let s = schema();
        let ok = SequenceFeature::new("h", &names(&["cat_2", "cat_3"]), 4, KeepEnd::Last, &s, &[]).unwrap();
        assert_eq!((ok.features.clone(), ok.is_request_level(&s)), (vec![2, 3], true));
        let e = SequenceFeature::new("h", &names(&["nope"]), 4, KeepEnd::Last, &s, &[]).unwrap_err();
        assert!(e.contains("\"nope\""), "{e}");
        let e =
            SequenceFeature::new("h", &names(&["cat_1", "cat_2"]), 4, KeepEnd::Last, &s, &[]).unwrap_err();
        assert!(e.contains("request-level in cat_2 but not in cat_1"), "{e}");
        let e = SequenceFeature::new("g", &names(&["cat_3"]), 4, KeepEnd::Last, &s, &[ok]).unwrap_err();
        assert!(e.contains("two sequences"), "{e}");
        let e = SequenceFeature::new("h", &names(&["cat_0"]), 0, KeepEnd::Last, &s, &[]).unwrap_err();
        assert!(e.contains("max_len"), "{e}");
        assert_eq!(KeepEnd::parse("first"), Ok(KeepEnd::First));
        assert!(KeepEnd::parse("newest").is_err());
    }

    #[test]
    fn request_rows_on_a_sequence_sent_on_every_row_is_refused_naming_it() {
        let s = schema();
        let json = |name: &str, features: &[&str]| SequenceJson {
            name: name.into(),
            features: names(features),
            max_len: 4,
            keep: None,
            working_set: None,
            package_working_set: None,
            request_rows: true,
        };
        // cat_1 is per row: each row is its own unit, with no whole request to count.
        let e = declare(&[json("r", &["cat_1"])], &s).unwrap_err();
        assert!(
            e.contains("sequence \"r\" declares \"request_rows\": true") && e.contains("request-level"),
            "{e}"
        );
        // cat_2 and cat_3 are request-level.
        assert!(declare(&[json("h", &["cat_2", "cat_3"])], &s).unwrap()[0].request_rows);
    }

    #[test]
    fn a_package_working_set_is_charged_only_where_a_package_is_served() {
        let mut s = schema();
        let units: WorkingSet = serde_json::from_str(
            r#"{"kind": "unit_attention", "block": 4, "heads": 1, "head_dim": 2, "model_dim": 2}"#,
        )
        .unwrap();
        let blocks: WorkingSet = serde_json::from_str(
            r#"{"kind": "block_attention", "block": 4, "heads": 1, "head_dim": 2, "model_dim": 2}"#,
        )
        .unwrap();
        let json = |package: Option<WorkingSet>| SequenceJson {
            name: "h".into(),
            features: names(&["cat_2", "cat_3"]),
            max_len: 4,
            keep: None,
            working_set: Some(units),
            package_working_set: package,
            request_rows: false,
        };
        s.sequences = declare(&[json(Some(blocks))], &s).unwrap();
        assert_eq!(s.sequences[0].working_set(), units);
        s.charge_package_working_sets();
        assert_eq!(s.sequences[0].working_set(), blocks);
        // Declared without one: every form is charged `working_set`.
        s.sequences = declare(&[json(None)], &s).unwrap();
        s.charge_package_working_sets();
        assert_eq!(s.sequences[0].working_set(), units);
        // A package's declaration is checked as the other is.
        let zero: WorkingSet = serde_json::from_str(r#"{"kind": "gather", "width": 0}"#).unwrap();
        let e = declare(&[json(Some(zero))], &s).unwrap_err();
        assert!(e.contains("sequence \"h\"") && e.contains("width must be at least 1"), "{e}");
    }

    #[test]
    fn every_part_of_a_cut_request_carries_its_whole_requests_last_row_raw_inputs() {
        // cat_0: a raw input per row (a query time); h (cat_2, cat_3) request-level, counting rows.
        let mut s = schema();
        s.sparse[0].raw_input = true;
        let mut h =
            SequenceFeature::new("h", &names(&["cat_2", "cat_3"]), 3, KeepEnd::Last, &s, &[]).unwrap();
        h.request_rows = true;
        s.sequences = vec![h];
        let ranking = |query_times: [i64; 3]| RequestSamples {
            num_samples: 3,
            dense: vec![0.5; 3],
            lengths: vec![1, 1, 1, 1, 1, 1],
            ids: vec![query_times[0], 10, query_times[1], 11, query_times[2], 12],
            request: Some(Arc::new(RequestBlock {
                lengths: vec![2, 2],
                ids: vec![20, 21, 30, 31],
                ..Default::default()
            })),
            ..Default::default()
        };
        let mut r = ranking([1_700_000_000, 1_700_000_005, -7]);
        r.validate(&s, LIMITS).unwrap();
        let parts = r.split_rows(2, s.num_sparse());
        assert_eq!(parts.len(), 2);
        for part in &parts {
            let block = part.request.as_ref().unwrap();
            assert_eq!((block.request_rows, block.last_row_raw.as_slice()), (3, &[-7][..]));
        }
        // Two requests of one user differing only in their last row's query time are two units.
        let mut other = ranking([1_700_000_000, 1_700_000_005, 9]);
        other.validate(&s, LIMITS).unwrap();
        assert_ne!(other.request.as_ref().unwrap().digest, parts[0].request.as_ref().unwrap().digest);
        assert_ne!(other.request, parts[0].request);
    }
}
