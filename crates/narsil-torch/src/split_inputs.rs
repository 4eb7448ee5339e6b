//! The split lanes' inputs to the dense network, made from the stage's
//! buffers: a block lent to libtorch without a copy, the dense network's
//! precision, and each sequence's values, offsets and rows' units.

use narsil_core::BackendError;
use narsil_embedding::SequenceValues;
use tch::{Device, Tensor};

use crate::lane::torch_error;
use crate::precision::DensePrecision;

/// Each sequence's inputs to the dense network, in order: its values
/// `[positions, width]` (copied; in the network's precision), its units'
/// offsets and its rows' units (int64).
pub(crate) fn sequence_inputs(
    sequences: &[SequenceValues],
    precision: DensePrecision,
) -> Result<Vec<Tensor>, BackendError> {
    let mut inputs = Vec::with_capacity(3 * sequences.len());
    for sequence in sequences {
        let shape = [sequence.positions() as i64, sequence.width as i64];
        let values =
            Tensor::f_from_slice(&sequence.values).and_then(|t| t.f_view(shape)).map_err(torch_error)?;
        inputs.push(in_precision(values, precision)?);
        inputs.push(Tensor::f_from_slice(&sequence.offsets).map_err(torch_error)?);
        inputs.push(Tensor::f_from_slice(&sequence.row_unit).map_err(torch_error)?);
    }
    Ok(inputs)
}

/// `values` as a `[rows, cols]` FP32 CPU tensor over the same memory, lent
/// to libtorch for reading and writing.
///
/// # Safety
///
/// The tensor does not own or borrow-check `values`: the caller must drop
/// it, and every tensor that may alias it (views, shallow clones, a
/// network's output that returns its input), before the borrow of `values`
/// ends, and must not rely on what `values` holds afterwards (libtorch may
/// have written into it).
pub(crate) unsafe fn lent(values: &mut [f32], rows: usize, cols: usize) -> Result<Tensor, BackendError> {
    if values.len() != rows * cols {
        return Err(BackendError::forward(format!(
            "a [{rows}, {cols}] input block holds {} values, not {}",
            values.len(),
            rows * cols
        )));
    }
    // SAFETY: `values` holds rows * cols contiguous, initialized f32s
    // (checked above), borrowed exclusively for as long as the caller keeps
    // the tensor (this function's contract), so a write through the tensor
    // (an in-place op of the network) is a write through that exclusive
    // borrow that nothing else observes meanwhile; libtorch never frees
    // memory it did not allocate, and cannot grow it (a blob's storage is
    // not resizable).
    unsafe {
        Tensor::f_from_blob(
            values.as_mut_ptr().cast::<u8>(),
            &[rows as i64, cols as i64],
            &[cols as i64, 1],
            tch::Kind::Float,
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
