//! The values `narsil load` sends for a model's raw integer inputs
//! (`ModelInfo.sparse_features[].raw_input`: never looked up, they reach
//! the dense network as sent), shaped like a generative recommender's:
//!
//! * a raw channel of a sequence whose name contains `time`
//!   (case-insensitive): increasing timestamps in epoch seconds, oldest
//!   first, from a per-user start in the year after 1.7e9 s, gaps of a
//!   second to a few hours ([`history_times`]);
//! * any other raw channel of a sequence: an action bitmask in `[0, 256)`;
//! * a raw feature outside a sequence whose name contains `time`: the
//!   request's query time, seconds to an hour after its history's last
//!   timestamp ([`query_time`]), the same on every candidate row;
//! * any other raw feature outside a sequence: a small value in `[0, 256)`.

use rand::Rng;

/// Epoch seconds the timestamps start from (November 2023).
pub const EPOCH_BASE: i64 = 1_700_000_000;

/// Whether a raw feature named `name` carries times.
pub fn is_time(name: &str) -> bool {
    name.to_ascii_lowercase().contains("time")
}

/// A history's start: a second of the year after [`EPOCH_BASE`].
pub fn start_time(rng: &mut impl Rng) -> i64 {
    EPOCH_BASE + rng.random_range(0..365 * 86_400)
}

/// `len` increasing timestamps after `start`, oldest first, gaps
/// log-uniform from 1 second to about 2.8 hours.
pub fn history_times(rng: &mut impl Rng, start: i64, len: usize) -> Vec<i64> {
    let mut time = start;
    (0..len)
        .map(|_| {
            time += 10f64.powf(rng.random_range(0.0..4.0)) as i64;
            time
        })
        .collect()
}

/// A request's query time: 1 second to an hour after `last` (its history's
/// last timestamp; [`EPOCH_BASE`] plus a year when it has none).
pub fn query_time(rng: &mut impl Rng, last: Option<i64>) -> i64 {
    last.unwrap_or(EPOCH_BASE + 365 * 86_400) + rng.random_range(1..=3_600)
}

/// An action bitmask, or any other small raw value: `[0, 256)`.
pub fn small(rng: &mut impl Rng) -> i64 {
    rng.random_range(0..256)
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn timestamps_increase_within_a_history_from_a_realistic_start() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for _ in 0..50 {
            let start = start_time(&mut rng);
            let times = history_times(&mut rng, start, 256);
            assert!(times[0] > start && times[0] < EPOCH_BASE + 366 * 86_400, "{start} {}", times[0]);
            assert!(times.windows(2).all(|w| w[1] > w[0]), "oldest first, strictly increasing");
            let gaps: Vec<i64> = times.windows(2).map(|w| w[1] - w[0]).collect();
            assert!(gaps.iter().all(|&g| (1..=10_000).contains(&g)), "gaps of seconds to hours");
            assert!(gaps.iter().any(|&g| g < 60) && gaps.iter().any(|&g| g > 3_600), "{gaps:?}");
        }
    }

    #[test]
    fn names_with_time_in_any_case_are_times() {
        for name in ["action_timestamp", "item_query_time", "Watch_TIME"] {
            assert!(is_time(name), "{name}");
        }
        assert!(!is_time("item_weights") && !is_time("action_weight"));
    }
}
