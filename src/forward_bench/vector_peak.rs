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
/// `vfmadd231ps` (AVX-512, else AVX2), bf16 `vdpbf16ps` (AVX512-BF16),
/// INT8 `vpdpbusd` (AVX512-VNNI, else AVX-VNNI). `None` when this CPU has
/// no such instruction (or off x86-64).
pub fn vector_peak(precision: DensePrecision, duration: Duration) -> Option<VectorPeak> {
    let (instruction, ops_per_instruction, kernel) = kernel(precision)?;
    let ops_per_iteration = ACCUMULATORS as f64 * ops_per_instruction as f64;
    let best = fastest_rate(duration, ops_per_iteration, kernel);
    Some(VectorPeak { instruction, ops_per_instruction, gops: best })
}

/// A kernel: `iterations` x [`ACCUMULATORS`] instructions.
type Kernel = fn(u64);

#[cfg(target_arch = "x86_64")]
fn kernel(precision: DensePrecision) -> Option<(&'static str, u32, Kernel)> {
    use x86::*;
    let avx512 = is_x86_feature_detected!("avx512f");
    match precision {
        DensePrecision::Fp32 if avx512 => Some(("vfmadd231ps zmm", 32, |n| {
            // SAFETY: chosen only when the CPU has AVX-512F.
            unsafe { fp32_avx512(n) }
        })),
        DensePrecision::Fp32 if is_x86_feature_detected!("fma") => Some(("vfmadd231ps ymm", 16, |n| {
            // SAFETY: chosen only when the CPU has AVX2's FMA.
            unsafe { fp32_fma(n) }
        })),
        DensePrecision::Bf16 if avx512 && is_x86_feature_detected!("avx512bf16") => {
            Some(("vdpbf16ps zmm", 64, |n| {
                // SAFETY: chosen only when the CPU has AVX512-BF16.
                unsafe { bf16_avx512(n) }
            }))
        }
        DensePrecision::Int8 if avx512 && is_x86_feature_detected!("avx512vnni") => {
            Some(("vpdpbusd zmm", 128, |n| {
                // SAFETY: chosen only when the CPU has AVX512-VNNI.
                unsafe { int8_avx512(n) }
            }))
        }
        DensePrecision::Int8 if is_x86_feature_detected!("avxvnni") => Some(("vpdpbusd ymm", 64, |n| {
            // SAFETY: chosen only when the CPU has AVX-VNNI.
            unsafe { int8_avx_vnni(n) }
        })),
        _ => None,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn kernel(_precision: DensePrecision) -> Option<(&'static str, u32, Kernel)> {
    None
}

/// The kernels, in assembly so that they run the same in every build
/// profile (an unoptimised build would keep intrinsics' operands in
/// memory): registers 12 and 13 are the operands, 0-11 the accumulators,
/// each one dependency chain; all start at zero (no denormals, and integer
/// sums wrap harmlessly).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;

    /// Declares `$name(iterations)`: zeroes 14 registers of `$width`
    /// (`zmm`/`ymm`) with `$zero`, then runs `iterations` x 12 `$op`.
    macro_rules! kernel {
        ($name:ident, $features:literal, $width:literal, $zero:literal, $op:literal, [$($reg:tt),*]) => {
            /// # Safety
            ///
            /// The CPU has the target features the function enables.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name(iterations: u64) {
                // SAFETY: touches only the registers it declares clobbered
                // and its counter; no memory, no stack.
                unsafe {
                    asm!(
                        ".irp r,0,1,2,3,4,5,6,7,8,9,10,11,12,13",
                        concat!($zero, " ", $width, "\\r, ", $width, "\\r, ", $width, "\\r"),
                        ".endr",
                        "2:",
                        ".irp r,0,1,2,3,4,5,6,7,8,9,10,11",
                        concat!($op, " ", $width, "\\r, ", $width, "12, ", $width, "13"),
                        ".endr",
                        "dec {n}",
                        "jnz 2b",
                        n = inout(reg) iterations.max(1) => _,
                        $(out($reg) _,)*
                        options(nomem, nostack),
                    );
                }
            }
        };
    }

    kernel!(
        fp32_avx512,
        "avx512f",
        "zmm",
        "vpxord",
        "vfmadd231ps",
        [
            "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9", "zmm10", "zmm11",
            "zmm12", "zmm13"
        ]
    );
    kernel!(
        fp32_fma,
        "avx2,fma",
        "ymm",
        "vpxor",
        "vfmadd231ps",
        [
            "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", "ymm10", "ymm11",
            "ymm12", "ymm13"
        ]
    );
    kernel!(
        bf16_avx512,
        "avx512f,avx512bf16",
        "zmm",
        "vpxord",
        "vdpbf16ps",
        [
            "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9", "zmm10", "zmm11",
            "zmm12", "zmm13"
        ]
    );
    kernel!(
        int8_avx512,
        "avx512f,avx512vnni",
        "zmm",
        "vpxord",
        "vpdpbusd",
        [
            "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9", "zmm10", "zmm11",
            "zmm12", "zmm13"
        ]
    );
    // AVX-VNNI's VEX form of the same instruction.
    kernel!(
        int8_avx_vnni,
        "avx2,avxvnni",
        "ymm",
        "vpxor",
        "{{vex}} vpdpbusd",
        [
            "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", "ymm10", "ymm11",
            "ymm12", "ymm13"
        ]
    );
}

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
    fn every_x86_core_has_an_fp32_multiply_add_peak_of_at_least_eight_ops_per_cycle() {
        if !cfg!(target_arch = "x86_64") {
            println!("skipped: every_x86_core_has_an_fp32_…: not x86-64");
            return;
        }
        let peak = vector_peak(DensePrecision::Fp32, Duration::from_millis(30)).expect("AVX2 or AVX-512");
        let ghz = clock_ghz(Duration::from_millis(30)).unwrap();
        let per_cycle = peak.gops / ghz;
        // 8 lanes x 2 ops, one pipe: the least an FMA core has. Above 4x the
        // widest known (2 x 512-bit pipes, 64) the kernel was optimised away.
        assert!(
            (8.0..256.0).contains(&per_cycle),
            "{per_cycle} FP32 ops/cycle ({} GOP/s at {ghz} GHz)",
            peak.gops
        );
    }

    #[test]
    fn a_precision_this_cpu_cannot_multiply_has_no_peak_and_one_it_can_has_a_finite_one() {
        for precision in [DensePrecision::Bf16, DensePrecision::Int8] {
            match vector_peak(precision, Duration::from_millis(10)) {
                Some(peak) => assert!(peak.gops.is_finite() && peak.gops > 0.0, "{peak:?}"),
                None => println!("{precision:?}: no multiply-add instruction on this CPU"),
            }
        }
    }
}
