//! The served protocols: `narsil.v1` ([`narsil_v1`]), TorchRec's
//! ([`torchrec`]) and KServe v2 ([`kserve`]). Each decodes its message into
//! the engine's request, encodes the answer, and names its fields; routing,
//! deadlines, admission and outcome counting are the one entry they all
//! call ([`infer`]). Below them, two tower layers bound what a message may
//! cost before it is decoded ([`message_limit`], [`memory_layer`]).
//!
//! [`services`] is the one table of served protocols. A new protocol is its
//! module here (decode, encode, field names, service, and its [`SERVED`
//! declaration](ServedProtocol): its service name and how much its messages
//! grow when decoded, which the memory bound reserves before reading one)
//! and its lines in that table and in [`PROTOCOLS`], plus its `.proto` and
//! its line in `build.rs`: 4 files.

pub mod convert;
pub mod deadline;
pub mod infer;
pub mod kserve;
pub mod memory_layer;
pub mod message_limit;
pub mod narsil_v1;
pub mod status;
pub mod torchrec;

use tonic::service::Routes;

use crate::kserve_proto::grpc_inference_service_server::GrpcInferenceServiceServer;
use crate::proto::predictor_server::PredictorServer;
use crate::torchrec_proto::predictor_server::PredictorServer as TorchRecPredictorServer;

/// What the server knows of a protocol besides its routes, declared by the
/// protocol itself (its module's `SERVED`).
#[derive(Debug, Clone, Copy)]
pub struct ServedProtocol {
    /// The gRPC service name (grpc.health reports the server's status under
    /// it).
    pub service: &'static str,
    /// For each method that carries requests, the most bytes its decoding
    /// takes per encoded byte of the message: the memory bound reserves that
    /// before the message is read ([`memory_layer`]). Methods not listed
    /// are held to their encoded size.
    pub decode_expansion: &'static [(&'static str, usize)],
}

/// Every served protocol, as [`services`] routes them.
pub const PROTOCOLS: [ServedProtocol; 3] = [narsil_v1::SERVED, torchrec::SERVED, kserve::SERVED];

/// Every served protocol over `infer`, messages up to `max_message_bytes`
/// each way (what else the server needs of them: [`PROTOCOLS`]).
pub fn services(infer: &infer::Infer, max_message_bytes: usize) -> Routes {
    let limit = max_message_bytes;
    Routes::default()
        .add_service(
            PredictorServer::new(narsil_v1::PredictorService::new(infer.clone()))
                .max_decoding_message_size(limit)
                .max_encoding_message_size(limit),
        )
        .add_service(
            TorchRecPredictorServer::new(torchrec::TorchRecService::new(infer.clone()))
                .max_decoding_message_size(limit)
                .max_encoding_message_size(limit),
        )
        .add_service(
            GrpcInferenceServiceServer::new(kserve::KServeService::new(infer.clone()))
                .max_decoding_message_size(limit)
                .max_encoding_message_size(limit),
        )
}
