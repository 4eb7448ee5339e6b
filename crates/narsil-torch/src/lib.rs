//! Narsil's libtorch backend: a TorchScript DLRM exported by
//! `models/export_dlrm.py`, with TorchRec's INT8 FBGEMM embedding tables, run
//! through `tch` on CPU or CUDA.
//!
//! * [`fbgemm`]: registers FBGEMM's operators in the process before a model
//!   that calls them is loaded.
//! * [`model`]: loads the TorchScript module once and reads its schema.
//! * [`script_module`]: the frozen TorchScript module behind a C++ shim.
//! * [`precision`]: `--dense-precision` and the CPU's bf16 instructions.
//! * [`roofline`]: this core's GEMM peak through the same libtorch.
//! * [`lane`]: one lane's forward: key-major batch in, scores out (pinned
//!   host staging and asynchronous copies on CUDA).
//! * [`factory`]: the [`narsil_core::BackendFactory`] the engine uses.
//! * [`split`]: split models (a directory: INT8 tables pooled by
//!   `narsil-embedding`, then a TorchScript dense network).
//! * [`device`]: `cpu` / `cuda:N` parsing and availability checks.

pub mod device;
pub mod factory;
pub mod fbgemm;
pub mod lane;
pub mod model;
pub mod precision;
pub mod roofline;
pub mod script_module;
pub mod split;

pub use factory::{TorchConfig, TorchFactory};
pub use model::TorchModel;
pub use narsil_embedding::TableStore;
pub use precision::{cpu_bf16_instructions, DensePrecision};
pub use split::SplitFactory;

/// The libtorch `lib` directory this crate was built against (also the rpath
/// the binaries carry).
pub fn libtorch_lib_dir() -> std::path::PathBuf {
    env!("NARSIL_LIBTORCH_LIB").into()
}
