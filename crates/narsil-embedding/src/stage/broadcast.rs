//! The last step of a batch with ranking requests: each request-level
//! unit's pooled bags (pooled once, `pooling.rs`) copied into the columns
//! of its features in every candidate row of its requests, whose own bags
//! there were empty; counts the bags and rows. Also which rows pool their
//! own request-level bags before it ([`own_rows`]: the flat requests').

use narsil_core::KeyedBatch;

use super::EmbeddingStage;
use crate::pooled_value::PooledValue;

impl EmbeddingStage {
    /// Copies each request-level unit's pooled bags into the columns of
    /// its features in every row of its requests (whose own bags there
    /// were empty), each unit's converted once to the block's type.
    pub(super) fn broadcast<T: PooledValue>(
        &self,
        batch: &KeyedBatch,
        unit_pooled: &[f32],
        pooled: &mut [T],
        width: usize,
    ) {
        let Some(blocks) = &batch.request_blocks else { return };
        let (dim, stride) = (self.dim, blocks.features.len() * self.dim);
        let mut rows = 0;
        let mut unit = vec![T::default(); stride];
        for run in batch.broadcasts() {
            T::convert(&unit_pooled[run.unit * stride..(run.unit + 1) * stride], &mut unit);
            for row in pooled[run.start * width..(run.start + run.rows) * width].chunks_exact_mut(width) {
                for (&f, vector) in blocks.features.iter().zip(unit.chunks_exact(dim)) {
                    // A sequence's channels have no column: their units
                    // are the sequences' own.
                    if let Some(c) = self.features[f].column {
                        row[c * dim..(c + 1) * dim].copy_from_slice(vector);
                    }
                }
            }
            rows += run.rows;
        }
        self.metrics.count_request_level(blocks.unit_count * blocks.features.len(), rows);
    }
}

/// Into `ranges`, the rows of `batch` that take no request-level unit's
/// bags (its flat requests' rows), where it has ranking requests: the only
/// rows whose request-level features' own bags pooling reads (a grouped
/// row's are empty, and `broadcast` writes its columns).
pub(super) fn own_rows(batch: &KeyedBatch, ranges: &mut Vec<std::ops::Range<usize>>) {
    ranges.clear();
    let mut row = 0;
    for run in batch.broadcasts() {
        if run.start > row {
            ranges.push(row..run.start);
        }
        row = run.start + run.rows;
    }
    if row < batch.rows {
        ranges.push(row..batch.rows);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use narsil_core::request::{IdPolicy, RequestLimits};
    use narsil_core::{assemble, RequestBlock, RequestLevel, RequestSamples};

    use super::super::fixtures::{pooled_bits_both_ways, rows, schema};
    use super::super::pooling::tests::Fetching;
    use super::super::{EmbeddingStage, StageScratch};
    use crate::stores::row_store::RowStore;

    const LIMITS: RequestLimits = RequestLimits::new(64, IdPolicy::Reject);

    /// A ranking request of `b` candidates for `user`: features a and c
    /// (weighted) and the dense feature request-level, b per candidate.
    fn ranking(user: i64, b: usize) -> RequestSamples {
        RequestSamples {
            num_samples: b,
            lengths: (0..b).map(|c| (c % 3) as u32).collect(),
            ids: (0..b).flat_map(|c| (0..c % 3).map(move |k| ((c + k) % 10) as i64)).collect(),
            request: Some(Arc::new(RequestBlock {
                dense: vec![user as f32],
                lengths: vec![3, 2],
                ids: vec![user, user + 1, user, 49 - user, 7],
                weights: vec![0.5, -2.0],
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    #[test]
    fn request_level_bags_pooled_once_and_broadcast_equal_the_flat_batch_on_every_kind_of_store() {
        let split = schema();
        let mut model = split.model_schema("torch", "cpu");
        model.request_level = RequestLevel::parse(["a", "c", "dense"], &model).unwrap();
        let flat_one = {
            let mut r = RequestSamples {
                num_samples: 1,
                dense: vec![0.5],
                lengths: vec![1, 2, 1],
                ids: vec![3, 4, 5, 6],
                weights: vec![4.0],
                ..Default::default()
            };
            r.validate(&model, LIMITS).unwrap();
            r
        };
        let mut requests = vec![ranking(1, 4), ranking(20, 3), ranking(1, 2)];
        for r in &mut requests {
            r.validate(&model, LIMITS).unwrap();
        }
        // Flat rows first, between grouped ones and last: the rows that pool
        // their own request-level bags are three runs.
        let grouped =
            assemble(1, 3, [&flat_one, &requests[0], &flat_one, &requests[1], &requests[2], &flat_one]);
        assert_eq!(grouped.request_blocks.as_ref().unwrap().unit_count, 2, "user 1 twice: one unit");
        let flat = grouped.clone().into_flat();
        for fetches in [false, true] {
            let store = |t| match fetches {
                false => Arc::new(rows(t, 5)) as Arc<dyn RowStore>,
                true => Arc::new(Fetching(rows(t, 5))),
            };
            let stage = EmbeddingStage::new(&split, split.tables.iter().map(store).collect());
            let (mut scratch, mut expected, mut pooled) = (StageScratch::default(), Vec::new(), Vec::new());
            stage.pool(&flat, &mut scratch, &mut expected).unwrap();
            assert_eq!(stage.metrics().request_level_counts(), (0, 0));
            stage.pool(&grouped, &mut scratch, &mut pooled).unwrap();
            assert_eq!(pooled, expected, "every row as if sent flat");
            // 2 units x 2 request-level features pooled; 9 of 10 rows broadcast.
            assert_eq!(stage.metrics().request_level_counts(), (4, 9));
            let bits: Vec<u32> = expected.iter().map(|v| v.to_bits()).collect();
            assert_eq!(pooled_bits_both_ways(&stage, &grouped), bits, "broadcast in bf16 too");
        }
    }
}
