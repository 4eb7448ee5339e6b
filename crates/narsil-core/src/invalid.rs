//! Why a request cannot be served as sent, and what to do with ids
//! outside their tables: shared by every check of a request (its rows in
//! `request.rs`, its request-level block in `request_level.rs`).

/// What to do with an id outside `[0, num_rows)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IdPolicy {
    /// Reject the request with INVALID_ARGUMENT (default).
    #[default]
    Reject,
    /// Map the id into range with `id.rem_euclid(num_rows)`.
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
