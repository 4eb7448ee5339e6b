//! The fused batch a backend runs, and the reorder that builds it.
//!
//! Requests arrive sample-major (sample 0's bags for every feature, then
//! sample 1's). Models built with TorchRec take sparse input key-major, as a
//! `KeyedJaggedTensor`: every bag of feature 0 for all rows, then feature 1,
//! and so on. [`BatchBuilder`] does that reorder one request at a time, so the
//! engine can assemble the next batch while the current one runs; `finish`
//! then lays the per-feature buffers end to end.
//!
//! The builder remembers where each request's values lie in its buffers, so
//! a request can be removed (cancelled while queued) or moved to another
//! batch without keeping its original samples: a queued request is held
//! once, in the builder.
//!
//! [`KeyedBatch::split`] hands each request back its own rows of the scores;
//! [`KeyedBatch::split_outputs`] does so for every output of a multi-output
//! model.

use crate::request::{RequestSamples, SparseLayout};

/// A fused batch in the layout backends consume.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct KeyedBatch {
    /// Total rows (samples) across all fused requests.
    pub rows: usize,
    /// Dense features per row.
    pub num_dense: usize,
    /// Sparse features.
    pub num_sparse: usize,
    /// `[rows x num_dense]`, row-major.
    pub dense: Vec<f32>,
    /// Key-major bag lengths: `lengths[f * rows + row]`.
    pub lengths: Vec<i32>,
    /// Key-major ids: feature 0's bags for rows `0..rows`, then feature 1's.
    pub ids: Vec<i64>,
    /// For models with weighted features: one weight per id in `ids`, in
    /// the same order (1.0 for unweighted features' ids; the weighted
    /// features are the last ones, so theirs are
    /// `weights[feature_offsets[first weighted]..]`). Empty otherwise.
    pub weights: Vec<f32>,
    /// `num_sparse + 1` offsets: feature `f`'s ids are
    /// `ids[feature_offsets[f]..feature_offsets[f + 1]]`.
    pub feature_offsets: Vec<usize>,
    /// Rows contributed by each fused request, in order.
    pub request_rows: Vec<usize>,
    /// When the last of its callers stops waiting (the latest of the fused
    /// requests' deadlines; `None` when some request has none): work for
    /// the batch past it is wasted, so a store that reads rows over the
    /// network gives up then.
    pub deadline: Option<std::time::Instant>,
}

impl KeyedBatch {
    /// Feature `f`'s bag lengths for every row.
    pub fn feature_lengths(&self, f: usize) -> &[i32] {
        &self.lengths[f * self.rows..(f + 1) * self.rows]
    }

    /// Feature `f`'s ids for every row, bags end to end.
    pub fn feature_ids(&self, f: usize) -> &[i64] {
        &self.ids[self.feature_offsets[f]..self.feature_offsets[f + 1]]
    }

    /// The same batch without the requests `keep` says no to (by their
    /// order in the batch), as [`assemble`] would fuse the rest: for a batch
    /// whose forward had not run when some of its callers stopped waiting.
    pub fn retain_requests(&self, keep: impl Fn(usize) -> bool) -> KeyedBatch {
        let kept_rows: Vec<bool> = self
            .request_rows
            .iter()
            .enumerate()
            .flat_map(|(r, &n)| std::iter::repeat_n(keep(r), n))
            .collect();
        let rows = kept_rows.iter().filter(|&&k| k).count();
        let weighted = !self.weights.is_empty();
        let mut kept = KeyedBatch {
            rows,
            num_dense: self.num_dense,
            num_sparse: self.num_sparse,
            dense: Vec::with_capacity(rows * self.num_dense),
            lengths: Vec::with_capacity(rows * self.num_sparse),
            feature_offsets: vec![0],
            request_rows: self
                .request_rows
                .iter()
                .enumerate()
                .filter(|&(r, _)| keep(r))
                .map(|(_, &n)| n)
                .collect(),
            deadline: self.deadline,
            ..Default::default()
        };
        for (row, dense) in self.dense.chunks_exact(self.num_dense.max(1)).enumerate() {
            if self.num_dense > 0 && kept_rows[row] {
                kept.dense.extend_from_slice(dense);
            }
        }
        for f in 0..self.num_sparse {
            let mut id = self.feature_offsets[f];
            for (&len, &keep_row) in self.feature_lengths(f).iter().zip(&kept_rows) {
                let bag = id..id + len as usize;
                id = bag.end;
                if keep_row {
                    kept.lengths.push(len);
                    kept.ids.extend_from_slice(&self.ids[bag.clone()]);
                    if weighted {
                        kept.weights.extend_from_slice(&self.weights[bag]);
                    }
                }
            }
            kept.feature_offsets.push(kept.ids.len());
        }
        kept
    }

    /// Splits a batch's scores (one per row) back into per-request slices,
    /// in the order requests were fused. `scores.len()` must equal `rows`.
    pub fn split<'a>(&'a self, scores: &'a [f32]) -> impl Iterator<Item = &'a [f32]> + 'a {
        debug_assert_eq!(scores.len(), self.rows);
        let mut start = 0;
        self.request_rows.iter().map(move |&n| {
            let part = &scores[start..start + n];
            start += n;
            part
        })
    }

    /// Splits a forward's scores, output after output (`k` blocks of `rows`
    /// scores), into each request's own scores per output, in the order
    /// requests were fused.
    pub fn split_outputs<'a>(&'a self, scores: &'a [f32]) -> impl Iterator<Item = Vec<Vec<f32>>> + 'a {
        let outputs = scores.len().checked_div(self.rows).unwrap_or(0);
        debug_assert_eq!(scores.len(), outputs * self.rows);
        let mut start = 0;
        self.request_rows.iter().map(move |&n| {
            let own = (0..outputs)
                .map(|o| scores[o * self.rows + start..o * self.rows + start + n].to_vec())
                .collect();
            start += n;
            own
        })
    }
}

/// Builds a [`KeyedBatch`] request by request, reordering each one into
/// per-feature buffers as it is pushed.
#[derive(Debug)]
pub struct BatchBuilder {
    num_dense: usize,
    rows: usize,
    dense: Vec<f32>,
    lengths: Vec<Vec<i32>>,
    ids: Vec<Vec<i64>>,
    /// Per feature, like `ids`; filled only for requests with weights.
    weights: Vec<Vec<f32>>,
    request_rows: Vec<usize>,
    /// Where each request's ids (and weights) start in every feature's
    /// buffer: request `r`, feature `f` at `id_starts[r * num_sparse + f]`.
    id_starts: Vec<usize>,
}

impl BatchBuilder {
    /// An empty builder for a model with the given feature counts.
    pub fn new(num_dense: usize, num_sparse: usize) -> Self {
        Self {
            num_dense,
            rows: 0,
            dense: Vec::new(),
            lengths: vec![Vec::new(); num_sparse],
            ids: vec![Vec::new(); num_sparse],
            weights: vec![Vec::new(); num_sparse],
            request_rows: Vec::new(),
            id_starts: Vec::new(),
        }
    }

    /// Rows pushed so far.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Requests pushed so far.
    pub fn requests(&self) -> usize {
        self.request_rows.len()
    }

    /// True when nothing has been pushed.
    pub fn is_empty(&self) -> bool {
        self.request_rows.is_empty()
    }

    /// Appends a validated request: its dense rows as they are, its bags
    /// scattered to their features' buffers (or, for a key-major request,
    /// each feature's run appended whole).
    pub fn push(&mut self, request: &RequestSamples) {
        let num_sparse = self.lengths.len();
        let b = request.num_samples;
        debug_assert_eq!(request.dense.len(), b * self.num_dense);
        debug_assert_eq!(request.lengths.len(), b * num_sparse);
        self.dense.extend_from_slice(&request.dense);
        self.rows += b;
        self.request_rows.push(b);
        self.id_starts.extend(self.ids.iter().map(Vec::len));
        if num_sparse == 0 {
            return;
        }
        if !request.weights.is_empty() {
            self.push_weights(request);
        }
        if request.layout == SparseLayout::KeyMajor {
            // Already key-major: append each feature's run as it is.
            let mut cursor = 0usize;
            for (f, feature_lengths) in request.lengths.chunks_exact(b).enumerate() {
                let count: usize = feature_lengths.iter().map(|&l| l as usize).sum();
                self.lengths[f].extend(feature_lengths.iter().map(|&l| l as i32));
                self.ids[f].extend_from_slice(&request.ids[cursor..cursor + count]);
                cursor += count;
            }
            return;
        }
        for lengths in &mut self.lengths {
            lengths.reserve(b);
        }
        if request.is_one_id_per_bag() {
            for ids in &mut self.ids {
                ids.reserve(b);
            }
            for sample_ids in request.ids.chunks_exact(num_sparse) {
                for (f, &id) in sample_ids.iter().enumerate() {
                    self.lengths[f].push(1);
                    self.ids[f].push(id);
                }
            }
            return;
        }
        let mut cursor = 0usize;
        for sample_lengths in request.lengths.chunks_exact(num_sparse) {
            for (f, &len) in sample_lengths.iter().enumerate() {
                let len = len as usize;
                self.lengths[f].push(len as i32);
                self.ids[f].extend_from_slice(&request.ids[cursor..cursor + len]);
                cursor += len;
            }
        }
    }

    /// A weighted request's weights, to their features' buffers: they move
    /// exactly as its ids do.
    fn push_weights(&mut self, request: &RequestSamples) {
        let (b, num_sparse) = (request.num_samples, self.weights.len());
        let mut cursor = 0usize;
        let mut take = |f: usize, len: usize| {
            self.weights[f].extend_from_slice(&request.weights[cursor..cursor + len]);
            cursor += len;
        };
        match request.layout {
            SparseLayout::KeyMajor => {
                for (bag, &len) in request.lengths.iter().enumerate() {
                    take(bag / b, len as usize);
                }
            }
            SparseLayout::SampleMajor => {
                for (bag, &len) in request.lengths.iter().enumerate() {
                    take(bag % num_sparse, len as usize);
                }
            }
        }
    }

    /// Request `r`'s ids' range in feature `f`'s buffer.
    fn id_range(&self, r: usize, f: usize) -> std::ops::Range<usize> {
        let num_sparse = self.ids.len();
        let start = self.id_starts[r * num_sparse + f];
        let end = self.id_starts.get((r + 1) * num_sparse + f).copied().unwrap_or(self.ids[f].len());
        start..end
    }

    /// Request `r` as it was pushed, in key-major layout (to move it to
    /// another batch).
    pub fn request(&self, r: usize) -> RequestSamples {
        let num_sparse = self.ids.len();
        let mut samples = RequestSamples {
            num_samples: self.request_rows[r],
            layout: SparseLayout::KeyMajor,
            ..Default::default()
        };
        let first_row: usize = self.request_rows[..r].iter().sum();
        let rows = first_row..first_row + self.request_rows[r];
        samples.dense.extend_from_slice(&self.dense[rows.start * self.num_dense..rows.end * self.num_dense]);
        for f in 0..num_sparse {
            let ids = self.id_range(r, f);
            samples.lengths.extend(self.lengths[f][rows.clone()].iter().map(|&l| l as u32));
            samples.ids.extend_from_slice(&self.ids[f][ids.clone()]);
            if !self.weights[f].is_empty() {
                samples.weights.extend_from_slice(&self.weights[f][ids]);
            }
        }
        samples
    }

    /// The same builder without the requests `keep` says no to, in order.
    pub fn retain(&self, keep: impl Fn(usize) -> bool) -> BatchBuilder {
        let mut kept = BatchBuilder::new(self.num_dense, self.ids.len());
        for r in (0..self.requests()).filter(|&r| keep(r)) {
            kept.push(&self.request(r));
        }
        kept
    }

    /// Lays the per-feature buffers end to end into the key-major batch,
    /// freeing each as it is copied (the first is extended in place), so
    /// the batch's ids are held about once, not twice, while it is made.
    pub fn finish(self) -> KeyedBatch {
        let num_sparse = self.lengths.len();
        let total_ids: usize = self.ids.iter().map(Vec::len).sum();
        let mut feature_offsets = Vec::with_capacity(num_sparse + 1);
        feature_offsets.push(0);
        let mut features = self.ids.into_iter();
        let mut ids = features.next().unwrap_or_default();
        ids.reserve_exact(total_ids - ids.len());
        feature_offsets.push(ids.len());
        for feature_ids in features {
            ids.extend_from_slice(&feature_ids);
            feature_offsets.push(ids.len());
        }
        KeyedBatch {
            rows: self.rows,
            num_dense: self.num_dense,
            num_sparse,
            dense: self.dense,
            lengths: self.lengths.concat(),
            ids,
            weights: self.weights.concat(),
            feature_offsets,
            request_rows: self.request_rows,
            deadline: None,
        }
    }
}

/// Fuses validated requests, in order, into one key-major batch.
pub fn assemble<'a>(
    num_dense: usize,
    num_sparse: usize,
    requests: impl IntoIterator<Item = &'a RequestSamples>,
) -> KeyedBatch {
    let mut builder = BatchBuilder::new(num_dense, num_sparse);
    for request in requests {
        builder.push(request);
    }
    builder.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sample-major request with explicit lengths; ids encode their origin
    /// (request tag, sample, feature, position) so misplacement is visible.
    fn request(tag: i64, lengths: Vec<Vec<u32>>, num_dense: usize) -> RequestSamples {
        let b = lengths.len();
        let mut ids = Vec::new();
        for (s, per_feature) in lengths.iter().enumerate() {
            for (f, &len) in per_feature.iter().enumerate() {
                for k in 0..len as i64 {
                    ids.push(tag * 10_000 + s as i64 * 100 + f as i64 * 10 + k);
                }
            }
        }
        RequestSamples {
            num_samples: b,
            dense: (0..b * num_dense).map(|i| (tag * 1000) as f32 + i as f32).collect(),
            lengths: lengths.concat(),
            ids,
            ..Default::default()
        }
    }

    /// Straightforward reference: for each feature, for each request, for
    /// each sample, find the bag by scanning the sample-major layout.
    fn reference(num_sparse: usize, requests: &[RequestSamples]) -> (Vec<i32>, Vec<i64>) {
        let mut lengths = Vec::new();
        let mut ids = Vec::new();
        for f in 0..num_sparse {
            for r in requests {
                for s in 0..r.num_samples {
                    let bag = s * num_sparse + f;
                    let start: u32 = r.lengths[..bag].iter().sum();
                    let len = r.lengths[bag];
                    lengths.push(len as i32);
                    ids.extend_from_slice(&r.ids[start as usize..(start + len) as usize]);
                }
            }
        }
        (lengths, ids)
    }

    fn check(num_dense: usize, num_sparse: usize, requests: &[RequestSamples]) -> KeyedBatch {
        let batch = assemble(num_dense, num_sparse, requests);
        let (lengths, ids) = reference(num_sparse, requests);
        assert_eq!(batch.lengths, lengths);
        assert_eq!(batch.ids, ids);
        let dense: Vec<f32> = requests.iter().flat_map(|r| r.dense.clone()).collect();
        assert_eq!(batch.dense, dense);
        assert_eq!(batch.rows, requests.iter().map(|r| r.num_samples).sum::<usize>());
        for f in 0..num_sparse {
            let sum: i32 = batch.feature_lengths(f).iter().sum();
            assert_eq!(batch.feature_ids(f).len(), sum as usize);
        }
        batch
    }

    /// The same request, key-major (as TorchRec's protocol sends it).
    fn to_key_major(r: &RequestSamples, num_sparse: usize) -> RequestSamples {
        let b = r.num_samples;
        let mut bags = Vec::new();
        let mut cursor = 0;
        for &len in &r.lengths {
            bags.push(&r.ids[cursor..cursor + len as usize]);
            cursor += len as usize;
        }
        let order: Vec<usize> =
            (0..num_sparse).flat_map(|f| (0..b).map(move |s| s * num_sparse + f)).collect();
        RequestSamples {
            num_samples: b,
            dense: r.dense.clone(),
            lengths: order.iter().map(|&i| r.lengths[i]).collect(),
            ids: order.iter().flat_map(|&i| bags[i].iter().copied()).collect(),
            weights: vec![],
            layout: SparseLayout::KeyMajor,
        }
    }

    #[test]
    fn key_major_requests_merge_per_feature_like_their_sample_major_twins() {
        let a = request(1, vec![vec![1, 2, 0], vec![3, 0, 1]], 2);
        let b = request(2, vec![vec![0, 1, 1]], 2);
        let c = request(3, vec![vec![2, 2, 2], vec![1, 0, 0], vec![0, 0, 3]], 2);
        let sample_major = assemble(2, 3, [&a, &b, &c]);
        let mixed = assemble(2, 3, [&to_key_major(&a, 3), &b, &to_key_major(&c, 3)]);
        assert_eq!(mixed, sample_major);
    }

    #[test]
    fn single_sample_single_request_keeps_feature_order() {
        let r = request(1, vec![vec![1, 1, 1]], 2);
        let batch = check(2, 3, std::slice::from_ref(&r));
        assert_eq!(batch.ids, vec![10_000, 10_010, 10_020]);
        assert_eq!(batch.feature_offsets, vec![0, 1, 2, 3]);
        assert_eq!(batch.request_rows, vec![1]);
    }

    #[test]
    fn two_samples_are_transposed_to_key_major() {
        // sample 0: f0=[a], f1=[b, c]; sample 1: f0=[d, e, f], f1=[]
        let r = request(0, vec![vec![1, 2], vec![3, 0]], 1);
        let batch = check(1, 2, &[r]);
        assert_eq!(batch.lengths, vec![1, 3, 2, 0]);
        assert_eq!(batch.ids, vec![0, 100, 101, 102, 10, 11]);
        assert_eq!(batch.feature_offsets, vec![0, 4, 6]);
    }

    #[test]
    fn multi_hot_and_zero_length_bags_across_mixed_request_sizes() {
        let requests = vec![
            request(1, vec![vec![0, 3, 1]], 4),
            request(2, vec![vec![2, 0, 0], vec![1, 1, 5], vec![0, 0, 0]], 4),
            request(3, vec![vec![1, 1, 1], vec![4, 0, 2]], 4),
        ];
        let batch = check(4, 3, &requests);
        assert_eq!(batch.request_rows, vec![1, 3, 2]);
    }

    #[test]
    fn all_bags_empty_gives_empty_ids() {
        let requests = vec![request(1, vec![vec![0, 0]; 3], 1)];
        let batch = check(1, 2, &requests);
        assert!(batch.ids.is_empty());
        assert_eq!(batch.feature_offsets, vec![0, 0, 0]);
    }

    #[test]
    fn sixteen_requests_of_many_shapes_match_reference() {
        let requests: Vec<_> = (0..16)
            .map(|t| {
                let b = 1 + (t as usize * 7) % 13;
                let lengths =
                    (0..b).map(|s| (0..5).map(|f| ((t as usize + s * 3 + f) % 4) as u32).collect()).collect();
                request(t, lengths, 3)
            })
            .collect();
        check(3, 5, &requests);
    }

    #[test]
    fn builder_counts_rows_and_requests_as_it_goes() {
        let mut builder = BatchBuilder::new(1, 1);
        assert!(builder.is_empty());
        builder.push(&request(1, vec![vec![1]; 4], 1));
        builder.push(&request(2, vec![vec![2]; 2], 1));
        assert_eq!((builder.rows(), builder.requests()), (6, 2));
    }

    #[test]
    fn a_request_read_back_from_the_builder_fuses_like_the_original() {
        let requests = vec![
            request(1, vec![vec![0, 3, 1]], 2),
            request(2, vec![vec![2, 0, 0], vec![1, 1, 5]], 2),
            request(3, vec![vec![1, 1, 1], vec![4, 0, 2]], 2),
        ];
        let mut builder = BatchBuilder::new(2, 3);
        for r in &requests {
            builder.push(r);
        }
        for (i, original) in requests.iter().enumerate() {
            assert_eq!(builder.request(i), to_key_major(original, 3), "request {i}");
        }
        let without_middle = builder.retain(|r| r != 1).finish();
        assert_eq!(without_middle, assemble(2, 3, [&requests[0], &requests[2]]));
        assert_eq!(builder.retain(|_| true).finish(), assemble(2, 3, &requests));
    }

    #[test]
    fn a_fused_batch_without_some_requests_equals_the_rest_fused() {
        let mut requests = vec![
            request(1, vec![vec![0, 3, 1]], 2),
            request(2, vec![vec![2, 0, 0], vec![1, 1, 5]], 2),
            request(3, vec![vec![1, 1, 1], vec![4, 0, 2]], 2),
        ];
        for (i, r) in requests.iter_mut().enumerate() {
            r.weights = (0..r.ids.len()).map(|w| (i * 100 + w) as f32).collect();
        }
        let batch = assemble(2, 3, &requests);
        assert_eq!(batch.retain_requests(|r| r != 1), assemble(2, 3, [&requests[0], &requests[2]]));
        assert_eq!(batch.retain_requests(|r| r == 1), assemble(2, 3, [&requests[1]]));
        assert_eq!(batch.retain_requests(|_| true), batch);
        let none = batch.retain_requests(|_| false);
        assert_eq!((none.rows, none.ids.len(), none.request_rows.len()), (0, 0, 0));
    }

    #[test]
    fn weights_move_with_their_request() {
        let mut weighted = request(1, vec![vec![2, 1], vec![0, 3]], 1);
        weighted.weights = (0..weighted.ids.len()).map(|i| i as f32 / 10.0).collect();
        let mut other = request(2, vec![vec![1, 1]], 1);
        other.weights = vec![7.0; other.ids.len()];
        let mut builder = BatchBuilder::new(1, 2);
        builder.push(&other);
        builder.push(&weighted);
        let moved = builder.request(1);
        assert_eq!(assemble(1, 2, [&moved]), assemble(1, 2, [&weighted]));
    }

    #[test]
    fn split_returns_each_requests_rows_in_order() {
        let requests = vec![
            request(1, vec![vec![1]; 2], 1),
            request(2, vec![vec![1]; 1], 1),
            request(3, vec![vec![1]; 3], 1),
        ];
        let batch = assemble(1, 1, &requests);
        let scores = [0.0, 0.1, 1.0, 2.0, 2.1, 2.2];
        let parts: Vec<_> = batch.split(&scores).collect();
        assert_eq!(parts, vec![&[0.0, 0.1][..], &[1.0][..], &[2.0, 2.1, 2.2][..]]);
    }
}
