//! A batch's work done ahead of its forward. A backend whose forward has a
//! part that needs none of its lane's state (a split model's embedding
//! stage: dedup, row fetches, pooling) hands its lane a [`BatchStage`];
//! the engine then runs that part for batch N+1 on a thread of its own
//! while the lane runs batch N's [`ModelBackend::forward_staged`]
//! (`--stage-ahead`).
//!
//! A staged batch waits at the hand-over until its lane is free; that wait
//! counts in its requests' queue time (the engine's
//! `narsil_stage_handover_seconds`), and the lane chooses the forward's
//! threads when it takes the batch, not when the stage did.
//!
//! What a stage hands over is a host block of `[rows, width]` FP32 values:
//! the one seam between the stage and whatever runs the rest (a CPU
//! network today; a device network copies it in).
//!
//! [`ModelBackend::forward_staged`]: crate::ModelBackend::forward_staged
//! [`BatchStage`]: crate::BatchStage

use std::time::Duration;

/// A batch's staged input: `[rows, width]` values, row-major, rows in the
/// batch's order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StagedBatch {
    /// The block.
    pub values: Vec<f32>,
    /// Values per row.
    pub width: usize,
    /// How long staging took (part of the batch's compute time).
    pub took: Duration,
    /// Where the stage put the batch's inputs somewhere else than `values`
    /// (a device lane's staging buffers, held by its hand-off), the number
    /// it holds them under; `values` is then empty. Dropping any request's
    /// rows drops it: the inputs held no longer match the batch.
    pub ticket: Option<u64>,
}

impl StagedBatch {
    /// Drops the rows of the requests `keep` says no to, in place, as
    /// [`KeyedBatch::retain_requests`](crate::KeyedBatch::retain_requests) drops them from the batch whose
    /// `request_rows` are given.
    pub fn retain_requests(&mut self, request_rows: &[usize], keep: impl Fn(usize) -> bool) {
        let width = self.width;
        let (mut read, mut write) = (0, 0);
        for (r, &rows) in request_rows.iter().enumerate() {
            let len = rows * width;
            if keep(r) {
                self.values.copy_within(read..read + len, write);
                write += len;
            } else {
                self.ticket = None;
            }
            read += len;
        }
        self.values.truncate(write);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropping_a_request_keeps_the_other_requests_rows_in_order() {
        // Requests of 1, 2 and 1 rows, width 2: row i holds [i, i + 0.5].
        let values: Vec<f32> = (0..4).flat_map(|i| [i as f32, i as f32 + 0.5]).collect();
        let staged = StagedBatch { values, width: 2, took: Duration::ZERO, ticket: None };
        let mut without_middle = staged.clone();
        without_middle.retain_requests(&[1, 2, 1], |r| r != 1);
        assert_eq!(without_middle.values, vec![0.0, 0.5, 3.0, 3.5]);
        let mut only_middle = staged.clone();
        only_middle.retain_requests(&[1, 2, 1], |r| r == 1);
        assert_eq!(only_middle.values, vec![1.0, 1.5, 2.0, 2.5]);
        let mut all = staged.clone();
        all.retain_requests(&[1, 2, 1], |_| true);
        assert_eq!(all, staged);
    }

    #[test]
    fn a_ticket_survives_only_while_every_request_is_kept() {
        let held = StagedBatch { ticket: Some(7), ..StagedBatch::default() };
        let mut all = held.clone();
        all.retain_requests(&[1, 2, 1], |_| true);
        assert_eq!(all.ticket, Some(7));
        let mut without_one = held.clone();
        without_one.retain_requests(&[1, 2, 1], |r| r != 2);
        assert_eq!(without_one.ticket, None, "the held inputs no longer match the batch");
    }
}
