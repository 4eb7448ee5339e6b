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

/// A `narsil.v1` request as a ModelInfer request with raw contents: dense
/// FP32 [B, D], lengths INT64 [B, F] (omitted when the request has none),
/// ids INT64 [N] and weights FP32 [M] when there are any. Used by
/// `narsil load --protocol kserve` and the tests.
pub fn encode(request: &PredictRequest, num_dense: usize, num_sparse: usize) -> pb::ModelInferRequest {
    let b = request.batch_size as i64;
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
    add(
        DENSE,
        "FP32",
        vec![b, num_dense as i64],
        request.dense.iter().flat_map(|v| v.to_le_bytes()).collect(),
    );
    if !request.sparse_lengths.is_empty() {
        let bytes = request.sparse_lengths.iter().flat_map(|&l| i64::from(l).to_le_bytes()).collect();
        add(LENGTHS, "INT64", vec![b, num_sparse as i64], bytes);
    }
    add(
        IDS,
        "INT64",
        vec![request.sparse_ids.len() as i64],
        request.sparse_ids.iter().flat_map(|v| v.to_le_bytes()).collect(),
    );
    if !request.sparse_weights.is_empty() {
        let bytes = request.sparse_weights.iter().flat_map(|v| v.to_le_bytes()).collect();
        add(WEIGHTS, "FP32", vec![request.sparse_weights.len() as i64], bytes);
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
