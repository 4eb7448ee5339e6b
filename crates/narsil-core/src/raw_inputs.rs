//! Raw integer inputs outside a sequence ([`crate::SparseFeature::raw_input`]:
//! a candidate's query time): exactly one value per sample, or one in a
//! ranking request's block where the feature is request-level (each of
//! the block's rows gets it). Checked at validation, before any queue; a
//! bag of any other length is refused naming the feature and the sample.
//! Their values are never range-checked nor mapped (`ids.rs`).

use crate::invalid::{InputField, InvalidInput};
use crate::request::RequestSamples;
use crate::request_level::RequestBlock;
use crate::schema::ModelSchema;

impl RequestSamples {
    /// Checks that each row holds exactly one value of every raw input
    /// outside a sequence (none where a grouped request's block holds it).
    /// Lengths explicit.
    pub(crate) fn check_row_raw_inputs(&self, schema: &ModelSchema) -> Result<(), InvalidInput> {
        let (b, num_sparse, layout) = (self.num_samples, schema.num_sparse(), self.layout);
        for f in schema.row_raw_inputs() {
            if self.request.is_some() && schema.request_level.contains(f) {
                // Sent once in the block (checked there); the rows' bags
                // of it are empty once widened.
                continue;
            }
            for sample in 0..b {
                let len = self.lengths[layout.bag_index(sample, f, b, num_sparse)];
                if len != 1 {
                    let place = format!("sample {sample}");
                    return Err(not_one(InputField::Lengths, &place, &schema.sparse[f].name, len));
                }
            }
        }
        Ok(())
    }

    /// For a grouped request whose block counts its rows
    /// ([`RequestBlock::request_rows`]): records its last row's raw inputs
    /// outside sequences on the block ([`RequestBlock::last_row_raw`]),
    /// before the engine can cut it into parts. Rows checked
    /// ([`Self::check_row_raw_inputs`]).
    pub(crate) fn record_last_row_raw(&mut self, schema: &ModelSchema) {
        let (b, num_sparse, layout) = (self.num_samples, schema.num_sparse(), self.layout);
        let Some(block) = self.request.as_mut().filter(|block| block.request_rows > 0) else { return };
        let level = &schema.request_level;
        let last_row: Vec<i64> = schema
            .row_raw_inputs()
            .into_iter()
            .map(|f| match level.features.binary_search(&f) {
                // Checked: one value in the block (`check_raw_inputs`).
                Ok(k) => block.feature_ids(k)[0],
                Err(_) => {
                    let bag = layout.bag_index(b - 1, f, b, num_sparse);
                    let at: u64 = self.lengths[..bag].iter().map(|&l| u64::from(l)).sum();
                    self.ids[at as usize]
                }
            })
            .collect();
        let block = std::sync::Arc::make_mut(block);
        block.last_row_raw = last_row;
        block.digest = block.hash_values();
    }
}

impl RequestBlock {
    /// Checks that the block holds exactly one value of every request-level
    /// raw input outside a sequence. Lengths explicit, one per
    /// request-level feature.
    pub(crate) fn check_raw_inputs(&self, schema: &ModelSchema) -> Result<(), InvalidInput> {
        for (k, &f) in schema.request_level.features.iter().enumerate() {
            let feature = &schema.sparse[f];
            if feature.raw_input && schema.sequence_of(f).is_none() && self.lengths[k] != 1 {
                let place = "the request block";
                return Err(not_one(InputField::RequestLengths, place, &feature.name, self.lengths[k]));
            }
        }
        Ok(())
    }
}

/// A raw input outside a sequence sent with `len` values at `place`.
fn not_one(field: InputField, place: &str, name: &str, len: u32) -> InvalidInput {
    InvalidInput::new(
        field,
        format!(
            "{place}: raw input {name:?} has {len} values; a raw input outside a sequence takes exactly \
             one value per sample (once in the request block where it is request-level)"
        ),
    )
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::request::{IdPolicy, RequestLimits, RequestSamples};
    use crate::request_level::RequestBlock;
    use crate::schema::{ModelSchema, RequestLevel, SparseFeature};
    use crate::InputField;

    /// cat_0 (10 rows), `query_time` and `user_time` raw inputs, the
    /// latter request-level with cat_0.
    fn schema() -> ModelSchema {
        let mut s = ModelSchema::dlrm("mock", "cpu", 10);
        s.num_dense = 1;
        s.sparse.truncate(1);
        s.sparse.extend([SparseFeature::raw("query_time"), SparseFeature::raw("user_time")]);
        s
    }

    const LIMITS: RequestLimits = RequestLimits::new(8, IdPolicy::Reject);

    #[test]
    fn a_raw_input_takes_any_int64_unchanged_under_either_id_policy() {
        for policy in [IdPolicy::Reject, IdPolicy::Modulo] {
            let mut r = RequestSamples {
                num_samples: 3,
                dense: vec![0.5; 3],
                ids: vec![3, i64::MIN, 0, 4, -1, 7, 5, i64::MAX, 9],
                ..Default::default()
            };
            r.validate(&schema(), RequestLimits { id_policy: policy, ..LIMITS }).unwrap();
            assert_eq!(r.ids, [3, i64::MIN, 0, 4, -1, 7, 5, i64::MAX, 9], "{policy:?}");
        }
        // The table's own feature is still checked.
        let mut r =
            RequestSamples { num_samples: 1, dense: vec![0.5], ids: vec![10, 1, 2], ..Default::default() };
        assert!(r.validate(&schema(), LIMITS).unwrap_err().message.contains("cat_0"));
    }

    #[test]
    fn a_raw_input_with_other_than_one_value_a_sample_is_refused_naming_the_feature_and_sample() {
        // Sample 1 sends two query times, then none.
        for (lengths, ids, len) in [
            (vec![1, 1, 1, 1, 2, 1], vec![1, 5, 6, 2, 7, 8, 9], 2),
            (vec![1, 1, 1, 1, 0, 1], vec![1, 5, 6, 2, 9], 0),
        ] {
            let mut r =
                RequestSamples { num_samples: 2, dense: vec![0.5; 2], lengths, ids, ..Default::default() };
            let e = r.validate(&schema(), LIMITS).unwrap_err();
            assert_eq!(e.field, InputField::Lengths);
            assert!(
                e.message.contains(&format!("sample 1: raw input \"query_time\" has {len} values")),
                "{e}"
            );
        }
    }

    #[test]
    fn a_request_level_raw_input_is_one_value_in_the_block_and_none_on_its_rows() {
        let mut s = schema();
        s.request_level = RequestLevel::parse(["cat_0", "user_time"], &s).unwrap();
        let grouped = |block_lengths: Vec<u32>, block_ids: Vec<i64>| RequestSamples {
            num_samples: 2,
            dense: vec![0.5; 2],
            // Each row: its query time.
            ids: vec![-5, i64::MAX],
            request: Some(Arc::new(RequestBlock {
                lengths: block_lengths,
                ids: block_ids,
                ..Default::default()
            })),
            ..Default::default()
        };
        let mut ok = grouped(vec![1, 1], vec![3, i64::MIN]);
        ok.validate(&s, LIMITS).unwrap();
        assert_eq!(ok.request.as_ref().unwrap().ids, [3, i64::MIN]);
        assert_eq!(ok.ids, [-5, i64::MAX]);
        let e = grouped(vec![1, 2], vec![3, 1, 2]).validate(&s, LIMITS).unwrap_err();
        assert_eq!(e.field, InputField::RequestLengths);
        assert!(e.message.contains("the request block: raw input \"user_time\" has 2 values"), "{e}");
        // Sent flat, the same model takes it on every row.
        let mut flat = RequestSamples {
            num_samples: 1,
            dense: vec![0.5],
            lengths: vec![1, 1, 0],
            ids: vec![3, 4],
            ..Default::default()
        };
        let e = flat.clone().validate(&s, LIMITS).unwrap_err();
        assert!(e.message.contains("sample 0: raw input \"user_time\" has 0 values"), "{e}");
        flat.lengths[2] = 1;
        flat.ids.push(-1);
        flat.validate(&s, LIMITS).unwrap();
    }
}
