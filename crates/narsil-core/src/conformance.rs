//! The checks every backend must pass, written once: each backend's tests
//! call them with its own model and tolerances.
//!
//! * [`golden_parity`]: each golden request alone, and all of them fused
//!   into one batch, score within a tolerance of the reference scores.
//! * [`fused_equals_alone`]: a request's scores in a large fused batch (the
//!   requests repeated) stay within a tolerance of its scores alone.
//! * [`concurrent_lanes`]: several lanes of one factory running at once, on
//!   their own threads, each give every request its scores alone.
//! * [`int8_parity`]: an INT8 dense network within the bound its export
//!   recorded of the FP32 scores, alone and fused.
//!
//! Requests come from the golden file ([`crate::golden`]); a panic names the
//! request and the largest difference. A request's scores are compared
//! output after output (a forward's layout, [`fused_scores`]).

use crate::backend::BackendFactory;
use crate::batch::assemble;
use crate::golden::{max_abs_diff, Golden, GoldenRequest};
use crate::request::{IdPolicy, RequestSamples};

/// The golden requests validated against `factory`'s schema (ids handled by
/// `policy`: `Modulo` folds them into a smaller model's tables).
pub fn requests(factory: &dyn BackendFactory, golden: &Golden, policy: IdPolicy) -> Vec<RequestSamples> {
    golden
        .requests
        .iter()
        .map(|g| g.validated(factory.schema(), policy).expect("golden requests fit the model"))
        .collect()
}

/// Scores each request alone on a fresh lane.
pub fn scores_alone(factory: &dyn BackendFactory, requests: &[RequestSamples]) -> Vec<Vec<f32>> {
    let schema = factory.schema();
    let mut lane = factory.create_lane(0).expect("lane");
    requests
        .iter()
        .map(|r| lane.forward(&assemble(schema.num_dense, schema.num_sparse(), [r])).expect("forward"))
        .collect()
}

/// Panics unless `got` has as many scores as `want` and each is within
/// `tolerance`. Returns the largest difference.
pub fn assert_close(got: &[f32], want: &[f32], tolerance: f32, what: &str) -> f32 {
    let diff = max_abs_diff(got, want)
        .unwrap_or_else(|| panic!("{what}: {} scores, want {}", got.len(), want.len()));
    assert!(diff <= tolerance, "{what}: max |diff| {diff:e} > {tolerance:e}\n got {got:?}\nwant {want:?}");
    diff
}

/// Each fused request's scores, output after output, as it would get them
/// alone.
pub fn fused_scores(batch: &crate::KeyedBatch, scores: &[f32]) -> Vec<Vec<f32>> {
    batch.split_outputs(scores).map(|outputs| outputs.concat()).collect()
}

/// A golden request's reference scores for every output of `schema`, output
/// after output (`export_torchrec.py`'s golden files).
pub fn golden_outputs(schema: &crate::ModelSchema, g: &GoldenRequest) -> Vec<f32> {
    schema.outputs.iter().flat_map(|name| g.outputs[name].iter().copied()).collect()
}

/// Every golden request alone, then all of them in one fused batch, within
/// `tolerance` of `want`'s reference scores (output after output). Returns
/// the largest difference.
pub fn golden_parity(
    factory: &dyn BackendFactory,
    golden: &Golden,
    want: impl Fn(&GoldenRequest) -> Vec<f32>,
    tolerance: f32,
) -> f32 {
    let schema = factory.schema();
    let requests = requests(factory, golden, IdPolicy::Reject);
    let mut worst = 0f32;
    for (i, (alone, g)) in scores_alone(factory, &requests).iter().zip(&golden.requests).enumerate() {
        worst = worst.max(assert_close(alone, &want(g), tolerance, &format!("golden request {i} alone")));
    }
    let mut lane = factory.create_lane(0).expect("lane");
    let fused = assemble(schema.num_dense, schema.num_sparse(), requests.iter());
    let scores = lane.forward(&fused).expect("fused forward");
    for (i, (part, g)) in fused_scores(&fused, &scores).iter().zip(&golden.requests).enumerate() {
        worst = worst.max(assert_close(part, &want(g), tolerance, &format!("golden request {i} fused")));
    }
    worst
}

/// `requests` repeated `copies` times in one fused batch: each part within
/// `tolerance` of that request's scores alone. Returns the largest
/// difference.
pub fn fused_equals_alone(
    factory: &dyn BackendFactory,
    requests: &[RequestSamples],
    copies: usize,
    tolerance: f32,
) -> f32 {
    let schema = factory.schema();
    let alone = scores_alone(factory, requests);
    let many: Vec<&RequestSamples> = requests.iter().cycle().take(copies * requests.len()).collect();
    let fused = assemble(schema.num_dense, schema.num_sparse(), many.iter().copied());
    let scores = factory.create_lane(0).expect("lane").forward(&fused).expect("fused forward");
    let mut worst = 0f32;
    for (i, part) in fused_scores(&fused, &scores).iter().enumerate() {
        let what = format!("request {} fused into {} rows", i % requests.len(), fused.rows);
        worst = worst.max(assert_close(part, &alone[i % requests.len()], tolerance, &what));
    }
    worst
}

/// Whatever an export recorded, INT8 scores further than this from FP32 on
/// the golden requests fail (probabilities).
pub const INT8_CAP: f32 = 2e-2;

/// What [`int8_parity`] measured.
#[derive(Debug, Clone, Copy)]
pub struct Int8Parity {
    /// The largest |INT8 - FP32| the export recorded on the golden requests.
    pub recorded: f32,
    /// The bound held: twice `recorded`, at most [`INT8_CAP`].
    pub bound: f32,
    /// The largest |served - FP32| over the golden requests, alone and fused.
    pub worst: f32,
    /// The largest difference of a request fused with others from alone.
    pub fused: f32,
}

/// An export's INT8 quality record, `int8_quality.json` in `split_dir`.
pub fn int8_quality(split_dir: &std::path::Path) -> serde_json::Value {
    let path = split_dir.join("int8_quality.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `factory`'s INT8 dense network (a split model's `dense_int8.pt2`, in
/// `split_dir`) serves the golden requests within twice the max |INT8 -
/// FP32| its export recorded (`int8_quality.json`; never more than
/// [`INT8_CAP`]) of `want`'s FP32 scores, alone and fused ([`golden_parity`]);
/// its scores are not the FP32 ones (the INT8 network ran, not a fallback);
/// and each request fused with others scores as alone within 1e-6
/// (activations quantized with static per-tensor scales: a row's
/// arithmetic does not depend on its batch).
pub fn int8_parity(
    factory: &dyn BackendFactory,
    golden: &Golden,
    split_dir: &std::path::Path,
    want: impl Fn(&GoldenRequest) -> Vec<f32>,
) -> Int8Parity {
    let quality = int8_quality(split_dir);
    let recorded = quality["golden"]["max_abs_diff"].as_f64().expect("golden.max_abs_diff") as f32;
    assert!(
        recorded > 0.0 && recorded <= INT8_CAP,
        "the export recorded {recorded:e} from FP32: not an INT8 network's, or over the cap {INT8_CAP:e}"
    );
    let bound = (2.0 * recorded).min(INT8_CAP);
    let worst = golden_parity(factory, golden, want, bound);
    assert!(worst > 0.0, "the FP32 scores exactly: was the INT8 network served?");
    let fused = fused_equals_alone(factory, &requests(factory, golden, IdPolicy::Reject), 4, 1e-6);
    Int8Parity { recorded, bound, worst, fused }
}

/// `lanes` lanes, each created and run on its own thread at the same time,
/// score every request (alone, then all fused) within `tolerance` of a
/// single lane's scores alone, `rounds` times over.
pub fn concurrent_lanes(
    factory: &dyn BackendFactory,
    requests: &[RequestSamples],
    lanes: usize,
    rounds: usize,
    tolerance: f32,
) {
    let schema = factory.schema();
    let alone = scores_alone(factory, requests);
    let start = std::sync::Barrier::new(lanes);
    std::thread::scope(|scope| {
        for lane_index in 0..lanes {
            let (alone, start) = (&alone, &start);
            scope.spawn(move || {
                let mut lane = factory.create_lane(lane_index).expect("lane");
                start.wait();
                for round in 0..rounds {
                    for (i, r) in requests.iter().enumerate() {
                        let scores = lane
                            .forward(&assemble(schema.num_dense, schema.num_sparse(), [r]))
                            .expect("forward");
                        assert_close(
                            &scores,
                            &alone[i],
                            tolerance,
                            &format!("lane {lane_index} round {round} request {i}"),
                        );
                    }
                    let fused = assemble(schema.num_dense, schema.num_sparse(), requests.iter());
                    let scores = lane.forward(&fused).expect("fused forward");
                    for (i, part) in fused_scores(&fused, &scores).iter().enumerate() {
                        let what = format!("lane {lane_index} round {round} request {i} fused");
                        assert_close(part, &alone[i], tolerance, &what);
                    }
                }
            });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mock::{MockConfig, MockFactory};
    use crate::schema::ModelSchema;
    use std::time::Duration;

    /// Three small requests in the golden file's form.
    fn golden() -> Golden {
        let request = |b: usize, seed: i64| GoldenRequest {
            batch_size: b,
            dense: (0..b * 13).map(|i| (i as f32 + seed as f32) / 50.0).collect(),
            lengths: (0..b * 26).map(|i| (i % 3) as u32).collect(),
            ids: (0..(0..b * 26).map(|i| i % 3).sum::<usize>() as i64)
                .map(|i| (i * 7 + seed) % 100)
                .collect(),
            weights: vec![],
            scores_int8: vec![],
            scores_fp32: vec![],
            outputs: Default::default(),
            request: None,
        };
        Golden { requests: vec![request(1, 0), request(4, 1), request(7, 2)] }
    }

    fn mock() -> MockFactory {
        let config = MockConfig { latency: Duration::ZERO, per_row: Duration::ZERO };
        MockFactory::new(ModelSchema::dlrm("mock", "cpu", 100), config)
    }

    #[test]
    fn the_mock_passes_the_kit() {
        let factory = mock();
        let golden = golden();
        let requests = requests(&factory, &golden, IdPolicy::Reject);
        assert_eq!(fused_equals_alone(&factory, &requests, 3, 0.0), 0.0);
        concurrent_lanes(&factory, &requests, 2, 2, 0.0);
        let mut golden = golden;
        for (g, scores) in golden.requests.iter_mut().zip(scores_alone(&factory, &requests)) {
            g.scores_fp32 = scores;
        }
        assert_eq!(golden_parity(&factory, &golden, |g| g.scores_fp32.clone(), 0.0), 0.0);
    }

    #[test]
    #[should_panic(expected = "golden request 0 alone")]
    fn a_wrong_score_fails_parity() {
        let factory = mock();
        let mut golden = golden();
        let requests = requests(&factory, &golden, IdPolicy::Reject);
        for (g, scores) in golden.requests.iter_mut().zip(scores_alone(&factory, &requests)) {
            g.scores_fp32 = scores;
        }
        golden.requests[0].scores_fp32[0] += 1e-3;
        golden_parity(&factory, &golden, |g| g.scores_fp32.clone(), 1e-4);
    }
}
