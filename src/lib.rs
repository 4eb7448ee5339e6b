//! Narsil: a gRPC serving engine for recommendation models with continuous
//! batching. This crate is the front of the data path and the tooling:
//!
//! * [`cli`]: `narsil serve`, `narsil load`, `narsil bench-forward` (clap).
//! * [`grpc`]: the served protocols (`narsil.v1`, TorchRec's, KServe v2)
//!   behind one entry (`grpc::infer`), and the memory bound on messages.
//! * [`server`]: binds, starts the models, reports health, serves, drains.
//! * [`metrics_http`]: Prometheus text and model control on `--metrics-addr`.
//! * [`models`]: the model repository, versions, live reload.
//! * [`backends`]: the backend flags; builds the configured model backend.
//! * [`forward_bench`]: `narsil bench-forward`, a backend's raw forward speed.
//! * [`load`]: the load generator used by tests and benchmarks.
//! * [`shutdown`]: SIGINT/SIGTERM handling.

pub mod backends;
pub mod cli;
pub mod forward_bench;
pub mod grpc;
pub mod load;
pub mod metrics_http;
pub mod models;
pub mod server;
pub mod shutdown;

/// Generated protocol code for TorchRec's inference protocol (`predictor`).
pub mod torchrec_proto {
    tonic::include_proto!("predictor");
}

/// Generated protocol code for the Open Inference Protocol (KServe v2,
/// `inference`).
pub mod kserve_proto {
    tonic::include_proto!("inference");
}

/// Generated protocol code for `narsil.v1`.
pub mod proto {
    tonic::include_proto!("narsil.v1");

    /// Encoded descriptors of every served protocol, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/narsil_descriptor.bin"));
}
