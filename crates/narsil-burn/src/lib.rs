//! Narsil's pure-Rust backend: TorchRec's DLRM forward in FP32 on Burn's
//! `burn-flex` CPU backend, without libtorch.
//!
//! * [`weights`]: the FP32 weights, from `weights_fp32.safetensors` (written
//!   by `models/export_dlrm.py`) or a seeded random DLRM of any shape.
//! * [`pooling`]: sum-pooled embedding bags over the key-major batch, a tight
//!   loop over each table's contiguous rows (no per-id tensor op).
//! * [`model`]: dense arch, interaction and over arch as Burn tensor ops.
//! * [`factory`]: the [`narsil_core::BackendFactory`]; lanes share one copy
//!   of the weights.

pub mod factory;
pub mod model;
pub mod pooling;
pub mod weights;

pub use factory::BurnFactory;
pub use weights::{DlrmShape, DlrmWeights};
