//! The roofline `narsil bench-forward` holds each forward against: for
//! each precision, this core's peak, the largest of
//!
//! * the multiply-add instruction's own peak (`vector_peak`: vector width x
//!   pipes x clock, measured),
//! * the best of a few large GEMMs through the libtorch the model runs on
//!   (oneDNN may use units the instruction kernels do not, such as AMX),
//! * on CPUs with AMX, Intel's published AMX rate per cycle at the measured
//!   clock (not measured here: no AMX kernel of Narsil's own),
//!
//! so that no forward can reach more than 1.0 of it. The limit in
//! samples/s is that peak over the dense network's FLOPs per sample (as its
//! export counted them).

use std::time::Duration;

use serde::Serialize;

use super::vector_peak::{clock_ghz, vector_peak, VectorPeak};
use crate::flags::backend::DensePrecision;

/// GEMM shapes (`[m, k, n]`) timed through libtorch: the default DLRM's
/// widest layer at 1,600 rows, and two large enough to reach a library's
/// best.
pub const GEMM_SHAPES: [[i64; 3]; 3] = [[1600, 512, 512], [4096, 1024, 1024], [2048, 2048, 2048]];

/// Intel's published AMX rates per core and cycle (Sapphire Rapids and
/// later): 1,024 bf16 FLOPs, 2,048 INT8 operations.
const AMX_OPS_PER_CYCLE: [(DensePrecision, &str, f64); 2] =
    [(DensePrecision::Bf16, "amx_bf16", 1024.0), (DensePrecision::Int8, "amx_int8", 2048.0)];

/// One GEMM shape's rate through libtorch.
#[derive(Debug, Clone, Serialize)]
pub struct GemmRate {
    /// `[m, k, n]`.
    pub shape: [i64; 3],
    pub gflops: f64,
}

/// One precision's peak on this core.
#[derive(Debug, Clone, Serialize)]
pub struct PrecisionPeak {
    /// `fp32`, `bf16` or `int8`.
    pub precision: String,
    /// The multiply-add instruction's own peak; `None` when this CPU has no
    /// such instruction.
    pub vector: Option<VectorPeak>,
    /// The vector peak per clock cycle (vector width x pipes x 2).
    pub vector_ops_per_cycle: Option<f64>,
    /// The best libtorch GEMM in this precision (FP32 and bf16, with
    /// libtorch compiled in).
    pub best_gemm: Option<GemmRate>,
    /// Intel's published AMX rate at the measured clock, GOP/s, where this
    /// CPU has AMX for this precision.
    pub amx_published_gops: Option<f64>,
    /// The limit: the largest of the three, GOP/s (FLOP/s for FP32 and
    /// bf16).
    pub limit_gops: Option<f64>,
}

/// This core's peaks.
#[derive(Debug, Clone, Serialize)]
pub struct Roofline {
    /// The clock while busy, GHz (dependent adds).
    pub clock_ghz: Option<f64>,
    pub peaks: Vec<PrecisionPeak>,
}

impl Roofline {
    /// Measures every precision on the calling thread, about `seconds` per
    /// precision. `gemm` times one libtorch GEMM shape in a precision for a
    /// duration (`None` without libtorch, or for INT8).
    pub fn measure(seconds: f64, gemm: impl Fn(DensePrecision, [i64; 3], Duration) -> Option<f64>) -> Self {
        let part = Duration::from_secs_f64(seconds / (GEMM_SHAPES.len() + 1) as f64);
        let clock_ghz = clock_ghz(part.min(Duration::from_millis(200)));
        let cpu_flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let peaks = [DensePrecision::Fp32, DensePrecision::Bf16, DensePrecision::Int8]
            .into_iter()
            .map(|precision| {
                let vector = vector_peak(precision, part);
                let best_gemm = GEMM_SHAPES
                    .iter()
                    .filter_map(|&shape| {
                        gemm(precision, shape, part).map(|gflops| GemmRate { shape, gflops })
                    })
                    .filter(|rate| rate.gflops.is_finite())
                    .max_by(|a, b| a.gflops.total_cmp(&b.gflops));
                let amx_published_gops = AMX_OPS_PER_CYCLE
                    .iter()
                    .find(|(p, flag, _)| *p == precision && has_cpu_flag(&cpu_flags, flag))
                    .and_then(|(_, _, per_cycle)| clock_ghz.map(|ghz| per_cycle * ghz));
                Self::peak(precision, vector, best_gemm, amx_published_gops, clock_ghz)
            })
            .collect();
        Self { clock_ghz, peaks }
    }

    fn peak(
        precision: DensePrecision,
        vector: Option<VectorPeak>,
        best_gemm: Option<GemmRate>,
        amx_published_gops: Option<f64>,
        clock_ghz: Option<f64>,
    ) -> PrecisionPeak {
        let limit_gops =
            [vector.as_ref().map(|v| v.gops), best_gemm.as_ref().map(|g| g.gflops), amx_published_gops]
                .into_iter()
                .flatten()
                .reduce(f64::max);
        PrecisionPeak {
            precision: precision_name(precision).into(),
            vector_ops_per_cycle: vector.as_ref().zip(clock_ghz).map(|(v, ghz)| v.gops / ghz),
            vector,
            best_gemm,
            amx_published_gops,
            limit_gops,
        }
    }

    /// The peak of `precision`.
    pub fn limit_gops(&self, precision: DensePrecision) -> Option<f64> {
        self.peaks.iter().find(|p| p.precision == precision_name(precision)).and_then(|p| p.limit_gops)
    }
}

/// The flag value of a precision.
pub fn precision_name(precision: DensePrecision) -> &'static str {
    match precision {
        DensePrecision::Fp32 => "fp32",
        DensePrecision::Bf16 => "bf16",
        DensePrecision::Int8 => "int8",
    }
}

/// Whether `/proc/cpuinfo`'s first `flags` line names `flag`.
fn has_cpu_flag(cpuinfo: &str, flag: &str) -> bool {
    cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .is_some_and(|line| line.split_whitespace().any(|f| f == flag))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_is_the_largest_of_the_instruction_the_gemms_and_the_published_rate() {
        let vector =
            Some(VectorPeak { instruction: "vfmadd231ps zmm", ops_per_instruction: 32, gops: 118.0 });
        let gemm = Some(GemmRate { shape: [1600, 512, 512], gflops: 97.0 });
        let peak = Roofline::peak(DensePrecision::Fp32, vector.clone(), gemm.clone(), None, Some(3.7));
        assert_eq!(peak.limit_gops, Some(118.0));
        assert!((peak.vector_ops_per_cycle.unwrap() - 118.0 / 3.7).abs() < 1e-9);
        // A library faster than the instruction kernel (AMX through oneDNN)
        // raises the limit, and so does a published rate above both.
        let fast = Some(GemmRate { shape: [2048, 2048, 2048], gflops: 900.0 });
        assert_eq!(
            Roofline::peak(DensePrecision::Bf16, vector.clone(), fast, None, None).limit_gops,
            Some(900.0)
        );
        assert_eq!(
            Roofline::peak(DensePrecision::Bf16, vector, gemm, Some(3789.0), None).limit_gops,
            Some(3789.0)
        );
        assert_eq!(Roofline::peak(DensePrecision::Int8, None, None, None, None).limit_gops, None);
    }

    #[test]
    fn every_gemm_shape_is_timed_and_the_best_kept_per_precision() {
        let timed = std::sync::Mutex::new(Vec::new());
        let roofline = Roofline::measure(0.04, |precision, shape, _| {
            timed.lock().unwrap().push((precision, shape));
            // Only FP32 and bf16 GEMMs exist; the largest shape is fastest.
            (precision != DensePrecision::Int8).then_some(shape[2] as f64)
        });
        assert_eq!(timed.into_inner().unwrap().len(), 3 * GEMM_SHAPES.len());
        let fp32 = &roofline.peaks[0];
        assert_eq!(fp32.best_gemm.as_ref().map(|g| g.shape), Some([2048, 2048, 2048]));
        assert!(roofline.peaks[2].best_gemm.is_none());
        // The limit is never below the best GEMM.
        for peak in &roofline.peaks {
            if let Some(gemm) = &peak.best_gemm {
                assert!(peak.limit_gops.unwrap() >= gemm.gflops);
            }
        }
    }

    #[test]
    fn cpu_flags_are_matched_whole() {
        let cpuinfo = "processor\t: 0\nflags\t\t: fpu avx512f amx_bf16_x\n";
        assert!(has_cpu_flag(cpuinfo, "avx512f"));
        assert!(!has_cpu_flag(cpuinfo, "amx_bf16"));
    }
}
