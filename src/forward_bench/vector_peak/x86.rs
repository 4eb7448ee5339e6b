//! The kernels, in assembly so that they run the same in every build
//! profile (an unoptimised build would keep intrinsics' operands in
//! memory): registers 12 and 13 are the operands, 0-11 the accumulators,
//! each one dependency chain; all start at zero (no denormals, and integer
//! sums wrap harmlessly).

use std::arch::asm;

use super::KernelSpec;
use crate::flags::backend::DensePrecision;

/// Declares `$name(iterations)`: zeroes 14 registers of `$width`
/// (`zmm`/`ymm`) with `$zero`, then runs `iterations` x 12 `$op`; and
/// `$spec`, the [`KernelSpec`] that describes it (the same instruction
/// text and features, and `$label` to print), for the run-time check
/// before it is called.
macro_rules! kernel {
    (
        $name:ident, $spec:ident, $precision:ident, $ops:literal, $features:literal, $width:literal,
        $zero:literal, $op:literal, $label:literal, [$($reg:tt),*]
    ) => {
        /// # Safety
        ///
        /// The CPU has the target features the function enables.
        #[target_feature(enable = $features)]
        unsafe fn $name(iterations: u64) {
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

        pub(super) const $spec: KernelSpec = KernelSpec {
            precision: DensePrecision::$precision,
            name: $label,
            op: concat!($op, " ", $width),
            zero: concat!($zero, " ", $width),
            ops_per_instruction: $ops,
            features: $features,
            fallback: false,
            run: $name,
        };
    };
}

kernel!(
    fp32_avx512,
    FP32_AVX512,
    Fp32,
    32,
    "avx512f",
    "zmm",
    "vpxord",
    "vfmadd231ps",
    "vfmadd231ps zmm",
    [
        "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9", "zmm10", "zmm11",
        "zmm12", "zmm13"
    ]
);
// AVX's `vxorps`, not AVX2's `vpxor`: CPUs with FMA but no AVX2 exist
// (AMD Piledriver).
kernel!(
    fp32_fma,
    FP32_FMA,
    Fp32,
    16,
    "avx,fma",
    "ymm",
    "vxorps",
    "vfmadd231ps",
    "vfmadd231ps ymm",
    [
        "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", "ymm10", "ymm11",
        "ymm12", "ymm13"
    ]
);
kernel!(
    bf16_avx512,
    BF16_AVX512,
    Bf16,
    64,
    "avx512f,avx512bf16",
    "zmm",
    "vpxord",
    "vdpbf16ps",
    "vdpbf16ps zmm",
    [
        "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9", "zmm10", "zmm11",
        "zmm12", "zmm13"
    ]
);
kernel!(
    bf16_avx512_ymm,
    BF16_AVX512_YMM,
    Bf16,
    32,
    "avx,avx512bf16,avx512vl",
    "ymm",
    "vxorps",
    "vdpbf16ps",
    "vdpbf16ps ymm",
    [
        "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", "ymm10", "ymm11",
        "ymm12", "ymm13"
    ]
);
kernel!(
    int8_avx512,
    INT8_AVX512,
    Int8,
    128,
    "avx512f,avx512vnni",
    "zmm",
    "vpxord",
    "vpdpbusd",
    "vpdpbusd zmm",
    [
        "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9", "zmm10", "zmm11",
        "zmm12", "zmm13"
    ]
);
// AVX512-VNNI's 256-bit form (EVEX, with AVX512-VL).
kernel!(
    int8_avx512_ymm,
    INT8_AVX512_YMM,
    Int8,
    64,
    "avx,avx512vnni,avx512vl",
    "ymm",
    "vxorps",
    "{{evex}} vpdpbusd",
    "vpdpbusd ymm (EVEX)",
    [
        "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", "ymm10", "ymm11",
        "ymm12", "ymm13"
    ]
);
// AVX-VNNI's VEX form of the same instruction.
kernel!(
    int8_avx_vnni,
    INT8_AVX_VNNI,
    Int8,
    64,
    "avx,avxvnni",
    "ymm",
    "vxorps",
    "{{vex}} vpdpbusd",
    "vpdpbusd ymm (VEX)",
    [
        "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", "ymm10", "ymm11",
        "ymm12", "ymm13"
    ]
);

/// AVX2's INT8 multiply-add without VNNI, as oneDNN's AVX2 INT8 GEMMs
/// run it: `vpmaddubsw` (32 uint8 x int8 products, summed in pairs in
/// 16 bits), `vpmaddwd` by ones (the pairs summed to 32 bits), `vpaddd`
/// into the accumulator: 32 multiply-adds per three instructions, on 12
/// independent accumulators (the temporary, ymm15, renamed per chain).
///
/// # Safety
///
/// The CPU has AVX2.
#[target_feature(enable = "avx2")]
unsafe fn int8_avx2(iterations: u64) {
    // SAFETY: touches only the registers it declares clobbered and its
    // counter; no memory, no stack.
    unsafe {
        asm!(
            ".irp r,0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15",
            "vpxor ymm\\r, ymm\\r, ymm\\r",
            ".endr",
            "2:",
            ".irp r,0,1,2,3,4,5,6,7,8,9,10,11",
            "vpmaddubsw ymm15, ymm12, ymm13",
            "vpmaddwd ymm15, ymm15, ymm14",
            "vpaddd ymm\\r, ymm\\r, ymm15",
            ".endr",
            "dec {n}",
            "jnz 2b",
            n = inout(reg) iterations.max(1) => _,
            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _, out("ymm4") _, out("ymm5") _,
            out("ymm6") _, out("ymm7") _, out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
            out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
            options(nomem, nostack),
        );
    }
}

pub(super) const INT8_AVX2: KernelSpec = KernelSpec {
    precision: DensePrecision::Int8,
    name: "vpmaddubsw+vpmaddwd+vpaddd ymm",
    op: "vpmaddubsw+vpmaddwd+vpaddd ymm",
    zero: "vpxor ymm",
    ops_per_instruction: 64,
    features: "avx2",
    fallback: true,
    run: int8_avx2,
};
