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

use std::sync::Arc;
use std::time::Instant;

use narsil_core::{InputField, InvalidInput, ModelSchema, RequestBlock, RequestSamples};
use tonic::server::NamedService;
use tonic::{Request, Response, Status};

use super::infer::Infer;
use super::{deadline, status, ServedProtocol};
use crate::kserve_proto as pb;
use crate::kserve_proto::grpc_inference_service_server::GrpcInferenceService;
use crate::kserve_proto::model_infer_request::InferInputTensor;
use crate::kserve_proto::model_metadata_response::TensorMetadata;
use crate::lifecycle::registry::VersionState;
use crate::lifecycle::ModelRegistry;
use crate::wire::kserve::{
    DENSE, IDS, LENGTHS, REQUEST_DENSE, REQUEST_IDS, REQUEST_LENGTHS, REQUEST_WEIGHTS, WEIGHTS,
};
use crate::wire::le;

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
/// NOT_FOUND for a model that is not served (as Triton answers).
fn to_status(error: narsil_engine::EngineError) -> Status {
    match &error {
        narsil_engine::EngineError::Invalid(invalid) if invalid.field == InputField::Model => {
            Status::not_found(format!("{}: {}", field_name(InputField::Model), invalid.message))
        }
        _ => status::to_status(error, field_name),
    }
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
        let ready = match self.models().find(&request.name, &request.version) {
            Ok(live) => live.engine.is_ready(),
            Err(narsil_engine::EngineError::NoServingVersion(_)) => false,
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

/// One input tensor and its raw bytes, if the request sent them raw.
struct Input<'a> {
    tensor: &'a InferInputTensor,
    raw: Option<&'a [u8]>,
    field: InputField,
}

impl Input<'_> {
    fn error(&self, message: String) -> InvalidInput {
        InvalidInput::new(self.field, message)
    }

    /// The element count its shape declares.
    fn count(&self) -> Result<usize, InvalidInput> {
        self.tensor.shape.iter().try_fold(1usize, |n, &d| {
            usize::try_from(d).ok().and_then(|d| n.checked_mul(d)).ok_or_else(|| {
                self.error(format!("has shape {:?}; dimensions must be non-negative", self.tensor.shape))
            })
        })
    }

    fn check_rank(&self, rank: usize, expected: &str) -> Result<(), InvalidInput> {
        if self.tensor.shape.len() != rank {
            return Err(self.error(format!("has shape {:?}, expected {expected}", self.tensor.shape)));
        }
        Ok(())
    }

    /// The width of a request-level input, sent once: `[1, W]` or `[W]`.
    fn request_width(&self, expected: &str) -> Result<usize, InvalidInput> {
        let shape = &self.tensor.shape;
        let width = match shape.as_slice() {
            [w] | [1, w] => usize::try_from(*w).ok(),
            _ => None,
        };
        width.ok_or_else(|| {
            self.error(format!("has shape {shape:?}, expected {expected} (sent once for all candidates)"))
        })
    }

    /// Its values as bag lengths (non-negative, 32-bit); `bag` names entry
    /// `i` in an error.
    fn lengths(&self, bag: impl Fn(usize) -> String) -> Result<Vec<u32>, InvalidInput> {
        let wide = self.integers()?;
        if let Some(i) = wide.iter().position(|&l| u32::try_from(l).is_err()) {
            return Err(self.error(format!("{} has length {}", bag(i), wide[i])));
        }
        Ok(wide.into_iter().map(|l| l as u32).collect())
    }

    fn floats(&self) -> Result<Vec<f32>, InvalidInput> {
        if self.tensor.datatype != "FP32" {
            return Err(self.error(format!("has datatype {}, expected FP32", self.tensor.datatype)));
        }
        let values = match self.raw {
            Some(bytes) => le::f32s(bytes)
                .ok_or_else(|| self.error(format!("has {} raw bytes, not whole FP32 values", bytes.len())))?,
            None => self.tensor.contents.as_ref().map(|c| c.fp32_contents.clone()).unwrap_or_default(),
        };
        self.counted(values)
    }

    /// INT64, INT32 or UINT64 values, as `i64`: a UINT64 value above
    /// `i64::MAX` (a raw 64-bit id) keeps its bits, two's complement.
    fn integers(&self) -> Result<Vec<i64>, InvalidInput> {
        let width = match self.tensor.datatype.as_str() {
            "INT64" | "UINT64" => 8,
            "INT32" => 4,
            other => return Err(self.error(format!("has datatype {other}, expected INT64, INT32 or UINT64"))),
        };
        let values = match (self.raw, width) {
            (Some(bytes), _) => match width {
                8 => le::i64s(bytes),
                _ => le::i32s_wide(bytes),
            }
            .ok_or_else(|| {
                self.error(format!(
                    "has {} raw bytes, not whole {} values",
                    bytes.len(),
                    self.tensor.datatype
                ))
            })?,
            (None, 8) if self.tensor.datatype == "UINT64" => self
                .tensor
                .contents
                .as_ref()
                .map(|c| c.uint64_contents.iter().map(|&v| v as i64).collect())
                .unwrap_or_default(),
            (None, 8) => self.tensor.contents.as_ref().map(|c| c.int64_contents.clone()).unwrap_or_default(),
            (None, _) => self
                .tensor
                .contents
                .as_ref()
                .map(|c| c.int_contents.iter().map(|&v| i64::from(v)).collect())
                .unwrap_or_default(),
        };
        self.counted(values)
    }

    fn counted<T>(&self, values: Vec<T>) -> Result<Vec<T>, InvalidInput> {
        let count = self.count()?;
        if values.len() != count {
            return Err(self.error(format!(
                "has {} values for shape {:?} ({count} values)",
                values.len(),
                self.tensor.shape
            )));
        }
        Ok(values)
    }
}

/// The inputs of a ModelInfer request, by name.
#[derive(Default)]
struct Inputs<'a> {
    dense: Option<Input<'a>>,
    lengths: Option<Input<'a>>,
    ids: Option<Input<'a>>,
    weights: Option<Input<'a>>,
    request_dense: Option<Input<'a>>,
    request_lengths: Option<Input<'a>>,
    request_ids: Option<Input<'a>>,
    request_weights: Option<Input<'a>>,
}

impl<'a> Inputs<'a> {
    fn read(request: &'a pb::ModelInferRequest) -> Result<Self, InvalidInput> {
        let raw = &request.raw_input_contents;
        if !raw.is_empty() && raw.len() != request.inputs.len() {
            return Err(InvalidInput::new(
                InputField::Wire("raw_input_contents"),
                format!(
                    "has {} entries for {} inputs (one per input, or none)",
                    raw.len(),
                    request.inputs.len()
                ),
            ));
        }
        let mut inputs = Self::default();
        for (i, tensor) in request.inputs.iter().enumerate() {
            let (slot, field) = match tensor.name.as_str() {
                DENSE => (&mut inputs.dense, InputField::Dense),
                LENGTHS => (&mut inputs.lengths, InputField::Lengths),
                IDS => (&mut inputs.ids, InputField::Ids),
                WEIGHTS => (&mut inputs.weights, InputField::Weights),
                REQUEST_DENSE => (&mut inputs.request_dense, InputField::RequestDense),
                REQUEST_LENGTHS => (&mut inputs.request_lengths, InputField::RequestLengths),
                REQUEST_IDS => (&mut inputs.request_ids, InputField::RequestIds),
                REQUEST_WEIGHTS => (&mut inputs.request_weights, InputField::RequestWeights),
                other => {
                    return Err(InvalidInput::new(
                        InputField::Wire("inputs"),
                        format!(
                            "unknown input {other:?}; the model takes {DENSE}, {LENGTHS}, {IDS} and {WEIGHTS} \
                             (and, in a ranking request, {REQUEST_DENSE}, {REQUEST_LENGTHS}, {REQUEST_IDS} and \
                             {REQUEST_WEIGHTS})"
                        ),
                    ))
                }
            };
            if slot.is_some() {
                return Err(InvalidInput::new(field, "is given twice"));
            }
            if !raw.is_empty() && tensor.contents.is_some() {
                return Err(InvalidInput::new(field, "has contents although raw_input_contents is used"));
            }
            *slot = Some(Input { tensor, raw: raw.get(i).map(|b| b.as_ref()), field });
        }
        Ok(inputs)
    }

    /// Whether any request-level input is present (a ranking request).
    fn grouped(&self) -> bool {
        self.request_dense.is_some()
            || self.request_lengths.is_some()
            || self.request_ids.is_some()
            || self.request_weights.is_some()
    }
}

/// A ModelInfer request as the engine's sample-major request (shapes
/// checked here; values by `RequestSamples::validate`, as for every
/// protocol).
///
/// A ranking request sends its request-level features once, in
/// `request_dense`, `request_lengths`, `request_ids` and `request_weights`;
/// its `dense`, `lengths`, `ids` and `weights` then carry the candidates'
/// features only. The candidate count B is `dense`'s first dimension
/// (`[B, 0]` when the dense features are request-level), or, with `dense`
/// omitted there, `lengths`' first dimension.
pub fn decode(request: &pb::ModelInferRequest, schema: &ModelSchema) -> Result<RequestSamples, InvalidInput> {
    let inputs = Inputs::read(request)?;
    let grouped = inputs.grouped();
    let level = &schema.request_level;
    if grouped && !level.is_declared() {
        return Err(InvalidInput::new(
            InputField::Request,
            format!(
                "model {:?} declares no request-level feature: send every feature on every row, in {DENSE}, \
                 {LENGTHS}, {IDS} and {WEIGHTS}, without request_* inputs",
                schema.name
            ),
        ));
    }
    // What each candidate row carries.
    let dense_request_level = grouped && level.dense;
    let row_dense = if dense_request_level { 0 } else { schema.num_dense };
    let candidate: Vec<usize> = match grouped {
        true => level.candidate_features(schema),
        false => (0..schema.num_sparse()).collect(),
    };
    let lengths_shape = |b: &str| {
        if grouped {
            format!(
                "[{b}, {}] (the candidates' features; the {} request-level ones go in {REQUEST_LENGTHS})",
                candidate.len(),
                level.features.len()
            )
        } else {
            format!("[{b}, {}]", candidate.len())
        }
    };
    let num_samples = match (&inputs.dense, &inputs.lengths) {
        (Some(dense), _) => {
            let expected = if dense_request_level {
                format!(
                    "[B, 0] (the model's dense features are request-level: they go once in {REQUEST_DENSE}, \
                     and B is the candidate count)"
                )
            } else {
                format!("[B, {row_dense}]")
            };
            dense.check_rank(2, &expected)?;
            if dense.tensor.shape[1] != row_dense as i64 {
                return Err(dense.error(format!("has shape {:?}, expected {expected}", dense.tensor.shape)));
            }
            usize::try_from(dense.tensor.shape[0]).map_err(|_| {
                InvalidInput::new(InputField::SampleCount, format!("is {}", dense.tensor.shape[0]))
            })?
        }
        // A ranking request whose dense features are all request-level
        // may leave `dense` out: B from `lengths`.
        (None, Some(lengths)) if dense_request_level => {
            let expected = lengths_shape("B");
            lengths.check_rank(2, &expected)?;
            match usize::try_from(lengths.tensor.shape[0]) {
                Ok(b) if b > 0 => b,
                _ => {
                    return Err(lengths.error(format!(
                        "has shape {:?}: without {DENSE} it gives the candidate count B, which must be at least 1",
                        lengths.tensor.shape
                    )))
                }
            }
        }
        (None, _) if dense_request_level => {
            return Err(InvalidInput::new(
                InputField::Dense,
                format!(
                    "is required to give the candidate count B: FP32 [B, 0] (the dense features are \
                     request-level, in {REQUEST_DENSE}), or leave it out and send {LENGTHS} {}",
                    lengths_shape("B")
                ),
            ))
        }
        (None, _) => {
            return Err(InvalidInput::new(InputField::Dense, format!("is required: FP32 [B, {row_dense}]")))
        }
    };
    let lengths = match &inputs.lengths {
        None => Vec::new(),
        Some(lengths) => {
            let from = if inputs.dense.is_some() { format!(" (B from {DENSE})") } else { String::new() };
            let expected = format!("{}{from}", lengths_shape(&num_samples.to_string()));
            lengths.check_rank(2, &expected)?;
            if lengths.tensor.shape != [num_samples as i64, candidate.len() as i64] {
                return Err(
                    lengths.error(format!("has shape {:?}, expected {expected}", lengths.tensor.shape))
                );
            }
            lengths.lengths(|i| {
                let (sample, f) = (i / candidate.len(), candidate[i % candidate.len()]);
                if grouped {
                    format!("sample {sample} feature {f} ({})", schema.sparse[f].name)
                } else {
                    format!("sample {sample} feature {f}")
                }
            })?
        }
    };
    let ids = match &inputs.ids {
        None => return Err(InvalidInput::new(InputField::Ids, "is required: INT64 [N]")),
        Some(ids) => {
            ids.check_rank(1, "[N]")?;
            ids.integers()?
        }
    };
    let weights = match &inputs.weights {
        None => Vec::new(),
        Some(weights) => {
            weights.check_rank(1, "[M]")?;
            weights.floats()?
        }
    };
    let dense = match &inputs.dense {
        Some(dense) => dense.floats()?,
        None => Vec::new(),
    };
    let request = grouped.then(|| request_block(&inputs, schema)).transpose()?;
    Ok(RequestSamples { num_samples, dense, lengths, ids, weights, request, ..Default::default() })
}

/// A ranking request's request-level inputs as its block (shapes checked
/// here; counts and values by validation).
fn request_block(inputs: &Inputs, schema: &ModelSchema) -> Result<Arc<RequestBlock>, InvalidInput> {
    let level = &schema.request_level;
    let mut block = RequestBlock::default();
    if let Some(dense) = &inputs.request_dense {
        let expected = format!("[1, {}]", schema.num_dense);
        let width = dense.request_width(&expected)?;
        if level.dense && width != schema.num_dense {
            return Err(dense.error(format!("has shape {:?}, expected {expected}", dense.tensor.shape)));
        }
        block.dense = dense.floats()?;
    }
    if let Some(lengths) = &inputs.request_lengths {
        let k = level.features.len();
        let expected =
            format!("[1, {k}] or [{k}] (one per request-level feature: {})", level.sparse_names(schema));
        if lengths.request_width(&expected)? != k {
            return Err(lengths.error(format!("has shape {:?}, expected {expected}", lengths.tensor.shape)));
        }
        block.lengths = lengths.lengths(|k| {
            let f = level.features[k];
            format!("request-level feature {f} ({})", schema.sparse[f].name)
        })?;
    }
    if let Some(ids) = &inputs.request_ids {
        ids.request_width("[1, N] or [N]")?;
        block.ids = ids.integers()?;
    }
    if let Some(weights) = &inputs.request_weights {
        weights.request_width("[1, M] or [M]")?;
        block.weights = weights.floats()?;
    }
    Ok(Arc::new(block))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::kserve::encode;
    use pb::model_infer_request::InferInputTensor;

    fn tensor(
        name: &str,
        datatype: &str,
        shape: Vec<i64>,
        contents: pb::InferTensorContents,
    ) -> InferInputTensor {
        InferInputTensor {
            name: name.into(),
            datatype: datatype.into(),
            shape,
            contents: Some(contents),
            ..Default::default()
        }
    }

    fn request(b: usize) -> pb::ModelInferRequest {
        let schema = ModelSchema::dlrm("mock", "cpu", 100);
        pb::ModelInferRequest {
            inputs: vec![
                tensor(
                    DENSE,
                    "FP32",
                    vec![b as i64, 13],
                    pb::InferTensorContents { fp32_contents: vec![0.5; b * 13], ..Default::default() },
                ),
                tensor(
                    IDS,
                    "INT64",
                    vec![(b * schema.num_sparse()) as i64],
                    pb::InferTensorContents { int64_contents: vec![3; b * 26], ..Default::default() },
                ),
            ],
            ..Default::default()
        }
    }

    fn raw(request: &pb::ModelInferRequest) -> pb::ModelInferRequest {
        let mut raw = request.clone();
        raw.raw_input_contents = raw
            .inputs
            .iter_mut()
            .map(|t| {
                let c = t.contents.take().unwrap();
                let bytes: Vec<u8> = match t.datatype.as_str() {
                    "FP32" => c.fp32_contents.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    "INT64" => c.int64_contents.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    _ => c.int_contents.iter().flat_map(|v| v.to_le_bytes()).collect(),
                };
                bytes.into()
            })
            .collect();
        raw
    }

    #[test]
    fn encoded_narsil_requests_decode_to_the_same_samples() {
        let schema = ModelSchema::dlrm("mock", "cpu", 100);
        let narsil = crate::proto::PredictRequest {
            batch_size: 2,
            dense: (0..26).map(|i| i as f32).collect(),
            sparse_lengths: (0..52).map(|i| i % 3).collect(),
            sparse_ids: (0..52).map(|i| i64::from(i % 3 == 1) * 7).collect(),
            ..Default::default()
        };
        let samples = decode(&encode(&narsil, 13, 26), &schema).unwrap();
        assert_eq!((samples.num_samples, &samples.dense), (2, &narsil.dense));
        assert_eq!((&samples.lengths, &samples.ids), (&narsil.sparse_lengths, &narsil.sparse_ids));
    }

    #[test]
    fn typed_and_raw_contents_decode_to_the_same_samples() {
        let schema = ModelSchema::dlrm("mock", "cpu", 100);
        let typed = decode(&request(3), &schema).unwrap();
        let raw = decode(&raw(&request(3)), &schema).unwrap();
        assert_eq!(typed.num_samples, 3);
        assert_eq!((typed.dense.len(), typed.ids.len()), (39, 78));
        assert_eq!((&typed.dense, &typed.ids, &typed.lengths), (&raw.dense, &raw.ids, &raw.lengths));
        let limits = narsil_core::request::RequestLimits {
            max_samples: 10,
            id_policy: narsil_core::request::IdPolicy::Reject,
        };
        let mut typed = typed;
        typed.validate(&schema, limits).unwrap();
    }

    #[test]
    fn bad_tensors_name_the_input() {
        let schema = ModelSchema::dlrm("mock", "cpu", 100);
        let error = |edit: fn(&mut pb::ModelInferRequest)| {
            let mut r = request(2);
            edit(&mut r);
            let e = decode(&r, &schema).unwrap_err();
            format!("{}: {}", field_name(e.field), e.message)
        };
        assert_eq!(
            error(|r| r.inputs[0].shape = vec![2, 12]),
            "inputs[dense]: has shape [2, 12], expected [B, 13]"
        );
        assert_eq!(
            error(|r| r.inputs[0].datatype = "FP64".into()),
            "inputs[dense]: has datatype FP64, expected FP32"
        );
        assert!(
            error(|r| r.inputs[1].shape = vec![51]).starts_with("inputs[ids]: has 52 values for shape [51]")
        );
        assert!(error(|r| r.inputs[1].name = "idz".into()).starts_with("inputs: unknown input \"idz\""));
        assert!(error(|r| {
            r.inputs.remove(0);
        })
        .starts_with("inputs[dense]: is required"));
        assert!(error(|r| r.raw_input_contents = vec![vec![0u8; 4].into()])
            .starts_with("raw_input_contents: has 1 entries for 2"));
    }

    /// The mock DLRM with `cat_0`..`cat_12` and the dense features
    /// request-level, and a grouped `narsil.v1` request of 3 candidates to
    /// it (the user's bags 1 to 3 ids long).
    fn ranking() -> (ModelSchema, crate::proto::PredictRequest) {
        let mut schema = ModelSchema::dlrm("mock", "cpu", 100);
        let names: Vec<String> = (0..13).map(|f| format!("cat_{f}")).chain(["dense".into()]).collect();
        schema.request_level =
            narsil_core::RequestLevel::parse(names.iter().map(String::as_str), &schema).unwrap();
        let lengths: Vec<u32> = (0..13).map(|f| 1 + f % 3).collect();
        let total = lengths.iter().sum::<u32>() as i64;
        let request = crate::proto::PredictRequest {
            batch_size: 3,
            sparse_lengths: vec![1; 3 * 13],
            sparse_ids: (0..39).collect(),
            request: Some(crate::proto::RequestFeatures {
                dense: (0..13).map(|d| d as f32 / 13.0).collect(),
                sparse_lengths: lengths,
                sparse_ids: (0..total).map(|i| 99 - i).collect(),
                sparse_weights: vec![],
            }),
            ..Default::default()
        };
        (schema, request)
    }

    /// A raw-contents request with typed contents instead.
    fn typed(request: &pb::ModelInferRequest) -> pb::ModelInferRequest {
        let mut typed = request.clone();
        for (tensor, bytes) in typed.inputs.iter_mut().zip(std::mem::take(&mut typed.raw_input_contents)) {
            let mut contents = pb::InferTensorContents::default();
            match tensor.datatype.as_str() {
                "FP32" => contents.fp32_contents = le::f32s(&bytes).unwrap(),
                _ => contents.int64_contents = le::i64s(&bytes).unwrap(),
            }
            tensor.contents = Some(contents);
        }
        typed
    }

    #[test]
    fn grouped_requests_decode_as_narsil_v1s_do_raw_typed_and_without_dense() {
        let (schema, narsil) = ranking();
        let want = crate::protocols::convert::request_samples(narsil.clone());
        let encoded = encode(&narsil, 13, 26);
        let names: Vec<(&str, &[i64])> =
            encoded.inputs.iter().map(|t| (t.name.as_str(), t.shape.as_slice())).collect();
        assert_eq!(
            names,
            [
                (DENSE, &[3, 0][..]),
                (LENGTHS, &[3, 13]),
                (IDS, &[39]),
                (REQUEST_DENSE, &[1, 13]),
                (REQUEST_LENGTHS, &[1, 13]),
                (REQUEST_IDS, &[1, 25])
            ]
        );
        assert_eq!(decode(&encoded, &schema).unwrap(), want, "raw contents");
        assert_eq!(decode(&typed(&encoded), &schema).unwrap(), want, "typed contents");
        let mut without_dense = typed(&encoded);
        without_dense.inputs.remove(0);
        assert_eq!(decode(&without_dense, &schema).unwrap(), want, "B from lengths");
        // Rank-1 request-level inputs, and no request_lengths (one id each).
        let mut flat_shapes = typed(&encoded);
        for t in &mut flat_shapes.inputs[3..] {
            t.shape.remove(0);
        }
        assert_eq!(decode(&flat_shapes, &schema).unwrap(), want, "[K] and [N]");
        let limits = narsil_core::request::RequestLimits {
            max_samples: 10,
            id_policy: narsil_core::request::IdPolicy::Reject,
        };
        let mut samples = decode(&encoded, &schema).unwrap();
        samples.validate(&schema, limits).unwrap();
        assert_eq!((samples.num_samples, samples.dense.len(), samples.lengths.len()), (3, 0, 3 * 26));
        // ModelMetadata lists the request-level inputs.
        let listed: Vec<(String, Vec<i64>)> =
            metadata(&schema, vec![]).inputs.into_iter().map(|t| (t.name, t.shape)).collect();
        assert_eq!(
            &listed[3..],
            [
                (REQUEST_DENSE.into(), vec![1, 13]),
                (REQUEST_LENGTHS.into(), vec![1, 13]),
                (REQUEST_IDS.into(), vec![1, -1])
            ]
        );
        assert_eq!(metadata(&ModelSchema::dlrm("mock", "cpu", 100), vec![]).inputs.len(), 3);
    }

    #[test]
    fn bad_request_level_inputs_name_the_input() {
        let (schema, narsil) = ranking();
        let limits = narsil_core::request::RequestLimits {
            max_samples: 10,
            id_policy: narsil_core::request::IdPolicy::Reject,
        };
        let error = |schema: &ModelSchema, edit: &dyn Fn(&mut pb::ModelInferRequest)| {
            let mut r = typed(&encode(&narsil, 13, 26));
            edit(&mut r);
            let e = decode(&r, schema).and_then(|mut s| s.validate(schema, limits)).unwrap_err();
            format!("{}: {}", field_name(e.field), e.message)
        };
        fn input(r: &mut pb::ModelInferRequest, name: &str) -> usize {
            r.inputs.iter().position(|t| t.name == name).unwrap()
        }
        fn contents(r: &mut pb::ModelInferRequest, name: &str) -> pb::InferTensorContents {
            let i = input(r, name);
            r.inputs[i].contents.clone().unwrap()
        }
        type Edit = Box<dyn Fn(&mut pb::ModelInferRequest)>;
        let cases: Vec<(&str, Edit)> = vec![
            ("inputs[dense]: has shape [3, 13], expected [B, 0]", Box::new(|r| r.inputs[0].shape = vec![3, 13])),
            (
                "inputs[lengths]: has shape [3, 26], expected [3, 13] (the candidates' features",
                Box::new(|r| r.inputs[1].shape = vec![3, 26]),
            ),
            (
                "inputs[dense]: is required to give the candidate count B",
                Box::new(|r| {
                    r.inputs.drain(0..2);
                }),
            ),
            (
                "inputs[request_dense]: has shape [1, 12], expected [1, 13]",
                Box::new(|r| {
                    let i = input(r, REQUEST_DENSE);
                    r.inputs[i].shape = vec![1, 12];
                }),
            ),
            (
                "inputs[request_dense]: has shape [2, 13], expected [1, 13]",
                Box::new(|r| {
                    let i = input(r, REQUEST_DENSE);
                    r.inputs[i].shape = vec![2, 13];
                }),
            ),
            (
                "inputs[request_dense]: feature 2 is NaN",
                Box::new(|r| {
                    let mut c = contents(r, REQUEST_DENSE);
                    c.fp32_contents[2] = f32::NAN;
                    let i = input(r, REQUEST_DENSE);
                    r.inputs[i].contents = Some(c);
                }),
            ),
            (
                "inputs[request_lengths]: has shape [1, 12], expected [1, 13] or [13] (one per request-level feature: cat_0",
                Box::new(|r| {
                    let mut c = contents(r, REQUEST_LENGTHS);
                    c.int64_contents.pop();
                    let i = input(r, REQUEST_LENGTHS);
                    r.inputs[i].shape = vec![1, 12];
                    r.inputs[i].contents = Some(c);
                }),
            ),
            (
                "inputs[request_lengths]: request-level feature 1 (cat_1) has length -1",
                Box::new(|r| {
                    let mut c = contents(r, REQUEST_LENGTHS);
                    c.int64_contents[1] = -1;
                    let i = input(r, REQUEST_LENGTHS);
                    r.inputs[i].contents = Some(c);
                }),
            ),
            (
                "inputs[request_ids]: has 24 ids but",
                Box::new(|r| {
                    let mut c = contents(r, REQUEST_IDS);
                    c.int64_contents.pop();
                    let i = input(r, REQUEST_IDS);
                    r.inputs[i].shape = vec![1, 24];
                    r.inputs[i].contents = Some(c);
                }),
            ),
            (
                "inputs[request_ids]: request feature 0 (cat_0) has id 100 outside [0, 100)",
                Box::new(|r| {
                    let mut c = contents(r, REQUEST_IDS);
                    c.int64_contents[0] = 100;
                    let i = input(r, REQUEST_IDS);
                    r.inputs[i].contents = Some(c);
                }),
            ),
            (
                "inputs[request_ids]: has 25 values for shape [1, 26]",
                Box::new(|r| {
                    let i = input(r, REQUEST_IDS);
                    r.inputs[i].shape = vec![1, 26];
                }),
            ),
            (
                "inputs[request_weights]: has 1 weights, but",
                Box::new(|r| {
                    r.inputs.push(tensor(
                        REQUEST_WEIGHTS,
                        "FP32",
                        vec![1, 1],
                        pb::InferTensorContents { fp32_contents: vec![1.0], ..Default::default() },
                    ))
                }),
            ),
            (
                "inputs[request_ids]: has datatype FP32, expected INT64, INT32 or UINT64",
                Box::new(|r| {
                    let i = input(r, REQUEST_IDS);
                    r.inputs[i].datatype = "FP32".into();
                }),
            ),
        ];
        for (want, edit) in &cases {
            let got = error(&schema, edit.as_ref());
            assert!(got.starts_with(want), "want {want:?}, got {got:?}");
        }
        // A model that declares no request-level feature.
        let flat_only = ModelSchema::dlrm("mock", "cpu", 100);
        let got = error(&flat_only, &|_| {});
        assert!(
            got.starts_with("inputs[request_*]: model \"dlrm\" declares no request-level feature"),
            "{got}"
        );
    }
}
