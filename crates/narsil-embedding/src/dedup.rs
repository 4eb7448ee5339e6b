//! Distinct ids in a fused batch. Under skewed traffic the requests fused
//! into one forward repeat the hot ids; each distinct id needs its row
//! fetched once, however many bags name it. The ratio of ids looked up to
//! distinct ids is what deduplication saves a store that fetches rows.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

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

    /// Both counts added.
    pub fn add(self, other: Self) -> Self {
        Self { looked_up: self.looked_up + other.looked_up, distinct: self.distinct + other.distinct }
    }
}

/// A multiplicative hash for ids: one multiply and a shift, enough to
/// spread both the low bits (bucket) and the high bits (tag) the map uses.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.0 ^ b as u64);
        }
    }

    fn write_i64(&mut self, id: i64) {
        self.write_u64(id as u64);
    }

    fn write_u64(&mut self, value: u64) {
        let h = value.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 29);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// The distinct ids of one table in a fused batch, in first-seen order,
/// and for every id looked up its slot: its position among the distinct
/// ids (where its fetched row lands). Reused between batches.
#[derive(Default)]
pub struct DistinctIds {
    slot_of: HashMap<i64, u32, BuildHasherDefault<IdHasher>>,
    distinct: Vec<i64>,
    slots: Vec<i64>,
}

impl DistinctIds {
    /// Forgets the last batch's ids (keeping the memory).
    pub fn clear(&mut self) {
        self.slot_of.clear();
        self.distinct.clear();
        self.slots.clear();
    }

    /// Adds the ids of one feature's bags.
    pub fn add(&mut self, ids: &[i64]) {
        self.slots.reserve(ids.len());
        for &id in ids {
            let next = self.distinct.len() as u32;
            let slot = *self.slot_of.entry(id).or_insert(next);
            if slot == next {
                self.distinct.push(id);
            }
            self.slots.push(slot as i64);
        }
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
        assert_eq!(count.add(count), IdCount { looked_up: 10, distinct: 6 });
        ids.clear();
        assert_eq!(ids.count().ratio(), 0.0);
        ids.add(&[1 << 40, 2 << 40, 1 << 40]);
        assert_eq!(ids.count(), IdCount { looked_up: 3, distinct: 2 });
    }
}
