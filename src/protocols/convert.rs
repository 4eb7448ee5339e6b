//! Conversions between the wire messages of `narsil.v1` and the engine's
//! types. Shape checks live in `RequestSamples::validate`, so every protocol
//! shares them.

use std::sync::Arc;

use narsil_core::{ModelSchema, RequestBlock, RequestSamples};
use narsil_engine::Prediction;

use crate::proto;

/// A wire request as the engine's sample-major request (not yet validated).
pub fn request_samples(request: proto::PredictRequest) -> RequestSamples {
    RequestSamples {
        num_samples: request.batch_size as usize,
        dense: request.dense,
        lengths: request.sparse_lengths,
        ids: request.sparse_ids,
        weights: request.sparse_weights,
        request: request.request.map(|block| {
            Arc::new(RequestBlock {
                dense: block.dense,
                lengths: block.sparse_lengths,
                ids: block.sparse_ids,
                weights: block.sparse_weights,
                ..Default::default()
            })
        }),
        ..Default::default()
    }
}

/// The engine's answer as a wire response: `scores` holds the first
/// output; a model with several also gets every one by name.
pub fn predict_response(
    prediction: Prediction,
    output_names: &[String],
    request_id: String,
) -> proto::PredictResponse {
    let mut outputs = prediction.outputs.into_iter();
    let scores = outputs.next().unwrap_or_default();
    let named = if output_names.len() > 1 {
        std::iter::once(scores.clone())
            .chain(outputs)
            .zip(output_names)
            .map(|(scores, name)| (name.clone(), proto::Scores { scores }))
            .collect()
    } else {
        Default::default()
    };
    proto::PredictResponse {
        scores,
        outputs: named,
        model_version: prediction.model_version.to_string(),
        request_id,
        fused_rows: prediction.fused_rows as u32,
        forwards: prediction.forwards as u32,
        fused_requests: prediction.fused_requests as u32,
        queue_time_us: prediction.queue_time.as_micros() as u64,
        compute_time_us: prediction.compute_time.as_micros() as u64,
    }
}

/// The model's schema as a wire response.
pub fn model_info(schema: &ModelSchema, max_request_samples: usize) -> proto::ModelInfoResponse {
    let mut info = proto::ModelInfoResponse {
        name: schema.name.clone(),
        version: schema.version.clone(),
        backend: schema.backend.clone(),
        device: schema.device.clone(),
        num_dense: schema.num_dense as u32,
        sparse_features: schema
            .sparse
            .iter()
            .map(|f| proto::SparseFeature {
                name: f.name.clone(),
                num_rows: f.num_rows,
                weighted: f.weighted,
                request_level: false,
                raw_ids: f.raw_ids,
                sequence: String::new(),
                raw_input: f.raw_input,
            })
            .collect(),
        max_batch_size: max_request_samples as u32,
        outputs: schema.outputs.clone(),
        versions: Vec::new(),
        dense_request_level: schema.request_level.dense,
        sequences: schema
            .sequences
            .iter()
            .map(|s| proto::SequenceFeature {
                name: s.name.clone(),
                features: s.features.iter().map(|&f| schema.sparse[f].name.clone()).collect(),
                max_len: s.max_len as u32,
                keep: s.keep.name().into(),
                request_rows: s.request_rows,
            })
            .collect(),
    };
    for sequence in &schema.sequences {
        for &f in &sequence.features {
            info.sparse_features[f].sequence.clone_from(&sequence.name);
        }
    }
    for &f in &schema.request_level.features {
        info.sparse_features[f].request_level = true;
    }
    info
}
