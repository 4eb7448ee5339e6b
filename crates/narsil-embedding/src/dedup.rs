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

    /// Both counts added.
    pub fn add(self, other: Self) -> Self {
        Self { looked_up: self.looked_up + other.looked_up, distinct: self.distinct + other.distinct }
    }
}

/// Counts the ids of one table (every feature that indexes it, chained);
/// `scratch` is reused between calls.
pub fn count_ids<'a>(ids: impl IntoIterator<Item = &'a [i64]>, scratch: &mut Vec<i64>) -> IdCount {
    scratch.clear();
    for part in ids {
        scratch.extend_from_slice(part);
    }
    let looked_up = scratch.len();
    scratch.sort_unstable();
    scratch.dedup();
    IdCount { looked_up, distinct: scratch.len() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_ids_across_the_features_of_a_table_count_once() {
        let mut scratch = Vec::new();
        let count = count_ids([&[5i64, 9, 5][..], &[9, 1][..]], &mut scratch);
        assert_eq!(count, IdCount { looked_up: 5, distinct: 3 });
        assert!((count.ratio() - 5.0 / 3.0).abs() < 1e-12);
        assert_eq!(count_ids([&[][..]], &mut scratch).ratio(), 0.0);
        assert_eq!(count.add(count), IdCount { looked_up: 10, distinct: 6 });
    }
}
