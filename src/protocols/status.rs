//! The one mapping from engine errors to gRPC status codes and messages.
//! Queue limits are named by the `narsil serve` flag that sets them; the
//! request's fields by the protocol's own wire names.

use narsil_core::InputField;
use narsil_engine::EngineError;
use tonic::{Code, Status};

use crate::flags::serve_flag;

/// A protocol's wire name for each part of a request (`InputField::name` for
/// `narsil.v1`).
pub type FieldNames = fn(InputField) -> &'static str;

/// The status a client sees for an engine error, fields named by `names`.
pub fn to_status(error: EngineError, names: FieldNames) -> Status {
    let code = match &error {
        EngineError::Invalid(_) | EngineError::NeverFits(_) => Code::InvalidArgument,
        EngineError::Overloaded(_) => Code::ResourceExhausted,
        EngineError::DeadlineExceeded => Code::DeadlineExceeded,
        EngineError::NotReady | EngineError::NoServingVersion(_) | EngineError::ShuttingDown => {
            Code::Unavailable
        }
        // A fetch given up while a caller still waited: as a store that
        // did not deliver in time (the lane answers the batches whose
        // callers all left with DeadlineExceeded itself).
        EngineError::Backend(
            narsil_core::BackendError::Unavailable { .. } | narsil_core::BackendError::Abandoned { .. },
        ) => Code::Unavailable,
        EngineError::Backend(_) => Code::Internal,
    };
    let message = match &error {
        EngineError::Overloaded(full) | EngineError::NeverFits(full) => {
            format!("{error} ({})", serve_flag(full.limit.setting()))
        }
        EngineError::Invalid(invalid) => format!("invalid {}: {}", names(invalid.field), invalid.message),
        _ => error.to_string(),
    };
    Status::new(code, message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use narsil_core::InvalidInput;

    fn to_status(error: EngineError) -> Status {
        super::to_status(error, InputField::name)
    }
    use narsil_engine::{QueueFull, QueueLimit};

    #[test]
    fn each_error_has_its_code_and_keeps_its_message() {
        let invalid = EngineError::Invalid(InvalidInput::new(InputField::Dense, "bad"));
        let status = to_status(invalid.clone());
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(status.message(), "invalid dense: bad");
        let status = super::to_status(invalid, crate::protocols::torchrec::field_name);
        assert_eq!(status.message(), "invalid float_features.values: bad");
        let full = QueueFull { limit: QueueLimit::Rows, queued: 90, max: 100, needed: 20 };
        let status = to_status(EngineError::Overloaded(full));
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(
            status.message(),
            "server overloaded: queue holds 90 of at most 100 rows; request has 20 (--max-queue-rows)"
        );
        let status = to_status(EngineError::NeverFits(QueueFull { limit: QueueLimit::Bytes, ..full }));
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(status.message().starts_with("invalid message: needs 20 decoded bytes"), "{status:?}");
        assert!(status.message().ends_with("(100) (--max-queue-bytes)"), "{status:?}");
        assert_eq!(to_status(EngineError::DeadlineExceeded).code(), Code::DeadlineExceeded);
        assert_eq!(to_status(EngineError::NotReady).code(), Code::Unavailable);
        let failed = EngineError::Backend(
            narsil_core::BackendError::forward("libtorch").caused_by(std::io::Error::other("out of memory")),
        );
        let status = to_status(failed);
        assert_eq!(status.code(), Code::Internal);
        assert_eq!(status.message(), "backend error: forward failed: libtorch: out of memory");
    }
}
