//! The split lanes' inputs to the dense network, made from the stage's
//! buffers: a block lent to libtorch without a copy, the dense network's
//! precision, and what follows the pooled block: each sequence's values,
//! offsets, rows' units, raw channels, units' request rows and their
//! requests' last rows' raw inputs, then the rows' raw inputs.

use narsil_core::BackendError;
use narsil_embedding::{Bf16, StageScratch};
use tch::{Device, Tensor};

use crate::lane::torch_error;
use crate::precision::DensePrecision;

/// The dense network's inputs after the pooled block, in order
/// (`docs/guide/split-models.md`), from the stage's last batch of `rows`
/// rows: for each sequence its values `[positions, width]` (copied; in the
/// network's precision), its units' offsets and its rows' units (int64),
/// its raw channels `[positions, K]` (int64, only where it has some), its
/// units' request rows (int64, only where it declares `request_rows`) and
/// their requests' last rows' raw inputs `[units, raw_width]` (int64,
/// where it declares `request_rows` and `raw_width > 0`); then the rows'
/// raw inputs `[rows, raw_width]` (int64, only where
/// `raw_width > 0`). Raw values are int64 in every precision: never cast.
pub(crate) fn unpooled_inputs(
    scratch: &StageScratch,
    raw_width: usize,
    rows: usize,
    precision: DensePrecision,
) -> Result<Vec<Tensor>, BackendError> {
    let sequences = scratch.sequences();
    let mut inputs = Vec::with_capacity(6 * sequences.len() + 1);
    let int64 = |values: &[i64], shape: &[i64]| {
        Tensor::f_from_slice(values).and_then(|t| t.f_view(shape)).map_err(torch_error)
    };
    for sequence in sequences {
        let positions = sequence.positions() as i64;
        let values = Tensor::f_from_slice(&sequence.values)
            .and_then(|t| t.f_view([positions, sequence.width as i64]))
            .map_err(torch_error)?;
        inputs.push(in_precision(values, precision)?);
        inputs.push(Tensor::f_from_slice(&sequence.offsets).map_err(torch_error)?);
        inputs.push(Tensor::f_from_slice(&sequence.row_unit).map_err(torch_error)?);
        if sequence.raw_width > 0 {
            inputs.push(int64(&sequence.raw, &[positions, sequence.raw_width as i64])?);
        }
        if sequence.request_rows {
            inputs.push(Tensor::f_from_slice(&sequence.unit_rows).map_err(torch_error)?);
            if raw_width > 0 {
                let units = sequence.unit_rows.len() as i64;
                inputs.push(int64(&sequence.unit_raw, &[units, raw_width as i64])?);
            }
        }
    }
    if raw_width > 0 {
        inputs.push(int64(scratch.row_raw(), &[rows as i64, raw_width as i64])?);
    }
    Ok(inputs)
}

/// A pooled block's element type, as libtorch names it.
///
/// # Safety
///
/// `Self` is laid out as one value of `KIND` (size, alignment, bits):
/// [`lent`] hands libtorch a slice of them as a tensor of that kind.
pub(crate) unsafe trait Lendable {
    const KIND: tch::Kind;
}

// SAFETY: an f32 is libtorch's Float.
unsafe impl Lendable for f32 {
    const KIND: tch::Kind = tch::Kind::Float;
}

// SAFETY: `Bf16` is `repr(transparent)` over the u16 of a bf16's bits,
// libtorch's BFloat16 (2 bytes, 2-aligned).
unsafe impl Lendable for Bf16 {
    const KIND: tch::Kind = tch::Kind::BFloat16;
}

/// `values` as a `[rows, cols]` CPU tensor (FP32, or bf16) over the same
/// memory, lent to libtorch for reading and writing.
///
/// # Safety
///
/// The tensor does not own or borrow-check `values`: the caller must drop
/// it, and every tensor that may alias it (views, shallow clones, a
/// network's output that returns its input), before the borrow of `values`
/// ends, and must not rely on what `values` holds afterwards (libtorch may
/// have written into it).
pub(crate) unsafe fn lent<T: Lendable>(
    values: &mut [T],
    rows: usize,
    cols: usize,
) -> Result<Tensor, BackendError> {
    if values.len() != rows * cols {
        return Err(BackendError::forward(format!(
            "a [{rows}, {cols}] input block holds {} values, not {}",
            values.len(),
            rows * cols
        )));
    }
    // SAFETY: `values` holds rows * cols contiguous, initialized values of
    // `T::KIND` (checked above; `Lendable`'s contract), borrowed
    // exclusively for as long as the caller keeps the tensor (this
    // function's contract), so a write through the tensor
    // (an in-place op of the network) is a write through that exclusive
    // borrow that nothing else observes meanwhile; libtorch never frees
    // memory it did not allocate, and cannot grow it (a blob's storage is
    // not resizable).
    unsafe {
        Tensor::f_from_blob(
            values.as_mut_ptr().cast::<u8>(),
            &[rows as i64, cols as i64],
            &[cols as i64, 1],
            T::KIND,
            Device::Cpu,
        )
    }
    .map_err(torch_error)
}

/// `input` as the dense network takes it: itself in FP32, a bf16 copy in
/// bf16.
pub(crate) fn in_precision(input: Tensor, precision: DensePrecision) -> Result<Tensor, BackendError> {
    match precision {
        DensePrecision::Fp32 | DensePrecision::Int8 => Ok(input),
        DensePrecision::Bf16 => input.f_to_kind(tch::Kind::BFloat16).map_err(torch_error),
    }
}

#[cfg(test)]
mod tests {
    use narsil_embedding::{Bf16, PooledValue};
    use tch::{Kind, Tensor};

    use super::lent;

    /// FP32 values of every kind: normal, subnormal, ties, infinities,
    /// NaNs with payloads, and a spread of random bit patterns.
    fn values() -> Vec<f32> {
        let mut bits: Vec<u32> = vec![
            0,
            0x8000_0000,
            0x3F80_8000,
            0x3F81_8000,
            0x3F80_8001,
            0x7F7F_FFFF,
            0x7F80_0000,
            0xFF80_0000,
            0x7FC0_0000,
            0xFFC0_1234,
            0x7F80_0001,
            0x0000_8000,
            0x0001_8000,
            0x0000_0001,
            0x807F_FFFF,
        ];
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        bits.extend((0..100_000).map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 32) as u32
        }));
        bits.into_iter().map(f32::from_bits).collect()
    }

    #[test]
    fn a_block_written_in_bf16_holds_the_bits_of_libtorchs_cast_of_the_fp32_block() {
        let values = values();
        let cast = Tensor::from_slice(&values).to_kind(Kind::BFloat16).view_dtype(Kind::Int16);
        let cast: Vec<i16> = Vec::try_from(&cast).unwrap();
        // As the stage rounds a bag: the vector path, then the tail.
        let mut rounded = vec![Bf16::default(); values.len()];
        Bf16::convert(&values, &mut rounded);
        let ours: Vec<i16> = rounded.iter().map(|b| b.0 as i16).collect();
        let differ = (0..values.len()).filter(|&i| cast[i] != ours[i]).count();
        assert_eq!(
            differ,
            0,
            "first: {:?}",
            (0..values.len()).find(|&i| cast[i] != ours[i]).map(|i| values[i])
        );
    }

    #[test]
    fn a_lent_bf16_block_is_a_bfloat16_tensor_over_the_same_values() {
        let mut block: Vec<Bf16> = [1.5f32, -2.0, 0.333, 7.0, 1e-3, 65280.0].map(Bf16::from_f32).to_vec();
        let expected: Vec<f32> = block.iter().map(|b| b.to_f32()).collect();
        // SAFETY: the tensor and its copy's source are dropped before `block`
        // is read again.
        let tensor = unsafe { lent(&mut block, 2, 3) }.unwrap();
        assert_eq!((tensor.kind(), tensor.size()), (Kind::BFloat16, vec![2, 3]));
        let read: Vec<f32> = Vec::try_from(&tensor.to_kind(Kind::Float).view([-1])).unwrap();
        drop(tensor);
        assert_eq!(read, expected);
    }
}
