//! `narsil.v1.Predictor`: Predict and ModelInfo over the served models.

use std::time::Instant;

use narsil_core::InputField;
use tonic::server::NamedService;
use tonic::{Request, Response, Status};

use super::infer::Infer;
use super::{convert, deadline, status, ServedProtocol};
use crate::proto;
use crate::proto::predictor_server::{Predictor, PredictorServer};

/// The native prediction service.
/// `narsil.v1`: `Predict`'s packed varint ids decode one byte to an 8-byte
/// integer.
pub const SERVED: ServedProtocol = ServedProtocol {
    service: <PredictorServer<PredictorService> as NamedService>::NAME,
    decode_expansion: &[("Predict", 8)],
};

pub struct PredictorService {
    infer: Infer,
}

impl PredictorService {
    /// A service over the entry every protocol shares.
    pub fn new(infer: Infer) -> Self {
        Self { infer }
    }
}

/// `narsil.v1`'s status for an engine error: fields by their own names.
fn to_status(error: narsil_engine::EngineError) -> Status {
    status::to_status(error, InputField::name)
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
        let (model, version) =
            (std::mem::take(&mut message.model), std::mem::take(&mut message.model_version));
        let served = self
            .infer
            .predict(Ok((&model, &version)), deadline, to_status, |_| Ok(convert::request_samples(message)))
            .await?;
        let outputs = &served.live.engine.schema().outputs;
        Ok(Response::new(convert::predict_response(served.prediction, outputs, request_id)))
    }

    async fn model_info(
        &self,
        request: Request<proto::ModelInfoRequest>,
    ) -> Result<Response<proto::ModelInfoResponse>, Status> {
        let (status, serving) =
            self.infer.models().describe(&request.into_inner().model).map_err(to_status)?;
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
