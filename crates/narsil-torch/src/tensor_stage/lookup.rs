//! A batch's lookups for the tensor stage, made on the host: per group,
//! each id's row of the group, its bag in the pooled block's layout and
//! its multiplier (weight, mean), every id range-checked against its table;
//! and the same lookups on the device.

use narsil_core::KeyedBatch;
use narsil_embedding::{OutOfRange, PoolingMode, StageError};
use tch::Tensor;

use super::FeatureTable;

/// A group's lookups for one batch, on the host: which rows of the group,
/// into which bag, with which multiplier.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct GroupLookup {
    /// Per id: its row in the group.
    pub rows: Vec<i64>,
    /// Per id: its bag (`row * features + feature`).
    pub bags: Vec<i64>,
    /// Per id: its weight, times `1 / len` for a mean-pooled bag.
    pub multipliers: Vec<f32>,
    /// Whether any multiplier is not 1 (else none is sent).
    pub scaled: bool,
}

/// A batch's lookups, one per group, reused from batch to batch.
#[derive(Debug, Default)]
pub struct Lookup {
    /// Per group.
    pub groups: Vec<GroupLookup>,
    /// The batch's request-level units (ranking requests), whose bags are
    /// `(rows + unit) * features + feature`, past the rows' own.
    pub units: usize,
    /// With units: for every bag of the pooled block (`row * features +
    /// feature`), the bag it takes (its own, or its unit's for a
    /// request-level feature of a grouped row); empty without units.
    pub gather: Vec<i64>,
}

/// A group's lookups on the device.
pub struct DeviceLookup {
    /// i64 `[ids]`.
    pub rows: Tensor,
    /// i64 `[ids]`.
    pub bags: Tensor,
    /// f32 `[ids]`, when some id's multiplier is not 1.
    pub multipliers: Option<Tensor>,
}

impl Lookup {
    /// Fills the lookups of `batch` for `features` (in `groups` groups),
    /// checking every id against its table.
    pub fn fill(
        &mut self,
        batch: &KeyedBatch,
        features: &[FeatureTable],
        groups: usize,
    ) -> Result<(), StageError> {
        self.groups.resize_with(groups, GroupLookup::default);
        for group in &mut self.groups {
            group.rows.clear();
            group.bags.clear();
            group.multipliers.clear();
            group.scaled = false;
        }
        let count = features.len() as i64;
        for (f, feature) in features.iter().enumerate() {
            let weights = (feature.weighted && !batch.weights.is_empty())
                .then(|| &batch.weights[batch.feature_offsets[f]..batch.feature_offsets[f + 1]]);
            let first_bag = f as i64;
            self.add(feature, batch.feature_lengths(f), batch.feature_ids(f), weights, first_bag, count)?;
        }
        self.units = 0;
        self.gather.clear();
        let Some(blocks) = &batch.request_blocks else { return Ok(()) };
        self.units = blocks.unit_count;
        for (k, &f) in blocks.features.iter().enumerate() {
            let feature = &features[f];
            let weights = blocks.feature_weights(k).filter(|_| feature.weighted);
            let first_bag = batch.rows as i64 * count + f as i64;
            self.add(feature, blocks.feature_lengths(k), blocks.feature_ids(k), weights, first_bag, count)?;
        }
        self.gather.extend(0..batch.rows as i64 * count);
        for run in batch.broadcasts() {
            let unit_bag = (batch.rows + run.unit) as i64 * count;
            for row in run.start..run.start + run.rows {
                for &f in &blocks.features {
                    self.gather[row * count as usize + f] = unit_bag + f as i64;
                }
            }
        }
        Ok(())
    }

    /// Adds one feature's bags (`lengths` of `ids`), bag `b` of them into
    /// pooled bag `first_bag + b * count`.
    fn add(
        &mut self,
        feature: &FeatureTable,
        lengths: &[i32],
        ids: &[i64],
        weights: Option<&[f32]>,
        first_bag: i64,
        count: i64,
    ) -> Result<(), StageError> {
        if let Some(&id) = ids.iter().find(|&&id| id < 0 || id as u64 >= feature.rows) {
            let source = OutOfRange { id, rows: feature.rows };
            return Err(StageError::OutOfRange { feature: feature.name.clone(), source });
        }
        let group = &mut self.groups[feature.group];
        group.rows.extend(ids.iter().map(|&id| id + feature.base));
        let mut at = 0;
        for (b, &len) in lengths.iter().enumerate() {
            let len = len.max(0) as usize;
            let bag = first_bag + b as i64 * count;
            let mean = if feature.mode == PoolingMode::Mean && len > 0 { 1.0 / len as f32 } else { 1.0 };
            for i in at..at + len {
                let m = weights.map_or(1.0, |w| w[i]) * mean;
                group.scaled |= m != 1.0;
                group.bags.push(bag);
                group.multipliers.push(m);
            }
            at += len;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch() -> KeyedBatch {
        // Two features over two rows: f0 bags [1, 2] [] ; f1 bags [0] [3, 3].
        KeyedBatch {
            rows: 2,
            num_dense: 1,
            num_sparse: 2,
            dense: vec![0.0, 0.0],
            lengths: vec![2, 0, 1, 2],
            ids: vec![1, 2, 0, 3, 3],
            weights: vec![1.0, 1.0, 0.5, 2.0, 4.0],
            feature_offsets: vec![0, 2, 5],
            request_rows: vec![2],
            ..Default::default()
        }
    }

    fn features() -> Vec<FeatureTable> {
        vec![
            FeatureTable {
                name: "a".into(),
                group: 0,
                base: 0,
                rows: 4,
                mode: PoolingMode::Mean,
                weighted: false,
            },
            FeatureTable {
                name: "b".into(),
                group: 0,
                base: 4,
                rows: 4,
                mode: PoolingMode::Sum,
                weighted: true,
            },
        ]
    }

    #[test]
    fn ids_become_group_rows_and_bags_in_the_pooled_layout() {
        let mut lookup = Lookup::default();
        lookup.fill(&batch(), &features(), 1).unwrap();
        let g = &lookup.groups[0];
        assert_eq!(g.rows, [1, 2, 4, 7, 7]);
        // bag = row * features + feature
        assert_eq!(g.bags, [0, 0, 1, 3, 3]);
        assert_eq!(g.multipliers, [0.5, 0.5, 0.5, 2.0, 4.0]);
        assert!(g.scaled);
    }

    #[test]
    fn an_id_past_its_table_is_refused_naming_the_feature() {
        let mut b = batch();
        b.ids[3] = 4;
        let error = Lookup::default().fill(&b, &features(), 1).unwrap_err();
        assert!(error.to_string().contains("\"b\"") && error.to_string().contains("id 4"), "{error}");
    }
}
