//! Little-endian values packed in protobuf `bytes` fields, as TorchRec's
//! protocol and KServe's raw contents carry them. Each reader answers `None`
//! when the bytes are not a whole number of values; the caller names the
//! field. Plain `chunks_exact` maps, which vectorize.

/// FP32 values.
pub fn f32s(bytes: &[u8]) -> Option<Vec<f32>> {
    whole(bytes, 4)
        .then(|| bytes.chunks_exact(4).map(|w| f32::from_le_bytes(w.try_into().expect("4"))).collect())
}

/// INT32 values, widened to i64.
pub fn i32s_wide(bytes: &[u8]) -> Option<Vec<i64>> {
    whole(bytes, 4).then(|| {
        bytes.chunks_exact(4).map(|w| i64::from(i32::from_le_bytes(w.try_into().expect("4")))).collect()
    })
}

/// INT64 values.
pub fn i64s(bytes: &[u8]) -> Option<Vec<i64>> {
    whole(bytes, 8)
        .then(|| bytes.chunks_exact(8).map(|w| i64::from_le_bytes(w.try_into().expect("8"))).collect())
}

fn whole(bytes: &[u8], width: usize) -> bool {
    bytes.len().is_multiple_of(width)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_and_partial_values_are_refused() {
        let floats = [1.5f32, -2.0];
        let bytes: Vec<u8> = floats.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(f32s(&bytes).unwrap(), floats);
        assert_eq!(f32s(&bytes[..7]), None);
        let narrow: Vec<u8> = [-3i32, 7].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(i32s_wide(&narrow).unwrap(), [-3, 7]);
        let wide: Vec<u8> = [-3i64, 1 << 40].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(i64s(&wide).unwrap(), [-3, 1 << 40]);
        assert_eq!(i64s(&wide[..12]), None);
    }
}
