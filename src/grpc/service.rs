//! `narsil.v1.Predictor`: Predict and ModelInfo over the engine.

use std::time::Instant;

use narsil_core::{InputField, InvalidInput};
use narsil_engine::EngineHandle;
use tonic::{Request, Response, Status};

use super::{convert, deadline, status};
use crate::proto;
use crate::proto::predictor_server::Predictor;

/// The native prediction service.
pub struct PredictorService {
    engine: EngineHandle,
}

impl PredictorService {
    /// A service submitting to `engine`.
    pub fn new(engine: EngineHandle) -> Self {
        Self { engine }
    }
}

#[tonic::async_trait]
impl Predictor for PredictorService {
    async fn predict(
        &self,
        request: Request<proto::PredictRequest>,
    ) -> Result<Response<proto::PredictResponse>, Status> {
        let deadline = deadline::deadline_of(&request, Instant::now());
        let mut message = request.into_inner();
        let request_id = std::mem::take(&mut message.request_id);
        if !message.model.is_empty() && message.model != self.engine.schema().name {
            let served = &self.engine.schema().name;
            let invalid = InvalidInput::new(
                InputField::Model,
                format!("unknown model {:?}; this server serves {served:?}", message.model),
            );
            return Err(status::to_status(self.engine.reject(invalid), InputField::name));
        }
        let prediction =
            self.engine.predict(convert::sample_batch(message), deadline).await.map_err(|e| {
                tracing::debug!(%request_id, error = %e, "predict failed");
                status::to_status(e, InputField::name)
            })?;
        Ok(Response::new(convert::predict_response(prediction, &self.engine.schema().outputs, request_id)))
    }

    async fn model_info(
        &self,
        _request: Request<proto::ModelInfoRequest>,
    ) -> Result<Response<proto::ModelInfoResponse>, Status> {
        Ok(Response::new(convert::model_info(self.engine.schema(), self.engine.limits().max_samples)))
    }
}
