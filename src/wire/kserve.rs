//! The Open Inference Protocol (KServe v2) as a client speaks it: the input
//! tensor names Narsil reads, a `narsil.v1` request encoded as a ModelInfer
//! request, and the scores of an answer (for `narsil load --protocol kserve`
//! and the tests).

use super::kserve_proto as pb;
use super::kserve_proto::model_infer_request::InferInputTensor;
use super::proto::PredictRequest;

/// Input tensor names.
pub const DENSE: &str = "dense";
/// Ids per bag.
pub const LENGTHS: &str = "lengths";
/// Sparse ids.
pub const IDS: &str = "ids";
/// Weights of the weighted features' ids.
pub const WEIGHTS: &str = "weights";
/// A ranking request's request-level dense features, once: FP32 [1, num_dense].
pub const REQUEST_DENSE: &str = "request_dense";
/// Ids per request-level sparse feature, once: [1, K] or [K].
pub const REQUEST_LENGTHS: &str = "request_lengths";
/// The request-level features' ids: [1, N] or [N].
pub const REQUEST_IDS: &str = "request_ids";
/// Weights of the weighted request-level features' ids: FP32 [1, M] or [M].
pub const REQUEST_WEIGHTS: &str = "request_weights";

/// A `narsil.v1` request as a ModelInfer request with raw contents: dense
/// FP32 [B, D], lengths INT64 [B, F] (omitted when the request has none),
/// ids INT64 [N] and weights FP32 [M] when there are any. Used by
/// `narsil load --protocol kserve` and the tests.
///
/// A ranking request (one with a `request` block) is encoded in KServe's
/// grouped form: its block as `request_dense` FP32 [1, D] (when it has
/// dense values), `request_lengths` INT64 [1, K] (when it has lengths),
/// `request_ids` INT64 [1, N] and `request_weights` FP32 [1, M] (when it
/// has weights); the rows' tensors carry the candidates' features only, so
/// `dense` is [B, 0] when the dense features are request-level and
/// `lengths` [B, candidate features].
pub fn encode(request: &PredictRequest, num_dense: usize, num_sparse: usize) -> pb::ModelInferRequest {
    let b = request.batch_size as i64;
    let per_row = |values: usize, flat: usize| match (&request.request, b) {
        (None, _) => flat as i64,
        (Some(_), 0) => 0,
        (Some(_), b) => values as i64 / b,
    };
    let mut inputs = Vec::new();
    let mut raw: Vec<tonic::codegen::Bytes> = Vec::new();
    let mut add = |name: &str, datatype: &str, shape: Vec<i64>, bytes: Vec<u8>| {
        inputs.push(InferInputTensor {
            name: name.into(),
            datatype: datatype.into(),
            shape,
            ..Default::default()
        });
        raw.push(bytes.into());
    };
    let floats = |values: &[f32]| values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
    let lengths =
        |values: &[u32]| values.iter().flat_map(|&l| i64::from(l).to_le_bytes()).collect::<Vec<u8>>();
    let ids = |values: &[i64]| values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
    add(DENSE, "FP32", vec![b, per_row(request.dense.len(), num_dense)], floats(&request.dense));
    if !request.sparse_lengths.is_empty() {
        let width = per_row(request.sparse_lengths.len(), num_sparse);
        add(LENGTHS, "INT64", vec![b, width], lengths(&request.sparse_lengths));
    }
    add(IDS, "INT64", vec![request.sparse_ids.len() as i64], ids(&request.sparse_ids));
    if !request.sparse_weights.is_empty() {
        add(WEIGHTS, "FP32", vec![request.sparse_weights.len() as i64], floats(&request.sparse_weights));
    }
    if let Some(block) = &request.request {
        if !block.dense.is_empty() {
            add(REQUEST_DENSE, "FP32", vec![1, block.dense.len() as i64], floats(&block.dense));
        }
        if !block.sparse_lengths.is_empty() {
            let shape = vec![1, block.sparse_lengths.len() as i64];
            add(REQUEST_LENGTHS, "INT64", shape, lengths(&block.sparse_lengths));
        }
        add(REQUEST_IDS, "INT64", vec![1, block.sparse_ids.len() as i64], ids(&block.sparse_ids));
        if !block.sparse_weights.is_empty() {
            let shape = vec![1, block.sparse_weights.len() as i64];
            add(REQUEST_WEIGHTS, "FP32", shape, floats(&block.sparse_weights));
        }
    }
    pb::ModelInferRequest {
        model_name: request.model.clone(),
        model_version: request.model_version.clone(),
        id: request.request_id.clone(),
        inputs,
        raw_input_contents: raw,
        ..Default::default()
    }
}

/// The first output's scores of a ModelInfer answer.
pub fn first_scores(response: &pb::ModelInferResponse) -> Option<Vec<f32>> {
    super::le::f32s(response.raw_output_contents.first()?)
}
