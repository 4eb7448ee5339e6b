//! Split models (tables apart from the dense network; models/README.md,
//! "Split models") served by libtorch: for each fused batch the lane runs
//! Narsil's embedding stage (`narsil-embedding`: per table dedup, fetch and
//! pooling with FBGEMM's arithmetic), then the dense network (TorchScript or
//! an AOTInductor package: [`crate::split::dense_network`]) on the dense features
//! and the pooled embeddings.
//!
//! In bf16 (`--dense-precision bf16`, CPUs with AVX512-BF16 or AMX-BF16)
//! the dense network's floating-point parameters are cast to bf16 at load
//! (as the single-file path does) and its two inputs as they enter it; the
//! stage pools in FP32 either way.
//!
//! The stage and its tables are shared by every lane (and the tables by
//! every model version that has the same ones). It runs on the lane, right
//! before the dense forward, on the intra-op threads' calling thread; with
//! `--stage-ahead`, on the lane's stage thread one batch ahead
//! (`lane.rs`), handing the lane the pooled block.
//!
//! Loading one and creating its lanes, CPU or CUDA, is
//! [`crate::split_factory`]'s (above this module and `device_lane`).

pub mod dense_cut;
pub mod dense_network;
pub(crate) mod inputs;
pub(crate) mod lane;
pub mod model;
