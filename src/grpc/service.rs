//! `narsil.v1.Predictor`: Predict and ModelInfo over the served models.

use std::sync::Arc;
use std::time::Instant;

use narsil_core::InputField;
use tonic::{Request, Response, Status};

use super::{convert, deadline, status};
use crate::models::ModelRegistry;
use crate::proto;
use crate::proto::predictor_server::Predictor;

/// The native prediction service.
pub struct PredictorService {
    models: Arc<ModelRegistry>,
}

impl PredictorService {
    /// A service routing to `models`.
    pub fn new(models: Arc<ModelRegistry>) -> Self {
        Self { models }
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
        let live = self
            .models
            .route(&message.model, &message.model_version)
            .map_err(|e| status::to_status(e, InputField::name))?;
        let prediction =
            live.engine.predict(convert::sample_batch(message), deadline).await.map_err(|e| {
                tracing::debug!(%request_id, error = %e, "predict failed");
                status::to_status(e, InputField::name)
            })?;
        Ok(Response::new(convert::predict_response(prediction, &live.engine.schema().outputs, request_id)))
    }

    async fn model_info(
        &self,
        request: Request<proto::ModelInfoRequest>,
    ) -> Result<Response<proto::ModelInfoResponse>, Status> {
        let (status, serving) = self
            .models
            .describe(&request.into_inner().model)
            .map_err(|e| status::to_status(e, InputField::name))?;
        let mut info = match serving {
            Some(live) => convert::model_info(live.engine.schema(), live.engine.limits().max_samples),
            None => proto::ModelInfoResponse { name: status.name.clone(), ..Default::default() },
        };
        info.versions = status
            .versions
            .into_iter()
            .map(|v| proto::ModelVersionStatus {
                version: v.version,
                state: v.state.into(),
                error: v.error.unwrap_or_default(),
            })
            .collect();
        Ok(Response::new(info))
    }
}
