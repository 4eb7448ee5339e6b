//! Messages over `--max-message-bytes`: tonic refuses them while decoding,
//! before any handler runs, with OUT_OF_RANGE. This layer turns that answer
//! into INVALID_ARGUMENT naming the message size and the flag, like every
//! other bad input, and counts it as invalid.

use std::sync::Arc;

use narsil_core::{InputField, InvalidInput};
use tonic::body::Body;
use tonic::codegen::http;
use tonic::{Code, Status};
use tower::util::MapResponseLayer;

use crate::lifecycle::ModelRegistry;

const TOO_LARGE: &str = "Error, decoded message length too large: found ";

/// The invalid-input error for a refusal tonic answered with `status`, if it
/// is the message-size refusal.
fn oversized(status: &Status) -> Option<InvalidInput> {
    let rest = status.message().strip_prefix(TOO_LARGE)?;
    if status.code() != Code::OutOfRange {
        return None;
    }
    let (found, rest) = rest.split_once(" bytes, the limit is: ")?;
    let limit = rest.strip_suffix(" bytes")?;
    Some(InvalidInput::new(
        InputField::Message,
        format!("{found} bytes exceeds the server's limit of {limit} bytes (--max-message-bytes)"),
    ))
}

/// Rewrites one response if it is tonic's message-size refusal.
pub fn rewrite(models: &ModelRegistry, mut response: http::Response<Body>) -> http::Response<Body> {
    let Some(invalid) = Status::from_header_map(response.headers()).as_ref().and_then(oversized) else {
        return response;
    };
    let status = crate::protocols::status::to_status(models.refuse(invalid), InputField::name);
    let headers = response.headers_mut();
    headers.remove("grpc-status");
    headers.remove("grpc-message");
    headers.remove("grpc-status-details-bin");
    if status.add_header(headers).is_err() {
        tracing::warn!("cannot rewrite a message-size refusal");
    }
    response
}

/// The layer, for `tonic::transport::Server::builder().layer(…)`.
pub fn layer(
    models: Arc<ModelRegistry>,
) -> MapResponseLayer<impl Fn(http::Response<Body>) -> http::Response<Body> + Clone> {
    MapResponseLayer::new(move |response| rewrite(&models, response))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_size_refusal_is_recognised() {
        let refusal = Status::out_of_range(
            "Error, decoded message length too large: found 70000 bytes, the limit is: 4096 bytes",
        );
        let invalid = oversized(&refusal).unwrap();
        assert_eq!(invalid.field, InputField::Message);
        assert!(
            invalid.message.starts_with("70000 bytes exceeds the server's limit of 4096 bytes"),
            "{invalid}"
        );
        assert!(oversized(&Status::out_of_range("something else")).is_none());
        assert!(oversized(&Status::internal(refusal.message())).is_none());
    }
}
