//! A ModelInfer request decoded into the engine's sample-major request:
//! shapes checked here, values by validation as for every protocol.

use narsil_core::{InputField, InvalidInput, ModelSchema, RequestSamples};

use super::inputs::Inputs;
use super::request_block::request_block;
use crate::kserve_proto as pb;
use crate::wire::kserve::{DENSE, IDS, LENGTHS, REQUEST_DENSE, REQUEST_LENGTHS, WEIGHTS};
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
