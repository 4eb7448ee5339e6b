//! The roofline `narsil bench-forward` holds each forward against: for
//! each precision, one core's peak, the largest of
//!
//! * the multiply-add instruction's own peak (`vector_peak`: vector width x
//!   pipes x clock, measured; the 256- and 512-bit forms both timed where
//!   both exist),
//! * the best of a few large GEMMs through the libtorch the model runs on,
//!   on one intra-op thread (oneDNN may use units the instruction kernels do
//!   not, such as AMX),
//! * on CPUs with AMX, Intel's published AMX rate per cycle at the measured
//!   clock (published, not measured: no AMX kernel of Narsil's own),
//!
//! so that no forward can reach more than 1.0 of it. The limit in
//! samples/s ([`forward_limit`]) is that peak times the cores the forward
//! may use (its intra-op threads, at most the cores this process may run
//! on) over the dense network's FLOPs per sample (as its export counted
//! them); a forward on a GPU has none (this CPU's peak does not bound it).

use std::time::Duration;

use serde::Serialize;

use super::vector_peak::{clock_ghz, vector_peak, VectorPeak};
use crate::flags::backend::DensePrecision;

/// GEMM shapes (`[m, k, n]`) timed through libtorch: the default DLRM's
/// widest layer at 1,600 rows, and two large enough to reach a library's
/// best.
pub const GEMM_SHAPES: [[i64; 3]; 3] = [[1600, 512, 512], [4096, 1024, 1024], [2048, 2048, 2048]];

/// The words every printed AMX rate carries: Narsil does not time AMX.
pub const AMX_PUBLISHED: &str = "published, not measured";

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
    /// CPU has AMX for this precision: published, not measured.
    pub amx_published_gops: Option<f64>,
    /// The limit of one core: the largest of the three, GOP/s (FLOP/s for
    /// FP32 and bf16).
    pub limit_gops: Option<f64>,
}

/// One core's peaks.
#[derive(Debug, Clone, Serialize)]
pub struct Roofline {
    /// The clock while busy, GHz (dependent adds).
    pub clock_ghz: Option<f64>,
    pub peaks: Vec<PrecisionPeak>,
}

impl Roofline {
    /// Measures every precision on the calling thread, about `seconds` per
    /// precision. `gemm` times one libtorch GEMM shape in a precision for a
    /// duration on one core (`None` without libtorch, or for INT8).
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

    /// One core's peak in `precision`.
    pub fn limit_gops(&self, precision: DensePrecision) -> Option<f64> {
        self.peaks.iter().find(|p| p.precision == precision_name(precision)).and_then(|p| p.limit_gops)
    }
}

/// The limit a forward's samples/s is held against.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Limit {
    /// The cores the limit counts: the threads the forward's arithmetic
    /// uses, at most the cores this process may run on.
    pub cores: usize,
    /// Those cores' peak over the dense FLOPs per sample.
    pub samples_per_s: f64,
}

impl Limit {
    /// `samples_per_s` as a fraction of the limit.
    pub fn fraction(&self, samples_per_s: f64) -> f64 {
        samples_per_s / self.samples_per_s
    }
}

/// The limit of a forward on `device` whose arithmetic runs on `threads`
/// threads, given one core's peak in its precision (`None`: not measured)
/// and the dense FLOPs per sample, on a machine whose process may use
/// `cores_here` cores; or why it has none. A forward on a GPU has none: the
/// peak is this CPU's.
pub fn forward_limit(
    device: &str,
    precision: DensePrecision,
    core_peak_gops: Option<f64>,
    dense_flops_per_sample: Option<f64>,
    threads: usize,
    cores_here: usize,
) -> Result<Limit, String> {
    if device != "cpu" {
        return Err(format!(
            "the forward runs on {device}: this CPU's peak does not bound it, and no {device} peak is measured"
        ));
    }
    let Some(flops) = dense_flops_per_sample.filter(|f| *f > 0.0) else {
        return Err("the model states no dense FLOPs per sample (the schema's dense_flops_per_sample: \
             export_dlrm.py, export_torchrec.py and extract_split.py write it for models of pooled features; a \
             sequence model's FLOPs grow with its histories, so none is stated for it)"
            .into());
    };
    let Some(gops) = core_peak_gops.filter(|g| g.is_finite() && *g > 0.0) else {
        return Err(format!(
            "no {} peak measured on this CPU (no such instruction or GEMM, or --peak-seconds 0)",
            precision_name(precision)
        ));
    };
    let cores = threads.clamp(1, cores_here.max(1));
    Ok(Limit { cores, samples_per_s: gops * 1e9 * cores as f64 / flops })
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
    fn a_core_peak_is_the_largest_source_and_the_forwards_limit_scales_it_by_the_cores_used() {
        let vector = Some(VectorPeak {
            instruction: "vfmadd231ps zmm",
            ops_per_instruction: 32,
            gops: 118.0,
            timed: Vec::new(),
        });
        let gemm = Some(GemmRate { shape: [1600, 512, 512], gflops: 97.0 });
        // The instruction above a slower GEMM, a GEMM above the instruction,
        // a published AMX rate above both: each one chooses the limit.
        let cases = [
            (vector.clone(), gemm.clone(), None, 118.0),
            (vector.clone(), Some(GemmRate { shape: [2048, 2048, 2048], gflops: 900.0 }), None, 900.0),
            (vector.clone(), gemm.clone(), Some(3789.0), 3789.0),
            (None, gemm.clone(), None, 97.0),
        ];
        for (vector, gemm, amx, chosen) in cases {
            let peak = Roofline::peak(DensePrecision::Bf16, vector, gemm, amx, Some(3.7));
            assert_eq!(peak.limit_gops, Some(chosen));
            let roofline = Roofline { clock_ghz: Some(3.7), peaks: vec![peak] };
            let core = roofline.limit_gops(DensePrecision::Bf16);
            assert_eq!(roofline.limit_gops(DensePrecision::Fp32), None, "another precision's peak");
            // 1 MFLOP/sample: one core at `chosen` GFLOP/s is `chosen` x
            // 1,000 samples/s; 4 threads on a 16-core machine, 4x that; 4
            // threads on 2 cores, only 2x.
            let limit = |threads, cores_here| {
                forward_limit("cpu", DensePrecision::Bf16, core, Some(1e6), threads, cores_here).unwrap()
            };
            assert_eq!(limit(1, 16), Limit { cores: 1, samples_per_s: chosen * 1e3 });
            assert_eq!(limit(4, 16), Limit { cores: 4, samples_per_s: chosen * 4e3 });
            assert_eq!(limit(4, 2), Limit { cores: 2, samples_per_s: chosen * 2e3 });
            // A 4-thread forward at 3x one core's limit is at 0.75 of its
            // own.
            assert!((limit(4, 16).fraction(chosen * 3e3) - 0.75).abs() < 1e-12);
        }
        let peak = Roofline::peak(DensePrecision::Fp32, vector, gemm, None, Some(3.7));
        assert!((peak.vector_ops_per_cycle.unwrap() - 118.0 / 3.7).abs() < 1e-9);
        assert_eq!(Roofline::peak(DensePrecision::Int8, None, None, None, None).limit_gops, None);
    }

    #[test]
    fn a_forward_on_a_gpu_or_without_flops_or_a_peak_has_no_limit_and_says_why() {
        let limit = |device, peak, flops| forward_limit(device, DensePrecision::Fp32, peak, flops, 1, 2);
        for device in ["cuda", "cuda:1"] {
            let why = limit(device, Some(100.0), Some(1e6)).unwrap_err();
            assert!(why.contains(device) && why.contains("CPU"), "{why}");
        }
        assert!(limit("cpu", Some(100.0), None).unwrap_err().contains("FLOPs"));
        assert!(limit("cpu", Some(100.0), Some(0.0)).unwrap_err().contains("FLOPs"));
        assert!(limit("cpu", None, Some(1e6)).unwrap_err().contains("fp32 peak"));
        assert!(limit("cpu", Some(f64::NAN), Some(1e6)).is_err());
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
