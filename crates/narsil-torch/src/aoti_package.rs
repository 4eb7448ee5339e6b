//! A dense network compiled ahead of time by AOTInductor: a `.pt2` package
//! (`torch.export` with a dynamic row dimension, compiled by AOTInductor;
//! `models/dense_packages.py`'s `compile_package`), loaded with
//! libtorch's `AOTIModelPackageLoader` through the C++ shim in
//! `csrc/aoti_package.cpp` and run on the lane's tensors at any row count.
//!
//! A package's kernels are compiled for one vector ISA (AVX2, AVX-512,
//! AMX): the exporter records the CPU flags they need in the package's
//! metadata (`narsil_cpu_flags`), and loading refuses a package whose flags
//! this CPU lacks, naming the file and the flags, before any of its code is
//! loaded (it would die of an illegal instruction instead).
//!
//! The shim keeps `csrc/script_module.cpp`'s contract, which every call
//! below relies on: no C++ exception leaves it (each function is `noexcept`,
//! catches everything and reports it through its `error` out-pointer as a
//! malloc'd C string, or as null when even that allocation failed), a
//! function that fails returns null (or -1) and nothing else, and a tensor it
//! returns is a new heap `at::Tensor` the caller owns.
//!
//! libtorch's package loader is not safe to enter from two threads at once
//! (two versions or models loading together crashed a test process, each
//! loader thread faulting inside it, and a metadata read once returned
//! another entry's value): its entry points here (metadata, load, free)
//! take one process-wide lock. Loads are rare; `run` does not take it.

use std::ffi::{c_char, c_int, CString};
use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use tch::Tensor;

use crate::script_module::{take_string, LibtorchError};

#[repr(C)]
struct RawPackage {
    _private: [u8; 0],
}

type RawTensor = torch_sys::C_tensor;

extern "C" {
    fn narsil_aoti_package_metadata(
        path: *const c_char,
        key: *const c_char,
        value: *mut *mut c_char,
        error: *mut *mut c_char,
    ) -> c_int;
    fn narsil_aoti_package_load(
        path: *const c_char,
        runners: c_int,
        error: *mut *mut c_char,
    ) -> *mut RawPackage;
    fn narsil_aoti_package_run(
        package: *mut RawPackage,
        num_inputs: c_int,
        inputs: *const *const RawTensor,
        error: *mut *mut c_char,
    ) -> *mut RawTensor;
    fn narsil_aoti_package_free(package: *mut RawPackage);
}

/// The metadata key under which the exporter records the CPU flags the
/// package's kernels need (space-separated, as `/proc/cpuinfo` names them).
pub const CPU_FLAGS_KEY: &str = "narsil_cpu_flags";

/// The metadata key under which the exporter records whether the package's
/// kernels link `libtorch.so` (`"false"`: they find libtorch_cpu's symbols
/// in the process instead).
pub const LINKS_LIBTORCH_KEY: &str = "narsil_links_libtorch";

/// A loaded AOTInductor package.
pub struct AotiPackage {
    raw: *mut RawPackage,
}

// SAFETY: AOTInductor's model container serves `run` from any thread: each
// call takes one of its model instances (waiting for a free one) and the
// constants are read-only after loading; the pointer is freed only by Drop.
unsafe impl Send for AotiPackage {}
// SAFETY: as above; no method takes `&mut self`.
unsafe impl Sync for AotiPackage {}

/// Held across every call into libtorch's package loader (module docs).
static LOADER: Mutex<()> = Mutex::new(());

/// [`LOADER`], whatever a panic while it was held left (it guards no data).
fn loader_lock() -> MutexGuard<'static, ()> {
    LOADER.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn c_path(path: &Path) -> Result<CString, LibtorchError> {
    CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| LibtorchError(format!("path with a NUL byte: {}", path.display())))
}

impl AotiPackage {
    /// Checks that this CPU has the flags the package at `path` was
    /// compiled for (`cpu_flags`: this CPU's, as `/proc/cpuinfo` lists
    /// them), then loads it with `runners` model instances (the forwards
    /// that can run at once).
    pub fn load(path: &Path, runners: usize, cpu_flags: &[&str]) -> Result<Self, LibtorchError> {
        let needed = Self::metadata(path, CPU_FLAGS_KEY)?.ok_or_else(|| {
            LibtorchError(format!(
                "the package has no {CPU_FLAGS_KEY} entry: compile it with models/dense_packages.py's \
                 compile_package, which records the CPU flags its kernels need"
            ))
        })?;
        let missing: Vec<&str> = needed.split_whitespace().filter(|flag| !cpu_flags.contains(flag)).collect();
        if !missing.is_empty() {
            return Err(LibtorchError(format!(
                "the package was compiled for CPU instructions this CPU lacks ({}); compile it again on \
                 this CPU class, or serve the TorchScript dense network",
                missing.join(", ")
            )));
        }
        // A package whose kernels link `libtorch.so` needs it by name, which
        // the binary does not link (only libtorch_cpu): open it from the
        // libtorch in use. Opening it also loads libtorch_cuda and the CUDA
        // libraries it needs (~280 MiB resident on a CPU-only machine), so
        // the exporter compiles packages that do not link it.
        if Self::metadata(path, LINKS_LIBTORCH_KEY)?.as_deref() != Some("false") {
            crate::fbgemm::open_global(&crate::libtorch_lib_dir().join("libtorch.so"))
                .map_err(LibtorchError)?;
        }
        let c_path = c_path(path)?;
        let mut error: *mut c_char = std::ptr::null_mut();
        let _loader = loader_lock();
        // SAFETY: a valid C string and out-pointer that outlive the call;
        // the shim returns a package or sets `error` (possibly to null),
        // never both, and throws nothing (module docs).
        let raw = unsafe { narsil_aoti_package_load(c_path.as_ptr(), runners.max(1) as c_int, &mut error) };
        if raw.is_null() {
            return Err(shim_error(error));
        }
        Ok(Self { raw })
    }

    /// Loads a package compiled for CUDA (no CPU flags to check) with
    /// `runners` model instances.
    pub fn load_compiled_for_cuda(path: &Path, runners: usize) -> Result<Self, LibtorchError> {
        crate::fbgemm::open_global(&crate::libtorch_lib_dir().join("libtorch.so")).map_err(LibtorchError)?;
        let c_path = c_path(path)?;
        let mut error: *mut c_char = std::ptr::null_mut();
        let _loader = loader_lock();
        // SAFETY: as in `load`.
        let raw = unsafe { narsil_aoti_package_load(c_path.as_ptr(), runners.max(1) as c_int, &mut error) };
        if raw.is_null() {
            return Err(shim_error(error));
        }
        Ok(Self { raw })
    }

    /// The package's metadata entry `key`, read without loading its code.
    pub fn metadata(path: &Path, key: &str) -> Result<Option<String>, LibtorchError> {
        let c_path = c_path(path)?;
        let c_key = CString::new(key).map_err(|_| LibtorchError(format!("key with a NUL byte: {key}")))?;
        let mut value: *mut c_char = std::ptr::null_mut();
        let mut error: *mut c_char = std::ptr::null_mut();
        let _loader = loader_lock();
        // SAFETY: valid C strings and out-pointers that outlive the call; on
        // success `value` is a malloc'd string or null, on failure `value`
        // is null and `error` is set (possibly to null); the shim throws
        // nothing.
        let status =
            unsafe { narsil_aoti_package_metadata(c_path.as_ptr(), c_key.as_ptr(), &mut value, &mut error) };
        if status != 0 {
            return Err(shim_error(error));
        }
        Ok(take_string(value))
    }

    /// `forward(inputs...)`: its first output.
    pub fn forward_tensors(&self, inputs: &[&Tensor]) -> Result<Tensor, LibtorchError> {
        let raw: Vec<*const RawTensor> = inputs.iter().map(|t| t.as_ptr()).collect();
        let mut error: *mut c_char = std::ptr::null_mut();
        // SAFETY: `self.raw` is a live package (freed only by Drop); `raw`
        // has the length passed and it, the tensors it points at and `error`
        // outlive the call; the shim throws nothing.
        let output =
            unsafe { narsil_aoti_package_run(self.raw, raw.len() as c_int, raw.as_ptr(), &mut error) };
        if output.is_null() {
            return Err(shim_error(error));
        }
        // SAFETY: a non-null result is a new heap `at::Tensor` no one else
        // holds; its ownership passes to the returned Tensor.
        Ok(unsafe { Tensor::from_ptr(output) })
    }
}

/// The error the shim reported: its message, or (when it could not
/// allocate one) a message that says so.
fn shim_error(error: *mut c_char) -> LibtorchError {
    LibtorchError(
        take_string(error)
            .unwrap_or_else(|| "unknown error (the AOTInductor shim could not allocate its message)".into()),
    )
}

impl Drop for AotiPackage {
    fn drop(&mut self) {
        let _loader = loader_lock();
        // SAFETY: `raw` came from the shim's load and is freed once.
        unsafe { narsil_aoti_package_free(self.raw) }
    }
}
