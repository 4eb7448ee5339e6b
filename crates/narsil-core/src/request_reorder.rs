//! A request's sparse bags reordered key-major (every bag of feature 0
//! for all samples, then feature 1), as a fused batch lays them out: done
//! on the caller's thread before a request is queued.

use crate::request::{RequestSamples, SparseLayout};

/// `values`, a `[rows x cols]` matrix (row-major), as `[cols x rows]`.
fn transpose<T: Copy>(values: &[T], rows: usize, cols: usize) -> Vec<T> {
    debug_assert_eq!(values.len(), rows * cols);
    let mut out = Vec::with_capacity(values.len());
    for c in 0..cols {
        out.extend((0..rows).map(|r| values[r * cols + c]));
    }
    out
}

impl RequestSamples {
    /// The request in key-major layout (every bag of feature 0 for all
    /// samples, then feature 1, as a fused batch lays them out), for a
    /// request whose lengths are explicit (validated). A key-major request
    /// is returned as it is, without a copy; a sample-major one is
    /// reordered into new buffers and freed.
    ///
    /// The engine calls this on the caller's thread before a request is
    /// queued, so the per-sample reorder runs on every core at once and
    /// never under the queue's lock; fusing key-major requests
    /// ([`crate::batch::fuse`]) then only copies runs.
    pub fn into_key_major(self, num_sparse: usize) -> RequestSamples {
        if self.layout == SparseLayout::KeyMajor {
            return self;
        }
        self.to_key_major(num_sparse)
    }

    /// [`RequestSamples::into_key_major`] of a copy, leaving `self` as it is.
    pub fn to_key_major(&self, num_sparse: usize) -> RequestSamples {
        let b = self.num_samples;
        let mut reordered = RequestSamples {
            num_samples: b,
            dense: self.dense.clone(),
            layout: SparseLayout::KeyMajor,
            request: self.request.clone(),
            ..Default::default()
        };
        if self.layout == SparseLayout::KeyMajor || num_sparse == 0 || b == 0 {
            reordered.lengths.clone_from(&self.lengths);
            reordered.ids.clone_from(&self.ids);
            reordered.weights.clone_from(&self.weights);
            return reordered;
        }
        debug_assert_eq!(self.lengths.len(), b * num_sparse, "lengths are explicit once validated");
        reordered.lengths = transpose(&self.lengths, b, num_sparse);
        if self.is_one_id_per_bag() {
            // `ids` (and one weight per id) is a [B x num_sparse] matrix.
            reordered.ids = transpose(&self.ids, b, num_sparse);
            if !self.weights.is_empty() {
                reordered.weights = transpose(&self.weights, b, num_sparse);
            }
            return reordered;
        }
        // Where each feature's run starts, then every bag copied to the
        // end of its feature's run, sample by sample.
        let mut at = Vec::with_capacity(num_sparse);
        let mut total = 0usize;
        for feature_lengths in reordered.lengths.chunks_exact(b) {
            at.push(total);
            total += feature_lengths.iter().map(|&l| l as usize).sum::<usize>();
        }
        let weighted = !self.weights.is_empty();
        reordered.ids = vec![0; total];
        if weighted {
            reordered.weights = vec![0.0; total];
        }
        let mut read = 0usize;
        for sample_lengths in self.lengths.chunks_exact(num_sparse) {
            for (at, &len) in at.iter_mut().zip(sample_lengths) {
                let (from, to) = (read..read + len as usize, *at..*at + len as usize);
                reordered.ids[to.clone()].copy_from_slice(&self.ids[from.clone()]);
                if weighted {
                    reordered.weights[to].copy_from_slice(&self.weights[from]);
                }
                read += len as usize;
                *at += len as usize;
            }
        }
        reordered
    }
}
