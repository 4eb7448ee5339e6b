//! Distinct ids in a fused batch. Under skewed traffic the requests fused
//! into one forward repeat the hot ids; each distinct id needs its row
//! fetched once, however many bags name it. The ratio of ids looked up to
//! distinct ids is what deduplication saves a store that fetches rows.

/// Ids looked up and how many of them are distinct.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IdCount {
    /// Every id of every bag.
    pub looked_up: usize,
    /// Distinct ids among them.
    pub distinct: usize,
}

impl IdCount {
    /// `looked_up / distinct` (1 when nothing repeats; 0 without ids).
    pub fn ratio(self) -> f64 {
        if self.distinct == 0 {
            0.0
        } else {
            self.looked_up as f64 / self.distinct as f64
        }
    }
}

/// Both counts added.
impl std::ops::Add for IdCount {
    type Output = Self;

    fn add(self, other: Self) -> Self {
        Self { looked_up: self.looked_up + other.looked_up, distinct: self.distinct + other.distinct }
    }
}

/// The distinct ids of one table in a fused batch, in first-seen order,
/// and for every id looked up its slot: its position among the distinct
/// ids (where its fetched row lands). Reused between batches.
///
/// An open-addressing table (linear probing, a multiplicative hash, at most
/// half full) whose entries carry the generation that wrote them, so
/// clearing it is one increment rather than a pass over its memory: a few
/// nanoseconds per id where `std`'s `HashMap` took about 25.
#[derive(Default)]
pub struct DistinctIds {
    /// Per entry: the generation that wrote it (0: never), the id, its slot.
    entries: Vec<Entry>,
    generation: u32,
    shift: u32,
    distinct: Vec<i64>,
    slots: Vec<i64>,
}

#[derive(Clone, Copy, Default)]
struct Entry {
    generation: u32,
    slot: u32,
    id: i64,
}

impl DistinctIds {
    /// Forgets the last batch's ids (keeping the memory).
    pub fn clear(&mut self) {
        self.distinct.clear();
        self.slots.clear();
        self.generation = self.generation.wrapping_add(1);
        if self.generation == 0 {
            // Wrapped: old entries could look current; wipe them once.
            self.entries.iter_mut().for_each(|e| *e = Entry::default());
            self.generation = 1;
        }
    }

    /// Adds the ids of one feature's bags.
    pub fn add(&mut self, ids: &[i64]) {
        self.reserve(self.distinct.len() + ids.len());
        self.slots.reserve(ids.len());
        let mask = self.entries.len() - 1;
        for &id in ids {
            let mut at = ((id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize;
            let slot = loop {
                let entry = &mut self.entries[at];
                if entry.generation != self.generation {
                    let slot = self.distinct.len() as u32;
                    *entry = Entry { generation: self.generation, slot, id };
                    self.distinct.push(id);
                    break slot;
                }
                if entry.id == id {
                    break entry.slot;
                }
                at = (at + 1) & mask;
            };
            self.slots.push(slot as i64);
        }
    }

    /// Room for `distinct` ids at most half full, rehashing those held.
    fn reserve(&mut self, distinct: usize) {
        if self.generation == 0 {
            self.generation = 1;
        }
        let needed = (distinct * 2).next_power_of_two().max(64);
        if needed <= self.entries.len() {
            return;
        }
        self.entries = vec![Entry::default(); needed];
        self.shift = 64 - needed.trailing_zeros();
        let held = std::mem::take(&mut self.distinct);
        let slots = std::mem::take(&mut self.slots);
        self.generation = 1;
        self.add(&held);
        self.slots = slots;
    }

    /// The distinct ids, first-seen order.
    pub fn distinct(&self) -> &[i64] {
        &self.distinct
    }

    /// Every id added so far as its slot, in the order added.
    pub fn slots(&self) -> &[i64] {
        &self.slots
    }

    /// Ids added and distinct ids.
    pub fn count(&self) -> IdCount {
        IdCount { looked_up: self.slots.len(), distinct: self.distinct.len() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_ids_across_the_features_of_a_table_get_one_slot() {
        let mut ids = DistinctIds::default();
        ids.add(&[5, 9, 5]);
        ids.add(&[9, 1]);
        assert_eq!(ids.distinct(), &[5, 9, 1]);
        assert_eq!(ids.slots(), &[0, 1, 0, 1, 2]);
        let count = ids.count();
        assert_eq!(count, IdCount { looked_up: 5, distinct: 3 });
        assert!((count.ratio() - 5.0 / 3.0).abs() < 1e-12);
        assert_eq!(count + count, IdCount { looked_up: 10, distinct: 6 });
        ids.clear();
        assert_eq!(ids.count().ratio(), 0.0);
        ids.add(&[1 << 40, 2 << 40, 1 << 40]);
        assert_eq!(ids.count(), IdCount { looked_up: 3, distinct: 2 });
    }

    #[test]
    fn growing_and_many_batches_keep_every_slot() {
        let mut ids = DistinctIds::default();
        for batch in 0..300u64 {
            ids.clear();
            // Grows past its first size within a batch, with repeats.
            let added: Vec<i64> = (0..500).map(|i| ((i * 7919 + batch) % 211) as i64 * 1_000_003).collect();
            ids.add(&added[..100]);
            ids.add(&added[100..]);
            let mut seen = Vec::new();
            for (&id, &slot) in added.iter().zip(ids.slots()) {
                assert_eq!(ids.distinct()[slot as usize], id);
                if !seen.contains(&id) {
                    assert_eq!(slot as usize, seen.len(), "first-seen order");
                    seen.push(id);
                }
            }
            assert_eq!(ids.distinct().len(), seen.len());
        }
        ids.generation = u32::MAX;
        ids.clear();
        ids.add(&[3, 3]);
        assert_eq!(ids.count(), IdCount { looked_up: 2, distinct: 1 });
    }
}
