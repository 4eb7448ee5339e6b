//! Why a request cannot be served as sent, what to do with ids outside
//! their tables, and the weights check: shared by every check of a request
//! (its rows in `request.rs`, its request-level block in
//! `request_level.rs`).

/// What to do with an id outside `[0, num_rows)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IdPolicy {
    /// Reject the request with INVALID_ARGUMENT (default).
    #[default]
    Reject,
    /// Map the id into range, [`crate::ids::Modulo::Signed`] (`id %
    /// num_rows` as Python computes it).
    Modulo,
}

/// The part of a request at fault, whatever a protocol calls it: every
/// protocol maps these to its own wire names when it answers (see
/// `narsil::protocols::status`), so validation is written once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputField {
    /// The number of samples.
    SampleCount,
    /// The dense features.
    Dense,
    /// The ids per (sample, feature) bag.
    Lengths,
    /// The sparse ids.
    Ids,
    /// A weighted feature's ids (where a protocol sends them apart).
    WeightedIds,
    /// The weights of the weighted features' ids.
    Weights,
    /// The requested model's name.
    Model,
    /// The message as a whole (its size, its encoding).
    Message,
    /// A ranking request's request-level block as a whole.
    Request,
    /// The request-level block's dense features.
    RequestDense,
    /// The request-level block's ids per feature.
    RequestLengths,
    /// The request-level block's ids.
    RequestIds,
    /// The request-level block's weights.
    RequestWeights,
    /// A field only one protocol has, by its wire name.
    Wire(&'static str),
}

impl InputField {
    /// The name used where no protocol applies (logs, [`InvalidInput`]'s
    /// `Display`): `narsil.v1`'s wire names.
    pub fn name(self) -> &'static str {
        match self {
            Self::SampleCount => "batch_size",
            Self::Dense => "dense",
            Self::Lengths => "sparse_lengths",
            Self::Ids | Self::WeightedIds => "sparse_ids",
            Self::Weights => "sparse_weights",
            Self::Model => "model",
            Self::Message => "message",
            Self::Request => "request",
            Self::RequestDense => "request.dense",
            Self::RequestLengths => "request.sparse_lengths",
            Self::RequestIds => "request.sparse_ids",
            Self::RequestWeights => "request.sparse_weights",
            Self::Wire(name) => name,
        }
    }
}

/// A request that cannot be served as sent. `field` names the part at
/// fault; the message names the sample and feature where one applies.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {}: {message}", field.name())]
pub struct InvalidInput {
    /// The part of the request at fault.
    pub field: InputField,
    /// Human-readable explanation.
    pub message: String,
}

impl InvalidInput {
    /// The error for `field`.
    pub fn new(field: InputField, message: impl Into<String>) -> Self {
        Self { field, message: message.into() }
    }
}

/// Checks `weights` as sent (one per id of the bags `weighted` says yes to,
/// bag after bag of `lengths`; finite) and widens them to one per id (1.0
/// for the other bags' ids). `whose` names the weighted bags in the error.
pub(crate) fn widen_weights(
    weights: &mut Vec<f32>,
    lengths: &[u32],
    weighted: impl Fn(usize) -> bool,
    field: InputField,
    whose: &str,
) -> Result<(), InvalidInput> {
    let expected: u64 =
        lengths.iter().enumerate().filter(|&(bag, _)| weighted(bag)).map(|(_, &l)| u64::from(l)).sum();
    if weights.len() as u64 != expected {
        return Err(InvalidInput::new(
            field,
            format!(
                "has {} weights, but {whose} bags hold {expected} ids (one weight per id)",
                weights.len()
            ),
        ));
    }
    if let Some(pos) = weights.iter().position(|w| !w.is_finite()) {
        return Err(InvalidInput::new(
            field,
            format!("weight {pos} is {} (weights must be finite)", weights[pos]),
        ));
    }
    let mut sent = std::mem::take(weights).into_iter();
    let total = lengths.iter().map(|&l| l as usize).sum();
    let mut widened = Vec::with_capacity(total);
    for (bag, &len) in lengths.iter().enumerate() {
        if weighted(bag) {
            widened.extend(sent.by_ref().take(len as usize));
        } else {
            widened.resize(widened.len() + len as usize, 1.0);
        }
    }
    *weights = widened;
    Ok(())
}

/// Limits applied to every request, from the server's configuration.
#[derive(Debug, Clone, Copy)]
pub struct RequestLimits {
    /// Most samples one request may carry.
    pub max_samples: usize,
    /// Most ids a ranking request's request-level block may carry, all its
    /// features together (`--max-request-level-ids`).
    pub max_request_level_ids: usize,
    /// Out-of-range id handling.
    pub id_policy: IdPolicy,
}

impl RequestLimits {
    /// `--max-request-level-ids`' default: 65,536 ids (512 KiB decoded), far
    /// more than a user's bags hold, far less than what a flat-only
    /// backend's copy per candidate could bear unbounded.
    pub const DEFAULT_MAX_REQUEST_LEVEL_IDS: usize = 65_536;

    /// At most `max_samples` samples, the default bound on request-level
    /// ids, and `id_policy`.
    pub const fn new(max_samples: usize, id_policy: IdPolicy) -> Self {
        Self { max_samples, max_request_level_ids: Self::DEFAULT_MAX_REQUEST_LEVEL_IDS, id_policy }
    }
}

/// Refuses `ids` ids where the lengths (as sent, or one per bag when none
/// were) sum to `total`.
pub(crate) fn ids_match_lengths(ids: usize, total: usize, field: InputField) -> Result<(), InvalidInput> {
    if ids == total {
        return Ok(());
    }
    Err(InvalidInput::new(field, format!("has {ids} ids but the lengths sum to {total}")))
}
