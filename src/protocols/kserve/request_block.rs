//! A ranking request's request-level inputs (`request_dense`,
//! `request_lengths`, `request_ids`, `request_weights`) as its block.

use std::sync::Arc;

use narsil_core::{InvalidInput, ModelSchema, RequestBlock};

use super::inputs::Inputs;
/// A ranking request's request-level inputs as its block (shapes checked
/// here; counts and values by validation).
pub(super) fn request_block(
    inputs: &Inputs,
    schema: &ModelSchema,
) -> Result<Arc<RequestBlock>, InvalidInput> {
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
