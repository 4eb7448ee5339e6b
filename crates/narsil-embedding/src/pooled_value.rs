//! What the pooled block holds: FP32 values, or bf16 ones for a dense
//! network that runs in bf16, written by the stage as each bag is pooled so
//! that no pass casts the block afterwards.
//!
//! A bag is always summed in FP32 (FBGEMM's arithmetic, [`crate::pool`]);
//! only its store differs. An FP32 block is summed in place. A bf16 one is
//! summed into an accumulator of the bag's width on the stack (L1) and
//! rounded to bf16 as libtorch's `to(torch.bfloat16)` rounds a tensor on a
//! CPU (ATen's vectorised `cvtfp32_bf16`: nearest, ties to even; every NaN
//! `0xFFFF`), so the block holds the bits a cast of the FP32 block would.

/// A value of the pooled block.
pub trait PooledValue: Copy + Default + Send + Sync + 'static {
    /// `value` in this type.
    fn from_f32(value: f32) -> Self;

    /// Stores a bag's values into `out` (its `dim` values), which `sum`
    /// writes in FP32 into the slice it is given (`out.len()` values; what
    /// the slice held before is never read).
    fn store_bag(out: &mut [Self], sum: impl FnOnce(&mut [f32]));

    /// `values` in this type into `out` (as many).
    fn convert(values: &[f32], out: &mut [Self]) {
        out.iter_mut().zip(values).for_each(|(o, &v)| *o = Self::from_f32(v));
    }
}

impl PooledValue for f32 {
    fn from_f32(value: f32) -> Self {
        value
    }

    fn store_bag(out: &mut [f32], sum: impl FnOnce(&mut [f32])) {
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
    /// ties to even, every NaN `0xFFFF` (c10's scalar conversion would give
    /// `0x7FC0`; a tensor's cast never takes it).
    pub fn from_f32(value: f32) -> Self {
        if value.is_nan() {
            return Self(0xFFFF);
        }
        let bits = value.to_bits();
        let rounding = ((bits >> 16) & 1) + 0x7FFF;
        Self((bits.wrapping_add(rounding) >> 16) as u16)
    }

    /// The FP32 value it is (exact).
    pub fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
}

/// The widest bag a bf16 block's accumulator holds on the stack; wider
/// ones take one on the heap.
const STACK_DIM: usize = 512;

impl PooledValue for Bf16 {
    fn from_f32(value: f32) -> Self {
        Bf16::from_f32(value)
    }

    fn store_bag(out: &mut [Bf16], sum: impl FnOnce(&mut [f32])) {
        let dim = out.len();
        if dim <= STACK_DIM {
            let mut acc = [0.0f32; STACK_DIM];
            sum(&mut acc[..dim]);
            Self::convert(&acc[..dim], out);
        } else {
            let mut acc = vec![0.0f32; dim];
            sum(&mut acc);
            Self::convert(&acc, out);
        }
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
    fn a_bf16_bag_holds_its_fp32_sum_rounded_at_any_width() {
        for dim in [1, 64, 512, 513, 1000] {
            let mut out = vec![Bf16(0xFFFF); dim];
            let values: Vec<f32> = (0..dim).map(|i| 1.0 + i as f32 / 3.0).collect();
            Bf16::store_bag(&mut out, |acc| acc.copy_from_slice(&values));
            let expected: Vec<Bf16> = values.iter().map(|&v| Bf16::from_f32(v)).collect();
            assert_eq!(out, expected, "dim {dim}");
        }
        let mut out = vec![0.0f32; 3];
        f32::store_bag(&mut out, |acc| acc.copy_from_slice(&[1.5, 2.5, 3.5]));
        assert_eq!(out, [1.5, 2.5, 3.5]);
    }
}
