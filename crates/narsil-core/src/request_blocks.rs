//! The request-level blocks of a fused batch: each distinct block once
//! (a *unit*: two requests of the same user, or two parts of one split
//! request, share one), laid out key-major like the rows, and for every
//! fused request the unit its rows use. The rows of a grouped request hold
//! an empty bag for each request-level feature; the embedding stage pools
//! each unit's bags once and broadcasts them into those rows
//! (`crate::broadcast`).

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
}

impl RequestBlocks {
    /// The blocks of the fused requests (`None` for a flat one), each
    /// distinct block once. `None` when no request has one.
    pub fn gather(blocks: &[Option<Arc<RequestBlock>>]) -> Option<Self> {
        let mut units: Vec<&Arc<RequestBlock>> = Vec::new();
        let request_unit: Vec<Option<usize>> = blocks
            .iter()
            .map(|block| {
                let block = block.as_ref()?;
                let same = |u: &&Arc<RequestBlock>| Arc::ptr_eq(u, block) || ***u == **block;
                Some(units.iter().position(same).unwrap_or_else(|| {
                    units.push(block);
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
