//! The gRPC front of the data path: decode a request, turn it into the
//! engine's types, submit it, and map the outcome to a response or a status.

pub mod codec;
pub mod convert;
pub mod deadline;
pub mod infer;
pub mod kserve;
pub mod memory_layer;
pub mod message_limit;
pub mod service;
pub mod status;
pub mod torchrec;

pub use service::PredictorService;
