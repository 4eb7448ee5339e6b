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
//! What the engine hands the lane is the batch and the stage's
//! [`StagedBatch`], not a buffer set: the stage numbers its batches (0, 1,
//! 2, ...) and the staged batch carries that number ([`ticket_block`]); the
//! lane takes the set whose ticket is that number ([`Handoff::take`]), which
//! only the batch staged under it can hold (never a batch's addresses,
//! which a later batch may be given once it is freed). A batch whose
//! requests were partly dropped before its forward is a new batch
//! (`KeyedBatch::retain_requests`), and dropping them from its staged batch
//! drops the ticket too ([`StagedBatch::retain_requests`]): it matches no
//! set, and the lane stages it itself.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use narsil_core::StagedBatch;

/// The staged batch the stage hands over for batch `seq`, whose inputs are
/// in a buffer set: no values, its ticket `seq`.
pub fn ticket_block(seq: u64, took: Duration) -> StagedBatch {
    StagedBatch { values: Vec::new(), width: 0, took, ticket: Some(seq) }
}

/// The sequence number a staged batch carries: `None` for one that lost
/// requests after its stage ([`StagedBatch::retain_requests`] drops it) or
/// was not staged into a buffer set.
pub fn ticket(staged: &StagedBatch) -> Option<u64> {
    staged.ticket
}

/// The two sets and which batch each holds.
pub struct Handoff<S> {
    sets: [Mutex<S>; 2],
    /// Per set: the sequence number of the batch staged into it and not
    /// yet taken (a lock held only to read or write these).
    tickets: Mutex<[Option<u64>; 2]>,
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

    /// The lane's side: the set holding batch number `seq`, if its stage
    /// put it there and no later batch replaced it (its ticket is taken, so
    /// it matches once).
    pub fn take(&self, seq: u64) -> Option<MutexGuard<'_, S>> {
        let index = (seq % 2) as usize;
        {
            let mut tickets = self.tickets.lock().unwrap_or_else(|e| e.into_inner());
            if tickets[index] != Some(seq) {
                return None;
            }
            tickets[index] = None;
        }
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

    /// Records that the set now holds batch number `seq` (before the set is
    /// released).
    pub fn staged(self) {
        let mut tickets = self.handoff.tickets.lock().unwrap_or_else(|e| e.into_inner());
        tickets[self.index] = Some(self.seq);
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

    use narsil_core::KeyedBatch;

    use super::*;

    fn batch(rows: usize, fill: i64) -> KeyedBatch {
        KeyedBatch {
            rows,
            ids: vec![fill; rows],
            dense: vec![fill as f32; rows],
            request_rows: vec![rows],
            ..Default::default()
        }
    }

    fn staged(handoff: &Handoff<Vec<i64>>, seq: u64, batch: &KeyedBatch) -> StagedBatch {
        let mut staging = handoff.stage(seq);
        staging.set().clone_from(&batch.ids);
        staging.staged();
        ticket_block(seq, Duration::ZERO)
    }

    #[test]
    fn the_lane_finds_the_set_its_batch_was_staged_into() {
        let handoff = Handoff::new(Vec::<i64>::new(), Vec::new());
        let (a, b) = (batch(2, 1), batch(3, 2));
        let (staged_a, staged_b) = (staged(&handoff, 0, &a), staged(&handoff, 1, &b));
        assert_eq!(*handoff.take(ticket(&staged_b).unwrap()).unwrap(), b.ids);
        assert_eq!(*handoff.take(ticket(&staged_a).unwrap()).unwrap(), a.ids);
        assert!(handoff.take(0).is_none(), "a ticket is taken once");
    }

    /// Keyed by addresses, two batches at the same addresses (a freed
    /// batch's memory given to the next) matched each other's sets; by
    /// sequence number each finds its own.
    #[test]
    fn two_batches_at_the_same_addresses_each_find_their_own_set() {
        let handoff = Handoff::new(Vec::<i64>::new(), Vec::new());
        let mut reused = batch(4, 1);
        let first = staged(&handoff, 0, &reused);
        let first_ids = reused.ids.clone();
        // The same memory, other values.
        reused.ids.iter_mut().for_each(|id| *id = 2);
        let second = staged(&handoff, 1, &reused);
        assert_eq!(*handoff.take(ticket(&first).unwrap()).unwrap(), first_ids);
        assert_eq!(*handoff.take(ticket(&second).unwrap()).unwrap(), reused.ids);
    }

    /// A set's ticket left by a batch the lane dropped never matches a
    /// later batch: only the number staged into it.
    #[test]
    fn a_ticket_left_by_a_dropped_batch_matches_no_later_batch() {
        let handoff = Handoff::new(Vec::<i64>::new(), Vec::new());
        let (a, b, c) = (batch(1, 1), batch(1, 2), batch(1, 3));
        let _dropped = staged(&handoff, 0, &a);
        let taken = staged(&handoff, 1, &b);
        assert_eq!(*handoff.take(ticket(&taken).unwrap()).unwrap(), b.ids);
        for seq in [2, 3, 4] {
            assert!(handoff.take(seq).is_none(), "batch {seq} was never staged");
        }
        let later = staged(&handoff, 2, &c);
        assert_eq!(*handoff.take(ticket(&later).unwrap()).unwrap(), c.ids);
        assert!(handoff.take(0).is_none(), "batch 0's set now holds batch 2");
    }

    #[test]
    fn a_batch_with_dropped_requests_or_a_failed_stage_matches_no_set() {
        let handoff = Handoff::new(Vec::<i64>::new(), Vec::new());
        let a = KeyedBatch { request_rows: vec![2, 2], ..batch(4, 1) };
        let mut staged_a = staged(&handoff, 0, &a);
        // What the engine does to a staged batch whose first request's
        // caller stopped waiting.
        staged_a.retain_requests(&a.request_rows, |r| r > 0);
        assert_eq!(ticket(&staged_a), None);
        handoff.stage(1).failed();
        assert!(handoff.take(1).is_none());
    }

    #[test]
    fn a_ticket_holds_any_sequence_number() {
        for seq in [0, 1, (1 << 24) - 1, 1 << 24, 1 << 48, u64::MAX] {
            assert_eq!(ticket(&ticket_block(seq, Duration::ZERO)), Some(seq), "{seq}");
        }
        let host_block = StagedBatch { values: vec![0.5; 3], width: 1, ..StagedBatch::default() };
        assert_eq!(ticket(&host_block), None);
    }

    /// The engine's hand-over (a rendezvous; the lane takes batch N+1 only
    /// after it is done with N), with the lane dropping every third batch
    /// untouched: each forward reads its own batch's values (a set
    /// overwritten by a later batch before its forward would fail this).
    #[test]
    fn staging_one_batch_ahead_hands_each_forward_its_own_set() {
        let handoff = Handoff::new(Vec::<i64>::new(), Vec::new());
        let (to_lane, from_stage) = sync_channel::<(u64, KeyedBatch, StagedBatch)>(0);
        let stage_side = Arc::clone(&handoff);
        let stager = std::thread::spawn(move || {
            for seq in 0..200u64 {
                let batch = batch(1 + (seq % 7) as usize, seq as i64);
                let mut staging = stage_side.stage(seq);
                staging.set().clone_from(&batch.ids);
                std::thread::yield_now();
                staging.staged();
                if to_lane.send((seq, batch, ticket_block(seq, Duration::ZERO))).is_err() {
                    return;
                }
            }
        });
        let mut forwards = 0;
        for (seq, batch, staged) in from_stage {
            if seq % 3 == 2 {
                continue; // dropped: every caller stopped waiting
            }
            let set = handoff.take(ticket(&staged).unwrap()).expect("a staged batch has its set");
            std::thread::yield_now();
            assert_eq!(*set, batch.ids, "batch {seq}");
            forwards += 1;
        }
        stager.join().unwrap();
        assert_eq!(forwards, 200 - 66);
    }
}
