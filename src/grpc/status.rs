//! The one mapping from engine errors to gRPC status codes.

use narsil_engine::EngineError;
use tonic::{Code, Status};

/// The status a client sees for an engine error.
pub fn to_status(error: EngineError) -> Status {
    let code = match &error {
        EngineError::Invalid(_) => Code::InvalidArgument,
        EngineError::Overloaded(_) => Code::ResourceExhausted,
        EngineError::DeadlineExceeded => Code::DeadlineExceeded,
        EngineError::NotReady | EngineError::ShuttingDown => Code::Unavailable,
        EngineError::Backend(_) => Code::Internal,
    };
    Status::new(code, error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use narsil_core::InvalidInput;

    #[test]
    fn each_error_has_its_code_and_keeps_its_message() {
        let invalid = EngineError::Invalid(InvalidInput { field: "dense", message: "bad".into() });
        let status = to_status(invalid);
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(status.message(), "invalid dense: bad");
        assert_eq!(to_status(EngineError::Overloaded("full".into())).code(), Code::ResourceExhausted);
        assert_eq!(to_status(EngineError::DeadlineExceeded).code(), Code::DeadlineExceeded);
        assert_eq!(to_status(EngineError::NotReady).code(), Code::Unavailable);
        assert_eq!(to_status(EngineError::Backend("x".into())).code(), Code::Internal);
    }
}
