//! The transport floor: a gRPC server with Narsil's tonic settings and both
//! prediction protocols that decodes each request (prost, as any server
//! must) and answers fixed zero scores without an engine or a model. What it
//! costs per request, measured by `benchmarks/engine_overhead.py`, is the
//! part of Narsil's per-request CPU and latency that belongs to tonic,
//! HTTP/2 and the kernel's loopback TCP rather than to the engine.
//!
//! With a second argument, each request first holds its handler thread for
//! that many milliseconds (a thread sleep, like the mock backend's): a model
//! run on the thread that read the request, with no hand-off, which is the
//! latency floor for Narsil with a mock of the same latency.
//!
//!     cargo run --release --example grpc_floor -- 127.0.0.1:50051 [FORWARD_MS]

use narsil::proto::predictor_server::{Predictor, PredictorServer};
use narsil::torchrec_proto as trpb;
use narsil::torchrec_proto::predictor_server::{
    Predictor as TorchRecPredictor, PredictorServer as TorchRecServer,
};
use narsil::{proto, protocols, wire};
use narsil_core::ModelSchema;
use tonic::{Request, Response, Status};

struct Floor {
    schema: ModelSchema,
    forward: std::time::Duration,
}

impl Floor {
    fn forward(&self) {
        if !self.forward.is_zero() {
            std::thread::sleep(self.forward);
        }
    }
}

#[tonic::async_trait]
impl Predictor for Floor {
    async fn predict(
        &self,
        request: Request<proto::PredictRequest>,
    ) -> Result<Response<proto::PredictResponse>, Status> {
        let samples = request.into_inner().batch_size as usize;
        self.forward();
        Ok(Response::new(proto::PredictResponse { scores: vec![0.0; samples], ..Default::default() }))
    }

    async fn model_info(
        &self,
        _request: Request<proto::ModelInfoRequest>,
    ) -> Result<Response<proto::ModelInfoResponse>, Status> {
        Ok(Response::new(protocols::convert::model_info(&self.schema, 100_000)))
    }
}

#[tonic::async_trait]
impl TorchRecPredictor for Floor {
    async fn predict(
        &self,
        request: Request<trpb::PredictionRequest>,
    ) -> Result<Response<trpb::PredictionResponse>, Status> {
        let request = request.into_inner();
        let num_dense = request.float_features.as_ref().map_or(1, |f| f.num_features.max(1) as usize);
        let samples = request.float_features.map_or(0, |f| f.values.len() / 4 / num_dense);
        self.forward();
        let scores = trpb::FloatVec { data: vec![0.0; samples] };
        let predictions = [(wire::torchrec::SCORES_KEY.to_string(), scores)].into();
        Ok(Response::new(trpb::PredictionResponse { predictions }))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr: std::net::SocketAddr =
        std::env::args().nth(1).unwrap_or_else(|| "127.0.0.1:50051".into()).parse()?;
    let forward_ms: f64 = std::env::args().nth(2).map_or(Ok(0.0), |ms| ms.parse())?;
    let forward = std::time::Duration::from_secs_f64(forward_ms / 1e3);
    let schema = ModelSchema::dlrm("floor", "cpu", 100_000);
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .add_service(PredictorServer::new(Floor { schema: schema.clone(), forward }))
        .add_service(TorchRecServer::new(Floor { schema, forward }))
        .serve_with_incoming(incoming)
        .await?;
    Ok(())
}
