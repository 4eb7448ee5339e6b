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
//! | `ids` | INT64 or INT32 | [N] | bag after bag, sample-major |
//! | `weights` | FP32 | [M] | one per id of the weighted features (models that have them) |
//!
//! Each model output is an FP32 [B] tensor under its name (`default` for a
//! single-output DLRM), answered as `raw_output_contents`. Inputs may be
//! typed `contents` or `raw_input_contents` (little-endian, row-major).

use std::time::Instant;

use narsil_core::{InputField, InvalidInput, ModelSchema, RequestSamples};
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
use crate::wire::kserve::{DENSE, IDS, LENGTHS, WEIGHTS};
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

    fn integers(&self) -> Result<Vec<i64>, InvalidInput> {
        let width = match self.tensor.datatype.as_str() {
            "INT64" => 8,
            "INT32" => 4,
            other => return Err(self.error(format!("has datatype {other}, expected INT64 or INT32"))),
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

/// A ModelInfer request as the engine's sample-major request (shapes
/// checked here; values by `RequestSamples::validate`, as for every
/// protocol).
pub fn decode(request: &pb::ModelInferRequest, schema: &ModelSchema) -> Result<RequestSamples, InvalidInput> {
    let raw = &request.raw_input_contents;
    if !raw.is_empty() && raw.len() != request.inputs.len() {
        return Err(InvalidInput::new(
            InputField::Wire("raw_input_contents"),
            format!("has {} entries for {} inputs (one per input, or none)", raw.len(), request.inputs.len()),
        ));
    }
    let (mut dense, mut lengths, mut ids, mut weights) = (None, None, None, None);
    for (i, tensor) in request.inputs.iter().enumerate() {
        let (slot, field) = match tensor.name.as_str() {
            DENSE => (&mut dense, InputField::Dense),
            LENGTHS => (&mut lengths, InputField::Lengths),
            IDS => (&mut ids, InputField::Ids),
            WEIGHTS => (&mut weights, InputField::Weights),
            other => {
                return Err(InvalidInput::new(
                    InputField::Wire("inputs"),
                    format!(
                        "unknown input {other:?}; the model takes {DENSE}, {LENGTHS}, {IDS} and {WEIGHTS}"
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
    let Some(dense) = dense else {
        return Err(InvalidInput::new(
            InputField::Dense,
            format!("is required: FP32 [B, {}]", schema.num_dense),
        ));
    };
    let dense_shape = format!("[B, {}]", schema.num_dense);
    dense.check_rank(2, &dense_shape)?;
    if dense.tensor.shape[1] != schema.num_dense as i64 {
        return Err(dense.error(format!("has shape {:?}, expected {dense_shape}", dense.tensor.shape)));
    }
    let num_samples = usize::try_from(dense.tensor.shape[0])
        .map_err(|_| InvalidInput::new(InputField::SampleCount, format!("is {}", dense.tensor.shape[0])))?;
    let lengths = match lengths {
        None => Vec::new(),
        Some(lengths) => {
            let expected = format!("[{num_samples}, {}] (B from dense)", schema.num_sparse());
            lengths.check_rank(2, &expected)?;
            if lengths.tensor.shape != [num_samples as i64, schema.num_sparse() as i64] {
                return Err(
                    lengths.error(format!("has shape {:?}, expected {expected}", lengths.tensor.shape))
                );
            }
            let wide = lengths.integers()?;
            if let Some(i) = wide.iter().position(|&l| u32::try_from(l).is_err()) {
                let (sample, feature) = (i / schema.num_sparse(), i % schema.num_sparse());
                return Err(
                    lengths.error(format!("sample {sample} feature {feature} has length {}", wide[i]))
                );
            }
            wide.into_iter().map(|l| l as u32).collect()
        }
    };
    let ids = match ids {
        None => return Err(InvalidInput::new(InputField::Ids, "is required: INT64 [N]")),
        Some(ids) => {
            ids.check_rank(1, "[N]")?;
            ids.integers()?
        }
    };
    let weights = match weights {
        None => Vec::new(),
        Some(weights) => {
            weights.check_rank(1, "[M]")?;
            weights.floats()?
        }
    };
    Ok(RequestSamples { num_samples, dense: dense.floats()?, lengths, ids, weights, ..Default::default() })
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
}
