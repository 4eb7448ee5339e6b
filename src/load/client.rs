//! The connections of a run and what they send: one client per connection
//! in the run's protocol ([`Client`]), a prebuilt request in that protocol
//! ([`Message`], [`Prebuilt`]), and a call with its deadline.

use std::time::Duration;

use tonic::transport::Channel;

use super::{tls, LoadArgs, Protocol};
use crate::kserve_proto::grpc_inference_service_client::GrpcInferenceServiceClient as KServeClient;
use crate::kserve_proto::ModelInferRequest;
use crate::proto::predictor_client::PredictorClient;
use crate::proto::{PredictRequest, PredictResponse};
use crate::torchrec_proto::predictor_client::PredictorClient as TorchRecClient;
use crate::torchrec_proto::PredictionRequest;

/// One connection, in the protocol of the run.
#[derive(Clone)]
pub(super) enum Client {
    Narsil(PredictorClient<Channel>),
    TorchRec(TorchRecClient<Channel>),
    KServe(KServeClient<Channel>),
}

/// One prebuilt request, with its flat twin's scores when --compare-flat
/// fetched them.
pub(super) struct Prebuilt {
    pub(super) message: Message,
    pub(super) flat_scores: Option<Vec<f32>>,
}

/// One prebuilt request, in the protocol of the run.
pub(super) enum Message {
    Narsil(Box<PredictRequest>),
    TorchRec(Box<PredictionRequest>),
    KServe(Box<ModelInferRequest>),
}

impl Client {
    /// Sends `message`; TorchRec answers become a `PredictResponse` with
    /// the scores only (that protocol reports no server-side timings).
    pub(super) async fn call(
        &mut self,
        message: &Message,
        timeout_ms: Option<u64>,
    ) -> Result<PredictResponse, tonic::Status> {
        match (self, message) {
            (Client::Narsil(client), Message::Narsil(m)) => {
                Ok(client.predict(with_timeout(m.as_ref().clone(), timeout_ms)).await?.into_inner())
            }
            (Client::TorchRec(client), Message::TorchRec(m)) => {
                let mut response =
                    client.predict(with_timeout(m.as_ref().clone(), timeout_ms)).await?.into_inner();
                // A multi-output model's scores are counted by any output.
                let default = response.predictions.remove(crate::wire::torchrec::SCORES_KEY);
                let scores = default
                    .or_else(|| response.predictions.into_values().next())
                    .map(|v| v.data)
                    .ok_or_else(|| tonic::Status::internal("response has no predictions"))?;
                Ok(PredictResponse { scores, ..Default::default() })
            }
            (Client::KServe(client), Message::KServe(m)) => {
                let response =
                    client.model_infer(with_timeout(m.as_ref().clone(), timeout_ms)).await?.into_inner();
                let scores = crate::wire::kserve::first_scores(&response)
                    .ok_or_else(|| tonic::Status::internal("response has no outputs"))?;
                Ok(PredictResponse { scores, ..Default::default() })
            }
            _ => unreachable!("clients and messages are built for one protocol"),
        }
    }
}

impl Message {
    /// Its protobuf-encoded size: the bytes the request takes on the wire
    /// (before gRPC's 5-byte frame and HTTP/2's).
    pub(super) fn encoded_len(&self) -> usize {
        match self {
            Message::Narsil(m) => prost::Message::encoded_len(m.as_ref()),
            Message::TorchRec(m) => prost::Message::encoded_len(m.as_ref()),
            Message::KServe(m) => prost::Message::encoded_len(m.as_ref()),
        }
    }
}

/// One connection per `--connections`, each a client of the run's protocol.
pub(super) async fn connect(args: &LoadArgs) -> anyhow::Result<Vec<Client>> {
    let mut clients = Vec::with_capacity(args.connections);
    let endpoint = args.tls.endpoint(&args.addr)?.tcp_nodelay(true);
    for _ in 0..args.connections {
        let channel = endpoint
            .clone()
            .connect()
            .await
            .map_err(|e| anyhow::anyhow!("cannot connect to {}: {}", args.addr, tls::causes(&e)))?;
        clients.push(match args.protocol {
            Protocol::Narsil => Client::Narsil(
                PredictorClient::new(channel)
                    .max_decoding_message_size(usize::MAX)
                    .max_encoding_message_size(usize::MAX),
            ),
            Protocol::Torchrec => Client::TorchRec(
                TorchRecClient::new(channel)
                    .max_decoding_message_size(usize::MAX)
                    .max_encoding_message_size(usize::MAX),
            ),
            Protocol::Kserve => Client::KServe(
                KServeClient::new(channel)
                    .max_decoding_message_size(usize::MAX)
                    .max_encoding_message_size(usize::MAX),
            ),
        });
    }
    Ok(clients)
}

fn with_timeout<T>(message: T, timeout_ms: Option<u64>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(ms) = timeout_ms {
        request.set_timeout(Duration::from_millis(ms));
    }
    request
}
