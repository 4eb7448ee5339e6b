//! One core's GEMM peak through the same libtorch the model runs on: the
//! ceiling the model's MLP arithmetic can reach. It only times a GEMM; the
//! roofline `narsil bench-forward` holds each forward against (this rate
//! among others) is `src/forward_bench/roofline.rs`.

use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};

use crate::precision::DensePrecision;

/// GFLOP/s of `[m, k] x [k, n]` linear layers (with bias) in `precision`, on
/// one intra-op thread (one core's rate: `bench-forward` scales it by the
/// threads a forward uses), run back to back for `duration` after a short
/// warm-up. The calling thread's intra-op thread count is set back after.
/// The default shape is the over arch's widest layer at 1,600 rows.
pub fn gemm_peak_gflops(precision: DensePrecision, shape: [i64; 3], duration: Duration) -> f64 {
    let kind = match precision {
        DensePrecision::Fp32 => Kind::Float,
        DensePrecision::Bf16 => Kind::BFloat16,
        // oneDNN's INT8 linear layer is no aten op tch exposes: no INT8 peak.
        DensePrecision::Int8 => return f64::NAN,
    };
    let threads = tch::get_num_threads();
    tch::set_num_threads(1);
    let gflops = timed_linear(kind, shape, duration);
    tch::set_num_threads(threads);
    gflops
}

/// [`gemm_peak_gflops`] on the calling thread's intra-op threads as set.
fn timed_linear(kind: Kind, [m, k, n]: [i64; 3], duration: Duration) -> f64 {
    let _guard = tch::no_grad_guard();
    let options = (Kind::Float, Device::Cpu);
    let input = Tensor::randn([m, k], options).to_kind(kind);
    let weight = Tensor::randn([n, k], options).to_kind(kind);
    let bias = Tensor::randn([n], options).to_kind(kind);
    for _ in 0..3 {
        let _ = input.linear(&weight, Some(&bias));
    }
    let started = Instant::now();
    let mut runs = 0u64;
    while started.elapsed() < duration || runs == 0 {
        let _ = input.linear(&weight, Some(&bias));
        runs += 1;
    }
    (2 * m * k * n) as f64 * runs as f64 / started.elapsed().as_secs_f64() / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_gemm_reports_a_positive_finite_rate() {
        let gflops = gemm_peak_gflops(DensePrecision::Fp32, [64, 64, 64], Duration::from_millis(20));
        assert!(gflops.is_finite() && gflops > 0.0, "{gflops}");
    }

    #[test]
    fn the_gemm_leaves_the_callers_intra_op_thread_count_as_it_was() {
        // Per calling thread (OpenMP): a thread of this test's own.
        std::thread::spawn(|| {
            tch::set_num_threads(2);
            let gflops = gemm_peak_gflops(DensePrecision::Fp32, [64, 64, 64], Duration::from_millis(5));
            assert!(gflops.is_finite() && gflops > 0.0, "{gflops}");
            assert_eq!(tch::get_num_threads(), 2, "the caller's intra-op threads are set back");
        })
        .join()
        .unwrap();
    }
}
