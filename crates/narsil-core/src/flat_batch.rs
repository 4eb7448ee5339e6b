//! Which rows of a fused batch take a request-level unit's bags
//! ([`KeyedBatch::broadcasts`]: the embedding stage pools each unit once and
//! copies it there), and the batch the same requests sent flat would have
//! made ([`KeyedBatch::into_flat`]: for backends that take only flat
//! batches, and for tests).

use crate::batch::KeyedBatch;

/// Rows `start..start + rows` of a batch use unit `unit`'s request-level
/// bags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Broadcast {
    /// First row.
    pub start: usize,
    /// Rows.
    pub rows: usize,
    /// The unit.
    pub unit: usize,
}

impl KeyedBatch {
    /// The runs of rows that take a unit's request-level bags, in row
    /// order (none for a batch of flat requests).
    pub fn broadcasts(&self) -> Vec<Broadcast> {
        let Some(blocks) = &self.request_blocks else { return Vec::new() };
        let mut start = 0;
        let mut runs = Vec::new();
        for (&rows, unit) in self.request_rows.iter().zip(&blocks.request_unit) {
            if let Some(unit) = *unit {
                runs.push(Broadcast { start, rows, unit });
            }
            start += rows;
        }
        runs
    }

    /// The batch the same requests sent flat would have made: every
    /// grouped row's request-level bags filled from its unit (a copy per
    /// row: for backends that take only flat batches, and for tests).
    pub fn into_flat(self) -> KeyedBatch {
        let Some(blocks) = self.request_blocks.as_ref() else { return self };
        let mut unit_of_row = Vec::with_capacity(self.rows);
        for (&rows, &unit) in self.request_rows.iter().zip(&blocks.request_unit) {
            unit_of_row.extend(std::iter::repeat_n(unit, rows));
        }
        let mut flat = Bags {
            weighted: !self.weights.is_empty() || !blocks.weights.is_empty(),
            lengths: Vec::with_capacity(self.lengths.len()),
            ..Bags::default()
        };
        let mut feature_offsets = vec![0];
        for f in 0..self.num_sparse {
            let range = self.feature_offsets[f]..self.feature_offsets[f + 1];
            let (own, own_weights) = (&self.ids[range.clone()], self.weights.get(range));
            // Where each unit's bag of this feature starts, when it has one.
            let units = blocks.position(f).map(|k| {
                let mut starts = vec![0];
                for &len in blocks.feature_lengths(k) {
                    starts.push(starts.last().copied().unwrap_or(0) + len as usize);
                }
                (blocks.feature_ids(k), blocks.feature_weights(k), starts)
            });
            let mut at = 0;
            for (&len, unit) in self.feature_lengths(f).iter().zip(&unit_of_row) {
                let bag = at..at + len as usize;
                at = bag.end;
                match (&units, unit) {
                    (Some((unit_ids, unit_weights, starts)), Some(u)) => {
                        let bag = starts[*u]..starts[u + 1];
                        flat.push(&unit_ids[bag.clone()], unit_weights.map(|w| &w[bag]));
                    }
                    _ => flat.push(&own[bag.clone()], own_weights.map(|w| &w[bag])),
                }
            }
            feature_offsets.push(flat.ids.len());
        }
        let Bags { lengths, ids, weights, .. } = flat;
        KeyedBatch { lengths, ids, weights, feature_offsets, request_blocks: None, ..self }
    }
}

/// Bags laid end to end, as [`KeyedBatch::into_flat`] builds them.
#[derive(Default)]
struct Bags {
    /// Whether every id gets a weight.
    weighted: bool,
    lengths: Vec<i32>,
    ids: Vec<i64>,
    weights: Vec<f32>,
}

impl Bags {
    /// Appends one bag (a row's own, or a unit's) and its weights (1.0
    /// each where it has none).
    fn push(&mut self, run: &[i64], run_weights: Option<&[f32]>) {
        self.lengths.push(run.len() as i32);
        self.ids.extend_from_slice(run);
        if self.weighted {
            match run_weights {
                Some(w) => self.weights.extend_from_slice(w),
                None => self.weights.resize(self.weights.len() + run.len(), 1.0),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::batch::assemble;
    use crate::request::{IdPolicy, RequestLimits, RequestSamples};
    use crate::request_level::RequestBlock;
    use crate::schema::{ModelSchema, RequestLevel};

    /// 2 dense, 4 sparse features (weighted: cat_3); cat_0, cat_2 and the
    /// dense features request-level.
    fn schema() -> ModelSchema {
        let mut s = ModelSchema::dlrm("mock", "cpu", 100);
        s.num_dense = 2;
        s.sparse.truncate(4);
        s.sparse[3].weighted = true;
        s.request_level = RequestLevel::parse(["cat_0", "cat_2", "dense"], &s).unwrap();
        s
    }

    const LIMITS: RequestLimits = RequestLimits::new(64, IdPolicy::Reject);

    /// User `user`'s request of `b` candidates, grouped, and the same
    /// request flat (the user's features on every row), both validated.
    fn user_request(user: i64, b: usize) -> (RequestSamples, RequestSamples) {
        let user_ids = [vec![user, user + 1, user + 2], vec![user + 3]];
        let dense = vec![user as f32, 0.5];
        let candidate = |c: usize| (vec![c as i64 + 10], vec![c as i64 + 20, c as i64 + 30]);
        let mut grouped = RequestSamples {
            num_samples: b,
            request: Some(Arc::new(RequestBlock {
                dense: dense.clone(),
                lengths: vec![3, 1],
                ids: user_ids.concat(),
                ..Default::default()
            })),
            ..Default::default()
        };
        let mut flat = RequestSamples { num_samples: b, ..Default::default() };
        for c in 0..b {
            let (c1, c3) = candidate(c);
            grouped.lengths.extend([1, 2]);
            grouped.ids.extend(c1.iter().chain(&c3));
            grouped.weights.extend([0.5, c as f32]);
            flat.dense.extend(&dense);
            flat.lengths.extend([3, 1, 1, 2]);
            flat.ids.extend(user_ids[0].iter().chain(&c1).chain(&user_ids[1]).chain(&c3));
            flat.weights.extend([0.5, c as f32]);
        }
        grouped.validate(&schema(), LIMITS).unwrap();
        flat.validate(&schema(), LIMITS).unwrap();
        (grouped, flat)
    }

    #[test]
    fn a_fused_batch_of_grouped_requests_made_flat_is_the_flat_requests_batch() {
        let (a, a_flat) = user_request(1, 3);
        let (b, b_flat) = user_request(50, 2);
        let plain = RequestSamples {
            num_samples: 1,
            dense: vec![7.0, 8.0],
            lengths: vec![1, 1, 2, 1],
            ids: vec![1, 2, 3, 4, 5],
            weights: vec![9.0],
            ..Default::default()
        };
        let mut plain = plain;
        plain.validate(&schema(), LIMITS).unwrap();
        let fused = assemble(2, 4, [&a, &plain, &b]);
        let blocks = fused.request_blocks.as_ref().unwrap();
        assert_eq!((blocks.unit_count, blocks.request_unit.clone()), (2, vec![Some(0), None, Some(1)]));
        assert_eq!(blocks.dense, [1.0, 0.5, 50.0, 0.5]);
        assert_eq!(
            fused.dense,
            assemble(2, 4, [&a_flat, &plain, &b_flat]).dense,
            "dense broadcast to every row"
        );
        let broadcasts = fused.broadcasts();
        assert_eq!(
            broadcasts.iter().map(|b| (b.start, b.rows, b.unit)).collect::<Vec<_>>(),
            [(0, 3, 0), (4, 2, 1)]
        );
        assert_eq!(fused.into_flat(), assemble(2, 4, [&a_flat, &plain, &b_flat]));
    }

    #[test]
    fn the_same_user_twice_and_the_parts_of_a_split_request_share_one_unit() {
        let (a, a_flat) = user_request(1, 5);
        let (again, _) = user_request(1, 2);
        let parts = a.clone().split_rows(2, 4);
        assert_eq!(parts.len(), 3);
        assert!(parts.iter().all(|p| Arc::ptr_eq(p.request.as_ref().unwrap(), a.request.as_ref().unwrap())));
        assert_eq!(
            parts[1].decoded_bytes() - parts[1].row_bytes(),
            a.request.as_ref().unwrap().decoded_bytes()
        );
        let mut requests: Vec<&RequestSamples> = parts.iter().collect();
        requests.push(&again);
        let fused = assemble(2, 4, requests);
        let blocks = fused.request_blocks.as_ref().unwrap();
        assert_eq!((blocks.unit_count, blocks.request_unit.clone()), (1, vec![Some(0); 4]));
        let (_, again_flat) = user_request(1, 2);
        let mut flat = a_flat.split_rows(2, 4);
        flat.push(again_flat);
        assert_eq!(fused.into_flat(), assemble(2, 4, &flat));
    }

    #[test]
    fn dropping_a_fused_grouped_request_keeps_the_others_units_right() {
        let (a, a_flat) = user_request(1, 2);
        let (b, b_flat) = user_request(9, 3);
        let fused = assemble(2, 4, [&a, &b]);
        assert_eq!(fused.retain_requests(|r| r == 1).into_flat(), assemble(2, 4, [&b_flat]));
        assert_eq!(fused.retain_requests(|r| r == 0).into_flat(), assemble(2, 4, [&a_flat]));
    }
}
