//! What a model's forwards hold for their sequences' working sets
//! ([`narsil_core::working_set`]), on the process's memory budget.
//!
//! A request's working set is allocated by the forward that computes it,
//! not while it waits, and a model computes at most one batch per lane at
//! a time. So instead of each request holding its own from admission on,
//! the engine holds one lease for all of its requests in flight: the
//! lesser of
//! * the sum of their own working sets (with what fusing added: a request
//!   joins a batch only where the batch's working set is no more than its
//!   requests hold, [`crate::collector::FusedWorkingSet`]), and
//! * its lanes times the most any one batch of them can hold
//!   ([`WorkingSet::batch_bound`]: for GR's unit-by-unit network, one
//!   group's states however many users are queued).
//!
//! Each request part holds a [`WorkingShare`]; taking one resizes the
//! lease (refused at once, RESOURCE_EXHAUSTED, where the budget cannot
//! grow it), dropping one (its forward ended, or it expired unstarted)
//! shrinks it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use narsil_core::working_set::{Unit, WorkingSet};
use prometheus_client::metrics::gauge::Gauge;

use crate::admission::QueueFull;
use crate::memory::{Lease, MemoryBudget};

/// One model's working-set lease (module docs). Clones share it.
#[derive(Debug, Clone)]
pub struct WorkingSets(Arc<Pool>);

#[derive(Debug)]
struct Pool {
    /// Each sequence's declared working set, in schema order.
    kinds: Vec<WorkingSet>,
    /// Whether a batch of some kind may hold less than its requests' sum
    /// ([`WorkingSet::fuses_below_sum`]); where none does, the sum is held
    /// and the shares' units are not kept.
    bounded: bool,
    /// Forwards that may run at once (the lanes).
    lanes: usize,
    /// Shows what the lease holds.
    gauge: Gauge,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    lease: Lease,
    /// The shares held, by key.
    held: HashMap<u64, Held>,
    next: u64,
}

/// One share's part of the state.
#[derive(Debug)]
struct Held {
    /// Each sequence's units (kept where the pool is `bounded`).
    units: Vec<Vec<Unit>>,
    bytes: usize,
}

impl Pool {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Resizes `state`'s lease to what its shares need (module docs).
    fn resize(&self, state: &mut State) -> Result<(), QueueFull> {
        let sum = state.held.values().fold(0usize, |a, h| a.saturating_add(h.bytes));
        let charge = if self.bounded {
            let bound = self.kinds.iter().enumerate().fold(0usize, |a, (s, kind)| {
                let units: Vec<Unit> =
                    state.held.values().flat_map(|h| h.units.get(s).into_iter().flatten().copied()).collect();
                a.saturating_add(kind.batch_bound(&units))
            });
            sum.min(bound.saturating_mul(self.lanes))
        } else {
            sum
        };
        state.lease.resize(charge)?;
        self.gauge.set(charge.try_into().unwrap_or(i64::MAX));
        Ok(())
    }
}

impl WorkingSets {
    /// An empty lease on `budget` for a model whose sequences declare
    /// `kinds`, run by `lanes` lanes; `gauge` shows what it holds.
    pub fn new(kinds: Vec<WorkingSet>, lanes: usize, budget: &MemoryBudget, gauge: Gauge) -> Self {
        let lease = budget.try_reserve(0).expect("an empty lease always fits");
        let state = Mutex::new(State { lease, held: HashMap::new(), next: 0 });
        let bounded = kinds.iter().any(WorkingSet::fuses_below_sum);
        Self(Arc::new(Pool { kinds, bounded, lanes: lanes.max(1), gauge, state }))
    }

    /// A share for a request part of `units` (each sequence's) whose own
    /// forward holds `bytes`; refused where the budget cannot hold what the
    /// lease grows by.
    pub fn hold(&self, units: &[Vec<Unit>], bytes: usize) -> Result<WorkingShare, QueueFull> {
        let pool = &*self.0;
        let mut state = pool.state();
        let key = state.next;
        state.next += 1;
        let units = if pool.bounded { units.to_vec() } else { Vec::new() };
        state.held.insert(key, Held { units, bytes });
        if let Err(full) = pool.resize(&mut state) {
            state.held.remove(&key);
            return Err(full);
        }
        Ok(WorkingShare { sets: self.clone(), key, bytes })
    }

    /// Bytes the lease holds now.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.0.state().lease.bytes()
    }
}

/// A request part's hold on its model's [`WorkingSets`], until dropped.
#[derive(Debug)]
pub struct WorkingShare {
    sets: WorkingSets,
    key: u64,
    bytes: usize,
}

impl WorkingShare {
    /// The working set its own forward holds, with what fusing added.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Adds `more` bytes (what fusing it into a batch adds); false, and
    /// nothing changed, where the budget cannot hold it.
    pub fn grow(&mut self, more: usize) -> bool {
        let pool = &*self.sets.0;
        let mut state = pool.state();
        let bytes = self.bytes.saturating_add(more);
        let set = |state: &mut State, bytes| {
            if let Some(held) = state.held.get_mut(&self.key) {
                held.bytes = bytes;
            }
        };
        set(&mut state, bytes);
        if pool.resize(&mut state).is_err() {
            set(&mut state, self.bytes);
            return false;
        }
        self.bytes = bytes;
        true
    }
}

impl Drop for WorkingShare {
    fn drop(&mut self) {
        let pool = &*self.sets.0;
        let mut state = pool.state();
        state.held.remove(&self.key);
        // Shrinking always fits.
        let _ = pool.resize(&mut state);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GR's unit-by-unit network at the DLRMv3-scaled shape.
    const GR: WorkingSet = WorkingSet::UnitAttention {
        block: 64,
        heads: 4,
        head_dim: 64,
        contexts: 1,
        model_dim: 256,
        group_tokens: 2048,
        bytes_per_value: 4,
    };

    fn user(positions: usize, rows: usize) -> Vec<Vec<Unit>> {
        vec![vec![Unit { positions, rows }]]
    }

    #[test]
    fn queued_gr_users_hold_one_groups_working_set_per_lane_not_each_their_own() {
        let budget = MemoryBudget::new(usize::MAX);
        let one = GR.bytes(&user(1023, 128)[0]);
        let sets = WorkingSets::new(vec![GR], 1, &budget, Gauge::default());
        let first = sets.hold(&user(1023, 128), one).unwrap();
        assert_eq!(sets.held(), one, "one request: its own");
        let shares: Vec<_> = (0..15).map(|_| sets.hold(&user(1023, 128), one).unwrap()).collect();
        let bound = GR.batch_bound(&vec![Unit { positions: 1023, rows: 128 }; 16]);
        assert_eq!(sets.held(), bound, "16 requests: one group's");
        assert!(bound < 2 * one, "{bound} vs {one}");
        // Two lanes may each run a batch of them.
        let two = WorkingSets::new(vec![GR], 2, &budget, Gauge::default());
        let held: Vec<_> = (0..16).map(|_| two.hold(&user(1023, 128), one).unwrap()).collect();
        assert_eq!(two.held(), 2 * bound);
        drop(held);
        assert_eq!(two.held(), 0);
        // Answered requests give theirs back; the lease follows the rest.
        drop(shares);
        assert_eq!(sets.held(), one);
        drop(first);
        assert_eq!((sets.held(), budget.used()), (0, 0));
    }

    #[test]
    fn kinds_that_add_up_hold_their_sum_and_a_share_past_the_budget_is_refused_unchanged() {
        let gather = WorkingSet::Gather { width: 10, position_width: 0, bytes_per_value: 4 };
        let one = gather.bytes(&user(50, 1)[0]);
        let budget = MemoryBudget::new(3 * one);
        let sets = WorkingSets::new(vec![gather], 1, &budget, Gauge::default());
        let mut shares: Vec<_> = (0..3).map(|_| sets.hold(&user(50, 1), one).unwrap()).collect();
        assert_eq!(budget.used(), 3 * one);
        let refused = sets.hold(&user(50, 1), one).unwrap_err();
        assert_eq!((refused.needed, budget.used()), (one, 3 * one));
        // Growing past the budget fails and keeps the share as it was.
        assert!(!shares[0].grow(1));
        assert_eq!((shares[0].bytes(), budget.used()), (one, 3 * one));
        shares.pop();
        assert!(shares[0].grow(one));
        assert_eq!((shares[0].bytes(), budget.used()), (2 * one, 3 * one));
    }
}
