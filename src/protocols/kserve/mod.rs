//! The Open Inference Protocol (KServe v2, `inference.GRPCInferenceService`)
//! over the served models, beside `narsil.v1` and TorchRec's protocol: its
//! requests are decoded into the same sample-major [`RequestSamples`] and
//! fuse with the other protocols' requests in one forward.
//!
//! Tensors (ModelMetadata lists them as the model takes them):
//!
//! | input | datatype | shape | |
//! |---|---|---|---|
//! | `dense` | FP32 | [B, num_dense] | required |
//! | `lengths` | INT64 or INT32 | [B, num_sparse] | ids per bag, sample-major; absent: one id per bag |
//! | `ids` | INT64, INT32 or UINT64 | [N] | bag after bag, sample-major (UINT64: raw 64-bit ids, above `i64::MAX` taken as their two's complement) |
//! | `weights` | FP32 | [M] | one per id of the weighted features (models that have them) |
//!
//! A ranking request (one user, B candidates) to a model that declares
//! request-level features sends them once, beside the candidates' rows:
//!
//! | input | datatype | shape | |
//! |---|---|---|---|
//! | `request_dense` | FP32 | [1, num_dense] or [num_dense] | when the dense features are request-level |
//! | `request_lengths` | INT64 or INT32 | [1, K] or [K] | ids per request-level feature (K of them, schema order); absent: one id each |
//! | `request_ids` | INT64, INT32 or UINT64 | [1, N] or [N] | their ids, feature after feature |
//! | `request_weights` | FP32 | [1, M] or [M] | one per id of the weighted request-level features |
//!
//! Any `request_*` input makes the request grouped: `dense`, `lengths`,
//! `ids` and `weights` then carry the candidates' features only (`lengths`
//! [B, num_sparse - K]), and when the dense features are request-level
//! `dense` is [B, 0], only giving the candidate count B (a stock
//! `tritonclient` sends zero-sized tensors), or is left out, B then being
//! `lengths`' first dimension.
//!
//! Each model output is an FP32 [B] tensor under its name (`default` for a
//! single-output DLRM), answered as `raw_output_contents`. Inputs may be
//! typed `contents` or `raw_input_contents` (little-endian, row-major).

use std::time::Instant;

use narsil_core::{InputField, InvalidInput, ModelSchema};
use tonic::server::NamedService;
use tonic::{Request, Response, Status};

use super::infer::Infer;
use super::{deadline, status, ServedProtocol};
use crate::kserve_proto as pb;
use crate::kserve_proto::grpc_inference_service_server::GrpcInferenceService;
use crate::kserve_proto::model_metadata_response::TensorMetadata;
use crate::lifecycle::registry::{VersionState, VERSION_FIELD};
use crate::lifecycle::ModelRegistry;
use crate::wire::kserve::{
    DENSE, IDS, LENGTHS, REQUEST_DENSE, REQUEST_IDS, REQUEST_LENGTHS, REQUEST_WEIGHTS, WEIGHTS,
};

mod decode;
mod inputs;
mod request_block;

pub use self::decode::decode;

/// The protocol's name for each part of a request.
pub fn field_name(field: InputField) -> &'static str {
    match field {
        InputField::SampleCount => "inputs[dense].shape",
        InputField::Dense => "inputs[dense]",
        InputField::Lengths => "inputs[lengths]",
        InputField::Ids | InputField::WeightedIds => "inputs[ids]",
        InputField::Weights => "inputs[weights]",
        InputField::Model => "model_name",
        InputField::Request => "inputs[request_*]",
        InputField::RequestDense => "inputs[request_dense]",
        InputField::RequestLengths => "inputs[request_lengths]",
        InputField::RequestIds => "inputs[request_ids]",
        InputField::RequestWeights => "inputs[request_weights]",
        InputField::Message | InputField::Wire(_) => field.name(),
    }
}

/// `inference.GRPCInferenceService` over the engine.
/// KServe v2: `ModelInfer`'s typed `int64_contents` are packed varints, one
/// byte decoding to an 8-byte integer.
pub const SERVED: ServedProtocol = ServedProtocol {
    service:
        <pb::grpc_inference_service_server::GrpcInferenceServiceServer<KServeService> as NamedService>::NAME,
    decode_expansion: &[("ModelInfer", 8)],
};

pub struct KServeService {
    infer: Infer,
}

impl KServeService {
    /// A service over the entry every protocol shares.
    pub fn new(infer: Infer) -> Self {
        Self { infer }
    }

    fn models(&self) -> &ModelRegistry {
        self.infer.models()
    }
}

/// KServe's status for an engine error: fields by the protocol's names, and
/// NOT_FOUND for a model, or a version of it, that is not served (as Triton
/// answers).
fn to_status(error: narsil_engine::EngineError) -> Status {
    match &error {
        narsil_engine::EngineError::Invalid(invalid) if not_served(invalid) => {
            Status::not_found(format!("{}: {}", field_name(invalid.field), invalid.message))
        }
        _ => status::to_status(error, field_name),
    }
}

/// Whether `invalid` names a model, or a version of one, that is not
/// served ([`ModelRegistry::find`]).
fn not_served(invalid: &InvalidInput) -> bool {
    invalid.field == InputField::Model || invalid.field == VERSION_FIELD
}

#[tonic::async_trait]
impl GrpcInferenceService for KServeService {
    async fn server_live(
        &self,
        _request: Request<pb::ServerLiveRequest>,
    ) -> Result<Response<pb::ServerLiveResponse>, Status> {
        Ok(Response::new(pb::ServerLiveResponse { live: true }))
    }

    async fn server_ready(
        &self,
        _request: Request<pb::ServerReadyRequest>,
    ) -> Result<Response<pb::ServerReadyResponse>, Status> {
        Ok(Response::new(pb::ServerReadyResponse { ready: self.models().ready() }))
    }

    async fn model_ready(
        &self,
        request: Request<pb::ModelReadyRequest>,
    ) -> Result<Response<pb::ModelReadyResponse>, Status> {
        let request = request.into_inner();
        // A version not served (still loading, failed, retired or never
        // published) is not ready, as a model with no serving version is:
        // a readiness poll waits on it rather than failing.
        let ready = match self.models().find(&request.name, &request.version) {
            Ok(live) => live.engine.is_ready(),
            Err(narsil_engine::EngineError::NoServingVersion(_)) => false,
            Err(narsil_engine::EngineError::Invalid(invalid)) if invalid.field == VERSION_FIELD => false,
            Err(error) => return Err(to_status(error)),
        };
        Ok(Response::new(pb::ModelReadyResponse { ready }))
    }

    async fn server_metadata(
        &self,
        _request: Request<pb::ServerMetadataRequest>,
    ) -> Result<Response<pb::ServerMetadataResponse>, Status> {
        Ok(Response::new(pb::ServerMetadataResponse {
            name: "narsil".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            extensions: Vec::new(),
        }))
    }

    async fn model_metadata(
        &self,
        request: Request<pb::ModelMetadataRequest>,
    ) -> Result<Response<pb::ModelMetadataResponse>, Status> {
        let request = request.into_inner();
        let live = self.models().find(&request.name, &request.version).map_err(to_status)?;
        let (status, _) = self.models().describe(&request.name).map_err(to_status)?;
        let versions = status
            .versions
            .into_iter()
            .filter(|v| v.state == VersionState::Ready.name())
            .map(|v| v.version)
            .collect();
        Ok(Response::new(metadata(live.engine.schema(), versions)))
    }

    async fn model_infer(
        &self,
        request: Request<pb::ModelInferRequest>,
    ) -> Result<Response<pb::ModelInferResponse>, Status> {
        let deadline = deadline::deadline_of(&request, Instant::now());
        let request = request.into_inner();
        let mut wanted = Vec::new();
        let served = self
            .infer
            .predict(Ok((&request.model_name, &request.model_version)), deadline, to_status, |schema| {
                wanted = requested_outputs(&request, schema)?;
                decode(&request, schema)
            })
            .await?;
        let (schema, prediction) = (served.live.engine.schema(), served.prediction);
        let rows = prediction.outputs.first().map_or(0, Vec::len) as i64;
        let mut outputs = Vec::with_capacity(wanted.len());
        let mut raw_output_contents = Vec::with_capacity(wanted.len());
        for index in wanted {
            outputs.push(pb::model_infer_response::InferOutputTensor {
                name: schema.outputs[index].clone(),
                datatype: "FP32".into(),
                shape: vec![rows],
                ..Default::default()
            });
            raw_output_contents
                .push(prediction.outputs[index].iter().flat_map(|s| s.to_le_bytes()).collect());
        }
        Ok(Response::new(pb::ModelInferResponse {
            model_name: schema.name.clone(),
            model_version: prediction.model_version.to_string(),
            id: request.id,
            outputs,
            raw_output_contents,
            ..Default::default()
        }))
    }
}

/// The model's tensors as ModelMetadata lists them.
pub fn metadata(schema: &ModelSchema, versions: Vec<String>) -> pb::ModelMetadataResponse {
    let tensor = |name: &str, datatype: &str, shape: Vec<i64>| TensorMetadata {
        name: name.into(),
        datatype: datatype.into(),
        shape,
    };
    let mut inputs = vec![
        tensor(DENSE, "FP32", vec![-1, schema.num_dense as i64]),
        tensor(LENGTHS, "INT64", vec![-1, schema.num_sparse() as i64]),
        tensor(IDS, "INT64", vec![-1]),
    ];
    if schema.num_unweighted() < schema.num_sparse() {
        inputs.push(tensor(WEIGHTS, "FP32", vec![-1]));
    }
    // A ranking request's request-level inputs, sent once (the rows then
    // carry the candidates' features only: `decode`).
    let level = &schema.request_level;
    if level.dense {
        inputs.push(tensor(REQUEST_DENSE, "FP32", vec![1, schema.num_dense as i64]));
    }
    if !level.features.is_empty() {
        inputs.push(tensor(REQUEST_LENGTHS, "INT64", vec![1, level.features.len() as i64]));
        inputs.push(tensor(REQUEST_IDS, "INT64", vec![1, -1]));
        if level.features.iter().any(|&f| schema.sparse[f].weighted) {
            inputs.push(tensor(REQUEST_WEIGHTS, "FP32", vec![1, -1]));
        }
    }
    pb::ModelMetadataResponse {
        name: schema.name.clone(),
        versions,
        platform: format!("narsil_{}", schema.backend),
        inputs,
        outputs: schema.outputs.iter().map(|o| tensor(o, "FP32", vec![-1])).collect(),
    }
}

/// Indices of the outputs asked for (all, in order, when none are named).
fn requested_outputs(
    request: &pb::ModelInferRequest,
    schema: &ModelSchema,
) -> Result<Vec<usize>, InvalidInput> {
    if request.outputs.is_empty() {
        return Ok((0..schema.num_outputs()).collect());
    }
    request
        .outputs
        .iter()
        .map(|wanted| {
            schema.outputs.iter().position(|o| *o == wanted.name).ok_or_else(|| {
                InvalidInput::new(
                    InputField::Wire("outputs"),
                    format!("no output {:?}; the model answers {:?}", wanted.name, schema.outputs),
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests;
