//! Raw integer inputs (`"pooling": "raw"`: never looked up) laid out for
//! the dense network, their values exactly as sent:
//!
//! * a sequence's raw channels, `[positions, K]` beside its looked-up
//!   values: position `p` of the same units in the same order (the rows'
//!   own units, then the request blocks'; cut at the kept end at
//!   validation like every channel), so dropping and renumbering empty
//!   units moves nothing;
//! * per unit, where the sequence declares `request_rows`, the rows of the
//!   whole request its block came from (the count the block carries from
//!   validation, however the request was cut or fused; 1 for a row's own
//!   unit) and that request's last row's raw inputs outside sequences
//!   (carried the same way; a row's own unit: the row's);
//! * the raw inputs outside any sequence, `[rows, K]`: each row's own
//!   value, or, for a grouped row, its request block's (one per block).
//!
//! Whether a feature arrived once per request is the batch's blocks' to
//! say, as for every lookup (`sequences.rs`).

use narsil_core::KeyedBatch;

use super::{EmbeddingStage, SequenceValues, StageSequence};

impl EmbeddingStage {
    /// Fills `values`' raw channels and units' request rows for `batch`
    /// (its offsets laid out already: the rows' units, then the blocks').
    pub(super) fn lay_out_raw_channels(
        &self,
        sequence: &StageSequence,
        batch: &KeyedBatch,
        row_raw: &[i64],
        values: &mut SequenceValues,
    ) {
        let positions = values.positions();
        let k = sequence.raw.len();
        values.raw_width = k;
        values.raw.clear();
        values.raw.resize(positions * k, 0);
        let blocks = batch.request_blocks.as_ref();
        for (j, &f) in sequence.raw.iter().enumerate() {
            // Aligned channels: the rows' bags end to end are the rows'
            // units' positions, the blocks' bags the blocks' units'.
            let unit_ids = blocks.and_then(|b| b.unit_ids(f)).unwrap_or(&[]);
            let sent = batch.feature_ids(f).iter().chain(unit_ids);
            for (position, &value) in values.raw.chunks_exact_mut(k).zip(sent) {
                position[j] = value;
            }
        }
        values.request_rows = sequence.request_rows;
        values.unit_rows.clear();
        values.unit_raw.clear();
        values.unit_raw_width = self.row_raw.len();
        if sequence.request_rows {
            let units = values.offsets.len() - 1;
            values.unit_rows.resize(batch.rows, 1);
            values.unit_raw.extend_from_slice(row_raw);
            if let Some(blocks) = blocks.filter(|_| units > batch.rows) {
                values.unit_rows.extend(blocks.unit_rows.iter().map(|&rows| rows as i64));
                values.unit_raw.extend_from_slice(&blocks.unit_last_raw);
            }
            debug_assert_eq!(values.unit_rows.len(), units);
            debug_assert_eq!(values.unit_raw.len(), units * values.unit_raw_width);
        }
    }

    /// Lays out `batch`'s raw inputs outside sequences into `out`, `[rows,
    /// K]` row-major (empty for a model without).
    pub(super) fn lay_out_row_raw(&self, batch: &KeyedBatch, out: &mut Vec<i64>) {
        let k = self.row_raw.len();
        out.clear();
        if k == 0 {
            return;
        }
        out.resize(batch.rows * k, 0);
        let blocks = batch.request_blocks.as_ref();
        for (j, &f) in self.row_raw.iter().enumerate() {
            // Each row's own value (validation: exactly one, or none on a
            // grouped row whose block holds it).
            let mut at = 0;
            let own = batch.feature_ids(f);
            for (row, &len) in batch.feature_lengths(f).iter().enumerate() {
                if len == 1 {
                    out[row * k + j] = own[at];
                }
                at += len.max(0) as usize;
            }
            if let Some(unit_ids) = blocks.and_then(|b| b.unit_ids(f)) {
                // One value per unit (validation).
                for run in batch.broadcasts() {
                    for row in run.start..run.start + run.rows {
                        out[row * k + j] = unit_ids[run.unit];
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use narsil_core::request::{IdPolicy, RequestLimits};
    use narsil_core::sequence::SequenceJson;
    use narsil_core::{assemble, RequestBlock, RequestSamples};

    use super::super::fixtures::{rows, schema};
    use super::super::{EmbeddingStage, StageScratch};
    use crate::schema::{FeatureSpec, PoolingMode, SplitSchema};

    const LIMITS: RequestLimits = RequestLimits::new(64, IdPolicy::Reject);

    /// Pooled `a` (shared table); `qt`, a raw input per row; `ut`, a raw
    /// input per request; the request-level sequence `h` of at most 3
    /// positions: `h_time` (raw), `h_item` (shared table), `h_act` (raw),
    /// counting its request rows.
    fn raw_schema() -> SplitSchema {
        let mut split = schema();
        let feature = |name: &str, table: &str, pooling| FeatureSpec {
            name: name.into(),
            table: table.into(),
            pooling,
            weighted: false,
        };
        split.features = vec![
            feature("a", "shared", PoolingMode::Sum),
            feature("qt", "", PoolingMode::Raw),
            feature("ut", "", PoolingMode::Raw),
            feature("h_time", "", PoolingMode::Raw),
            feature("h_item", "shared", PoolingMode::None),
            feature("h_act", "", PoolingMode::Raw),
        ];
        split.sequences = vec![SequenceJson {
            name: "h".into(),
            features: vec!["h_time".into(), "h_item".into(), "h_act".into()],
            max_len: 3,
            keep: None,
            working_set: None,
            package_working_set: None,
            request_rows: true,
        }];
        split.request_level = ["ut", "h_time", "h_item", "h_act"].map(String::from).to_vec();
        split.check().unwrap();
        split
    }

    /// User `user`'s ranking request of `b` candidates (query times
    /// `-c`), whose history is `times` (`item = time % 50`, `act = -time`).
    fn grouped(user: i64, times: &[i64], b: usize) -> RequestSamples {
        let n = times.len() as u32;
        let mut block_ids = vec![user * 1_000];
        block_ids.extend(times);
        block_ids.extend(times.iter().map(|t| t.rem_euclid(50)));
        block_ids.extend(times.iter().map(|t| t.wrapping_neg()));
        RequestSamples {
            num_samples: b,
            dense: vec![0.5; b],
            ids: (0..b as i64).flat_map(|c| [c % 50, -c]).collect(),
            request: Some(Arc::new(RequestBlock {
                lengths: vec![1, n, n, n],
                ids: block_ids,
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    #[test]
    fn raw_channels_follow_their_positions_and_units_keep_their_whole_requests_rows() {
        let split = raw_schema();
        let model = split.model_schema("torch", "cpu");
        let stage =
            EmbeddingStage::new(&split, split.tables.iter().map(|t| Arc::new(rows(t, 7)) as _).collect());
        assert_eq!((stage.pooled_width(), stage.row_raw_width()), (8, 2), "a pooled; qt and ut raw");
        assert!(stage.takes_unpooled_inputs());
        // User 1: 5 candidates cut into parts of 2, 2 and 1 (the engine's
        // cut shares the block); its history of 4 is cut to its last 3.
        let mut whole = grouped(1, &[i64::MIN, 10, i64::MAX, -1], 5);
        whole.validate(&model, LIMITS).unwrap();
        let parts = whole.split_rows(2, model.num_sparse());
        // A flat row: its own history of 2 positions, its own ut.
        let mut flat = RequestSamples {
            num_samples: 1,
            dense: vec![0.5],
            lengths: vec![1, 1, 1, 2, 2, 2],
            ids: vec![3, 77, -77, 5, 6, 5, 6, -5, -6],
            ..Default::default()
        };
        flat.validate(&model, LIMITS).unwrap();
        // User 2: 1 candidate, an empty history.
        let mut other = grouped(2, &[], 1);
        other.validate(&model, LIMITS).unwrap();
        let batch = assemble(1, model.num_sparse(), [&parts[1], &flat, &other, &parts[2]]);
        let mut scratch = StageScratch::default();
        stage.pool(&batch, &mut scratch, &mut Vec::new()).unwrap();
        let h = &scratch.sequences()[0];
        // Units after the empty ones are dropped: the flat row's, user 1's,
        // user 2's (attended, empty).
        assert_eq!(h.row_unit, [1, 1, 0, 2, 1]);
        assert_eq!(h.offsets, [0, 2, 5, 5]);
        assert_eq!((h.width, h.raw_width), (8, 2), "h_item's 8 values; h_time and h_act raw");
        assert_eq!(
            h.raw,
            [5, -5, 6, -6, 10, -10, i64::MAX, -i64::MAX, -1, 1],
            "as sent, position by position"
        );
        // Each unit's request rows: the whole request's 5 in both parts.
        assert!(h.request_rows);
        assert_eq!(h.unit_rows, [1, 5, 1]);
        // And its last row's [qt, ut]: user 1's candidate 4 in both parts
        // (this batch holds neither part's last row as user 1's last).
        assert_eq!(h.unit_raw_width, 2);
        assert_eq!(h.unit_raw, [77, -77, -4, 1_000, 0, 2_000]);
        // Rows' raw inputs: [qt, ut], ut broadcast from each row's block.
        assert_eq!(scratch.row_raw(), [-2, 1_000, -3, 1_000, 77, -77, 0, 2_000, -4, 1_000]);
        // The same rows sent flat: the same values per row and unit.
        let flat_batch = batch.clone().into_flat();
        stage.pool(&flat_batch, &mut scratch, &mut Vec::new()).unwrap();
        assert_eq!(scratch.row_raw(), [-2, 1_000, -3, 1_000, 77, -77, 0, 2_000, -4, 1_000]);
        let f = &scratch.sequences()[0];
        assert_eq!(f.offsets, [0, 3, 6, 8, 8, 11]);
        assert_eq!(&f.raw[..6], &[10, -10, i64::MAX, -i64::MAX, -1, 1]);
        assert_eq!(f.unit_rows, [1; 5], "each row its own unit");
        assert_eq!(f.unit_raw, scratch.row_raw(), "each row's own raw inputs");
    }

    #[test]
    fn two_requests_of_one_user_share_a_unit_only_where_their_rows_agree() {
        let split = raw_schema();
        let model = split.model_schema("torch", "cpu");
        let stage =
            EmbeddingStage::new(&split, split.tables.iter().map(|t| Arc::new(rows(t, 7)) as _).collect());
        let mut requests = [grouped(1, &[4, 5], 3), grouped(1, &[4, 5], 2), grouped(1, &[4, 5], 3)];
        for r in &mut requests {
            r.validate(&model, LIMITS).unwrap();
        }
        let batch = assemble(1, model.num_sparse(), &requests);
        assert_eq!(batch.request_blocks.as_ref().unwrap().unit_count, 2);
        let mut scratch = StageScratch::default();
        stage.pool(&batch, &mut scratch, &mut Vec::new()).unwrap();
        let h = &scratch.sequences()[0];
        assert_eq!(h.row_unit, [0, 0, 0, 1, 1, 0, 0, 0]);
        assert_eq!(h.unit_rows, [3, 2]);
        assert_eq!(h.unit_raw, [-2, 1_000, -1, 1_000], "each request's last query time");
        assert_eq!(h.positions(), 4, "the history once per distinct count");
    }
}
