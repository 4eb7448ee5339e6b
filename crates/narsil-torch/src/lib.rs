//! Narsil's libtorch backend: a TorchScript DLRM exported by
//! `models/export_dlrm.py`, with TorchRec's INT8 FBGEMM embedding tables, run
//! through `tch` on CPU or CUDA.
//!
//! * [`fbgemm`]: registers FBGEMM's operators in the process before a model
//!   that calls them is loaded.
//! * [`model`]: loads the TorchScript module once and reads its schema.
//! * [`script_module`]: the frozen TorchScript module behind a C++ shim.
//! * [`precision`]: `--dense-precision` and the CPU's bf16 instructions.
//! * [`gemm_peak`]: this core's GEMM peak through the same libtorch (the
//!   `bench-forward` roofline's GEMM part).
//! * [`lane`]: one lane's forward: key-major batch in, scores out (pinned
//!   host staging and asynchronous copies on CUDA).
//! * [`factory`]: the [`narsil_core::BackendFactory`] the engine uses.
//! * [`split`]: split models (a directory: INT8 tables pooled by
//!   `narsil-embedding`, then the dense network), loaded once by
//!   [`split_factory`] as a [`split::model`] their lanes share (`split/lane.rs`: the CPU lane,
//!   its stage one batch ahead; `split/inputs.rs`: the dense network's
//!   inputs from the stage's buffers).
//! * [`split::dense_network`]: a split model's dense network, TorchScript or
//!   [`aoti_package`] (AOTInductor `.pt2`), chosen by `--dense-form`;
//!   [`split::dense_cut`]: the same network cut in two, for ranking requests
//!   (the dense arch once per request, DLRM's user products once).
//! * [`device`]: `cpu` / `cuda:N` parsing and availability checks.
//! * [`device_lane`]: a split model's lane on a device (CUDA): staging
//!   buffers, [`tensor_stage`] (tables in device memory), CUDA graphs per
//!   [`buckets`] bucket, [`handoff`] of two buffer sets to stage one batch
//!   ahead; [`cuda`]: streams, events and graphs through the CUDA shim.

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod aoti_package;
pub mod buckets;
pub mod cuda;
pub mod device;
pub mod device_lane;
pub mod factory;
pub mod fbgemm;
pub mod gemm_peak;
pub mod handoff;
pub mod lane;
pub mod model;
pub mod precision;
pub mod script_module;
pub mod split;
pub mod split_factory;
pub mod tensor_stage;

pub use factory::{TorchConfig, TorchFactory, DEVICE_PATH_ON_CPU_ENV};
pub use model::TorchModel;
pub use narsil_embedding::TableStore;
pub use precision::{cpu_bf16_instructions, cpu_flags, cpu_identity, cpu_int8_instructions, DensePrecision};
pub use split::dense_network::DenseForm;
pub use split_factory::SplitFactory;

/// The libtorch `lib` directory this process loaded `libtorch_cpu.so` from
/// (the binary links it: found through its rpath, or `LD_LIBRARY_PATH` where
/// the libraries were moved, as in the `narsil-torch` container image); the
/// directory it was built against if the mapping cannot be read.
pub fn libtorch_lib_dir() -> std::path::PathBuf {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        std::fs::read_to_string("/proc/self/maps")
            .ok()
            .and_then(|maps| loaded_library_dir(&maps, "libtorch_cpu.so"))
            .unwrap_or_else(|| env!("NARSIL_LIBTORCH_LIB").into())
    })
    .clone()
}

/// The directory of the first mapping of a file named `name` in a
/// `/proc/PID/maps` text.
fn loaded_library_dir(maps: &str, name: &str) -> Option<std::path::PathBuf> {
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .map(std::path::Path::new)
        .find(|path| path.file_name().is_some_and(|file| file == name))
        .and_then(|path| path.parent().map(std::path::Path::to_path_buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lib_dir_is_where_this_process_mapped_libtorch() {
        let maps = "7f00-7f01 r--p 00000000 fd:01 12 /opt/narsil/site-packages/torch/lib/libtorch_cpu.so\n\
                    7f02-7f03 r--p 00000000 00:00 0 [heap]\n";
        assert_eq!(
            loaded_library_dir(maps, "libtorch_cpu.so"),
            Some("/opt/narsil/site-packages/torch/lib".into())
        );
        assert_eq!(loaded_library_dir(maps, "libc10.so"), None);
        // This test binary links libtorch: its own mapping is found.
        assert!(libtorch_lib_dir().join("libtorch_cpu.so").is_file());
    }
}
