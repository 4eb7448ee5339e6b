//! One client request as it arrives: `B` samples laid out sample-major, and
//! the checks that make it safe to hand to a model.
//!
//! Validation runs before a request is queued. A validated [`RequestSamples`]
//! has explicit lengths, finite dense values and in-range ids, so nothing
//! downstream (reorder, backends, FBGEMM's unchecked lookups) re-checks.

use std::sync::Arc;

use crate::ids::fit_ids;
use crate::invalid::{ids_match_lengths, widen_weights};
pub use crate::invalid::{IdPolicy, InputField, InvalidInput, RequestLimits};
use crate::request_level::{widen_row_lengths, RequestBlock};
use crate::schema::ModelSchema;

/// What validation changed in a request that it still serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Validated {
    /// Sequence positions dropped: sequences longer than their maximum are
    /// cut at the model's end ([`crate::sequence`]), never refused.
    pub positions_truncated: usize,
}

/// How a request lays out its sparse lengths and ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SparseLayout {
    /// Sample 0's bags for every feature, then sample 1's (Narsil's
    /// protocol).
    #[default]
    SampleMajor,
    /// Every bag of feature 0 for all samples, then feature 1 (TorchRec's
    /// `KeyedJaggedTensor` and inference protocol).
    KeyMajor,
}

/// One request's samples. (In Narsil's words a *request* carries samples;
/// a *batch* is what one forward runs: the rows of the requests fused into
/// it.)
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RequestSamples {
    /// Number of samples `B` (`batch_size` on the wire).
    pub num_samples: usize,
    /// `[B x num_dense]`, sample-major.
    pub dense: Vec<f32>,
    /// Ids per (sample, feature) bag, `B x num_sparse` of them in `layout`
    /// order. Empty on the wire means one id per bag; validation fills it in.
    pub lengths: Vec<u32>,
    /// All ids, bag after bag in `layout` order.
    pub ids: Vec<i64>,
    /// Weights of the weighted features' ids. As sent: one per id of a
    /// weighted feature, bag after bag in `layout` order (empty when the
    /// model has no weighted feature). Validation widens it to one per id in
    /// `ids` (1.0 for unweighted features' ids), so it moves with the ids.
    pub weights: Vec<f32>,
    /// Order of `lengths` and `ids`; dense values are always sample-major.
    pub layout: SparseLayout,
    /// A ranking request's request-level features, sent once for all its
    /// samples (its candidates); `None` for a flat request. See
    /// [`crate::request_level`]: once validated, the rows hold an empty
    /// bag for each request-level feature.
    pub request: Option<Arc<RequestBlock>>,
}

impl RequestSamples {
    /// Memory its decoded values take (what a queued request holds).
    pub fn decoded_bytes(&self) -> usize {
        self.row_bytes() + self.request.as_ref().map_or(0, |b| b.decoded_bytes())
    }

    /// Memory its rows take (without its request-level block, which the
    /// parts of a split request share).
    pub fn row_bytes(&self) -> usize {
        use std::mem::size_of;
        self.dense.len() * size_of::<f32>()
            + self.lengths.len() * size_of::<u32>()
            + self.ids.len() * size_of::<i64>()
            + self.weights.len() * size_of::<f32>()
    }
}

impl RequestSamples {
    /// Bytes its rows grow by once fused, beyond [`Self::decoded_bytes`]:
    /// a grouped request's request-level dense values are broadcast to each
    /// of its rows, and for a backend that takes only flat batches
    /// (`flat_only`) its block's ids, with a weight each, are copied into
    /// every row ([`crate::KeyedBatch::into_flat`]). 0 for a flat request.
    /// Saturates rather than overflows: the engine refuses what does not
    /// fit its memory bound.
    pub fn fused_growth_bytes(&self, flat_only: bool) -> usize {
        use std::mem::size_of;
        let Some(block) = &self.request else { return 0 };
        let per_row = block.dense.len() * size_of::<f32>()
            + if flat_only { block.ids.len() * (size_of::<i64>() + size_of::<f32>()) } else { 0 };
        self.num_samples.saturating_mul(per_row)
    }
}

impl SparseLayout {
    /// (sample, feature) of bag number `bag` in this layout.
    pub(crate) fn bag_position(self, bag: usize, batch_size: usize, num_sparse: usize) -> (usize, usize) {
        match self {
            Self::SampleMajor => (bag / num_sparse, bag % num_sparse),
            Self::KeyMajor => (bag % batch_size, bag / batch_size),
        }
    }

    /// The number of (sample, feature)'s bag in this layout: the inverse of
    /// [`Self::bag_position`].
    pub(crate) fn bag_index(
        self,
        sample: usize,
        feature: usize,
        batch_size: usize,
        num_sparse: usize,
    ) -> usize {
        match self {
            Self::SampleMajor => sample * num_sparse + feature,
            Self::KeyMajor => feature * batch_size + sample,
        }
    }
}

impl RequestSamples {
    /// True when every (sample, feature) bag holds exactly one id, so `ids`
    /// is a `[B x num_sparse]` matrix (`[num_sparse x B]` when key-major).
    pub fn is_one_id_per_bag(&self) -> bool {
        // A fold without early exit vectorizes; the common answer is yes.
        self.ids.len() == self.lengths.len() && self.lengths.iter().fold(0, |acc, &l| acc | (l ^ 1)) == 0
    }

    /// Checks the request against the model's schema and fills in implicit
    /// lengths; cuts sequences longer than their maximum
    /// ([`crate::sequence`]). On success the batch is safe to reorder and
    /// run.
    pub fn validate(
        &mut self,
        schema: &ModelSchema,
        limits: RequestLimits,
    ) -> Result<Validated, InvalidInput> {
        let b = self.num_samples;
        let num_sparse = schema.num_sparse();
        if b == 0 {
            return Err(InvalidInput::new(InputField::SampleCount, "must be at least 1"));
        }
        if b > limits.max_samples {
            return Err(InvalidInput::new(
                InputField::SampleCount,
                format!("{b} exceeds the server's limit of {}", limits.max_samples),
            ));
        }
        let mut validated = Validated::default();
        let row_dense = match self.request.as_mut() {
            Some(block) => {
                let (row_dense, truncated) = widen_row_lengths(
                    Arc::make_mut(block),
                    &mut self.lengths,
                    self.ids.len(),
                    b,
                    schema,
                    limits,
                )?;
                validated.positions_truncated += truncated;
                row_dense
            }
            None => schema.num_dense,
        };
        self.check_dense(row_dense)?;
        if self.lengths.is_empty() {
            // One id per bag: the count is checked before the lengths are
            // written out, so a message that claims many samples and sends
            // few ids allocates nothing for them.
            ids_match_lengths(self.ids.len(), b * num_sparse, InputField::Ids)?;
            self.lengths = vec![1; b * num_sparse];
        } else if self.lengths.len() != b * num_sparse {
            return Err(InvalidInput::new(
                InputField::Lengths,
                format!(
                    "has {} entries, expected batch_size x num_sparse = {b} x {num_sparse} = {} (or none for one id per bag)",
                    self.lengths.len(),
                    b * num_sparse
                ),
            ));
        }
        let total: u64 = self.lengths.iter().map(|&l| u64::from(l)).sum();
        ids_match_lengths(self.ids.len(), total as usize, InputField::Ids)?;
        validated.positions_truncated += self.fit_sequences(schema)?;
        self.check_row_raw_inputs(schema)?;
        self.record_last_row_raw(schema);
        self.check_ids(schema, limits.id_policy)?;
        self.widen_weights(schema)?;
        Ok(validated)
    }

    /// Checks the weights sent (count, finite) and widens them to one per
    /// id, in `ids` order.
    fn widen_weights(&mut self, schema: &ModelSchema) -> Result<(), InvalidInput> {
        let num_sparse = schema.num_sparse();
        let first_weighted = schema.num_unweighted();
        if first_weighted == num_sparse {
            if !self.weights.is_empty() {
                return Err(InvalidInput::new(
                    InputField::Weights,
                    "the model has no weighted feature; send none",
                ));
            }
            return Ok(());
        }
        let (b, layout) = (self.num_samples, self.layout);
        let weighted_bag = |bag: usize| layout.bag_position(bag, b, num_sparse).1 >= first_weighted;
        widen_weights(
            &mut self.weights,
            &self.lengths,
            weighted_bag,
            InputField::Weights,
            "the weighted features'",
        )
    }

    /// Cuts a validated batch into consecutive parts of at most `max_rows`
    /// samples each, in order, keeping the layout. A batch that fits is
    /// returned whole. Scores of the parts, concatenated, are the scores of
    /// the whole.
    pub fn split_rows(self, max_rows: usize, num_sparse: usize) -> Vec<RequestSamples> {
        let b = self.num_samples;
        if b <= max_rows || max_rows == 0 {
            return vec![self];
        }
        let ends: Vec<usize> = (max_rows..b).step_by(max_rows).chain([b]).collect();
        self.split_at(&ends, num_sparse)
    }

    /// Cuts a validated batch into consecutive parts ending at the rows
    /// `ends` (ascending, the last `num_samples`), in order, keeping the
    /// layout; each part shares the request block. One end: the batch
    /// whole.
    pub(crate) fn split_at(self, ends: &[usize], num_sparse: usize) -> Vec<RequestSamples> {
        let b = self.num_samples;
        debug_assert_eq!(ends.last(), Some(&b));
        if ends.len() <= 1 {
            return vec![self];
        }
        let num_dense = self.dense.len() / b;
        // Where each bag's ids start, in `layout` order.
        let mut starts = Vec::with_capacity(self.lengths.len() + 1);
        let mut cursor = 0usize;
        starts.push(0);
        for &len in &self.lengths {
            cursor += len as usize;
            starts.push(cursor);
        }
        let firsts = std::iter::once(0).chain(ends.iter().copied());
        firsts
            .zip(ends.iter().copied())
            .map(|(first, end)| {
                let mut part = RequestSamples {
                    num_samples: end - first,
                    dense: self.dense[first * num_dense..end * num_dense].to_vec(),
                    lengths: Vec::with_capacity((end - first) * num_sparse),
                    ids: Vec::new(),
                    weights: Vec::new(),
                    layout: self.layout,
                    // Shared, never copied per part.
                    request: self.request.clone(),
                };
                // Runs of consecutive bags that belong to this part: one run
                // sample-major, one per feature key-major.
                let runs: Vec<(usize, usize)> = match self.layout {
                    SparseLayout::SampleMajor => vec![(first * num_sparse, end * num_sparse)],
                    SparseLayout::KeyMajor => (0..num_sparse).map(|f| (f * b + first, f * b + end)).collect(),
                };
                for (from, to) in runs {
                    part.lengths.extend_from_slice(&self.lengths[from..to]);
                    part.ids.extend_from_slice(&self.ids[starts[from]..starts[to]]);
                    if !self.weights.is_empty() {
                        part.weights.extend_from_slice(&self.weights[starts[from]..starts[to]]);
                    }
                }
                part
            })
            .collect()
    }

    fn check_dense(&self, num_dense: usize) -> Result<(), InvalidInput> {
        let expected = self.num_samples * num_dense;
        if self.dense.len() != expected {
            let why = if self.request.is_some() && num_dense == 0 {
                format!("has {} values, but the dense features are request-level: send them once in request.dense", self.dense.len())
            } else {
                format!(
                    "has {} values, expected batch_size x num_dense = {} x {num_dense} = {expected}",
                    self.dense.len(),
                    self.num_samples
                )
            };
            return Err(InvalidInput::new(InputField::Dense, why));
        }
        // Scanned without early exit (vectorizes); located only when needed.
        let all_finite = self.dense.iter().fold(true, |ok, v| ok & v.is_finite());
        if let Some(pos) = (!all_finite).then(|| self.dense.iter().position(|v| !v.is_finite())).flatten() {
            return Err(InvalidInput::new(
                InputField::Dense,
                format!(
                    "sample {} feature {} is {} (values must be finite)",
                    pos / num_dense,
                    pos % num_dense,
                    self.dense[pos]
                ),
            ));
        }
        Ok(())
    }

    fn check_ids(&mut self, schema: &ModelSchema, policy: IdPolicy) -> Result<(), InvalidInput> {
        let num_sparse = schema.num_sparse();
        let b = self.num_samples;
        if num_sparse > 0 && self.is_one_id_per_bag() {
            // One id per bag: a quick scan (folds without early exit, which
            // vectorize) usually finds nothing to report.
            let in_range = match self.layout {
                SparseLayout::SampleMajor => self.ids.chunks_exact(num_sparse).fold(true, |ok, sample| {
                    sample
                        .iter()
                        .zip(&schema.sparse)
                        .fold(ok, |ok, (&id, f)| ok & (f.is_unchecked() | ((id as u64) < f.num_rows)))
                }),
                SparseLayout::KeyMajor => self.ids.chunks_exact(b).zip(&schema.sparse).all(|(ids, f)| {
                    f.is_unchecked() || ids.iter().fold(true, |ok, &id| ok & ((id as u64) < f.num_rows))
                }),
            };
            if in_range {
                return Ok(());
            }
        }
        let mut cursor = 0usize;
        for (bag, &len) in self.lengths.iter().enumerate() {
            let (sample, f) = self.layout.bag_position(bag, b, num_sparse);
            let feature = &schema.sparse[f];
            let end = cursor + len as usize;
            if let Err(at) = fit_ids(&mut self.ids[cursor..end], feature, policy) {
                return Err(InvalidInput::new(
                    if feature.weighted { InputField::WeightedIds } else { InputField::Ids },
                    format!(
                        "sample {sample} feature {f} ({}) has id {} outside [0, {})",
                        feature.name,
                        self.ids[cursor + at],
                        feature.num_rows
                    ),
                ));
            }
            cursor = end;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema() -> ModelSchema {
        let mut s = ModelSchema::dlrm("mock", "cpu", 10);
        s.num_dense = 2;
        s.sparse.truncate(3);
        s
    }

    const LIMITS: RequestLimits = RequestLimits::new(8, IdPolicy::Reject);

    fn valid(b: usize) -> RequestSamples {
        RequestSamples {
            num_samples: b,
            dense: vec![0.5; b * 2],
            lengths: vec![],
            ids: vec![1; b * 3],
            ..Default::default()
        }
    }

    fn err(mut r: RequestSamples) -> InvalidInput {
        r.validate(&schema(), LIMITS).unwrap_err()
    }

    #[test]
    fn key_major_errors_name_the_field_and_positions() {
        // 2 samples x 3 features, key-major: f0 = [1], [2]; f1 = [], [3, 4]; f2 = [5], [99].
        let mut r = RequestSamples {
            num_samples: 2,
            dense: vec![0.5; 4],
            lengths: vec![1, 1, 0, 2, 1, 1],
            ids: vec![1, 2, 3, 4, 5, 99],
            weights: vec![],
            layout: SparseLayout::KeyMajor,
            request: None,
        };
        let e = r.clone().validate(&schema(), LIMITS).unwrap_err();
        assert_eq!(e.field, InputField::Ids);
        assert!(e.message.contains("sample 1 feature 2 (cat_2) has id 99"), "{e}");
        let mut short = r.clone();
        short.lengths.pop();
        assert_eq!(short.validate(&schema(), LIMITS).unwrap_err().field, InputField::Lengths);
        let mut nan = r.clone();
        nan.dense[3] = f32::NAN;
        assert_eq!(nan.validate(&schema(), LIMITS).unwrap_err().field, InputField::Dense);
        r.ids[5] = 9;
        r.validate(&schema(), LIMITS).unwrap();
    }

    #[test]
    fn key_major_one_hot_range_check_reads_features_by_run() {
        // 3 samples, one id per bag, key-major: feature f's run is ids[3f..3f+3].
        let mut r = RequestSamples {
            num_samples: 3,
            dense: vec![0.0; 6],
            lengths: vec![1; 9],
            ids: vec![0, 1, 2, 3, 4, 5, 6, 7, 10],
            weights: vec![],
            layout: SparseLayout::KeyMajor,
            request: None,
        };
        let e = r.clone().validate(&schema(), LIMITS).unwrap_err();
        assert!(e.message.contains("sample 2 feature 2"), "{e}");
        r.ids[8] = 8;
        r.validate(&schema(), LIMITS).unwrap();
    }

    #[test]
    fn omitted_lengths_become_one_id_per_bag() {
        let mut r = valid(2);
        r.validate(&schema(), LIMITS).unwrap();
        assert_eq!(r.lengths, vec![1; 6]);
    }

    #[test]
    fn zero_and_oversized_batches_name_batch_size() {
        assert_eq!(err(valid(0)).field, InputField::SampleCount);
        let e = err(valid(9));
        assert_eq!(e.field, InputField::SampleCount);
        assert!(e.message.contains("limit of 8"), "{e}");
    }

    #[test]
    fn wrong_dense_length_names_dense() {
        let mut r = valid(2);
        r.dense.pop();
        assert_eq!(err(r).field, InputField::Dense);
    }

    #[test]
    fn non_finite_dense_names_sample_and_feature() {
        let mut r = valid(2);
        r.dense[3] = f32::NAN;
        let e = err(r);
        assert_eq!(e.field, InputField::Dense);
        assert!(e.message.contains("sample 1 feature 1"), "{e}");
    }

    #[test]
    fn wrong_lengths_count_names_sparse_lengths() {
        let mut r = valid(2);
        r.lengths = vec![1; 5];
        assert_eq!(err(r).field, InputField::Lengths);
    }

    #[test]
    fn lengths_not_matching_ids_name_sparse_ids() {
        let mut r = valid(2);
        r.lengths = vec![1, 1, 1, 1, 1, 2];
        let e = err(r);
        assert_eq!(e.field, InputField::Ids);
        assert!(e.message.contains("sum to 7"), "{e}");
    }

    #[test]
    fn out_of_range_id_names_sample_feature_and_id() {
        let mut r = valid(2);
        r.lengths = vec![1, 0, 2, 1, 1, 1];
        r.ids = vec![0, 1, 2, 3, 10, 5];
        let e = err(r);
        assert_eq!(e.field, InputField::Ids);
        assert!(e.message.contains("sample 1 feature 1 (cat_1) has id 10"), "{e}");
    }

    #[test]
    fn ids_are_checked_against_their_own_features_table() {
        let mut schema = schema();
        schema.sparse[0].num_rows = 100;
        // Feature 0 (100 rows) gets 50 and 60, feature 2 (10 rows) gets 5.
        let mut r = RequestSamples {
            num_samples: 1,
            dense: vec![0.0; 2],
            lengths: vec![2, 0, 1],
            ids: vec![50, 60, 5],
            ..Default::default()
        };
        r.validate(&schema, LIMITS).unwrap();
        // Same count of ids as bags, but the 2nd id lands in feature 2 (10 rows).
        let mut r = RequestSamples {
            num_samples: 1,
            dense: vec![0.0; 2],
            lengths: vec![1, 0, 2],
            ids: vec![50, 5, 60],
            ..Default::default()
        };
        let e = r.validate(&schema, LIMITS).unwrap_err();
        assert!(e.message.contains("feature 2 (cat_2) has id 60"), "{e}");
    }

    #[test]
    fn negative_id_is_rejected() {
        let mut r = valid(1);
        r.ids[0] = -1;
        assert!(err(r).message.contains("id -1"));
    }

    #[test]
    fn split_parts_score_like_the_whole_in_both_layouts() {
        use crate::batch::assemble;
        use crate::mock::mock_scores;
        // 7 samples x 3 features, bag sizes 0..=2, parts of at most 3 samples.
        let lengths: Vec<u32> = (0..21).map(|i| (i * 5 % 3) as u32).collect();
        let total: u32 = lengths.iter().sum();
        let sample_major = RequestSamples {
            num_samples: 7,
            dense: (0..14).map(|i| i as f32 / 10.0).collect(),
            lengths,
            ids: (0..total as i64).map(|i| i % 10).collect(),
            ..Default::default()
        };
        let key_major = assemble(2, 3, [&sample_major]);
        let key_major = RequestSamples {
            num_samples: 7,
            dense: key_major.dense.clone(),
            lengths: key_major.lengths.iter().map(|&l| l as u32).collect(),
            ids: key_major.ids.clone(),
            weights: vec![],
            layout: SparseLayout::KeyMajor,
            request: None,
        };
        for whole in [sample_major, key_major] {
            let expected = mock_scores(&assemble(2, 3, [&whole]));
            let parts = whole.clone().split_rows(3, 3);
            assert_eq!(parts.iter().map(|p| p.num_samples).collect::<Vec<_>>(), [3, 3, 1]);
            let mut scores = Vec::new();
            for mut part in parts {
                part.validate(&schema(), LIMITS).unwrap();
                scores.extend(mock_scores(&assemble(2, 3, [&part])));
            }
            assert_eq!(scores, expected, "{:?}", whole.layout);
        }
    }

    #[test]
    fn a_batch_that_fits_is_not_split() {
        let parts = valid(3).split_rows(3, 3);
        assert_eq!(parts, [valid(3)]);
    }

    #[test]
    fn weights_are_widened_to_every_id_and_follow_split_and_fusion() {
        use crate::batch::assemble;
        let mut weighted = schema();
        weighted.sparse[2].weighted = true;
        // 2 samples x 3 features, sample-major; feature 2 is weighted:
        // sample 0 has ids [5, 6] there, sample 1 has [7].
        let mut r = RequestSamples {
            num_samples: 2,
            dense: vec![0.5; 4],
            lengths: vec![1, 0, 2, 1, 1, 1],
            ids: vec![1, 5, 6, 2, 3, 7],
            weights: vec![0.5, 0.25, 2.0],
            ..Default::default()
        };
        let mut short = r.clone();
        short.weights.pop();
        assert_eq!(short.validate(&weighted, LIMITS).unwrap_err().field, InputField::Weights);
        let mut nan = r.clone();
        nan.weights[1] = f32::NAN;
        assert!(nan.validate(&weighted, LIMITS).unwrap_err().message.contains("weight 1 is NaN"));
        r.validate(&weighted, LIMITS).unwrap();
        assert_eq!(r.weights, [1.0, 0.5, 0.25, 1.0, 1.0, 2.0], "one per id, 1.0 for unweighted ids");
        let parts = r.clone().split_rows(1, 3);
        assert_eq!(
            (parts[0].weights.as_slice(), parts[1].weights.as_slice()),
            (&[1.0, 0.5, 0.25][..], &[1.0, 1.0, 2.0][..])
        );
        // Key-major: feature 0's ids [1, 2], feature 1's [3], feature 2's [5, 6, 7].
        let fused = assemble(2, 3, &parts);
        assert_eq!(fused.ids, [1, 2, 3, 5, 6, 7]);
        assert_eq!(fused.weights, [1.0, 1.0, 1.0, 0.5, 0.25, 2.0]);
        let mut out_of_range = r.clone();
        out_of_range.ids[5] = 10;
        out_of_range.weights.clear();
        out_of_range.weights.extend([0.5, 0.25, 2.0]);
        let e = out_of_range.validate(&weighted, LIMITS).unwrap_err();
        assert_eq!((e.field, e.field.name()), (InputField::WeightedIds, "sparse_ids"), "{e}");
        let mut unweighted = valid(1);
        unweighted.weights = vec![1.0];
        assert_eq!(unweighted.validate(&schema(), LIMITS).unwrap_err().field, InputField::Weights);
    }

    #[test]
    fn modulo_policy_maps_ids_into_range() {
        let mut r = valid(1);
        r.ids = vec![-1, 10, 23];
        let limits = RequestLimits { id_policy: IdPolicy::Modulo, ..LIMITS };
        r.validate(&schema(), limits).unwrap();
        assert_eq!(r.ids, vec![9, 0, 3]);
    }
}
