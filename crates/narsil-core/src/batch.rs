//! The fused batch a backend runs, and the reorder that builds it.
//!
//! Requests arrive sample-major (sample 0's bags for every feature, then
//! sample 1's). Models built with TorchRec take sparse input key-major, as a
//! `KeyedJaggedTensor`: every bag of feature 0 for all rows, then feature 1,
//! and so on. The reorder is split in two so that its per-sample part never
//! runs under the engine's queue lock nor on a lane:
//! [`RequestSamples::into_key_major`] reorders one request on its caller's
//! thread (every core at once), before it is queued; [`fuse`] then lays the
//! key-major requests of a batch end to end, feature by feature, which is
//! only copies of runs. A queued request is held once, key-major, and can be
//! removed (cancelled while queued) or moved to another batch as it is.
//!
//! [`KeyedBatch::split`] hands each request back its own rows of the scores;
//! [`KeyedBatch::split_outputs`] does so for every output of a multi-output
//! model.

use crate::request::{RequestSamples, SparseLayout};
use crate::request_blocks::RequestBlocks;

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
    /// The request-level blocks of its grouped requests (ranking requests:
    /// one user, many candidates), each distinct one once; their rows hold
    /// empty bags for the request-level features. `None` when every request
    /// is flat. See [`crate::request_blocks`].
    pub request_blocks: Option<RequestBlocks>,
}

impl KeyedBatch {
    /// Feature `f`'s bag lengths for every row.
    pub fn feature_lengths(&self, f: usize) -> &[i32] {
        &self.lengths[f * self.rows..(f + 1) * self.rows]
    }

    /// Makes `into` a copy of this batch, reusing its buffers (a lane's
    /// scratch copy, copied batch after batch without allocating).
    pub fn copy_into(&self, into: &mut KeyedBatch) {
        // Every field named: a new one must be copied too.
        let KeyedBatch {
            rows,
            num_dense,
            num_sparse,
            dense,
            lengths,
            ids,
            weights,
            feature_offsets,
            request_rows,
            deadline,
            request_blocks,
        } = self;
        (into.rows, into.num_dense, into.num_sparse, into.deadline) =
            (*rows, *num_dense, *num_sparse, *deadline);
        into.dense.clone_from(dense);
        into.lengths.clone_from(lengths);
        into.ids.clone_from(ids);
        into.weights.clone_from(weights);
        into.feature_offsets.clone_from(feature_offsets);
        into.request_rows.clone_from(request_rows);
        into.request_blocks.clone_from(request_blocks);
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
            request_blocks: self.request_blocks.as_ref().map(|blocks| RequestBlocks {
                request_unit: blocks
                    .request_unit
                    .iter()
                    .enumerate()
                    .filter(|&(r, _)| keep(r))
                    .map(|(_, &u)| u)
                    .collect(),
                ..blocks.clone()
            }),
            ..Default::default()
        };
        if kept.request_blocks.as_ref().is_some_and(|b| b.request_unit.iter().all(Option::is_none)) {
            kept.request_blocks = None;
        }
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

/// Fuses requests, in order, into one key-major batch. Each request must
/// already be key-major ([`RequestSamples::into_key_major`]), so fusing
/// only copies runs: each request's bags of feature `f` land, whole, after
/// the earlier requests' bags of `f`. Each request is freed as soon as it
/// is copied, so the batch's values are held about once, not twice, while
/// it is made.
pub fn fuse(num_dense: usize, num_sparse: usize, mut requests: Vec<RequestSamples>) -> KeyedBatch {
    let rows: usize = requests.iter().map(|r| r.num_samples).sum();
    let weighted = requests.iter().any(|r| !r.weights.is_empty());
    // Ids of each (request, feature), and where each feature's run starts
    // in the batch.
    let mut counts = Vec::with_capacity(requests.len() * num_sparse);
    let mut feature_offsets = vec![0usize; num_sparse + 1];
    for request in &requests {
        let b = request.num_samples;
        debug_assert_eq!(request.layout, SparseLayout::KeyMajor, "fuse takes key-major requests");
        debug_assert_eq!(request.lengths.len(), b * num_sparse);
        for f in 0..num_sparse {
            let count = request.lengths[f * b..(f + 1) * b].iter().map(|&l| l as usize).sum::<usize>();
            counts.push(count);
            feature_offsets[f + 1] += count;
        }
    }
    for f in 0..num_sparse {
        feature_offsets[f + 1] += feature_offsets[f];
    }
    let request_rows: Vec<usize> = requests.iter().map(|r| r.num_samples).collect();
    let blocks: Vec<_> = requests.iter().map(|r| r.request.clone()).collect();
    let request_blocks = RequestBlocks::gather(&blocks);
    // Request-level dense features are broadcast to their rows here (a
    // few values a row; the sparse ones never are).
    let broadcast_dense = |r: &RequestSamples| r.request.as_ref().filter(|b| !b.dense.is_empty()).cloned();
    // The first request's dense rows stay where they are.
    let mut dense = match requests.first_mut() {
        Some(first) if broadcast_dense(first).is_none() => std::mem::take(&mut first.dense),
        _ => Vec::new(),
    };
    dense.reserve_exact((rows * num_dense).saturating_sub(dense.len()));
    let row_offsets: Vec<usize> = (0..=num_sparse).map(|f| f * rows).collect();
    let mut lengths = Segments::new(&row_offsets);
    let mut ids = Segments::new(&feature_offsets);
    let mut weights = Segments::new(if weighted { &feature_offsets } else { &[0] });
    for (r, request) in requests.into_iter().enumerate() {
        let (b, counts) = (request.num_samples, &counts[r * num_sparse..(r + 1) * num_sparse]);
        match broadcast_dense(&request) {
            Some(block) => (0..b).for_each(|_| dense.extend_from_slice(&block.dense)),
            None => dense.extend_from_slice(&request.dense),
        }
        let mut read = 0;
        for (f, &count) in counts.iter().enumerate() {
            lengths.append(f, request.lengths[f * b..(f + 1) * b].iter().map(|&l| l as i32));
            let from = read..read + count;
            ids.append_slice(f, &request.ids[from.clone()]);
            if weighted {
                match request.weights.get(from) {
                    Some(run) => weights.append_slice(f, run),
                    // Only weighted models send weights, and validation
                    // widens them to every id: never met once validated.
                    None => weights.append(f, std::iter::repeat_n(1.0, count)),
                }
            }
            read += count;
        }
        // `request` is freed here, before the next one is copied.
    }
    KeyedBatch {
        rows,
        num_dense,
        num_sparse,
        dense,
        lengths: lengths.finish(),
        ids: ids.finish(),
        weights: weights.finish(),
        feature_offsets,
        request_rows,
        deadline: None,
        request_blocks,
    }
}

/// A vector made of consecutive segments, each filled from its start by
/// runs appended in order, into memory that is never zeroed first (the
/// values are copied once, from the requests, and nothing else): segment
/// `s` is `offsets[s]..offsets[s + 1]`.
struct Segments<T> {
    values: Vec<T>,
    /// Each segment's end, and where its next run goes.
    ends: Vec<usize>,
    next: Vec<usize>,
}

impl<T: Copy> Segments<T> {
    fn new(offsets: &[usize]) -> Self {
        let len = offsets.last().copied().unwrap_or(0);
        Self {
            values: Vec::with_capacity(len),
            ends: offsets[1..].to_vec(),
            next: offsets[..offsets.len().saturating_sub(1)].to_vec(),
        }
    }

    /// Appends `run` to segment `s`. Panics if it does not fit there.
    ///
    /// Only the values `run` yields count as written: its `len()` is a hint
    /// for the early check, never trusted for what [`Segments::finish`]
    /// exposes (a safe `ExactSizeIterator` may misreport it).
    fn append(&mut self, s: usize, run: impl ExactSizeIterator<Item = T>) {
        let at = self.next[s];
        let end = self.ends[s];
        assert!(run.len() <= end - at, "a run overflows its segment");
        let mut slots = self.values.spare_capacity_mut()[at..end].iter_mut();
        let mut written = 0;
        for value in run {
            let slot = slots.next().expect("a run overflows its segment");
            slot.write(value);
            written += 1;
        }
        // Counted, not taken from `len()`: a slot is marked written only
        // once a value was written into it. (A panic above leaves `next`
        // short of `end`, and `finish` refuses the gap.)
        self.next[s] = at + written;
    }

    /// Appends `run` to segment `s` with one memory copy. Panics if it does
    /// not fit there.
    fn append_slice(&mut self, s: usize, run: &[T]) {
        let at = self.next[s];
        assert!(at + run.len() <= self.ends[s], "a run overflows its segment");
        let slots = &mut self.values.spare_capacity_mut()[at..at + run.len()];
        // SAFETY: `slots` and `run` have the same length (sliced above) and
        // do not overlap (`slots` is this vector's unused capacity, `run` a
        // shared borrow of other memory); `MaybeUninit<T>` has `T`'s layout,
        // and `T: Copy` has no drop to skip.
        unsafe { std::ptr::copy_nonoverlapping(run.as_ptr(), slots.as_mut_ptr().cast::<T>(), run.len()) };
        self.next[s] = at + run.len();
    }

    /// The vector, once every segment is full. Panics otherwise.
    fn finish(mut self) -> Vec<T> {
        assert_eq!(self.next, self.ends, "every segment is filled");
        let len = self.ends.last().copied().unwrap_or(0);
        // SAFETY: the capacity is at least `len` (`new`), and every slot
        // below it was written: segments tile `0..len` end to end, each
        // was written from its start without a gap by `append` and
        // `append_slice` (which never write past its end, and advance
        // `next` only by the values they actually wrote, never by an
        // iterator's reported length), and each reached its end (asserted).
        unsafe { self.values.set_len(len) };
        self.values
    }
}

/// Fuses validated requests, in order, into one key-major batch (copies of
/// them: [`fuse`] takes the requests themselves).
pub fn assemble<'a>(
    num_dense: usize,
    num_sparse: usize,
    requests: impl IntoIterator<Item = &'a RequestSamples>,
) -> KeyedBatch {
    fuse(num_dense, num_sparse, requests.into_iter().map(|r| r.to_key_major(num_sparse)).collect())
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
            request: None,
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
    fn a_request_reordered_to_key_major_is_the_reference_reorder() {
        let requests = [
            request(1, vec![vec![0, 3, 1]], 2),
            request(2, vec![vec![2, 0, 0], vec![1, 1, 5]], 2),
            request(3, vec![vec![1, 1, 1], vec![1, 1, 1]], 2),
            request(4, vec![vec![0, 0, 0], vec![0, 0, 0]], 2),
        ];
        for (i, original) in requests.iter().enumerate() {
            let key_major = original.clone().into_key_major(3);
            assert_eq!(key_major, to_key_major(original, 3), "request {i}");
            assert_eq!(key_major.decoded_bytes(), original.decoded_bytes(), "request {i} holds as much");
            assert_eq!(key_major.clone().into_key_major(3), key_major, "already key-major: kept as it is");
        }
    }

    #[test]
    fn a_queued_request_removed_from_its_batch_leaves_the_rest_fused_as_before() {
        let requests = vec![
            request(1, vec![vec![0, 3, 1]], 2),
            request(2, vec![vec![2, 0, 0], vec![1, 1, 5]], 2),
            request(3, vec![vec![1, 1, 1], vec![4, 0, 2]], 2),
        ];
        let queued: Vec<_> = requests.iter().map(|r| r.clone().into_key_major(3)).collect();
        let without_middle = fuse(2, 3, vec![queued[0].clone(), queued[2].clone()]);
        assert_eq!(without_middle, assemble(2, 3, [&requests[0], &requests[2]]));
        assert_eq!(fuse(2, 3, queued), assemble(2, 3, &requests));
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
    fn weights_move_with_their_ids_through_the_reorder_and_the_fusion() {
        // Multi-hot and one id per bag: both reorders carry the weights.
        for lengths in [vec![vec![2, 1], vec![0, 3]], vec![vec![1, 1], vec![1, 1], vec![1, 1]]] {
            let mut weighted = request(1, lengths, 1);
            // Each weight names its id, so a misplaced weight shows.
            weighted.weights = weighted.ids.iter().map(|&id| id as f32).collect();
            let mut other = request(2, vec![vec![1, 1]], 1);
            other.weights = other.ids.iter().map(|&id| id as f32).collect();
            let key_major = weighted.clone().into_key_major(2);
            assert_eq!(key_major.weights, key_major.ids.iter().map(|&id| id as f32).collect::<Vec<_>>());
            let batch = fuse(1, 2, vec![other.clone().into_key_major(2), key_major]);
            assert_eq!(batch.weights, batch.ids.iter().map(|&id| id as f32).collect::<Vec<_>>());
            assert_eq!(batch, assemble(1, 2, [&other, &weighted]));
        }
    }

    #[test]
    fn a_model_without_sparse_features_fuses_dense_rows_only() {
        let requests = [request(1, vec![vec![]; 2], 3), request(2, vec![vec![]], 3)];
        let batch = assemble(3, 0, &requests);
        assert_eq!(
            (batch.rows, batch.request_rows.clone(), batch.feature_offsets.clone()),
            (3, vec![2, 1], vec![0])
        );
        assert_eq!(batch.dense, [requests[0].dense.clone(), requests[1].dense.clone()].concat());
    }

    #[test]
    fn segments_are_filled_run_by_run_and_refuse_a_run_that_overflows_or_a_gap() {
        let mut segments = Segments::new(&[0, 3, 3, 5]);
        segments.append(2, [7, 8].into_iter());
        segments.append(0, [1].into_iter());
        segments.append(0, [2, 3].into_iter());
        assert_eq!(segments.finish(), vec![1, 2, 3, 7, 8]);
        let overflow =
            std::panic::catch_unwind(|| Segments::new(&[0, 2, 4]).append(0, [1, 2, 3].into_iter()));
        assert!(overflow.is_err(), "a run longer than its segment is refused");
        let mut gap = Segments::new(&[0, 2, 4]);
        gap.append(0, [1, 2].into_iter());
        gap.append(1, [3].into_iter());
        assert!(std::panic::catch_unwind(move || gap.finish()).is_err(), "a slot never written is refused");
    }

    /// An iterator that yields `values` but reports `len` as its length:
    /// safe code may implement `ExactSizeIterator` wrongly.
    struct LyingLen {
        values: std::vec::IntoIter<i32>,
        len: usize,
    }

    impl Iterator for LyingLen {
        type Item = i32;
        fn next(&mut self) -> Option<i32> {
            self.values.next()
        }
    }

    impl ExactSizeIterator for LyingLen {
        fn len(&self) -> usize {
            self.len
        }
    }

    #[test]
    fn a_run_whose_len_lies_marks_only_what_it_yielded_as_written() {
        let lying = |values: Vec<i32>, len| LyingLen { values: values.into_iter(), len };
        // Claims 3, yields 1: two slots were never written, so the vector is
        // refused (marking the claimed 3 would expose uninitialised memory).
        let mut short = Segments::new(&[0, 3]);
        short.append(0, lying(vec![1], 3));
        assert_eq!(short.next, [1], "only the yielded value is marked written");
        assert!(std::panic::catch_unwind(move || short.finish()).is_err(), "unwritten slots are refused");
        // Claims 1, yields 3 that fit: all three are written and kept.
        let mut long = Segments::new(&[0, 3, 4]);
        long.append(0, lying(vec![1, 2, 3], 1));
        long.append(1, lying(vec![4], 0));
        assert_eq!(long.finish(), vec![1, 2, 3, 4]);
        // Claims 1, yields more than fit: refused while appending, never
        // written past the segment's end.
        let overflow = std::panic::catch_unwind(|| {
            let mut segments = Segments::new(&[0, 2, 3]);
            segments.append(0, lying(vec![1, 2, 3], 1));
            segments
        });
        assert!(overflow.is_err(), "a run yielding past its segment is refused");
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
