//! A backend with a fixed forward latency and deterministic scores, for
//! measuring what the engine itself costs (observed latency minus the mock's).
//!
//! Scores are computed from each row's own dense values and sparse ids, read
//! from the same key-major batch real backends get, so a wrong reorder or a
//! wrong split changes the scores a client sees. Ids are mixed with their
//! feature and bag position, making the check stricter than sum pooling.

use std::time::{Duration, Instant};

use crate::backend::{BackendError, BackendFactory, ModelBackend};
use crate::batch::KeyedBatch;
use crate::schema::ModelSchema;

/// Mock timing: `latency + per_row * rows` per forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MockConfig {
    /// Fixed cost of one forward.
    pub latency: Duration,
    /// Extra cost per row.
    pub per_row: Duration,
}

/// Creates mock lanes for a schema.
pub struct MockFactory {
    schema: ModelSchema,
    config: MockConfig,
}

impl MockFactory {
    /// A mock model with the given schema and timing.
    pub fn new(schema: ModelSchema, config: MockConfig) -> Self {
        Self { schema, config }
    }
}

impl BackendFactory for MockFactory {
    fn schema(&self) -> &ModelSchema {
        &self.schema
    }

    fn create_lane(&self, _lane: usize) -> Result<Box<dyn ModelBackend>, BackendError> {
        tighten_timer_slack();
        Ok(Box::new(MockBackend { config: self.config }))
    }
}

/// One lane's mock model.
pub struct MockBackend {
    config: MockConfig,
}

impl ModelBackend for MockBackend {
    fn forward(&mut self, batch: &KeyedBatch) -> Result<Vec<f32>, BackendError> {
        let start = Instant::now();
        let scores = mock_scores(batch);
        let busy = self.config.latency + self.config.per_row * batch.rows as u32;
        if let Some(rest) = busy.checked_sub(start.elapsed()) {
            std::thread::sleep(rest);
        }
        Ok(scores)
    }
}

/// The mock's score for every row: a sigmoid of a fixed mix of the row's
/// dense values and of its ids, each id keyed by feature and bag position.
pub fn mock_scores(batch: &KeyedBatch) -> Vec<f32> {
    let d = batch.num_dense;
    let mut acc: Vec<f64> = (0..batch.rows)
        .map(|row| {
            batch.dense[row * d..(row + 1) * d]
                .iter()
                .enumerate()
                .map(|(j, &x)| f64::from(x) * (0.01 * (j + 1) as f64))
                .sum()
        })
        .collect();
    for f in 0..batch.num_sparse {
        let mut ids = batch.feature_ids(f).iter();
        for (row, &len) in batch.feature_lengths(f).iter().enumerate() {
            for k in 0..len as u64 {
                let id = *ids.next().expect("lengths match ids");
                acc[row] += unit_hash((f as u64) << 48 ^ k << 40 ^ id as u64);
            }
        }
    }
    acc.iter().map(|&x| (1.0 / (1.0 + (-x).exp())) as f32).collect()
}

/// splitmix64 mapped to [-0.5, 0.5).
fn unit_hash(x: u64) -> f64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64 - 0.5
}

/// Linux rounds sleeps up by the thread's timer slack (50 us by default);
/// the mock's latency should be what was asked for, so shrink it to 1 ns.
fn tighten_timer_slack() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_TIMERSLACK only changes this thread's timer slack.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::assemble;
    use crate::request::RequestSamples;

    fn request(seed: i64, b: usize) -> RequestSamples {
        let lengths: Vec<u32> = (0..b * 3).map(|i| ((i as i64 + seed) % 3) as u32).collect();
        let n: u32 = lengths.iter().sum();
        RequestSamples {
            num_samples: b,
            dense: (0..b * 2).map(|i| (i as f32 + seed as f32) * 0.25).collect(),
            lengths,
            ids: (0..n as i64).map(|i| (i * 7 + seed) % 50).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn fused_scores_equal_scores_alone_bit_for_bit() {
        let requests: Vec<_> = (0..5).map(|s| request(s, 1 + s as usize)).collect();
        let fused = assemble(2, 3, &requests);
        let scores = mock_scores(&fused);
        for (request, part) in requests.iter().zip(fused.split(&scores)) {
            let alone = mock_scores(&assemble(2, 3, [request]));
            assert_eq!(
                alone.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                part.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn moving_an_id_to_another_feature_changes_the_score() {
        let a = RequestSamples {
            num_samples: 1,
            dense: vec![0.0; 2],
            lengths: vec![1, 0, 0],
            ids: vec![5],
            ..Default::default()
        };
        let b = RequestSamples { lengths: vec![0, 1, 0], ..a.clone() };
        let sa = mock_scores(&assemble(2, 3, [&a]));
        let sb = mock_scores(&assemble(2, 3, [&b]));
        assert_ne!(sa, sb);
    }

    #[test]
    fn forward_takes_at_least_the_configured_latency() {
        let factory = MockFactory::new(
            ModelSchema::dlrm("mock", "cpu", 10),
            MockConfig { latency: Duration::from_millis(3), per_row: Duration::from_micros(100) },
        );
        let mut lane = factory.create_lane(0).unwrap();
        let batch = crate::backend::warmup_batch(factory.schema(), 20);
        let start = Instant::now();
        let scores = lane.forward(&batch).unwrap();
        assert!(start.elapsed() >= Duration::from_millis(5));
        assert_eq!(scores.len(), 20);
        assert!(scores.iter().all(|s| (0.0..=1.0).contains(s)));
    }
}
