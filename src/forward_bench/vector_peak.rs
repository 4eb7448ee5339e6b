//! This core's arithmetic peak measured directly, whatever its
//! microarchitecture: each precision's widest multiply-add instruction
//! issued back to back on independent accumulators (so vector width x
//! multiply-add pipes x clock), and the clock itself, from a chain of
//! dependent register adds (one cycle each on every x86-64 core).
//!
//! No GEMM can beat these numbers on this core; a GEMM library that reaches
//! them is at the limit.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::flags::backend::DensePrecision;

/// One precision's multiply-add peak on the calling thread.
#[derive(Debug, Clone, Serialize)]
pub struct VectorPeak {
    /// The instruction timed, with its register width.
    pub instruction: &'static str,
    /// Arithmetic operations per instruction (2 per multiply-add).
    pub ops_per_instruction: u32,
    /// Operations per second, in billions.
    pub gops: f64,
    /// Every instruction form timed (the 256- and the 512-bit one where
    /// both exist), the fastest being the peak.
    pub timed: Vec<InstructionRate>,
}

/// One instruction form's rate.
#[derive(Debug, Clone, Serialize)]
pub struct InstructionRate {
    pub instruction: &'static str,
    pub gops: f64,
}

/// Independent accumulators per kernel (the `x86` kernels' registers 0-11):
/// enough to cover a multiply-add's latency (4-6 cycles) on two pipes, few
/// enough to stay in the 16 registers AVX2 has.
const ACCUMULATORS: usize = 12;

/// This core's clock in GHz while busy: a chain of dependent 64-bit adds
/// (one cycle each) timed for `duration`, the fastest of a few runs. `None`
/// off x86-64 or when the result is not a plausible clock.
pub fn clock_ghz(duration: Duration) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        const ADDS_PER_ITERATION: f64 = 100.0;
        let best = fastest_rate(duration, ADDS_PER_ITERATION, dependent_adds);
        (0.2..10.0).contains(&best).then_some(best)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = duration;
        None
    }
}

/// The fastest rate, in operations per nanosecond, of `run(iterations)`
/// (`ops_per_iteration` each) over runs of at least 5 ms for `duration`:
/// the iterations grow 4x until a run is that long.
fn fastest_rate(duration: Duration, ops_per_iteration: f64, run: impl Fn(u64)) -> f64 {
    let mut iterations = 1_000u64;
    let mut best = 0.0f64;
    let started = Instant::now();
    while started.elapsed() < duration || best == 0.0 {
        let t = Instant::now();
        run(iterations);
        let elapsed = t.elapsed();
        if elapsed < Duration::from_millis(5) {
            iterations *= 4;
            continue;
        }
        best = best.max(iterations as f64 * ops_per_iteration / elapsed.as_nanos() as f64);
    }
    best
}

/// `iterations` x 100 dependent register adds (register operands: some
/// cores fold chains of adds of small immediates at rename).
#[cfg(target_arch = "x86_64")]
fn dependent_adds(iterations: u64) {
    // SAFETY: the block reads and writes only the three registers it is
    // given (a counter, an accumulator and a constant), touches no memory
    // and no stack, and leaves the flags clobbered, which asm! assumes.
    unsafe {
        std::arch::asm!(
            "2:",
            ".rept 100",
            "add {x}, {one}",
            ".endr",
            "dec {n}",
            "jnz 2b",
            n = inout(reg) iterations => _,
            x = inout(reg) 0u64 => _,
            one = in(reg) 1u64,
            options(nomem, nostack),
        );
    }
}

/// `precision`'s multiply-add peak on this core for `duration`: FP32
/// `vfmadd231ps` (AVX-512, AVX's FMA), bf16 `vdpbf16ps` (AVX512-BF16),
/// INT8 `vpdpbusd` (AVX512-VNNI, AVX-VNNI), else AVX2's three-instruction
/// INT8 multiply-add (what oneDNN's INT8 GEMMs run there). Where a precision has both a
/// 512-bit and a 256-bit form on this CPU both are timed (the duration
/// shared between them) and the faster kept: a core with one 512-bit FMA
/// unit (some Xeons) issues more ymm than zmm work per cycle. `None` when
/// this CPU has no such instruction (or off x86-64).
pub fn vector_peak(precision: DensePrecision, duration: Duration) -> Option<VectorPeak> {
    vector_peak_with(precision, duration, detected)
}

/// [`vector_peak`] with only the features `has` says this CPU has (never
/// one it was not detected to have: a kernel runs only where it can).
fn vector_peak_with(
    precision: DensePrecision,
    duration: Duration,
    has: impl Fn(&str) -> bool,
) -> Option<VectorPeak> {
    let usable = usable_kernels(precision, |feature| has(feature) && detected(feature));
    let part = duration / usable.len().max(1) as u32;
    let timed: Vec<InstructionRate> = usable
        .iter()
        .map(|kernel| {
            let ops_per_iteration = ACCUMULATORS as f64 * kernel.ops_per_instruction as f64;
            // SAFETY: `usable` holds only kernels every feature of which
            // was detected on this CPU (`detected`, above): the features
            // the kernel's function enables.
            let run = |n| unsafe { (kernel.run)(n) };
            InstructionRate { instruction: kernel.name, gops: fastest_rate(part, ops_per_iteration, run) }
        })
        .collect();
    best_of(&usable, timed)
}

/// The fastest of the rates timed (one per kernel of `kernels`, in order).
fn best_of(kernels: &[&KernelSpec], timed: Vec<InstructionRate>) -> Option<VectorPeak> {
    let (best, rate) = kernels.iter().zip(&timed).max_by(|(_, a), (_, b)| a.gops.total_cmp(&b.gops))?;
    Some(VectorPeak {
        instruction: best.name,
        ops_per_instruction: best.ops_per_instruction,
        gops: rate.gops,
        timed: timed.clone(),
    })
}

/// A kernel: `iterations` x [`ACCUMULATORS`] instructions. Unsafe: the
/// CPU must have its [`KernelSpec::features`].
type Kernel = unsafe fn(u64);

/// One peak kernel: what it runs and exactly the CPU features its
/// instructions need (its `target_feature` list, each checked at run time,
/// with what it implies, before it is called).
#[derive(Debug)]
struct KernelSpec {
    precision: DensePrecision,
    /// The instruction and its width, as printed.
    name: &'static str,
    /// The multiply-add instruction with its register width, as in the
    /// `asm!` template (an encoding prefix escaped: `{{vex}} vpdpbusd ymm`;
    /// read by the test that checks each kernel's features).
    #[cfg_attr(not(test), allow(dead_code))]
    op: &'static str,
    /// The instruction that zeroes the registers, as assembled (read by
    /// the test that checks each kernel's features).
    #[cfg_attr(not(test), allow(dead_code))]
    zero: &'static str,
    ops_per_instruction: u32,
    /// The features the function enables (comma-separated, as
    /// `#[target_feature(enable)]` takes them).
    features: &'static str,
    /// Timed only where no other kernel of its precision runs (AVX2's INT8
    /// sequence: oneDNN uses it only without VNNI).
    fallback: bool,
    run: Kernel,
}

/// The kernels of `precision` that this CPU can run, given which features
/// `has` (each needs all of its features).
fn usable_kernels(precision: DensePrecision, has: impl Fn(&str) -> bool) -> Vec<&'static KernelSpec> {
    let mut usable: Vec<_> =
        KERNELS.iter().filter(|k| k.precision == precision && k.features.split(',').all(&has)).collect();
    if usable.iter().any(|k| !k.fallback) {
        usable.retain(|k| !k.fallback);
    }
    usable
}

/// Whether this CPU has `feature` (a name as `target_feature` spells it)
/// and every feature Rust's `target_feature` implies with it: a function
/// that enables one may use those too.
#[cfg(target_arch = "x86_64")]
fn detected(feature: &str) -> bool {
    match feature {
        "avx" => is_x86_feature_detected!("avx") && is_x86_feature_detected!("sse4.2"),
        "avx2" => is_x86_feature_detected!("avx2") && detected("avx"),
        "fma" => is_x86_feature_detected!("fma") && detected("avx"),
        "avx512f" => {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("f16c")
                && detected("avx2")
                && detected("fma")
        }
        "avx512bw" => is_x86_feature_detected!("avx512bw") && detected("avx512f"),
        "avx512vl" => is_x86_feature_detected!("avx512vl") && detected("avx512f"),
        "avx512bf16" => is_x86_feature_detected!("avx512bf16") && detected("avx512bw"),
        "avx512vnni" => is_x86_feature_detected!("avx512vnni") && detected("avx512f"),
        "avxvnni" => is_x86_feature_detected!("avxvnni") && detected("avx2"),
        _ => false,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detected(_feature: &str) -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
const KERNELS: &[KernelSpec] = &[
    x86::FP32_AVX512,
    x86::FP32_FMA,
    x86::BF16_AVX512,
    x86::BF16_AVX512_YMM,
    x86::INT8_AVX512,
    x86::INT8_AVX512_YMM,
    x86::INT8_AVX_VNNI,
    x86::INT8_AVX2,
];

#[cfg(not(target_arch = "x86_64"))]
const KERNELS: &[KernelSpec] = &[];

/// The kernels, in assembly (`vector_peak/x86.rs`).
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_reads_as_a_plausible_frequency_on_x86() {
        let ghz = clock_ghz(Duration::from_millis(30));
        if cfg!(target_arch = "x86_64") {
            let ghz = ghz.expect("x86-64 has a measurable clock");
            assert!((0.2..10.0).contains(&ghz), "{ghz} GHz");
        } else {
            assert!(ghz.is_none());
        }
    }

    #[test]
    fn every_x86_core_with_fma_has_an_fp32_multiply_add_peak_of_at_least_eight_ops_per_cycle() {
        let name = "every_x86_core_with_fma_has_an_fp32_multiply_add_peak_of_at_least_eight_ops_per_cycle";
        let can = detected("avx512f") || (detected("avx") && detected("fma"));
        let Some(peak) = vector_peak(DensePrecision::Fp32, Duration::from_millis(30)) else {
            // An x86-64 core without FMA (or not x86-64): no peak, not a
            // panic.
            assert!(!can, "this CPU has FMA or AVX-512 but no FP32 peak");
            eprintln!("skipped: {name}: no FMA or AVX-512 on this CPU: no FP32 peak");
            return;
        };
        assert!(can, "an FP32 peak on a CPU without FMA: {peak:?}");
        let ghz = clock_ghz(Duration::from_millis(30)).unwrap();
        let per_cycle = peak.gops / ghz;
        // 8 lanes x 2 ops, one pipe: the least an FMA core has. Above 4x the
        // widest known (2 x 512-bit pipes, 64) the kernel was optimised away.
        assert!(
            (8.0..256.0).contains(&per_cycle),
            "{per_cycle} FP32 ops/cycle ({} GOP/s at {ghz} GHz)",
            peak.gops
        );
        // Where AVX-512 exists, the ymm form is timed too, and the peak is
        // the faster of the two.
        let timed: Vec<&str> = peak.timed.iter().map(|t| t.instruction).collect();
        if detected("avx512f") && detected("avx") && detected("fma") {
            assert_eq!(timed, ["vfmadd231ps zmm", "vfmadd231ps ymm"]);
        }
        let fastest = peak.timed.iter().map(|t| t.gops).fold(0.0, f64::max);
        assert_eq!(peak.gops, fastest, "{peak:?}");
    }

    #[test]
    fn a_precision_this_cpu_cannot_multiply_has_no_peak_and_one_it_can_has_a_finite_one() {
        for precision in [DensePrecision::Fp32, DensePrecision::Bf16, DensePrecision::Int8] {
            // A CPU with none of the features: no peak, nothing timed.
            assert!(
                vector_peak_with(precision, Duration::from_millis(10), |_| false).is_none(),
                "{precision:?} without any feature"
            );
            // This CPU: a peak exactly where it has a kernel's features.
            let can = !usable_kernels(precision, detected).is_empty();
            match vector_peak(precision, Duration::from_millis(10)) {
                Some(peak) => {
                    assert!(can, "{precision:?}: a peak without the features: {peak:?}");
                    assert!(peak.gops.is_finite() && peak.gops > 0.0, "{peak:?}");
                }
                None => assert!(!can, "{precision:?}: no peak, though this CPU has a kernel's features"),
            }
        }
    }

    /// Which CPU features each instruction the kernels assemble needs
    /// (Intel SDM; a ymm register needs AVX's state).
    #[cfg(target_arch = "x86_64")]
    const NEEDS: &[(&str, &[&str])] = &[
        ("vpxord zmm", &["avx512f"]),
        ("vxorps ymm", &["avx"]),
        ("vpxor ymm", &["avx2"]),
        ("vfmadd231ps zmm", &["avx512f"]),
        ("vfmadd231ps ymm", &["avx", "fma"]),
        ("vdpbf16ps zmm", &["avx512f", "avx512bf16"]),
        ("vdpbf16ps ymm", &["avx", "avx512bf16", "avx512vl"]),
        ("vpdpbusd zmm", &["avx512f", "avx512vnni"]),
        ("{{evex}} vpdpbusd ymm", &["avx", "avx512vnni", "avx512vl"]),
        ("{{vex}} vpdpbusd ymm", &["avx", "avxvnni"]),
        ("vpmaddubsw+vpmaddwd+vpaddd ymm", &["avx2"]),
    ];

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn each_kernel_is_gated_on_exactly_the_features_its_instructions_need() {
        use std::collections::BTreeSet;
        let needs = |instruction: &str| -> BTreeSet<&str> {
            let (_, features) = NEEDS
                .iter()
                .find(|(i, _)| *i == instruction)
                .unwrap_or_else(|| panic!("`{instruction}` is not in NEEDS"));
            features.iter().copied().collect()
        };
        for kernel in KERNELS {
            let instructions: BTreeSet<&str> = needs(kernel.zero).union(&needs(kernel.op)).copied().collect();
            let enabled: BTreeSet<&str> = kernel.features.split(',').collect();
            assert_eq!(enabled, instructions, "{kernel:?}");
        }
        // A CPU with FMA but no AVX2 (AMD Piledriver) gets the ymm FP32
        // kernel, which runs nothing it lacks (no AVX2 `vpxor ymm`).
        let piledriver = |f: &str| ["avx", "fma"].contains(&f);
        let fp32 = usable_kernels(DensePrecision::Fp32, piledriver);
        assert_eq!(fp32.iter().map(|k| k.op).collect::<Vec<_>>(), ["vfmadd231ps ymm"]);
        assert!(fp32[0].features.split(',').all(piledriver), "{:?}", fp32[0]);
        assert!(usable_kernels(DensePrecision::Bf16, piledriver).is_empty());
        assert!(usable_kernels(DensePrecision::Int8, piledriver).is_empty());
        // AVX-512F without VL: no 256-bit EVEX forms.
        let no_vl = |f: &str| ["avx", "avx2", "fma", "avx512f", "avx512bf16", "avx512vnni"].contains(&f);
        let names = |p| usable_kernels(p, no_vl).iter().map(|k| k.op).collect::<Vec<_>>();
        assert_eq!(names(DensePrecision::Bf16), ["vdpbf16ps zmm"]);
        assert_eq!(names(DensePrecision::Int8), ["vpdpbusd zmm"]);
        // AVX2 alone (Zen 2 and 3): INT8 is AVX2's three-instruction
        // sequence, timed only there.
        let avx2 = |f: &str| ["avx", "avx2", "fma"].contains(&f);
        let int8 = usable_kernels(DensePrecision::Int8, avx2);
        assert_eq!(int8.iter().map(|k| k.op).collect::<Vec<_>>(), ["vpmaddubsw+vpmaddwd+vpaddd ymm"]);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn where_ymm_and_zmm_both_exist_both_are_timed_and_the_faster_is_the_peak() {
        // One 512-bit FMA unit: ymm issues more work per cycle than zmm.
        let avx512 = |f: &str| ["avx", "fma", "avx512f"].contains(&f);
        let kernels = usable_kernels(DensePrecision::Fp32, avx512);
        assert_eq!(
            kernels.iter().map(|k| k.name).collect::<Vec<_>>(),
            ["vfmadd231ps zmm", "vfmadd231ps ymm"]
        );
        let rates = |zmm, ymm| {
            vec![
                InstructionRate { instruction: "vfmadd231ps zmm", gops: zmm },
                InstructionRate { instruction: "vfmadd231ps ymm", gops: ymm },
            ]
        };
        let one_unit = best_of(&kernels, rates(100.0, 140.0)).unwrap();
        assert_eq!(
            (one_unit.instruction, one_unit.ops_per_instruction, one_unit.gops),
            ("vfmadd231ps ymm", 16, 140.0)
        );
        assert_eq!(one_unit.timed.len(), 2);
        let two_units = best_of(&kernels, rates(230.0, 140.0)).unwrap();
        assert_eq!((two_units.instruction, two_units.ops_per_instruction), ("vfmadd231ps zmm", 32));
        assert!(best_of(&[], Vec::new()).is_none());
        // The two 256-bit encodings of `vpdpbusd` print apart.
        let int8 = usable_kernels(DensePrecision::Int8, |_| true);
        assert_eq!(
            int8.iter().map(|k| k.name).collect::<Vec<_>>(),
            ["vpdpbusd zmm", "vpdpbusd ymm (EVEX)", "vpdpbusd ymm (VEX)"]
        );
    }
}
