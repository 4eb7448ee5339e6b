//! Narsil's pure-Rust backend: TorchRec's DLRM forward in FP32 on Burn's
//! `burn-flex` CPU backend, without libtorch.
//!
//! * [`weights`]: the FP32 weights, from `weights_fp32.safetensors` (written
//!   by `models/export_dlrm.py`) or a seeded random DLRM of any shape.
//!   The tables are pooled by Narsil's embedding stage (`narsil_embedding`),
//!   the one the libtorch backend's split models use.
//! * [`model`]: dense arch, interaction and over arch as Burn tensor ops.
//! * [`factory`]: the [`narsil_core::BackendFactory`], over those weights or
//!   a split model's tables and `dense_weights`; lanes share one copy.

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod factory;
pub mod model;
pub mod weights;

pub use factory::BurnFactory;
pub use weights::{DlrmShape, DlrmWeights};
