//! Sequence features looked up unpooled: for each declared sequence, one
//! vector per position (its channels' rows side by side), laid out unit
//! after unit as jagged values with per-unit offsets, and for each row the
//! unit it attends to. A grouped request's rows share one unit per
//! distinct request block (the user's history looked up once, never tiled
//! per candidate); a flat row is a unit of its own. Whether a sequence
//! arrives in a block is the block's to say (its features, set by the
//! engine's schema with `--request-level` applied), not `schema.json`'s:
//! the engine and the stage follow one declaration.
//!
//! Units are laid out as the batch's rows first (row `r` is unit `r`; a
//! grouped row's own bag of a request-level sequence is empty), then the
//! request blocks' units (`rows + u`), the order in which the table's ids
//! were collected: the lookups read each id's row in place or from its
//! fetched copy like any pooled bag of one id (`pooling.rs`), so an INT8
//! position is dequantized with FBGEMM's arithmetic (`fma(scale, q, bias)`
//! in FP32). Once looked up, the units no row attends to that hold no
//! position (grouped rows' own) are dropped and the rest renumbered in
//! order: the dense network sees only the histories its rows use, and a
//! network whose per-unit work does not depend on a unit's length (padded
//! attention, a unit's context tokens) pays for no empty one.
//!
//! A sequence's raw channels (raw integer inputs: never looked up) and
//! its units' request rows are laid out beside its values by
//! `raw_inputs.rs`, position for position and unit for unit.

use narsil_core::KeyedBatch;

use super::EmbeddingStage;

/// One sequence's values for a batch.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SequenceValues {
    /// `[positions, width]` row-major: unit after unit, oldest position
    /// first, each position its channels' vectors side by side.
    pub values: Vec<f32>,
    /// Values per position.
    pub width: usize,
    /// `units + 1` offsets: unit `u`'s positions are `offsets[u]..offsets[u
    /// + 1]`.
    pub offsets: Vec<i64>,
    /// Per row of the batch, the unit it attends to.
    pub row_unit: Vec<i64>,
    /// `[positions, raw_width]` row-major: its raw channels' values as
    /// sent, position for position with `values` (empty without raw
    /// channels).
    pub raw: Vec<i64>,
    /// Raw channels (0: the dense network takes no `seq{i}_raw`).
    pub raw_width: usize,
    /// Whether the dense network takes `unit_rows` (the sequence declares
    /// `request_rows`).
    pub request_rows: bool,
    /// Per unit, where `request_rows`: the rows of the whole request its
    /// block came from (1 for a row's own unit).
    pub unit_rows: Vec<i64>,
    /// Per unit, where `request_rows`: the whole request's last row's raw
    /// inputs outside sequences, `[units, unit_raw_width]` row-major (a
    /// row's own unit: the row's).
    pub unit_raw: Vec<i64>,
    /// Values per unit in `unit_raw`: the model's raw inputs outside
    /// sequences.
    pub unit_raw_width: usize,
}

impl SequenceValues {
    /// Positions looked up.
    pub fn positions(&self) -> usize {
        self.offsets.last().map_or(0, |&p| p as usize)
    }

    /// Drops the units no row attends to that hold no position, and
    /// renumbers the others in order (rows' units follow).
    pub(super) fn drop_unattended_empty_units(&mut self) {
        let units = self.offsets.len().saturating_sub(1);
        let mut attended = vec![false; units];
        for &u in &self.row_unit {
            attended[u as usize] = true;
        }
        let mut renumbered = vec![0i64; units];
        let mut kept = 0;
        let counted = self.unit_rows.len() == units;
        for u in 0..units {
            if attended[u] || self.offsets[u + 1] > self.offsets[u] {
                renumbered[u] = kept as i64;
                if counted {
                    // In place, as the offsets: `kept <= u`.
                    self.unit_rows[kept] = self.unit_rows[u];
                    let k = self.unit_raw_width;
                    self.unit_raw.copy_within(u * k..(u + 1) * k, kept * k);
                }
                kept += 1;
                // In place: `kept <= u + 1`, so nothing unread is overwritten.
                self.offsets[kept] = self.offsets[u + 1];
            }
        }
        self.offsets.truncate(kept + 1);
        if counted {
            self.unit_rows.truncate(kept);
            self.unit_raw.truncate(kept * self.unit_raw_width);
        }
        for u in &mut self.row_unit {
            *u = renumbered[*u as usize];
        }
    }

    /// The positions padding every unit some row attends to up to the
    /// longest of them would add (a dense network's padding waste when it
    /// pads units to the batch's longest; jagged work pays none).
    pub fn padding_to_longest(&self) -> usize {
        let length = |u: i64| (self.offsets[u as usize + 1] - self.offsets[u as usize]) as usize;
        let mut attended: Vec<i64> = self.row_unit.clone();
        attended.sort_unstable();
        attended.dedup();
        let longest = attended.iter().map(|&u| length(u)).max().unwrap_or(0);
        attended.iter().map(|&u| longest - length(u)).sum()
    }
}

/// Where a sequence channel's lookups go.
#[derive(Debug, Clone, Copy)]
pub(super) struct Channel {
    /// The sequence (index into the stage's sequences).
    pub sequence: usize,
    /// Its first column within a position's vector.
    pub column: usize,
}

/// A declared sequence, as the stage lays it out.
pub(super) struct StageSequence {
    /// Its first channel's feature (whose bag lengths are the sequence's).
    pub first: usize,
    /// Values per position.
    pub width: usize,
    /// Its raw channels' features, in the order it lists them.
    pub raw: Vec<usize>,
    /// Whether its network takes each unit's request rows.
    pub request_rows: bool,
}

impl EmbeddingStage {
    /// Lays out each sequence's units for `batch` (offsets, rows' units)
    /// and sizes its values (zeroed); the lookups fill them per table.
    /// `row_raw`: the batch's raw inputs outside sequences, laid out
    /// ([`Self::lay_out_row_raw`]).
    pub(super) fn lay_out_sequences(
        &self,
        batch: &KeyedBatch,
        row_raw: &[i64],
        out: &mut Vec<SequenceValues>,
    ) {
        out.resize_with(self.sequences.len(), SequenceValues::default);
        let blocks = batch.request_blocks.as_ref();
        for (sequence, values) in self.sequences.iter().zip(out.iter_mut()) {
            // Whether it arrives once per request is the batch's blocks'
            // to say (as for every feature the lookups pool): they hold
            // what the engine's schema, `--request-level` applied, made
            // request-level, all of a sequence's channels or none.
            let units = blocks.and_then(|b| Some((b, b.position(sequence.first)?)));
            values.width = sequence.width;
            values.offsets.clear();
            values.offsets.push(0);
            let mut at = 0i64;
            let unit_lengths = units.map_or(&[][..], |(b, k)| b.feature_lengths(k));
            for &len in batch.feature_lengths(sequence.first).iter().chain(unit_lengths) {
                at += i64::from(len.max(0));
                values.offsets.push(at);
            }
            values.row_unit.clear();
            values.row_unit.extend(0..batch.rows as i64);
            if units.is_some() {
                for run in batch.broadcasts() {
                    let unit = (batch.rows + run.unit) as i64;
                    values.row_unit[run.start..run.start + run.rows].fill(unit);
                }
            }
            values.values.clear();
            values.values.resize(at as usize * sequence.width, 0.0);
            self.lay_out_raw_channels(sequence, batch, row_raw, values);
            self.metrics.count_sequences(at as usize, batch.rows, values.padding_to_longest());
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
    use super::super::pooling::tests::Fetching;
    use super::super::{EmbeddingStage, StageScratch};
    use crate::pool::{pool_rows, Pooling};
    use crate::schema::{FeatureSpec, PoolingMode, SplitSchema, Storage};
    use crate::stores::row_store::RowStore;

    const LIMITS: RequestLimits = RequestLimits::new(64, IdPolicy::Reject);

    /// The fixture's tables with pooled features a (shared) and b (own),
    /// and a request-level sequence `h` of at most 4 positions whose
    /// channels are h_shared and h_own.
    fn sequence_schema() -> SplitSchema {
        let mut split = schema();
        let none = |name: &str, table: &str| FeatureSpec {
            name: name.into(),
            table: table.into(),
            pooling: PoolingMode::None,
            weighted: false,
        };
        split.features.truncate(2);
        split.features.extend([none("h_shared", "shared"), none("h_own", "own")]);
        split.sequences = vec![SequenceJson {
            name: "h".into(),
            features: vec!["h_shared".into(), "h_own".into()],
            max_len: 4,
            keep: None,
            working_set: None,
            package_working_set: None,
            request_rows: false,
        }];
        split.request_level = vec!["h_shared".into(), "h_own".into()];
        split.check().unwrap();
        split
    }

    /// A grouped request of `b` candidates whose user's history is `items`
    /// (shared table) and `items % 10` (own table).
    fn grouped(items: &[i64], b: usize) -> RequestSamples {
        RequestSamples {
            num_samples: b,
            dense: vec![0.5; b],
            lengths: vec![1; 2 * b],
            ids: (0..b as i64).flat_map(|c| [c, c % 10]).collect(),
            request: Some(Arc::new(RequestBlock {
                lengths: vec![items.len() as u32; 2],
                ids: items.iter().copied().chain(items.iter().map(|i| i % 10)).collect(),
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    /// One position's expected vector: each channel's row, dequantized as
    /// a bag of one id.
    fn position(tables: &[crate::stores::local::table::Table], item: i64) -> Vec<f32> {
        let mut out = vec![0.0; 16];
        for (t, id) in [(0, item), (1, item % 10)] {
            let one = Pooling { mode: PoolingMode::Sum, weights: None };
            let (rows, out) = (tables[t].bytes(), &mut out[t * 8..t * 8 + 8]);
            pool_rows(Storage::Int8Rowwise, rows, 16, 8, &[1], &[id], one, out, 8).unwrap();
        }
        out
    }

    #[test]
    fn a_users_history_is_looked_up_once_and_every_candidate_sees_what_it_would_flat() {
        let split = sequence_schema();
        let model = split.model_schema("torch", "cpu");
        let mut requests = vec![
            grouped(&[4, 9, 9, 33, 7, 1], 3), // cut to its last 4 positions
            grouped(&[], 1),                  // no history
            grouped(&[4, 9, 9, 33, 7, 1], 2), // the same user: one unit
        ];
        let mut flat_one = RequestSamples {
            num_samples: 1,
            dense: vec![0.5],
            lengths: vec![1, 1, 2, 2],
            ids: vec![3, 3, 5, 40, 5, 0],
            ..Default::default()
        };
        flat_one.validate(&model, LIMITS).unwrap();
        for r in &mut requests {
            r.validate(&model, LIMITS).unwrap();
        }
        let batch = assemble(1, 4, [&requests[0], &flat_one, &requests[1], &requests[2]]);
        assert_eq!(batch.request_blocks.as_ref().unwrap().unit_count, 2);
        let flat = batch.clone().into_flat();
        let tables: Vec<_> = split.tables.iter().map(|t| rows(t, 7)).collect();
        for fetches in [false, true] {
            let store = |t| match fetches {
                false => Arc::new(rows(t, 7)) as Arc<dyn RowStore>,
                true => Arc::new(Fetching(rows(t, 7))),
            };
            let stage = EmbeddingStage::new(&split, split.tables.iter().map(store).collect());
            assert_eq!(stage.pooled_width(), 16, "a and b only");
            let (mut scratch, mut pooled) = (StageScratch::default(), Vec::new());
            stage.pool(&flat, &mut scratch, &mut pooled).unwrap();
            let (flat_pooled, flat_sequence) = (pooled.clone(), scratch.sequences()[0].clone());
            // Flat: every row its own unit, each holding its history.
            assert_eq!(flat_sequence.row_unit, (0..7).collect::<Vec<i64>>());
            assert_eq!(flat_sequence.positions(), 4 * 5 + 2);
            stage.pool(&batch, &mut scratch, &mut pooled).unwrap();
            assert_eq!(pooled, flat_pooled, "the pooled features as if sent flat");
            let grouped = &scratch.sequences()[0];
            // The flat row's unit, then the 2 users' (the grouped rows' own,
            // empty, units dropped).
            assert_eq!(grouped.row_unit, [1, 1, 1, 0, 2, 1, 1]);
            assert_eq!(grouped.offsets, [0, 2, 6, 6]);
            assert_eq!(grouped.positions(), 4 + 2, "the user's history once, not per candidate");
            // Flat: 22 positions for 7 rows; grouped: 6 for 7 rows. Padding
            // to the longest attended unit (4): flat, units of 4, 4, 4, 2, 0,
            // 4 and 4; grouped, units of 4, 2 and 0.
            assert_eq!(stage.metrics().sequence_counts(), (22 + 6, 14, 6 + 6));
            let unit = |s: &super::SequenceValues, r: usize| {
                let u = s.row_unit[r] as usize;
                s.values[s.offsets[u] as usize * 16..s.offsets[u + 1] as usize * 16].to_vec()
            };
            for r in 0..7 {
                assert_eq!(unit(grouped, r), unit(&flat_sequence, r), "row {r}");
            }
            let expected: Vec<f32> = [9, 33, 7, 1].iter().flat_map(|&i| position(&tables, i)).collect();
            assert_eq!(unit(grouped, 0), expected, "the most recent 4 positions, oldest first");
            assert_eq!(unit(grouped, 3), [position(&tables, 5), position(&tables, 40)].concat());
            // A batch without a single position.
            let empty = assemble(1, 4, [&requests[1]]);
            stage.pool(&empty, &mut scratch, &mut pooled).unwrap();
            assert_eq!(
                (scratch.sequences()[0].positions(), scratch.sequences()[0].row_unit.as_slice()),
                (0, &[0][..])
            );
        }
    }

    #[test]
    fn a_history_declared_per_row_and_made_request_level_by_the_override_is_looked_up_once() {
        // schema.json sends h on every row; `--request-level h_shared,h_own`
        // makes the engine's schema send it once per request. The stage
        // follows the batch's blocks, so both agree.
        let mut split = sequence_schema();
        split.request_level.clear();
        split.check().unwrap();
        let mut model = split.model_schema("torch", "cpu");
        assert!(!model.sequences[0].is_request_level(&model), "per row as declared");
        let level = narsil_core::RequestLevel::parse(["h_shared", "h_own"], &model).unwrap();
        model.set_request_level(level).unwrap();
        let mut requests = vec![grouped(&[4, 9, 9, 33, 7, 1], 3), grouped(&[12, 2], 2)];
        for r in &mut requests {
            r.validate(&model, LIMITS).unwrap();
        }
        let batch = assemble(1, 4, &requests);
        let flat = batch.clone().into_flat();
        let stage =
            EmbeddingStage::new(&split, split.tables.iter().map(|t| Arc::new(rows(t, 7)) as _).collect());
        let (mut scratch, mut pooled) = (StageScratch::default(), Vec::new());
        stage.pool(&flat, &mut scratch, &mut pooled).unwrap();
        let (flat_pooled, flat_sequence) = (pooled.clone(), scratch.sequences()[0].clone());
        stage.pool(&batch, &mut scratch, &mut pooled).unwrap();
        assert_eq!(pooled, flat_pooled);
        let grouped = &scratch.sequences()[0];
        assert_eq!(grouped.positions(), 4 + 2, "each user's history once");
        let unit = |s: &super::SequenceValues, r: usize| {
            let u = s.row_unit[r] as usize;
            s.values[s.offsets[u] as usize * 16..s.offsets[u + 1] as usize * 16].to_vec()
        };
        for r in 0..5 {
            assert_eq!(unit(grouped, r), unit(&flat_sequence, r), "row {r}");
        }
    }
}
