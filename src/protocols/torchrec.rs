//! TorchRec's inference protocol (`predictor.Predictor/Predict`) over the same
//! admission, collector and lanes as `narsil.v1`. Its requests are already
//! key-major, so they are decoded as [`SparseLayout::KeyMajor`] and merged
//! into a fused batch feature by feature, without a transpose.

use std::collections::HashMap;
use std::time::Instant;

use narsil_core::{InputField, InvalidInput, RequestSamples, SparseLayout};
use tonic::server::NamedService;
use tonic::{Request, Response, Status};

use super::deadline;
use super::infer::Infer;
use super::ServedProtocol;
use crate::torchrec_proto as pb;
use crate::torchrec_proto::predictor_server::Predictor;
use crate::wire::le;
use crate::wire::torchrec::{MODEL_HEADER, MODEL_VERSION_HEADER};

/// `predictor.Predictor` over the engine.
/// TorchRec's protocol: `Predict`'s byte fields stay slices of the message,
/// and int32 ids decode to 8 bytes (2x).
pub const SERVED: ServedProtocol = ServedProtocol {
    service: <pb::predictor_server::PredictorServer<TorchRecService> as NamedService>::NAME,
    decode_expansion: &[("Predict", 2)],
};

pub struct TorchRecService {
    infer: Infer,
}

impl TorchRecService {
    /// A service over the entry every protocol shares.
    pub fn new(infer: Infer) -> Self {
        Self { infer }
    }
}

/// A request header's text, or an error naming it when it is not text.
fn header(request: &Request<pb::PredictionRequest>, name: &'static str) -> Result<String, InvalidInput> {
    match request.metadata().get(name) {
        None => Ok(String::new()),
        Some(value) => value
            .to_str()
            .map(str::to_owned)
            .map_err(|_| InvalidInput::new(InputField::Wire(name), "is not printable ASCII")),
    }
}

#[tonic::async_trait]
impl Predictor for TorchRecService {
    async fn predict(
        &self,
        request: Request<pb::PredictionRequest>,
    ) -> Result<Response<pb::PredictionResponse>, Status> {
        let deadline = deadline::deadline_of(&request, Instant::now());
        let target =
            header(&request, MODEL_HEADER).and_then(|m| Ok((m, header(&request, MODEL_VERSION_HEADER)?)));
        let message = request.into_inner();
        let target = match &target {
            Ok((model, version)) => Ok((model.as_str(), version.as_str())),
            Err(e) => Err(e.clone()),
        };
        let served = self
            .infer
            .predict(target, deadline, to_status, |schema| {
                decode(message, schema.num_dense, schema.num_unweighted(), schema.num_sparse())
            })
            .await?;
        let version = tonic::metadata::MetadataValue::try_from(served.prediction.model_version.as_ref()).ok();
        let predictions: HashMap<String, pb::FloatVec> = served
            .live
            .engine
            .schema()
            .outputs
            .iter()
            .cloned()
            .zip(served.prediction.outputs.into_iter().map(|data| pb::FloatVec { data }))
            .collect();
        let mut response = Response::new(pb::PredictionResponse { predictions });
        if let Some(version) = version {
            response.metadata_mut().insert(MODEL_VERSION_HEADER, version);
        }
        Ok(response)
    }
}

/// TorchRec's status for an engine error: fields by TorchRec's names.
fn to_status(error: narsil_engine::EngineError) -> Status {
    super::status::to_status(error, field_name)
}

/// TorchRec's wire name for each part of a request.
pub fn field_name(field: InputField) -> &'static str {
    match field {
        InputField::SampleCount => "batch_size",
        InputField::Dense => "float_features.values",
        InputField::Lengths => "id_list_features.lengths",
        InputField::Ids => "id_list_features.values",
        InputField::WeightedIds => "id_score_list_features.values",
        InputField::Weights => "id_score_list_features.weights",
        // TorchRec's protocol is flat: it has no request-level block.
        InputField::Model
        | InputField::Message
        | InputField::Wire(_)
        | InputField::Request
        | InputField::RequestDense
        | InputField::RequestLengths
        | InputField::RequestIds
        | InputField::RequestWeights => field.name(),
    }
}

/// Little-endian f32 values of a bytes field, or an error naming it when its
/// length is not a whole number of them.
fn floats(bytes: &[u8], field: InputField) -> Result<Vec<f32>, InvalidInput> {
    le::f32s(bytes).ok_or_else(|| {
        InvalidInput::new(field, format!("has {} bytes, not a whole number of 4-byte values", bytes.len()))
    })
}

/// A TorchRec integer field holding `count` values, as int32 or int64.
///
/// TorchRec's C++ server reads lengths and ids as int32, but TorchRec's own
/// Python client sends `KeyedJaggedTensor.values()` as int64 bytes (and
/// either width of lengths is easy to send). The width is unambiguous: the
/// field must hold exactly `count` values (samples x features for lengths,
/// the lengths' sum for ids), so its byte count is `4 * count` or
/// `8 * count`, never both unless both are zero.
fn integers(bytes: &[u8], count: usize, field: InputField, what: &str) -> Result<Vec<i64>, InvalidInput> {
    let decoded = match bytes.len() {
        n if n == 4 * count => le::i32s_wide(bytes),
        n if n == 8 * count => le::i64s(bytes),
        _ => None,
    };
    decoded.ok_or_else(|| {
        let n = bytes.len();
        InvalidInput::new(
            field,
            format!(
                "has {n} bytes, but {count} {what} take {} bytes as int32 or {} as int64",
                4 * count,
                8 * count
            ),
        )
    })
}

/// Key-major lengths (see [`integers`]); a negative one, or one past u32, is
/// an error naming its sample and feature. Decoded without a check per
/// value, then scanned once.
fn lengths(
    bytes: &[u8],
    samples: usize,
    num_sparse: usize,
    field: InputField,
) -> Result<Vec<u32>, InvalidInput> {
    let wide = integers(bytes, samples * num_sparse, field, "lengths")?;
    if let Some(i) = wide.iter().position(|&l| u32::try_from(l).is_err()) {
        let (sample, feature) = (i % samples, i / samples);
        return Err(InvalidInput::new(
            field,
            format!("sample {sample} feature {feature} has length {}", wide[i]),
        ));
    }
    Ok(wide.into_iter().map(|l| l as u32).collect())
}

/// A TorchRec request as the engine's key-major batch (shapes against the
/// schema are checked later by `RequestSamples::validate`, like every
/// protocol). The model's first `num_unweighted` sparse features come in
/// `id_list_features`, the rest (weighted) in `id_score_list_features`; the
/// two groups are laid end to end, which is the schema's order.
pub fn decode(
    request: pb::PredictionRequest,
    num_dense: usize,
    num_unweighted: usize,
    num_sparse: usize,
) -> Result<RequestSamples, InvalidInput> {
    let float = request.float_features.unwrap_or_default();
    if float.num_features as usize != num_dense {
        return Err(InvalidInput::new(
            InputField::Wire("float_features.num_features"),
            format!("is {}, the model takes {num_dense} dense features", float.num_features),
        ));
    }
    let dense = floats(&float.values, InputField::Dense)?;
    // TorchRec's server derives B from the float bytes; batch_size, when
    // set, must agree.
    let derived = dense.len().checked_div(num_dense).unwrap_or(request.batch_size.max(0) as usize);
    if request.batch_size != 0 && request.batch_size as usize != derived {
        return Err(InvalidInput::new(
            InputField::SampleCount,
            format!("is {} but float_features.values holds {derived} samples", request.batch_size),
        ));
    }
    for (field, unused) in [
        ("embedding_features", request.embedding_features.is_some_and(|f| !f.values.is_empty())),
        ("unary_features", request.unary_features.is_some_and(|f| !f.values.is_empty())),
    ] {
        if unused {
            return Err(InvalidInput::new(
                InputField::Wire(field),
                "is not used by this model; send it empty",
            ));
        }
    }
    let id_list = request.id_list_features.unwrap_or_default();
    if !id_list.weights.is_empty() {
        return Err(InvalidInput::new(
            InputField::Wire("id_list_features.weights"),
            "id_list_features carry no weights; weighted features go in id_score_list_features",
        ));
    }
    let (mut lengths, mut ids) = group(&id_list, derived, num_unweighted, Group::IdList)?;
    let mut weights = Vec::new();
    let id_score_list = request.id_score_list_features.unwrap_or_default();
    let num_weighted = num_sparse - num_unweighted;
    if num_weighted > 0 || !id_score_list.values.is_empty() || id_score_list.num_features != 0 {
        let (score_lengths, score_ids) = group(&id_score_list, derived, num_weighted, Group::IdScoreList)?;
        weights = floats(&id_score_list.weights, InputField::Wire("id_score_list_features.weights"))?;
        lengths.extend(score_lengths);
        ids.extend(score_ids);
    }
    Ok(RequestSamples {
        num_samples: derived,
        dense,
        lengths,
        ids,
        weights,
        layout: SparseLayout::KeyMajor,
        request: None,
    })
}

/// TorchRec's two groups of sparse features.
#[derive(Clone, Copy)]
enum Group {
    IdList,
    IdScoreList,
}

impl Group {
    /// The fields of the group: (num_features, lengths, values).
    fn fields(self) -> (InputField, InputField, InputField) {
        match self {
            Self::IdList => {
                (InputField::Wire("id_list_features.num_features"), InputField::Lengths, InputField::Ids)
            }
            Self::IdScoreList => (
                InputField::Wire("id_score_list_features.num_features"),
                InputField::Wire("id_score_list_features.lengths"),
                InputField::WeightedIds,
            ),
        }
    }

    fn what(self) -> &'static str {
        match self {
            Self::IdList => "unweighted",
            Self::IdScoreList => "weighted",
        }
    }
}

/// One group's key-major lengths and ids, checked against its feature
/// count.
fn group(
    features: &pb::SparseFeatures,
    samples: usize,
    count: usize,
    group: Group,
) -> Result<(Vec<u32>, Vec<i64>), InvalidInput> {
    let (count_field, lengths_field, values_field) = group.fields();
    if features.num_features as usize != count {
        return Err(InvalidInput::new(
            count_field,
            format!("is {}, the model takes {count} {} sparse features", features.num_features, group.what()),
        ));
    }
    let lengths = lengths(&features.lengths, samples, count, lengths_field)?;
    let total: u64 = lengths.iter().map(|&l| u64::from(l)).sum();
    let ids = integers(&features.values, total as usize, values_field, "ids (the sum of the lengths)")?;
    Ok((lengths, ids))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::torchrec::{encode, widened};

    fn bytes<T: Copy>(values: &[T], to: impl Fn(T) -> [u8; 4]) -> Vec<u8> {
        values.iter().flat_map(|&v| to(v)).collect()
    }

    fn request(b: i32, dense: &[f32], lengths: &[i32], ids: &[i32]) -> pb::PredictionRequest {
        pb::PredictionRequest {
            batch_size: b,
            float_features: Some(pb::FloatFeatures {
                num_features: 2,
                values: bytes(dense, f32::to_le_bytes).into(),
            }),
            id_list_features: Some(pb::SparseFeatures {
                num_features: 3,
                lengths: bytes(lengths, i32::to_le_bytes).into(),
                values: bytes(ids, i32::to_le_bytes).into(),
                weights: Default::default(),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn decodes_little_endian_key_major_and_derives_b_from_the_floats() {
        let r = request(0, &[1.0, 2.0, 3.0, 4.0], &[1, 0, 2, 1, 1, 0], &[7, 8, 9, 10, 11]);
        let batch = decode(r, 2, 3, 3).unwrap();
        assert_eq!(batch.num_samples, 2);
        assert_eq!(batch.dense, [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(batch.lengths, [1, 0, 2, 1, 1, 0]);
        assert_eq!(batch.ids, [7, 8, 9, 10, 11]);
        assert_eq!(batch.layout, SparseLayout::KeyMajor);
    }

    #[test]
    fn encode_then_decode_is_the_key_major_twin() {
        let sample_major = crate::proto::PredictRequest {
            batch_size: 2,
            dense: vec![1.0, 2.0, 3.0, 4.0],
            sparse_lengths: vec![1, 0, 2, 1, 1, 0], // s0: f0=[a] f1=[] f2=[b,c]; s1: f0=[d] f1=[e] f2=[]
            sparse_ids: vec![10, 20, 21, 30, 40],
            ..Default::default()
        };
        let batch = decode(encode(&sample_major, 3), 2, 3, 3).unwrap();
        assert_eq!(batch.lengths, [1, 1, 0, 1, 2, 0]);
        assert_eq!(batch.ids, [10, 30, 40, 20, 21]);
        assert_eq!(batch.dense, sample_major.dense);
    }

    #[test]
    fn int32_and_int64_lengths_and_ids_decode_to_the_same_batch() {
        let narrow = request(0, &[1.0, 2.0, 3.0, 4.0], &[1, 0, 2, 1, 1, 0], &[7, 8, 9, 10, 11]);
        let want = decode(narrow.clone(), 2, 3, 3).unwrap();
        for (wide_lengths, wide_ids) in [(false, true), (true, false), (true, true)] {
            let mut r = narrow.clone();
            let sparse = r.id_list_features.as_mut().unwrap();
            if wide_lengths {
                sparse.lengths = widened(&sparse.lengths).into();
            }
            if wide_ids {
                sparse.values = widened(&sparse.values).into();
            }
            assert_eq!(
                decode(r, 2, 3, 3).unwrap(),
                want,
                "int64 lengths {wide_lengths}, int64 ids {wide_ids}"
            );
        }
    }

    #[test]
    fn ids_of_neither_width_name_both() {
        let mut r = request(0, &[1.0, 2.0, 3.0, 4.0], &[1, 0, 2, 1, 1, 0], &[7, 8, 9, 10, 11]);
        let values = &mut r.id_list_features.as_mut().unwrap().values;
        *values = [values.as_ref(), &[0; 4]].concat().into();
        let err = decode(r, 2, 3, 3).unwrap_err();
        assert_eq!(field_name(err.field), "id_list_features.values");
        assert!(
            err.message.contains("has 24 bytes, but 5 ids")
                && err.message.contains("20 bytes as int32 or 40 as int64"),
            "{}",
            err.message
        );
        let mut r = request(0, &[1.0, 2.0, 3.0, 4.0], &[1, 0, 2, 1, 1, 0], &[7, 8, 9, 10, 11]);
        r.id_list_features.as_mut().unwrap().lengths.truncate(20);
        let err = decode(r, 2, 3, 3).unwrap_err();
        assert_eq!(field_name(err.field), "id_list_features.lengths");
        assert!(
            err.message.contains("has 20 bytes, but 6 lengths take 24 bytes as int32 or 48 as int64"),
            "{}",
            err.message
        );
    }

    #[test]
    fn bad_fields_are_named() {
        let cases: Vec<(pb::PredictionRequest, &str)> = vec![
            (request(3, &[1.0, 2.0, 3.0, 4.0], &[1; 6], &[0; 6]), "batch_size"),
            (request(0, &[1.0, 2.0, 3.0, 4.0], &[1, 1, 1, 1, 1, -1], &[0; 5]), "id_list_features.lengths"),
            (
                pb::PredictionRequest {
                    float_features: Some(pb::FloatFeatures { num_features: 2, values: vec![0; 7].into() }),
                    ..request(0, &[], &[], &[])
                },
                "float_features.values",
            ),
            (
                pb::PredictionRequest {
                    float_features: Some(pb::FloatFeatures { num_features: 5, values: Default::default() }),
                    ..request(0, &[], &[], &[])
                },
                "float_features.num_features",
            ),
            (
                pb::PredictionRequest {
                    unary_features: Some(pb::SparseFeatures {
                        num_features: 1,
                        values: vec![0; 4].into(),
                        ..Default::default()
                    }),
                    ..request(0, &[1.0, 2.0], &[1, 1, 1], &[0, 0, 0])
                },
                "unary_features",
            ),
        ];
        for (r, field) in cases {
            assert_eq!(field_name(decode(r, 2, 3, 3).unwrap_err().field), field);
        }
    }
}
