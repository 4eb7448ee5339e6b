//! The request-level blocks of a fused batch: each distinct block once
//! (a *unit*: two requests of the same user, or two parts of one split
//! request, share one), laid out key-major like the rows, and for every
//! fused request the unit its rows use. The rows of a grouped request hold
//! an empty bag for each request-level feature; the embedding stage pools
//! each unit's bags once and broadcasts them into those rows
//! (`crate::broadcast`).

use std::collections::HashMap;
use std::sync::Arc;

use crate::request_level::RequestBlock;

/// A fused batch's request-level blocks.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RequestBlocks {
    /// Schema indices of the request-level sparse features, ascending.
    pub features: Vec<usize>,
    /// Distinct blocks (units).
    pub unit_count: usize,
    /// Key-major bag lengths: `lengths[k * units + u]` for feature `k` (of
    /// `features`) of unit `u`.
    pub lengths: Vec<i32>,
    /// Key-major ids: feature 0's bags for every unit, then feature 1's.
    pub ids: Vec<i64>,
    /// One weight per id in `ids` where a request-level feature is weighted
    /// (1.0 for the others' ids); empty otherwise.
    pub weights: Vec<f32>,
    /// `features.len() + 1` offsets: feature `k`'s ids are
    /// `ids[feature_offsets[k]..feature_offsets[k + 1]]`.
    pub feature_offsets: Vec<usize>,
    /// `[units x num_dense]` when the dense features are request-level
    /// (the batch's `dense` holds them broadcast to every row as well).
    pub dense: Vec<f32>,
    /// Per fused request, in order: the unit its rows use, or `None` for a
    /// flat request.
    pub request_unit: Vec<Option<usize>>,
    /// Per unit: the rows of the whole request its block came with
    /// ([`RequestBlock::request_rows`]; 0 where the model takes none),
    /// however the engine cut that request into parts or fused them.
    pub unit_rows: Vec<usize>,
    /// Per unit, where its block counts request rows: the whole request's
    /// last row's raw inputs outside sequences
    /// ([`RequestBlock::last_row_raw`]), unit after unit (empty where the
    /// model takes none).
    pub unit_last_raw: Vec<i64>,
}

impl RequestBlocks {
    /// The blocks of the fused requests (`None` for a flat one), each
    /// distinct block once. `None` when no request has one.
    /// Blocks are told apart by their digests ([`RequestBlock::digest`]),
    /// and compared whole only where digests are equal.
    pub fn gather(blocks: &[Option<Arc<RequestBlock>>]) -> Option<Self> {
        let mut units: Vec<&Arc<RequestBlock>> = Vec::new();
        // Each digest's units (more than one only where different blocks'
        // digests collide).
        let mut by_digest: HashMap<u64, Vec<usize>> = HashMap::new();
        let request_unit: Vec<Option<usize>> = blocks
            .iter()
            .map(|block| {
                let block = block.as_ref()?;
                let same_digest = by_digest.entry(block.digest).or_default();
                let same = |&&u: &&usize| Arc::ptr_eq(units[u], block) || *units[u] == *block;
                Some(same_digest.iter().find(same).copied().unwrap_or_else(|| {
                    units.push(block);
                    same_digest.push(units.len() - 1);
                    units.len() - 1
                }))
            })
            .collect();
        let first = units.first()?;
        let features = first.features.clone();
        let weighted = units.iter().any(|u| !u.weights.is_empty());
        let mut gathered = Self {
            unit_count: units.len(),
            lengths: Vec::with_capacity(units.len() * features.len()),
            feature_offsets: vec![0],
            request_unit,
            ..Default::default()
        };
        for k in 0..features.len() {
            for unit in &units {
                let bag = unit.feature_range(k);
                gathered.lengths.push(bag.len() as i32);
                gathered.ids.extend_from_slice(&unit.ids[bag.clone()]);
                if weighted {
                    match unit.weights.get(bag.clone()) {
                        Some(w) => gathered.weights.extend_from_slice(w),
                        None => gathered.weights.resize(gathered.weights.len() + bag.len(), 1.0),
                    }
                }
            }
            gathered.feature_offsets.push(gathered.ids.len());
        }
        for unit in &units {
            gathered.dense.extend_from_slice(&unit.dense);
            gathered.unit_rows.push(unit.request_rows);
            gathered.unit_last_raw.extend_from_slice(&unit.last_row_raw);
        }
        gathered.features = features;
        Some(gathered)
    }

    /// Feature `k`'s (of [`RequestBlocks::features`]) bag lengths, one per
    /// unit.
    pub fn feature_lengths(&self, k: usize) -> &[i32] {
        &self.lengths[k * self.unit_count..(k + 1) * self.unit_count]
    }

    /// Feature `k`'s ids for every unit, bags end to end.
    pub fn feature_ids(&self, k: usize) -> &[i64] {
        &self.ids[self.feature_offsets[k]..self.feature_offsets[k + 1]]
    }

    /// Feature `k`'s weights (one per id), if any feature is weighted.
    pub fn feature_weights(&self, k: usize) -> Option<&[f32]> {
        (!self.weights.is_empty())
            .then(|| &self.weights[self.feature_offsets[k]..self.feature_offsets[k + 1]])
    }

    /// Which of `features` sparse feature `f` is, if request-level.
    pub fn position(&self, f: usize) -> Option<usize> {
        self.features.binary_search(&f).ok()
    }

    /// Sparse feature `f`'s ids for every unit, if it is request-level.
    pub fn unit_ids(&self, f: usize) -> Option<&[i64]> {
        self.position(f).map(|k| self.feature_ids(k))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::RequestBlocks;
    use crate::request::{IdPolicy, RequestLimits};
    use crate::{ModelSchema, RequestBlock, RequestLevel, RequestSamples};

    /// A validated block of user `user` (cat_0 and cat_1 request-level).
    fn block(user: i64) -> Arc<RequestBlock> {
        let mut schema = ModelSchema::dlrm("test", "cpu", 1000);
        schema.request_level = RequestLevel::parse(["cat_0", "cat_1"], &schema).unwrap();
        let mut request = RequestSamples {
            num_samples: 1,
            dense: vec![0.5; schema.num_dense],
            ids: vec![3; schema.num_sparse() - 2],
            request: Some(Arc::new(RequestBlock {
                lengths: vec![2, 1],
                ids: vec![user, user + 1, 7],
                ..Default::default()
            })),
            ..Default::default()
        };
        request.validate(&schema, RequestLimits::new(4096, IdPolicy::Reject)).unwrap();
        request.request.unwrap()
    }

    #[test]
    fn equal_blocks_of_separate_requests_share_a_unit_and_different_ones_do_not() {
        let (a, b, a_again) = (block(1), block(2), block(1));
        assert!(!Arc::ptr_eq(&a, &a_again));
        assert_eq!(a.digest, a_again.digest, "equal values, equal digests");
        assert_ne!(a.digest, b.digest);
        let blocks = [Some(a.clone()), None, Some(b), Some(a_again), Some(a)];
        let gathered = RequestBlocks::gather(&blocks).unwrap();
        assert_eq!(gathered.unit_count, 2);
        assert_eq!(gathered.request_unit, vec![Some(0), None, Some(1), Some(0), Some(0)]);
        assert_eq!(gathered.feature_ids(0), &[1, 2, 2, 3]);
    }

    #[test]
    fn different_blocks_whose_digests_collide_stay_apart() {
        let a = block(1);
        let mut b = (*block(2)).clone();
        b.digest = a.digest;
        let unvalidated = |ids: Vec<i64>| {
            Arc::new(RequestBlock {
                lengths: vec![2, 1],
                ids,
                features: a.features.clone(),
                ..Default::default()
            })
        };
        let blocks = [
            Some(a.clone()),
            Some(Arc::new(b)),
            Some(unvalidated(vec![1, 2, 7])),
            Some(unvalidated(vec![1, 2, 7])),
            Some(unvalidated(vec![4, 5, 6])),
        ];
        let gathered = RequestBlocks::gather(&blocks).unwrap();
        assert_eq!(gathered.request_unit, vec![Some(0), Some(1), Some(2), Some(2), Some(3)]);
        assert_eq!(gathered.feature_ids(0), &[1, 2, 2, 3, 1, 2, 4, 5]);
    }
}
