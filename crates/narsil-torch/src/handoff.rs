//! Two buffer sets shared by a lane and its stage thread, so that batch N+1
//! is staged (its inputs written into pinned host buffers and copied to the
//! device on the copy stream) while batch N runs on the compute stream.
//!
//! The engine's stage ahead (`narsil-engine`'s `lanes/staged.rs`) hands staged
//! batches to the lane through a rendezvous, one at a time, and the lane
//! takes batch N+1 only once it is done with N (its forward returned, or it
//! dropped N because every caller stopped waiting). So while the stage
//! thread stages batch `k`, batch `k - 2` is done: batch `k` uses set
//! `k % 2`, with no feedback from the lane needed, not even for batches
//! the lane drops without a forward.
//!
//! What the engine hands the lane is the batch and a host block, not a
//! buffer set; the lane finds the set that holds its batch by the batch's
//! identity ([`BatchKey`]: the addresses and lengths of its id and dense
//! vectors, which the batch keeps from stage to forward) and, among sets
//! that match (a freed batch's addresses may be reused), the newest. A batch
//! whose requests were partly dropped before its forward is a new batch
//! (`KeyedBatch::retain_requests`): it matches no set, and the lane stages
//! it itself.

use std::sync::{Arc, Mutex, MutexGuard};

use narsil_core::KeyedBatch;

/// A batch's identity from its stage to its forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchKey {
    ids: usize,
    ids_len: usize,
    dense: usize,
    rows: usize,
}

impl BatchKey {
    /// The key of `batch`.
    pub fn of(batch: &KeyedBatch) -> Self {
        Self {
            ids: batch.ids.as_ptr() as usize,
            ids_len: batch.ids.len(),
            dense: batch.dense.as_ptr() as usize,
            rows: batch.rows,
        }
    }
}

/// The two sets and which batch each holds.
pub struct Handoff<S> {
    sets: [Mutex<S>; 2],
    /// Per set: the sequence number and key of the batch staged into it
    /// and not yet taken (a lock held only to read or write these).
    tickets: Mutex<[Option<(u64, BatchKey)>; 2]>,
}

impl<S> Handoff<S> {
    /// Two sets, shared.
    pub fn new(a: S, b: S) -> Arc<Self> {
        Arc::new(Self { sets: [Mutex::new(a), Mutex::new(b)], tickets: Mutex::new([None, None]) })
    }

    /// The stage's side: the set batch number `seq` is staged into (held
    /// until the guard is dropped); call [`Staging::staged`] once it holds
    /// the batch.
    pub fn stage(&self, seq: u64) -> Staging<'_, S> {
        let index = (seq % 2) as usize;
        let set = self.sets[index].lock().unwrap_or_else(|e| e.into_inner());
        Staging { handoff: self, index, seq, set }
    }

    /// The lane's side: the set holding `batch`, if a stage put it in one
    /// (the newest match; its ticket is taken, so it matches once).
    pub fn take(&self, batch: &KeyedBatch) -> Option<MutexGuard<'_, S>> {
        let key = BatchKey::of(batch);
        let index = {
            let mut tickets = self.tickets.lock().unwrap_or_else(|e| e.into_inner());
            let index = (0..2)
                .filter(|&i| tickets[i].is_some_and(|(_, k)| k == key))
                .max_by_key(|&i| tickets[i].map(|(seq, _)| seq))?;
            tickets[index] = None;
            index
        };
        Some(self.sets[index].lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// A set being staged into.
pub struct Staging<'a, S> {
    handoff: &'a Handoff<S>,
    index: usize,
    seq: u64,
    set: MutexGuard<'a, S>,
}

impl<S> Staging<'_, S> {
    /// The set.
    pub fn set(&mut self) -> &mut S {
        &mut self.set
    }

    /// Records that the set now holds `batch` (before the set is released).
    pub fn staged(self, batch: &KeyedBatch) {
        let mut tickets = self.handoff.tickets.lock().unwrap_or_else(|e| e.into_inner());
        tickets[self.index] = Some((self.seq, BatchKey::of(batch)));
    }

    /// Records that the set holds nothing (its staging failed).
    pub fn failed(self) {
        let mut tickets = self.handoff.tickets.lock().unwrap_or_else(|e| e.into_inner());
        tickets[self.index] = None;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::sync_channel;

    use super::*;

    fn batch(rows: usize, fill: i64) -> KeyedBatch {
        KeyedBatch { rows, ids: vec![fill; rows], dense: vec![fill as f32; rows], ..Default::default() }
    }

    #[test]
    fn the_lane_finds_the_set_its_batch_was_staged_into() {
        let handoff = Handoff::new(Vec::<i64>::new(), Vec::new());
        let (a, b) = (batch(2, 1), batch(3, 2));
        let mut staging = handoff.stage(0);
        staging.set().clone_from(&a.ids);
        staging.staged(&a);
        let mut staging = handoff.stage(1);
        staging.set().clone_from(&b.ids);
        staging.staged(&b);
        assert_eq!(*handoff.take(&b).unwrap(), b.ids);
        assert_eq!(*handoff.take(&a).unwrap(), a.ids);
        assert!(handoff.take(&a).is_none(), "a ticket is taken once");
    }

    #[test]
    fn a_batch_with_dropped_requests_or_a_failed_stage_matches_no_set() {
        let handoff = Handoff::new(0u8, 0u8);
        let a = batch(4, 1);
        handoff.stage(0).staged(&a);
        let retained = a.clone(); // retain_requests builds a new batch
        assert!(handoff.take(&retained).is_none());
        let b = batch(4, 2);
        handoff.stage(1).failed();
        assert!(handoff.take(&b).is_none());
    }

    #[test]
    fn the_newest_of_two_matching_sets_wins() {
        let handoff = Handoff::new(0u64, 0u64);
        let a = batch(1, 1);
        // Batch 0's ticket is never taken (the lane dropped it) and batch 1
        // happens to have its key.
        let mut staging = handoff.stage(0);
        *staging.set() = 100;
        staging.staged(&a);
        let mut staging = handoff.stage(1);
        *staging.set() = 101;
        staging.staged(&a);
        assert_eq!(*handoff.take(&a).unwrap(), 101);
    }

    /// The engine's hand-over (a rendezvous; the lane takes batch N+1 only
    /// after it is done with N), with the lane dropping every third batch
    /// untouched: each forward reads its own batch's values (a set
    /// overwritten by a later batch before its forward would fail this).
    #[test]
    fn staging_one_batch_ahead_hands_each_forward_its_own_set() {
        let handoff = Handoff::new(Vec::<i64>::new(), Vec::new());
        let (to_lane, from_stage) = sync_channel::<(u64, KeyedBatch)>(0);
        let stage_side = Arc::clone(&handoff);
        let stager = std::thread::spawn(move || {
            for seq in 0..200u64 {
                let batch = batch(1 + (seq % 7) as usize, seq as i64);
                let mut staging = stage_side.stage(seq);
                staging.set().clone_from(&batch.ids);
                std::thread::yield_now();
                staging.staged(&batch);
                if to_lane.send((seq, batch)).is_err() {
                    return;
                }
            }
        });
        let mut forwards = 0;
        for (seq, batch) in from_stage {
            if seq % 3 == 2 {
                continue; // dropped: every caller stopped waiting
            }
            let set = handoff.take(&batch).expect("a staged batch has its set");
            std::thread::yield_now();
            assert_eq!(*set, batch.ids, "batch {seq}");
            forwards += 1;
        }
        stager.join().unwrap();
        assert_eq!(forwards, 200 - 66);
    }
}
