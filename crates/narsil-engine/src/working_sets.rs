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
//! * its lanes times the most any one batch of them can hold: no more
//!   than the largest shares of as many requests as one batch can take
//!   (the flush policy's limits on requests, rows and tokens: a DIN
//!   request of 500 candidates and 100 positions fills the default 1,024
//!   tokens alone, so each lane holds one request's), and for GR's
//!   unit-by-unit network no more than one group's states however many
//!   users are queued ([`WorkingSet::batch_bound`]).
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
use crate::flush::Fill;
use crate::memory::{Lease, MemoryBudget};

/// One model's working-set lease (module docs). Clones share it.
#[derive(Debug, Clone)]
pub struct WorkingSets(Arc<Pool>);

#[derive(Debug)]
struct Pool {
    /// Each sequence's declared working set, in schema order.
    kinds: Vec<WorkingSet>,
    /// Whether a batch of some kind may hold less than its requests' sum
    /// ([`WorkingSet::fuses_below_sum`]); where none does, the shares'
    /// units are not kept.
    bounded: bool,
    /// Forwards that may run at once (the lanes).
    lanes: usize,
    /// The most one batch holds (the flush policy's limits).
    batch: Fill,
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
    /// Its part's rows and tokens, as a batch counts them.
    fill: Fill,
    bytes: usize,
}

impl Pool {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Resizes `state`'s lease to what its shares need (module docs).
    fn resize(&self, state: &mut State) -> Result<(), QueueFull> {
        let sum = state.held.values().fold(0usize, |a, h| a.saturating_add(h.bytes));
        let charge = sum.min(self.one_batch(state).saturating_mul(self.lanes));
        state.lease.resize(charge)?;
        self.gauge.set(charge.try_into().unwrap_or(i64::MAX));
        Ok(())
    }

    /// The most one batch of the shares held can hold: no more than its
    /// shares (the join check), so no more than the largest shares of as
    /// many as one batch can take (at most `batch.requests`; several only
    /// within `batch.rows` and `batch.tokens`, counted from the smallest);
    /// where a kind fuses below its sum, no more than each kind's
    /// [`WorkingSet::batch_bound`] over every unit held.
    fn one_batch(&self, state: &State) -> usize {
        let fitting = |of: fn(&Held) -> usize, limit: usize| {
            let mut sizes: Vec<usize> = state.held.values().map(of).collect();
            sizes.sort_unstable();
            let mut sum = 0usize;
            sizes
                .iter()
                .take_while(|&&size| {
                    sum = sum.saturating_add(size);
                    sum <= limit
                })
                .count()
        };
        let most = fitting(|h| h.fill.rows, self.batch.rows)
            .min(fitting(|h| h.fill.tokens, self.batch.tokens))
            .min(self.batch.requests)
            .max(1);
        let mut bytes: Vec<usize> = state.held.values().map(|h| h.bytes).collect();
        bytes.sort_unstable_by(|a, b| b.cmp(a));
        let largest = bytes.iter().take(most).fold(0usize, |a, &b| a.saturating_add(b));
        if !self.bounded {
            return largest;
        }
        let bound = self.kinds.iter().enumerate().fold(0usize, |a, (s, kind)| {
            let units: Vec<Unit> =
                state.held.values().flat_map(|h| h.units.get(s).into_iter().flatten().copied()).collect();
            a.saturating_add(kind.batch_bound(&units))
        });
        largest.min(bound)
    }
}

impl WorkingSets {
    /// An empty lease on `budget` for a model whose sequences declare
    /// `kinds`, run by `lanes` lanes whose batches hold at most `batch`
    /// (the flush policy's [`crate::flush::FlushPolicy::limits`]); `gauge`
    /// shows what it holds.
    pub fn new(
        kinds: Vec<WorkingSet>,
        lanes: usize,
        batch: Fill,
        budget: &MemoryBudget,
        gauge: Gauge,
    ) -> Self {
        let lease = budget.try_reserve(0).expect("an empty lease always fits");
        let state = Mutex::new(State { lease, held: HashMap::new(), next: 0 });
        let bounded = kinds.iter().any(WorkingSet::fuses_below_sum);
        Self(Arc::new(Pool { kinds, bounded, lanes: lanes.max(1), batch, gauge, state }))
    }

    /// A share for a request part of `units` (each sequence's) and `fill`
    /// (its rows and tokens) whose own forward holds `bytes`; refused
    /// where the budget cannot hold what the lease grows by.
    pub fn hold(&self, units: &[Vec<Unit>], fill: Fill, bytes: usize) -> Result<WorkingShare, QueueFull> {
        let pool = &*self.0;
        let mut state = pool.state();
        let key = state.next;
        state.next += 1;
        let units = if pool.bounded { units.to_vec() } else { Vec::new() };
        state.held.insert(key, Held { units, fill, bytes });
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

    /// Limits that let one batch take every request.
    const UNLIMITED: Fill = Fill { requests: usize::MAX, rows: usize::MAX, tokens: usize::MAX };
    /// The engine's default batch limits for a model with sequences.
    const DEFAULTS: Fill = Fill { requests: 16, rows: 4096, tokens: 1024 };

    fn user(positions: usize, rows: usize) -> Vec<Vec<Unit>> {
        vec![vec![Unit { positions, rows }]]
    }

    /// A grouped request's part: one unit, its rows and tokens.
    fn part(positions: usize, rows: usize) -> Fill {
        Fill { requests: 1, rows, tokens: rows + positions }
    }

    #[test]
    fn queued_gr_users_hold_one_groups_working_set_per_lane_not_each_their_own() {
        let budget = MemoryBudget::new(usize::MAX);
        let one = GR.bytes(&user(1023, 128)[0]);
        let sets = WorkingSets::new(vec![GR], 1, UNLIMITED, &budget, Gauge::default());
        let first = sets.hold(&user(1023, 128), part(1023, 128), one).unwrap();
        assert_eq!(sets.held(), one, "one request: its own");
        let shares: Vec<_> =
            (0..15).map(|_| sets.hold(&user(1023, 128), part(1023, 128), one).unwrap()).collect();
        let bound = GR.batch_bound(&vec![Unit { positions: 1023, rows: 128 }; 16]);
        assert_eq!(sets.held(), bound, "16 requests: one group's");
        assert!(bound < 2 * one, "{bound} vs {one}");
        // Two lanes may each run a batch of them.
        let two = WorkingSets::new(vec![GR], 2, UNLIMITED, &budget, Gauge::default());
        let held: Vec<_> =
            (0..16).map(|_| two.hold(&user(1023, 128), part(1023, 128), one).unwrap()).collect();
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
    fn requests_that_fill_a_batchs_tokens_alone_hold_the_largest_working_set_per_lane() {
        // DIN's benchmark request: 500 candidates against a history of 100
        // positions, 600 tokens: two never share a forward of 1,024.
        let gather = WorkingSet::Gather { width: 64, position_width: 0, bytes_per_value: 4 };
        let budget = MemoryBudget::new(usize::MAX);
        let sets = WorkingSets::new(vec![gather], 1, DEFAULTS, &budget, Gauge::default());
        let (small, large) = (gather.bytes(&user(90, 500)[0]), gather.bytes(&user(110, 500)[0]));
        let mut shares: Vec<_> =
            (0..15).map(|_| sets.hold(&user(90, 500), part(90, 500), small).unwrap()).collect();
        assert_eq!(sets.held(), small, "15 requests: one's");
        shares.push(sets.hold(&user(110, 500), part(110, 500), large).unwrap());
        assert_eq!(sets.held(), large, "the largest one");
        // Two lanes may each run one.
        let two = WorkingSets::new(vec![gather], 2, DEFAULTS, &budget, Gauge::default());
        let held: Vec<_> = (0..16).map(|_| two.hold(&user(90, 500), part(90, 500), small).unwrap()).collect();
        assert_eq!(two.held(), 2 * small);
        drop((held, shares));
        assert_eq!((sets.held(), two.held(), budget.used()), (0, 0, 0));
    }

    #[test]
    fn requests_that_fuse_hold_the_largest_shares_of_as_many_as_one_batch_takes() {
        let gather = WorkingSet::Gather { width: 8, position_width: 0, bytes_per_value: 4 };
        let budget = MemoryBudget::new(usize::MAX);
        // Requests of 10 rows and 90-105 positions (100-115 tokens): the
        // smallest nine fit 1,024 tokens together (936; a tenth makes
        // 1,045), so one batch holds at most nine of any of them.
        let sizes: Vec<usize> = (90..106).collect();
        let own = |positions: usize| gather.bytes(&user(positions, 10)[0]);
        let hold = |sets: &WorkingSets| -> Vec<WorkingShare> {
            sizes.iter().map(|&p| sets.hold(&user(p, 10), part(p, 10), own(p)).unwrap()).collect()
        };
        let largest = |n: usize| sizes.iter().rev().take(n).map(|&p| own(p)).sum::<usize>();
        let tokens = WorkingSets::new(vec![gather], 1, DEFAULTS, &budget, Gauge::default());
        let _held = hold(&tokens);
        let fit = {
            let mut sum = 0;
            sizes
                .iter()
                .take_while(|&&p| {
                    sum += p + 10;
                    sum <= 1024
                })
                .count()
        };
        assert_eq!((fit, tokens.held()), (9, largest(9)), "as many as fit 1,024 tokens, the largest of them");
        // At most 4 requests a batch; rows of 25 a batch: 2 requests.
        let requests = Fill { requests: 4, ..UNLIMITED };
        let rows = Fill { rows: 25, ..UNLIMITED };
        for (limits, most) in [(requests, 4), (rows, 2), (UNLIMITED, sizes.len())] {
            let sets = WorkingSets::new(vec![gather], 1, limits, &budget, Gauge::default());
            let _held = hold(&sets);
            assert_eq!(sets.held(), largest(most), "{limits:?}");
        }
        // Worker mode: one request a forward.
        use crate::flush::{FlushPolicy, PerRequest};
        let worker = WorkingSets::new(vec![gather], 3, PerRequest.limits(), &budget, Gauge::default());
        let _held = hold(&worker);
        assert_eq!(worker.held(), 3 * own(105), "three lanes, the largest request each");
    }

    #[test]
    fn kinds_that_add_up_hold_their_sum_and_a_share_past_the_budget_is_refused_unchanged() {
        let gather = WorkingSet::Gather { width: 10, position_width: 0, bytes_per_value: 4 };
        let one = gather.bytes(&user(50, 1)[0]);
        let budget = MemoryBudget::new(3 * one);
        let sets = WorkingSets::new(vec![gather], 1, UNLIMITED, &budget, Gauge::default());
        let mut shares: Vec<_> = (0..3).map(|_| sets.hold(&user(50, 1), part(50, 1), one).unwrap()).collect();
        assert_eq!(budget.used(), 3 * one);
        let refused = sets.hold(&user(50, 1), part(50, 1), one).unwrap_err();
        assert_eq!((refused.needed, budget.used()), (one, 3 * one));
        // Growing past the budget fails and keeps the share as it was.
        assert!(!shares[0].grow(1));
        assert_eq!((shares[0].bytes(), budget.used()), (one, 3 * one));
        shares.pop();
        assert!(shares[0].grow(one));
        assert_eq!((shares[0].bytes(), budget.used()), (2 * one, 3 * one));
    }
}
