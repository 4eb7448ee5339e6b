//! The values `narsil load` sends for a model's raw integer inputs
//! (`ModelInfo.sparse_features[].raw_input`: never looked up, they reach
//! the dense network as sent), shaped like a generative recommender's:
//!
//! * a raw channel of a sequence that carries times ([`RawTimes`]: by
//!   default a name containing `time` but not `watch`, case-insensitive;
//!   `--raw-times` names them): increasing timestamps in epoch seconds
//!   (milliseconds with `--raw-time-unit ms`), oldest
//!   first, from a per-user start in the year after 1.7e9 s, gaps of a
//!   second to a few hours ([`history_times`]);
//! * any other raw channel of a sequence: an action bitmask in `[0, 256)`;
//! * a raw feature outside a sequence that carries times: the
//!   request's query time, seconds to an hour after its history's last
//!   timestamp ([`query_time`]), the same on every candidate row;
//! * any other raw feature outside a sequence: a small value in `[0, 256)`.

use rand::Rng;

/// Epoch seconds the timestamps start from (November 2023).
pub const EPOCH_BASE: i64 = 1_700_000_000;

/// Which raw features carry times, and in what unit.
#[derive(Debug, Clone, Default)]
pub struct RawTimes {
    /// `--raw-times`: exactly these features (`None`: the name rule).
    pub names: Option<Vec<String>>,
    /// `--raw-time-unit ms`: milliseconds (else seconds).
    pub milliseconds: bool,
}

impl RawTimes {
    /// Whether the raw feature `name` carries times: one of `--raw-times`,
    /// or by default a name containing `time` but not `watch`
    /// (case-insensitive: `action_timestamp`, `item_query_time`; not
    /// `watch_time`, a duration).
    pub fn is_time(&self, name: &str) -> bool {
        match &self.names {
            Some(names) => names.iter().any(|n| n == name),
            None => {
                let name = name.to_ascii_lowercase();
                name.contains("time") && !name.contains("watch")
            }
        }
    }

    /// A time in epoch seconds, in the unit sent.
    pub fn sent(&self, seconds: i64) -> i64 {
        if self.milliseconds {
            seconds.saturating_mul(1_000)
        } else {
            seconds
        }
    }
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
    fn names_with_time_in_any_case_are_times_but_watch_times_are_durations() {
        let times = RawTimes::default();
        for name in ["action_timestamp", "item_query_time", "User_TIME"] {
            assert!(times.is_time(name), "{name}");
        }
        for name in
            ["item_weights", "action_weight", "watch_time", "item_target_watchtime", "dummy_watch_time"]
        {
            assert!(!times.is_time(name), "{name}");
        }
        assert_eq!(times.sent(1_700_000_000), 1_700_000_000);
    }

    #[test]
    fn named_raw_times_replace_the_name_rule_and_milliseconds_scale_them() {
        let times = RawTimes { names: Some(vec!["ts".into(), "watch_time".into()]), milliseconds: true };
        assert!(times.is_time("ts") && times.is_time("watch_time"));
        assert!(!times.is_time("item_query_time"), "only the names given");
        assert_eq!(times.sent(1_700_000_000), 1_700_000_000_000);
    }
}
