//! Narsil: a gRPC serving engine for recommendation models with continuous
//! batching. The engine itself (admission, collector, lanes, memory bound)
//! is `narsil-engine`; this crate is the front of the data path, the model
//! lifecycle and the tooling, in rooms whose imports run one way
//! (`tests/layout.rs` checks it):
//!
//! | module | job | uses |
//! |---|---|---|
//! | [`wire`] | generated protocol code, little-endian values, client-side encoders | — |
//! | [`lifecycle`] | loading backends, the model repository and its sources, versions, live reload, reaping retired versions, ids pushed to a model (checked, logged beside the model, replayed into each version that loads) | — |
//! | [`flags`] | flag names and the backend flags, shared by commands and error messages | `lifecycle` |
//! | [`protocols`] | the served protocols (`narsil.v1`, TorchRec's, KServe v2) behind one entry (`protocols::infer`), the memory bound on messages | `wire`, `lifecycle`, `flags` |
//! | [`server`] | binds, serves the protocols, health, the admin endpoint, drain | `protocols`, `lifecycle`, `wire` |
//! | [`load`] | `narsil load`: the load generator used by tests and benchmarks | `wire` |
//! | [`forward_bench`] | `narsil bench-forward`: a backend's raw forward speed | `flags`, `lifecycle`, `protocols`, `load` |
//! | [`cli`] | `narsil serve`, `narsil load`, `narsil bench-forward` (clap) | everything |

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod cli;
pub mod flags;
pub mod forward_bench;
pub mod lifecycle;
pub mod load;
pub mod protocols;
pub mod server;
pub mod wire;

pub use wire::{kserve_proto, proto, torchrec_proto};
