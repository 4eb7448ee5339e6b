//! What the pooled block holds: FP32 values, or bf16 ones for a dense
//! network that runs in bf16, written by the stage as each bag is pooled so
//! that no pass casts the block afterwards.
//!
//! A bag is always summed in FP32 (FBGEMM's arithmetic, [`crate::pool`]);
//! only its store differs. An FP32 block is summed in place. A bf16 one is
//! summed into an accumulator of the bag's width (one per feature's bags,
//! in L1) and rounded to bf16 as libtorch's `to(torch.bfloat16)` rounds a
//! tensor on a CPU (ATen's vectorised `cvtfp32_bf16`: nearest, ties to
//! even; every NaN `0xFFFF`), so the block holds the bits a cast of the
//! FP32 block would.

/// A value of the pooled block.
pub trait PooledValue: Copy + Default + Send + Sync + 'static {
    /// Whether a bag is summed apart from the block (into the
    /// accumulator [`Self::store_bag`] is given).
    const SUMMED_APART: bool;

    /// Stores a bag's values into `out` (its `dim` values), which `sum`
    /// writes in FP32 into the slice it is given (`out.len()` values; what
    /// the slice held before is never read); `acc` holds `out.len()` values
    /// where [`Self::SUMMED_APART`].
    fn store_bag(out: &mut [Self], acc: &mut [f32], sum: impl FnOnce(&mut [f32]));

    /// `values` in this type into `out` (as many).
    fn convert(values: &[f32], out: &mut [Self]);
}

impl PooledValue for f32 {
    const SUMMED_APART: bool = false;

    fn store_bag(out: &mut [f32], _: &mut [f32], sum: impl FnOnce(&mut [f32])) {
        sum(out)
    }

    fn convert(values: &[f32], out: &mut [f32]) {
        out.copy_from_slice(values)
    }
}

/// A bf16 value (its bits): the top half of an FP32's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Bf16 {
    /// `value` rounded to bf16 as libtorch casts a tensor on a CPU (ATen's
    /// vectorised `cvtfp32_bf16`, for AVX2 and AVX-512 alike): nearest,
    /// ties to even, every NaN `0xFFFF` (c10's scalar conversion gives
    /// `0x7FC0`; a tensor's cast, tested, writes `0xFFFF`).
    pub fn from_f32(value: f32) -> Self {
        let bits = value.to_bits();
        let rounding = ((bits >> 16) & 1) + 0x7FFF;
        let rounded = (bits.wrapping_add(rounding) >> 16) as u16;
        // A select, not a branch: the loops over values vectorise.
        Self(if value.is_nan() { 0xFFFF } else { rounded })
    }

    /// The FP32 value it is (exact).
    pub fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
}

impl PooledValue for Bf16 {
    const SUMMED_APART: bool = true;

    fn store_bag(out: &mut [Bf16], acc: &mut [f32], sum: impl FnOnce(&mut [f32])) {
        sum(acc);
        Self::convert(acc, out);
    }

    fn convert(values: &[f32], out: &mut [Bf16]) {
        let n = values.len().min(out.len());
        // How many the vector path rounded; the rest, one at a time.
        #[cfg(target_arch = "x86_64")]
        let done = if is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked); both slices hold `n`
            // values.
            unsafe { avx2::round(&values[..n], &mut out[..n]) }
        } else {
            0
        };
        #[cfg(not(target_arch = "x86_64"))]
        let done = 0;
        let (values, out) = (&values[done..n], &mut out[done..n]);
        out.iter_mut().zip(values).for_each(|(o, &v)| *o = Bf16::from_f32(v));
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::Bf16;

    /// Eight values rounded as [`Bf16::from_f32`] rounds each, in the low
    /// 16 bits of each 32-bit lane (ATen's `cvtfp32_bf16`).
    #[target_feature(enable = "avx2")]
    fn eight(values: __m256) -> __m256i {
        let bits = _mm256_castps_si256(values);
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
        let rounded =
            _mm256_srli_epi32::<16>(_mm256_add_epi32(_mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)), bits));
        let ordered = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_ORD_Q>(values, values));
        _mm256_blendv_epi8(_mm256_set1_epi32(0xFFFF), rounded, ordered)
    }

    /// Rounds `values` into `out` sixteen at a time; returns how many (the
    /// rest, fewer than sixteen, are the caller's).
    ///
    /// # Safety
    ///
    /// The CPU has AVX2; `out.len() >= values.len()`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn round(values: &[f32], out: &mut [Bf16]) -> usize {
        let n = values.len() / 16 * 16;
        for i in (0..n).step_by(16) {
            // SAFETY: `i + 16 <= n <= values.len() <= out.len()`: the loads
            // read values `i..i + 16`, the store writes `out[i..i + 16]`
            // (Bf16 is a transparent u16: 32 bytes); none needs alignment.
            unsafe {
                let lo = eight(_mm256_loadu_ps(values.as_ptr().add(i)));
                let hi = eight(_mm256_loadu_ps(values.as_ptr().add(i + 8)));
                // Saturation never bites (each lane is at most 0xFFFF); the
                // pack interleaves 128-bit halves, the permute orders them.
                let packed = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(lo, hi));
                _mm256_storeu_si256(out.as_mut_ptr().add(i).cast(), packed);
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::{Bf16, PooledValue};

    #[test]
    fn bf16_rounds_to_nearest_with_ties_to_even_and_keeps_the_specials() {
        // Exactly representable values stay.
        for v in [0.0f32, -0.0, 1.0, -2.5, 65280.0, f32::INFINITY, f32::NEG_INFINITY] {
            assert_eq!(Bf16::from_f32(v).to_f32().to_bits(), v.to_bits(), "{v}");
        }
        // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: the even one (1).
        assert_eq!(Bf16::from_f32(1.0 + 2f32.powi(-8)).0, 0x3F80);
        // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: the even one (the latter).
        assert_eq!(Bf16::from_f32(1.0 + 3.0 * 2f32.powi(-8)).0, 0x3F82);
        // Just above a half: up.
        assert_eq!(Bf16::from_f32(f32::from_bits(0x3F80_8001)).0, 0x3F81);
        // The largest finite FP32 rounds up to infinity, as libtorch's does.
        assert_eq!(Bf16::from_f32(f32::MAX).0, 0x7F80);
        // Every NaN is the one NaN libtorch's cast writes.
        assert_eq!(Bf16::from_f32(f32::from_bits(0xFFC0_1234)).0, 0xFFFF);
        assert_eq!(Bf16::from_f32(f32::NAN).0, 0xFFFF);
        assert!(Bf16::from_f32(f32::from_bits(0x7F80_0001)).to_f32().is_nan());
        // Subnormals round like any value (no flush to zero).
        assert_eq!(Bf16::from_f32(f32::from_bits(0x0000_8000)).0, 0x0000, "a tie: to even");
        assert_eq!(Bf16::from_f32(f32::from_bits(0x0001_8000)).0, 0x0002);
    }

    #[test]
    fn a_block_rounded_at_once_holds_each_value_rounded_alone() {
        // Random bit patterns (NaNs, infinities, subnormals among them) and
        // a tail shorter than the vector path's sixteen.
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let values: Vec<f32> = (0..10_007)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                f32::from_bits((state >> 32) as u32)
            })
            .chain([f32::NAN, f32::INFINITY, -0.0, f32::from_bits(0x3F80_8000)])
            .collect();
        let mut out = vec![Bf16(0x1234); values.len()];
        Bf16::convert(&values, &mut out);
        let alone: Vec<Bf16> = values.iter().map(|&v| Bf16::from_f32(v)).collect();
        assert_eq!(out, alone);
    }

    #[test]
    fn a_bf16_bag_holds_its_fp32_sum_rounded() {
        for dim in [1, 8, 16, 64, 100] {
            let (mut out, mut acc) = (vec![Bf16(0xFFFF); dim], vec![f32::NAN; dim]);
            let values: Vec<f32> = (0..dim).map(|i| 1.0 + i as f32 / 3.0).collect();
            Bf16::store_bag(&mut out, &mut acc, |acc| acc.copy_from_slice(&values));
            let expected: Vec<Bf16> = values.iter().map(|&v| Bf16::from_f32(v)).collect();
            assert_eq!(out, expected, "dim {dim}");
        }
        let mut out = vec![0.0f32; 3];
        f32::store_bag(&mut out, &mut [], |acc| acc.copy_from_slice(&[1.5, 2.5, 3.5]));
        assert_eq!(out, [1.5, 2.5, 3.5]);
    }
}
