//! A request's sequences ([`crate::sequence`]): checked and cut at
//! validation, what they weigh once fused (tokens, the memory of their
//! values once looked up, and the dense network's working set for them:
//! [`crate::working_set`]), and a request cut into parts by tokens.

use crate::invalid::{InputField, InvalidInput};
use crate::request::RequestSamples;
use crate::schema::{ModelSchema, SequenceFeature};
use crate::sequence::{fit_sequences, BagLayout};
use crate::working_set::Unit;

impl RequestSamples {
    /// Its rows plus the sequence positions it looks up (once per position,
    /// whatever its channels): those on its rows and those in its request
    /// block (once, whatever its rows; on every row where `flat`: lanes
    /// that take only flat batches get the block copied into each row,
    /// [`crate::KeyedBatch::into_flat`]). Equal to its rows for a model
    /// without sequence features; what a batch's token budget counts.
    /// Lengths as validated (explicit).
    pub fn tokens(&self, schema: &ModelSchema, flat: bool) -> usize {
        let (rows, block) = self.sum_over_positions(schema, |_| 1);
        let block = if flat { block.saturating_mul(self.num_samples) } else { block };
        self.num_samples.saturating_add(rows).saturating_add(block)
    }

    /// Memory the stage's unpooled outputs for it take: those of its rows
    /// (each sequence position's FP32 values and raw channels' int64
    /// values, [`SequenceFeature::position_bytes`]; each row's raw inputs,
    /// request-level ones broadcast to it, 8 bytes each; a unit's request
    /// rows), and those of its request block's sequences (laid out once
    /// per request).
    pub fn stage_value_bytes(&self, schema: &ModelSchema) -> (usize, usize) {
        let (rows, block) = self.sum_over_positions(schema, SequenceFeature::position_bytes);
        let int64 = std::mem::size_of::<i64>();
        let row_raw = schema.row_raw_inputs().len() * int64;
        let counted = schema.sequences.iter().filter(|s| s.request_rows).count() * int64;
        // A unit's count: one per row (a row's own unit) and one for the
        // block's.
        let block_unit = if self.request.is_some() { counted } else { 0 };
        let rows = rows.saturating_add(self.num_samples.saturating_mul(row_raw + counted));
        (rows, block.saturating_add(block_unit))
    }

    /// `per_position(sequence)` summed over every sequence position of its
    /// rows, and of its request block (each position once: counted on its
    /// sequence's first channel); saturating.
    fn sum_over_positions(
        &self,
        schema: &ModelSchema,
        per_position: impl Fn(&SequenceFeature) -> usize,
    ) -> (usize, usize) {
        if schema.sequences.is_empty() {
            return (0, 0);
        }
        let weight = |f: usize| schema.first_channel_of(f).map_or(0, &per_position);
        let (b, num_sparse) = (self.num_samples, schema.num_sparse());
        let rows = self
            .lengths
            .iter()
            .enumerate()
            .map(|(bag, &len)| len as usize * weight(self.layout.bag_position(bag, b, num_sparse).1));
        let block = self.request.iter().flat_map(|block| {
            block.features.iter().zip(&block.lengths).map(|(&f, &len)| len as usize * weight(f))
        });
        (rows.fold(0, usize::saturating_add), block.fold(0, usize::saturating_add))
    }

    /// The units of `sequence` (its histories) and the rows attending to
    /// each: the request block's, once for all its rows, where the block
    /// holds it and the lanes take grouped batches; else each row's own
    /// (a flat row, or a block copied into every row when `flat_only`).
    pub fn sequence_units(
        &self,
        schema: &ModelSchema,
        sequence: &SequenceFeature,
        flat_only: bool,
    ) -> Vec<Unit> {
        let first = sequence.features[0];
        let in_block = self.request.as_deref().and_then(|block| {
            block.features.iter().position(|&f| f == first).map(|i| block.lengths[i] as usize)
        });
        match in_block {
            Some(positions) if !flat_only => vec![Unit { positions, rows: self.num_samples }],
            Some(positions) => vec![Unit { positions, rows: 1 }; self.num_samples],
            None => (0..self.num_samples)
                .map(|sample| {
                    let bag = self.layout.bag_index(sample, first, self.num_samples, schema.num_sparse());
                    Unit { positions: self.lengths.get(bag).map_or(0, |&l| l as usize), rows: 1 }
                })
                .collect(),
        }
    }

    /// Bytes the dense network holds at once for this request's sequences
    /// ([`SequenceFeature::working_set`]), each sequence's summed; 0 for a
    /// model without sequences. Lengths as validated.
    pub fn working_set_bytes(&self, schema: &ModelSchema, flat_only: bool) -> usize {
        crate::working_set::summed(
            schema.sequences.iter().map(SequenceFeature::working_set),
            &self.units(schema, flat_only),
        )
    }

    /// Each sequence's units ([`Self::sequence_units`]), in declaration
    /// order.
    pub fn units(&self, schema: &ModelSchema, flat_only: bool) -> Vec<Vec<Unit>> {
        schema.sequences.iter().map(|sequence| self.sequence_units(schema, sequence, flat_only)).collect()
    }

    /// Cuts a validated request into consecutive parts of at most
    /// `max_rows` rows and, where it can, `max_tokens` tokens each
    /// ([`Self::tokens`] with `flat`: every part counts the request block's
    /// positions, as each part keeps the block, on each of its rows where
    /// lanes take only flat batches); a part has at least one row, so a
    /// row over `max_tokens` alone is a part of its own, and a request
    /// block whose history is over half of it is cut by rows only (each
    /// part would encode the history again for fewer rows than the
    /// history has positions: a generative ranker's history of 1,000
    /// under a budget of 1,024 would be encoded once per 24 candidates).
    /// Scores of the parts, concatenated, are the scores of the whole.
    pub fn split_tokens(
        self,
        max_rows: usize,
        max_tokens: usize,
        schema: &ModelSchema,
        flat: bool,
    ) -> Vec<RequestSamples> {
        let num_sparse = schema.num_sparse();
        if schema.sequences.is_empty() || self.tokens(schema, flat) <= max_tokens {
            return self.split_rows(max_rows, num_sparse);
        }
        let (b, layout) = (self.num_samples, self.layout);
        let block = self.sum_over_positions(schema, |_| 1).1;
        if !flat && block.saturating_mul(2) > max_tokens {
            // Each part would hold fewer rows than its history's positions:
            // cutting would mostly encode the history once per part.
            return self.split_rows(max_rows, num_sparse);
        }
        // A part holds the block once, or each of its rows a copy of it.
        let (block, per_row) = if flat { (0, 1 + block) } else { (block, 1) };
        let mut row_tokens = vec![per_row; b];
        for (bag, &len) in self.lengths.iter().enumerate() {
            let (sample, f) = layout.bag_position(bag, b, num_sparse);
            if schema.first_channel_of(f).is_some() {
                row_tokens[sample] = row_tokens[sample].saturating_add(len as usize);
            }
        }
        let (mut ends, mut rows, mut tokens) = (Vec::new(), 0usize, block);
        for (sample, &own) in row_tokens.iter().enumerate() {
            if rows > 0 && (rows == max_rows.max(1) || tokens.saturating_add(own) > max_tokens) {
                ends.push(sample);
                (rows, tokens) = (0, block);
            }
            rows += 1;
            tokens = tokens.saturating_add(own);
        }
        ends.push(b);
        self.split_at(&ends, num_sparse)
    }

    /// Checks the rows' sequences' alignment and cuts those longer than
    /// their maximum; returns the positions dropped.
    pub(crate) fn fit_sequences(&mut self, schema: &ModelSchema) -> Result<usize, InvalidInput> {
        if schema.sequences.is_empty() {
            return Ok(0);
        }
        let (b, num_sparse, layout) = (self.num_samples, schema.num_sparse(), self.layout);
        let sequences: Vec<&SequenceFeature> = schema.sequences.iter().collect();
        let bag = move |sample: usize, f: usize| layout.bag_index(sample, f, b, num_sparse);
        let feature = move |bag: usize| layout.bag_position(bag, b, num_sparse).1;
        let place = |sample: usize| format!("sample {sample}");
        let bags =
            BagLayout { samples: b, bag: &bag, feature: &feature, field: InputField::Lengths, place: &place };
        fit_sequences(&sequences, schema, &mut self.lengths, &mut self.ids, &bags)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::request::{IdPolicy, RequestLimits};
    use crate::request_level::RequestBlock;
    use crate::schema::{KeepEnd, RequestLevel};
    use crate::working_set::WorkingSet;

    const LIMITS: RequestLimits = RequestLimits::new(64, IdPolicy::Reject);

    /// cat_0 pooled; sequence `h` (cat_1), at most 8 positions, per row or
    /// request-level; its working set a gather of 10 values.
    fn schema(request_level: bool) -> ModelSchema {
        let mut s = ModelSchema::dlrm("mock", "cpu", 100);
        s.num_dense = 1;
        s.sparse.truncate(2);
        if request_level {
            s.request_level = RequestLevel::parse(["cat_1"], &s).unwrap();
        }
        let mut h = SequenceFeature::new("h", &["cat_1".to_string()], 8, KeepEnd::Last, &s, &[]).unwrap();
        h.working_set = Some(WorkingSet::Gather { width: 10, position_width: 0, bytes_per_value: 4 });
        s.sequences = vec![h];
        s
    }

    /// Flat rows whose histories have `lengths` positions.
    fn flat(lengths: &[u32]) -> RequestSamples {
        let b = lengths.len();
        let mut r = RequestSamples { num_samples: b, dense: vec![0.5; b], ..Default::default() };
        for &len in lengths {
            r.lengths.extend([1, len]);
            r.ids.push(1);
            r.ids.extend((0..len).map(|p| p as i64));
        }
        r.validate(&schema(false), LIMITS).unwrap();
        r
    }

    /// `rows` candidates of one user whose history has `len` positions.
    fn ranking(rows: usize, len: u32) -> RequestSamples {
        let mut r = RequestSamples {
            num_samples: rows,
            dense: vec![0.5; rows],
            ids: vec![1; rows],
            request: Some(Arc::new(RequestBlock {
                lengths: vec![len],
                ids: (0..len as i64).collect(),
                ..Default::default()
            })),
            ..Default::default()
        };
        r.validate(&schema(true), LIMITS).unwrap();
        r
    }

    #[test]
    fn a_flat_requests_rows_are_units_of_their_own_and_a_ranking_requests_share_its_block() {
        let s = schema(false);
        let units = flat(&[3, 0, 8]).sequence_units(&s, &s.sequences[0], false);
        let positions: Vec<_> = units.iter().map(|u| (u.positions, u.rows)).collect();
        assert_eq!(positions, [(3, 1), (0, 1), (8, 1)]);
        // Gathered: 3 rows x the longest (8) x 10 values.
        assert_eq!(flat(&[3, 0, 8]).working_set_bytes(&s, false), 3 * 8 * (10 * 4 + 9));
        let s = schema(true);
        let grouped = ranking(5, 6);
        assert_eq!(grouped.sequence_units(&s, &s.sequences[0], false), [Unit { positions: 6, rows: 5 }]);
        // Lanes that take only flat batches copy the block into every row.
        assert_eq!(grouped.sequence_units(&s, &s.sequences[0], true), [Unit { positions: 6, rows: 1 }; 5]);
        assert_eq!(grouped.working_set_bytes(&s, false), 5 * 6 * 49);
        // No sequences: nothing.
        assert_eq!(grouped.working_set_bytes(&ModelSchema::dlrm("mock", "cpu", 100), false), 0);
    }

    #[test]
    fn raw_channels_raw_inputs_and_unit_counts_are_charged_eight_bytes_a_value() {
        use crate::schema::SparseFeature;
        // cat_0 pooled; `qt` a raw input per row; `h` (cat_1 looked up, 10
        // values a position, and `h_ts` raw), request-level, counting its
        // request rows.
        let mut s = ModelSchema::dlrm("mock", "cpu", 100);
        s.num_dense = 1;
        s.sparse.truncate(2);
        s.sparse.extend([SparseFeature::raw("qt"), SparseFeature::raw("h_ts")]);
        s.request_level = RequestLevel::parse(["cat_1", "h_ts"], &s).unwrap();
        let channels = ["cat_1".to_string(), "h_ts".to_string()];
        let mut h = SequenceFeature::new("h", &channels, 8, KeepEnd::Last, &s, &[]).unwrap();
        (h.width, h.request_rows) = (10, true);
        assert_eq!((h.raw_channels, h.position_bytes()), (1, 10 * 4 + 8));
        s.sequences = vec![h];
        let mut r = RequestSamples {
            num_samples: 3,
            dense: vec![0.5; 3],
            ids: vec![1, -1, 2, i64::MAX, 3, i64::MIN],
            request: Some(Arc::new(RequestBlock {
                lengths: vec![5, 5],
                ids: (0..5).chain(0..5).collect(),
                ..Default::default()
            })),
            ..Default::default()
        };
        r.validate(&s, LIMITS).unwrap();
        assert_eq!(r.request.as_ref().unwrap().request_rows, 3, "the whole request's rows, on its block");
        // Rows: each its raw input and its (empty) own unit's count; the
        // block: 5 positions of 48 bytes and its unit's count.
        assert_eq!(r.stage_value_bytes(&s), (3 * (8 + 8), 5 * 48 + 8));
        // Its parts keep the whole's count (they share the block).
        let parts = r.split_rows(1, s.num_sparse());
        assert!(parts.iter().all(|p| p.request.as_ref().unwrap().request_rows == 3));
    }

    #[test]
    fn a_request_over_the_token_budget_is_cut_into_parts_within_it_that_score_as_the_whole() {
        use crate::batch::assemble;
        use crate::mock::mock_scores;
        let s = schema(false);
        // Tokens per row: 1 + its positions: 4, 9, 2, 9, 9, 1.
        let whole = flat(&[3, 8, 1, 8, 8, 0]);
        let parts = whole.clone().split_tokens(64, 12, &s, false);
        let rows: Vec<_> = parts.iter().map(|p| p.num_samples).collect();
        assert_eq!(rows, [1, 2, 1, 2]);
        assert!(
            parts.iter().all(|p| p.tokens(&s, false) <= 12),
            "{:?}",
            parts.iter().map(|p| p.tokens(&s, false)).collect::<Vec<_>>()
        );
        let mut scores = Vec::new();
        for part in &parts {
            scores.extend(mock_scores(&assemble(1, 2, [part])));
        }
        assert_eq!(scores, mock_scores(&assemble(1, 2, [&whole])));
        // A row over the budget alone is a part of its own; rows still
        // bound a part; a request within both is whole.
        assert_eq!(whole.clone().split_tokens(64, 5, &s, false).len(), 6);
        assert_eq!(whole.clone().split_tokens(2, 1000, &s, false).len(), 3);
        assert_eq!(whole.clone().split_tokens(64, 1000, &s, false), [whole]);
    }

    #[test]
    fn a_ranking_requests_parts_each_count_its_block_and_keep_it() {
        let s = schema(true);
        // 6 positions in the block: each part holds 6 + its rows.
        let parts = ranking(10, 6).split_tokens(64, 12, &s, false);
        let rows: Vec<_> = parts.iter().map(|p| p.num_samples).collect();
        assert_eq!(rows, [6, 4]);
        assert!(parts.iter().all(|p| p.request.is_some() && p.tokens(&s, false) <= 12));
        // A history over half the budget, or over all of it: cut by rows
        // only (cutting by tokens would encode it again for every few
        // candidates, or once per candidate).
        assert_eq!(ranking(10, 6).split_tokens(64, 11, &s, false).len(), 1);
        assert_eq!(ranking(3, 6).split_tokens(64, 4, &s, false).len(), 1);
        assert_eq!(ranking(3, 6).split_tokens(2, 4, &s, false).len(), 2);
        // Lanes that take only flat batches copy the block into each row:
        // 7 tokens a row, one row a part under 10 (each within it).
        let flat = ranking(10, 6).split_tokens(64, 10, &s, true);
        assert_eq!(flat.len(), 10);
        assert!(flat.iter().all(|p| p.tokens(&s, true) <= 10));
        let two_a_part = ranking(10, 6).split_tokens(64, 14, &s, true);
        assert_eq!(two_a_part.iter().map(|p| p.num_samples).collect::<Vec<_>>(), [2; 5]);
    }
}
