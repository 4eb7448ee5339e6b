//! Sum-pooled embedding bags: TorchRec's `EmbeddingBagCollection` with
//! `PoolingType.SUM`, computed straight from the key-major batch into the
//! `[rows, features, dim]` buffer the interaction needs.
//!
//! One pass per feature over its bags; each id adds one contiguous table row
//! into the output row. Ids were range-checked before the batch was queued,
//! so indexing cannot fail here (slices still bound-check, cheaply).

use narsil_core::KeyedBatch;

/// Pools every bag of `batch` into `out` (`[rows x tables.len() x dim]`,
/// overwritten). An empty bag pools to zeros. Ids are added in bag order,
/// as TorchRec does.
pub fn sum_pool(batch: &KeyedBatch, tables: &[Vec<f32>], dim: usize, out: &mut Vec<f32>) {
    let features = tables.len();
    debug_assert_eq!(batch.num_sparse, features);
    out.clear();
    out.resize(batch.rows * features * dim, 0.0);
    for (f, table) in tables.iter().enumerate() {
        let ids = batch.feature_ids(f);
        let mut cursor = 0;
        for (row, &len) in batch.feature_lengths(f).iter().enumerate() {
            let start = (row * features + f) * dim;
            let target = &mut out[start..start + dim];
            for &id in &ids[cursor..cursor + len as usize] {
                let offset = id as usize * dim;
                let source = &table[offset..offset + dim];
                for (t, s) in target.iter_mut().zip(source) {
                    *t += s;
                }
            }
            cursor += len as usize;
        }
    }
}

#[cfg(test)]
mod tests {
    use narsil_core::{assemble, RequestSamples};

    use super::*;

    /// Sample-major reference: walk the request's bags directly.
    fn naive(request: &RequestSamples, tables: &[Vec<f32>], dim: usize) -> Vec<f32> {
        let features = tables.len();
        let mut out = vec![0.0; request.num_samples * features * dim];
        let mut cursor = 0;
        for (bag, &len) in request.lengths.iter().enumerate() {
            let (row, f) = (bag / features, bag % features);
            for &id in &request.ids[cursor..cursor + len as usize] {
                for d in 0..dim {
                    out[(row * features + f) * dim + d] += tables[f][id as usize * dim + d];
                }
            }
            cursor += len as usize;
        }
        out
    }

    #[test]
    fn multi_hot_bags_with_empty_ones_pool_like_the_naive_reference() {
        let dim = 4;
        let tables: Vec<Vec<f32>> =
            (0..3).map(|f| (0..10 * dim).map(|i| (f * 1000 + i) as f32 * 0.5).collect()).collect();
        let request = RequestSamples {
            num_samples: 2,
            dense: vec![0.0; 2],
            lengths: vec![2, 0, 1, 3, 1, 0],
            ids: vec![1, 9, 4, 0, 0, 7, 2],
            ..Default::default()
        };
        let batch = assemble(1, 3, [&request]);
        let mut out = Vec::new();
        sum_pool(&batch, &tables, dim, &mut out);
        assert_eq!(out, naive(&request, &tables, dim));
        // Sample 0, feature 1: empty bag.
        assert!(out[dim..2 * dim].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn fused_requests_pool_to_each_request_alone() {
        let dim = 3;
        let tables: Vec<Vec<f32>> =
            (0..2).map(|f| (0..5 * dim).map(|i| (i * 7 + f) as f32).collect()).collect();
        let a = RequestSamples {
            num_samples: 1,
            dense: vec![0.0],
            lengths: vec![1, 2],
            ids: vec![4, 1, 1],
            ..Default::default()
        };
        let b = RequestSamples {
            num_samples: 2,
            dense: vec![0.0; 2],
            lengths: vec![0, 1, 3, 0],
            ids: vec![2, 0, 3, 4],
            ..Default::default()
        };
        let mut fused = Vec::new();
        sum_pool(&assemble(1, 2, [&a, &b]), &tables, dim, &mut fused);
        let mut alone_a = Vec::new();
        let mut alone_b = Vec::new();
        sum_pool(&assemble(1, 2, [&a]), &tables, dim, &mut alone_a);
        sum_pool(&assemble(1, 2, [&b]), &tables, dim, &mut alone_b);
        assert_eq!(fused, [alone_a, alone_b].concat());
    }
}
