//! Pooling bags of rows: INT8 row-wise rows with FBGEMM's arithmetic, and
//! FP32 rows (`acc += weight * value`, FP32).
//!
//! A row is an fp16 scale, an fp16 bias and `dim` uint8 values (FBGEMM's
//! inference layout). Per id, FBGEMM's lookup (`EmbeddingSpMDM` for uint8)
//! folds the id's weight into the scale and the bias, then accumulates each
//! value as `acc = fma(scale, q, acc + bias)` in FP32; mean pooling then
//! multiplies by `1 / len`. Both paths here do exactly that, so they agree
//! with each other bit for bit; the AVX2 path (8 values per instruction, up
//! to 64 values in registers across a bag) is chosen at run time when the
//! CPU has AVX2, FMA and F16C.

use crate::pooled_value::PooledValue;
use crate::schema::{PoolingMode, Storage};

/// How a feature's bags are pooled.
#[derive(Debug, Clone, Copy)]
pub struct Pooling<'a> {
    /// Sum or mean.
    pub mode: PoolingMode,
    /// One weight per id, if the feature is weighted.
    pub weights: Option<&'a [f32]>,
}

/// An id that is not a row of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("id {id} is not a row of a table of {rows} rows")]
pub struct OutOfRange {
    /// The id.
    pub id: i64,
    /// The table's rows.
    pub rows: u64,
}

/// Pools one feature's bags of rows stored as `storage`: bag `b` holds
/// the next `lengths[b]` ids of `ids` (and weights), and its vector of
/// `dim` values is written to `out[b * stride..b * stride + dim]`, in FP32
/// or bf16 ([`PooledValue`]: summed in FP32 either way). `table` is `rows`
/// rows of `row_bytes` bytes.
#[allow(clippy::too_many_arguments)]
pub fn pool_rows<T: PooledValue>(
    storage: Storage,
    table: &[u8],
    row_bytes: usize,
    dim: usize,
    lengths: &[i32],
    ids: &[i64],
    pooling: Pooling<'_>,
    out: &mut [T],
    stride: usize,
) -> Result<(), OutOfRange> {
    let rows = (table.len() / row_bytes) as u64;
    if let Some(&id) = ids.iter().find(|&&id| id < 0 || id as u64 >= rows) {
        return Err(OutOfRange { id, rows });
    }
    assert!(storage.row_bytes(dim) <= row_bytes, "a row holds its values");
    let kernel: Kernel = match storage {
        Storage::Int8Rowwise => kernel(),
        Storage::Fp32 => accumulate_fp32,
    };
    // A bag summed apart from the block (bf16) is summed here: on the stack
    // for any width tables have (pool_rows runs once per re-pooled bag of
    // a laid-out table: no allocation per call).
    let (mut on_stack, mut on_heap) = ([0.0f32; ACC_ON_STACK], Vec::new());
    let acc: &mut [f32] = match (T::SUMMED_APART, dim <= ACC_ON_STACK) {
        (false, _) => &mut [],
        (true, true) => &mut on_stack[..dim],
        (true, false) => {
            on_heap.resize(dim, 0.0);
            &mut on_heap
        }
    };
    let mut start = 0;
    // Rows are read at random: ask for the rows PREFETCH_IDS ids ahead
    // while this bag's are summed, as FBGEMM's lookup does.
    let mut prefetched = 0;
    for (bag, &len) in lengths.iter().enumerate() {
        let len = len.max(0) as usize;
        let end = start + len;
        let ahead = (end + PREFETCH_IDS).min(ids.len());
        for &id in &ids[prefetched.max(start)..ahead.max(prefetched)] {
            prefetch_row(&table[id as usize * row_bytes..(id as usize + 1) * row_bytes]);
        }
        prefetched = prefetched.max(ahead);
        let bag_weights = pooling.weights.map(|w| &w[start..end]);
        T::store_bag(&mut out[bag * stride..bag * stride + dim], acc, |acc| {
            // SAFETY: every id was checked above to be a row of `table`,
            // the assert above holds that a row has room for its values
            // (`dim == acc.len()`), and `kernel()` chose a kernel this CPU
            // can run.
            unsafe { kernel(table, row_bytes, &ids[start..end], bag_weights, acc) };
            if pooling.mode == PoolingMode::Mean && len > 0 {
                let scale = 1.0 / len as f32;
                acc.iter_mut().for_each(|v| *v *= scale);
            }
        });
        start = end;
    }
    Ok(())
}

/// The widest bag summed apart on the stack (2 KiB); wider ones on the heap.
const ACC_ON_STACK: usize = 512;

/// How far ahead of the bag being pooled rows are prefetched, in ids.
const PREFETCH_IDS: usize = 16;

/// Asks the CPU to bring a row's cache lines in (a hint; no effect on
/// results).
fn prefetch_row(row: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..row.len()).step_by(64) {
        // SAFETY: a prefetch of an address inside `row` never faults and
        // changes no memory.
        unsafe {
            std::arch::x86_64::_mm_prefetch(row.as_ptr().add(line).cast(), std::arch::x86_64::_MM_HINT_T0)
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

/// Writes the sum of a bag's rows into `acc` (`dim` values, whatever they
/// held: the kernels that sum in registers never read it):
/// `kernel(table, row_bytes, ids, weights, acc)`.
///
/// # Safety
///
/// Every id is a row of `table` (`0 <= id` and `(id + 1) * row_bytes <=
/// table.len()`), and a row has room for its values (`storage.row_bytes(dim)
/// <= row_bytes` with `dim == acc.len()`). The portable kernels check both
/// anyway (they index slices); the AVX2 one relies on them.
type Kernel = unsafe fn(&[u8], usize, &[i64], Option<&[f32]>, &mut [f32]);

/// The INT8 row-wise kernel for this CPU.
fn kernel() -> Kernel {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static CHOSEN: OnceLock<Kernel> = OnceLock::new();
        // `avx2::accumulate` needs AVX2, FMA and F16C besides the bounds:
        // it is chosen only where `available()` found them.
        *CHOSEN.get_or_init(|| if avx2::available() { avx2::accumulate } else { accumulate_scalar })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        accumulate_scalar
    }
}

/// The scale and bias of a row, its weight folded in.
fn scale_bias(row: &[u8], weight: f32) -> (f32, f32) {
    let scale = f16_to_f32(u16::from_le_bytes([row[0], row[1]]));
    let bias = f16_to_f32(u16::from_le_bytes([row[2], row[3]]));
    (scale * weight, bias * weight)
}

/// The portable path.
pub fn accumulate_scalar(
    table: &[u8],
    row_bytes: usize,
    ids: &[i64],
    weights: Option<&[f32]>,
    acc: &mut [f32],
) {
    let dim = acc.len();
    acc.fill(0.0);
    for (i, &id) in ids.iter().enumerate() {
        let row = &table[id as usize * row_bytes..(id as usize + 1) * row_bytes];
        let (scale, bias) = scale_bias(row, weights.map_or(1.0, |w| w[i]));
        for (a, &q) in acc.iter_mut().zip(&row[4..4 + dim]) {
            *a = scale.mul_add(f32::from(q), *a + bias);
        }
    }
}

/// FP32 rows: the sum of `weight * value`, in FP32.
pub fn accumulate_fp32(
    table: &[u8],
    row_bytes: usize,
    ids: &[i64],
    weights: Option<&[f32]>,
    acc: &mut [f32],
) {
    let dim = acc.len();
    acc.fill(0.0);
    for (i, &id) in ids.iter().enumerate() {
        let row = &table[id as usize * row_bytes..id as usize * row_bytes + 4 * dim];
        let values = row.chunks_exact(4).map(|v| f32::from_le_bytes([v[0], v[1], v[2], v[3]]));
        match weights {
            None => acc.iter_mut().zip(values).for_each(|(a, v)| *a += v),
            Some(w) => acc.iter_mut().zip(values).for_each(|(a, v)| *a += w[i] * v),
        }
    }
}

/// IEEE half to single precision (exact).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exponent = u32::from((h >> 10) & 0x1f);
    let mantissa = u32::from(h & 0x3ff);
    let bits = match (exponent, mantissa) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: normalise.
            let shift = m.leading_zeros() - 21;
            sign | ((127 - 15 + 1 - shift) << 23) | (((m << shift) & 0x3ff) << 13)
        }
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    pub fn available() -> bool {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }

    /// Dispatches on the row width: up to 64 values (8 registers) stay in
    /// registers across the whole bag; wider or ragged rows go 8 at a time
    /// through memory, with a scalar tail.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2, FMA and F16C ([`available`]); every id is a row of
    /// `table` (`0 <= id` and `(id + 1) * row_bytes <= table.len()`); a row
    /// holds its scale and bias (4 bytes) and `acc.len()` values: `4 +
    /// acc.len() <= row_bytes`. Loads are not bounds-checked.
    pub unsafe fn accumulate(
        table: &[u8],
        row_bytes: usize,
        ids: &[i64],
        weights: Option<&[f32]>,
        acc: &mut [f32],
    ) {
        // SAFETY: this function's contract is each callee's (the CPU
        // features, ids that are rows, rows that hold `acc.len()` values),
        // and each `in_registers::<N>` is called with `acc.len() == 8 * N`.
        unsafe {
            match acc.len() {
                8 => in_registers::<1>(table, row_bytes, ids, weights, acc),
                16 => in_registers::<2>(table, row_bytes, ids, weights, acc),
                32 => in_registers::<4>(table, row_bytes, ids, weights, acc),
                64 => in_registers::<8>(table, row_bytes, ids, weights, acc),
                _ => through_memory(table, row_bytes, ids, weights, acc),
            }
        }
    }

    /// A row's scale and bias (its first 4 bytes, two fp16), the weight
    /// folded in, each in every lane.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2, FMA and F16C; `row` points at 4 readable bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale_bias(row: *const u8, weight: f32) -> (__m256, __m256) {
        // SAFETY: 4 readable bytes at `row` (the contract); unaligned read.
        let halves = _mm_cvtsi32_si128(unsafe { std::ptr::read_unaligned(row as *const i32) });
        let both = _mm_cvtph_ps(halves); // [scale, bias, 0, 0]
        let scale = _mm_cvtss_f32(both) * weight;
        let bias = _mm_cvtss_f32(_mm_shuffle_ps(both, both, 1)) * weight;
        (_mm256_set1_ps(scale), _mm256_set1_ps(bias))
    }

    /// Eight uint8 values as FP32.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2, FMA and F16C; `values` points at 8 readable bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn eight(values: *const u8) -> __m256 {
        // SAFETY: 8 readable bytes at `values` (the contract); `loadl`
        // reads exactly 8 bytes and needs no alignment.
        let loaded = unsafe { _mm_loadl_epi64(values as *const __m128i) };
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(loaded))
    }

    /// A bag of rows of `8 * N` values, summed in `N` registers.
    ///
    /// # Safety
    ///
    /// [`accumulate`]'s contract, and `acc.len() == 8 * N`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn in_registers<const N: usize>(
        table: &[u8],
        row_bytes: usize,
        ids: &[i64],
        weights: Option<&[f32]>,
        acc: &mut [f32],
    ) {
        debug_assert_eq!(acc.len(), 8 * N);
        let mut sums = [_mm256_setzero_ps(); N];
        for (i, &id) in ids.iter().enumerate() {
            let weight = weights.map_or(1.0, |w| w[i]);
            // SAFETY: `id` is a row of `table`, so the row's `row_bytes`
            // bytes are inside it; its scale and bias are its first 4
            // bytes, and group `g < N` reads bytes `4 + 8 * g ..= 11 + 8 *
            // g`, inside `4 + 8 * N == 4 + acc.len() <= row_bytes`. The CPU
            // features are this function's own.
            unsafe {
                let row = table.as_ptr().add(id as usize * row_bytes);
                let (scale, bias) = scale_bias(row, weight);
                for (g, sum) in sums.iter_mut().enumerate() {
                    *sum = _mm256_fmadd_ps(scale, eight(row.add(4 + 8 * g)), _mm256_add_ps(*sum, bias));
                }
            }
        }
        for (g, sum) in sums.iter().enumerate() {
            // SAFETY: writes `acc[8 * g..8 * g + 8]`, inside `acc` (`g < N`,
            // `acc.len() == 8 * N`); no alignment needed.
            unsafe { _mm256_storeu_ps(acc.as_mut_ptr().add(8 * g), *sum) };
        }
    }

    /// A bag of rows of any width, 8 values at a time through `acc`, then
    /// a scalar tail.
    ///
    /// # Safety
    ///
    /// [`accumulate`]'s contract.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn through_memory(
        table: &[u8],
        row_bytes: usize,
        ids: &[i64],
        weights: Option<&[f32]>,
        acc: &mut [f32],
    ) {
        let dim = acc.len();
        let whole = dim / 8 * 8;
        acc.fill(0.0);
        for (i, &id) in ids.iter().enumerate() {
            let weight = weights.map_or(1.0, |w| w[i]);
            // SAFETY: `id` is a row of `table`, so its `row_bytes >= 4 +
            // dim` bytes are inside it; the scale and bias are its first 4
            // bytes, group `g` (`g + 8 <= whole <= dim`) reads values
            // `g..g + 8` of the row and of `acc`, and the tail values
            // `whole..dim`. The CPU features are this function's own.
            unsafe {
                let row = table.as_ptr().add(id as usize * row_bytes);
                let (scale, bias) = scale_bias(row, weight);
                for g in (0..whole).step_by(8) {
                    let sum = _mm256_loadu_ps(acc.as_ptr().add(g));
                    let sum = _mm256_fmadd_ps(scale, eight(row.add(4 + g)), _mm256_add_ps(sum, bias));
                    _mm256_storeu_ps(acc.as_mut_ptr().add(g), sum);
                }
                let (scale, bias) = super::scale_bias(std::slice::from_raw_parts(row, 4), weight);
                for (j, sum) in acc.iter_mut().enumerate().take(dim).skip(whole) {
                    *sum = scale.mul_add(f32::from(*row.add(4 + j)), *sum + bias);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `rows` random rows of `dim` values in the INT8 row-wise layout.
    fn table(rows: usize, dim: usize, seed: u64) -> (Vec<u8>, usize) {
        let row_bytes = (4 + dim).div_ceil(16) * 16;
        let mut state = seed;
        let mut next = move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) as u32
        };
        let mut data = vec![0u8; rows * row_bytes];
        for row in data.chunks_mut(row_bytes) {
            // Scale in [2^-10, 2^-6), bias in (-0.1, 0.1) as fp16.
            let scale = 0x1400 + (next() % 0x1000) as u16;
            let bias = (next() % 0x2e66) as u16 | if next() % 2 == 0 { 0x8000 } else { 0 };
            row[..2].copy_from_slice(&scale.to_le_bytes());
            row[2..4].copy_from_slice(&bias.to_le_bytes());
            for q in &mut row[4..4 + dim] {
                *q = next() as u8;
            }
        }
        (data, row_bytes)
    }

    #[test]
    fn half_precision_converts_exactly() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x3555), 0.333_251_95);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24), "smallest subnormal");
        assert_eq!(f16_to_f32(0x8000), -0.0);
        assert!(f16_to_f32(0x7c00).is_infinite());
    }

    #[test]
    fn a_bag_is_the_sum_of_its_dequantized_rows_and_mean_divides_by_its_length() {
        let (data, row_bytes) = table(5, 8, 1);
        let row = |id: usize| -> Vec<f32> {
            let r = &data[id * row_bytes..];
            let (s, b) = scale_bias(r, 1.0);
            r[4..12].iter().map(|&q| f32::from(q) * s + b).collect()
        };
        let mut out = vec![f32::NAN; 3 * 8];
        let lengths = [2, 0, 1];
        let ids = [1, 3, 4];
        let sum = Pooling { mode: PoolingMode::Sum, weights: None };
        pool_rows(Storage::Int8Rowwise, &data, row_bytes, 8, &lengths, &ids, sum, &mut out, 8).unwrap();
        for j in 0..8 {
            assert!((out[j] - (row(1)[j] + row(3)[j])).abs() < 1e-5);
            assert_eq!(out[8 + j], 0.0, "an empty bag pools to zeros");
            assert!((out[16 + j] - row(4)[j]).abs() < 1e-6);
        }
        let mean = Pooling { mode: PoolingMode::Mean, weights: None };
        let mut averaged = vec![0.0; 3 * 8];
        pool_rows(Storage::Int8Rowwise, &data, row_bytes, 8, &lengths, &ids, mean, &mut averaged, 8).unwrap();
        assert!((averaged[0] - out[0] / 2.0).abs() < 1e-6);
        let error =
            pool_rows(Storage::Int8Rowwise, &data, row_bytes, 8, &[1], &[5], sum, &mut out, 8).unwrap_err();
        assert_eq!(error, OutOfRange { id: 5, rows: 5 });
    }

    #[test]
    fn an_empty_bag_pools_to_zeros_in_every_mode_and_storage_whatever_the_output_held() {
        // The kernels write a bag's result instead of adding to the output:
        // an empty bag must write its zeros too, mean pooling (which
        // divides by the length, 0) included.
        let (int8, int8_row_bytes) = table(4, 16, 7);
        let fp32: Vec<u8> = (0..4 * 16).flat_map(|v| (v as f32).to_le_bytes()).collect();
        let weights = [0.5, 2.0, 1.5];
        for (storage, data, row_bytes) in
            [(Storage::Int8Rowwise, &int8, int8_row_bytes), (Storage::Fp32, &fp32, 16 * 4)]
        {
            for mode in [PoolingMode::Sum, PoolingMode::Mean] {
                for weights in [None, Some(&weights[..])] {
                    let pooling = Pooling { mode, weights };
                    let mut out = vec![f32::NAN; 3 * 16];
                    let (lengths, ids) = ([1, 0, 2], [3i64, 0, 2]);
                    pool_rows(storage, data, row_bytes, 16, &lengths, &ids, pooling, &mut out, 16).unwrap();
                    let case = format!("{storage:?} {mode:?} weights {}", weights.is_some());
                    assert!(
                        out[16..32].iter().all(|&v| v == 0.0),
                        "{case}: the empty bag: {:?}",
                        &out[16..32]
                    );
                    assert!(out.iter().all(|v| v.is_finite()), "{case}: {out:?}");
                }
            }
        }
    }

    #[test]
    fn fp32_bags_sum_weight_and_average_their_rows() {
        let rows: [[f32; 3]; 3] = [[1.0, 2.0, 3.0], [0.5, -1.0, 4.0], [10.0, 0.0, -2.0]];
        let table: Vec<u8> = rows.iter().flatten().flat_map(|v| v.to_le_bytes()).collect();
        let (lengths, ids) = ([2, 0, 1], [0i64, 2, 1]);
        let mut out = vec![f32::NAN; 9];
        let sum = Pooling { mode: PoolingMode::Sum, weights: None };
        pool_rows(Storage::Fp32, &table, 12, 3, &lengths, &ids, sum, &mut out, 3).unwrap();
        assert_eq!(out, [11.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.5, -1.0, 4.0]);
        let weights = [2.0, 0.5, -1.0];
        let mean = Pooling { mode: PoolingMode::Mean, weights: Some(&weights) };
        pool_rows(Storage::Fp32, &table, 12, 3, &lengths, &ids, mean, &mut out, 3).unwrap();
        assert_eq!(out, [3.5, 2.0, 2.5, 0.0, 0.0, 0.0, -0.5, 1.0, -4.0]);
        let error = pool_rows(Storage::Fp32, &table, 12, 3, &[1], &[3], sum, &mut out, 3).unwrap_err();
        assert_eq!(error, OutOfRange { id: 3, rows: 3 });
    }

    #[test]
    fn the_vector_path_equals_the_scalar_path_bit_for_bit() {
        for dim in [8, 16, 32, 64, 12, 100, 128] {
            let (data, row_bytes) = table(50, dim, dim as u64);
            let ids: Vec<i64> = (0..40).map(|i| (i * 7 % 50) as i64).collect();
            let weights: Vec<f32> = (0..40).map(|i| 0.25 + i as f32 / 16.0).collect();
            for weights in [None, Some(&weights[..])] {
                // Whatever the output held before is overwritten.
                let mut scalar = vec![f32::NAN; dim];
                accumulate_scalar(&data, row_bytes, &ids, weights, &mut scalar);
                let mut chosen = vec![-7.0; dim];
                // SAFETY: every id is below the table's 50 rows, and
                // `table` sized each row for its `dim` values.
                unsafe { kernel()(&data, row_bytes, &ids, weights, &mut chosen) };
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&scalar), bits(&chosen), "dim {dim}, weighted {}", weights.is_some());
            }
        }
    }
}
