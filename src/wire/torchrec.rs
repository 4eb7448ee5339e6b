//! TorchRec's inference protocol as a client speaks it: the metadata
//! headers Narsil reads, the key scores are answered under, and a
//! `narsil.v1` request encoded as TorchRec's key-major message (for
//! `narsil load --protocol torchrec` and the tests).

use super::proto::PredictRequest;
use super::torchrec_proto as pb;

/// Response metadata naming the version of the model that computed the
/// scores (TorchRec's response message has no field for it); as request
/// metadata, the version to run (default: the highest ready one).
pub const MODEL_VERSION_HEADER: &str = "narsil-model-version";

/// Request metadata naming the model to run (default: the server's default
/// model).
pub const MODEL_HEADER: &str = "narsil-model";

/// The key TorchRec clients read scores from.
pub const SCORES_KEY: &str = narsil_core::schema::DEFAULT_OUTPUT;

/// int32 little-endian values as int64 ones, as TorchRec's Python client
/// sends ids (the tests send both widths with it).
pub fn widened(int32_bytes: &[u8]) -> Vec<u8> {
    int32_bytes
        .chunks_exact(4)
        .flat_map(|w| i64::from(i32::from_le_bytes([w[0], w[1], w[2], w[3]])).to_le_bytes())
        .collect()
}

/// The same samples as a TorchRec request: dense bytes as they are, bags
/// reordered key-major, ids as int32 (the protocol's width). Used by
/// `narsil load --protocol torchrec` and the tests.
pub fn encode(request: &PredictRequest, num_sparse: usize) -> pb::PredictionRequest {
    encode_weighted(request, num_sparse, num_sparse)
}

/// [`encode`] with the ids as int64, as TorchRec's Python client sends
/// `KeyedJaggedTensor.values()`: any 64-bit value (raw ids, raw inputs)
/// arrives whole.
pub fn encode_int64(request: &PredictRequest, num_sparse: usize) -> pb::PredictionRequest {
    let mut encoded = encode(request, num_sparse);
    // The same bags key-major, each id's 8 bytes.
    let b = request.batch_size as usize;
    let lengths: Vec<u32> = if request.sparse_lengths.is_empty() {
        vec![1; b * num_sparse]
    } else {
        request.sparse_lengths.clone()
    };
    let mut starts = Vec::with_capacity(lengths.len());
    let mut at = 0usize;
    for &len in &lengths {
        starts.push(at);
        at += len as usize;
    }
    let mut values = Vec::with_capacity(8 * at);
    for f in 0..num_sparse {
        for s in 0..b {
            let bag = s * num_sparse + f;
            for id in &request.sparse_ids[starts[bag]..starts[bag] + lengths[bag] as usize] {
                values.extend_from_slice(&id.to_le_bytes());
            }
        }
    }
    if let Some(features) = encoded.id_list_features.as_mut() {
        features.values = values.into();
    }
    encoded
}

/// [`encode`] for a model whose features from `num_unweighted` on are
/// weighted: those go in `id_score_list_features`, with their weights.
pub fn encode_weighted(
    request: &PredictRequest,
    num_unweighted: usize,
    num_sparse: usize,
) -> pb::PredictionRequest {
    let b = request.batch_size as usize;
    let lengths: Vec<u32> = if request.sparse_lengths.is_empty() {
        vec![1; b * num_sparse]
    } else {
        request.sparse_lengths.clone()
    };
    // Where each (sample-major) bag's ids, and a weighted bag's weights, start.
    let (mut id_starts, mut weight_starts) = (Vec::with_capacity(lengths.len()), vec![0; lengths.len()]);
    let (mut ids_seen, mut weights_seen) = (0usize, 0usize);
    for (bag, &len) in lengths.iter().enumerate() {
        id_starts.push(ids_seen);
        ids_seen += len as usize;
        if bag % num_sparse >= num_unweighted {
            weight_starts[bag] = weights_seen;
            weights_seen += len as usize;
        }
    }
    let group = |features: std::ops::Range<usize>, with_weights: bool| {
        let (mut key_lengths, mut key_ids, mut key_weights) = (Vec::new(), Vec::new(), Vec::new());
        for f in features.clone() {
            for s in 0..b {
                let bag = s * num_sparse + f;
                let len = lengths[bag] as usize;
                key_lengths.extend_from_slice(&(len as i32).to_le_bytes());
                for &id in &request.sparse_ids[id_starts[bag]..id_starts[bag] + len] {
                    key_ids.extend_from_slice(&(id as i32).to_le_bytes());
                }
                if with_weights {
                    for w in &request.sparse_weights[weight_starts[bag]..weight_starts[bag] + len] {
                        key_weights.extend_from_slice(&w.to_le_bytes());
                    }
                }
            }
        }
        pb::SparseFeatures {
            num_features: features.len() as i32,
            lengths: key_lengths.into(),
            values: key_ids.into(),
            weights: key_weights.into(),
        }
    };
    let num_dense = request.dense.len().checked_div(b).unwrap_or(0);
    pb::PredictionRequest {
        batch_size: b as i32,
        float_features: Some(pb::FloatFeatures {
            num_features: num_dense as i32,
            values: request.dense.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>().into(),
        }),
        id_list_features: Some(group(0..num_unweighted, false)),
        id_score_list_features: (num_unweighted < num_sparse)
            .then(|| group(num_unweighted..num_sparse, true)),
        ..Default::default()
    }
}
