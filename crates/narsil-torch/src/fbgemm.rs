//! Registers libtorch's CUDA support and FBGEMM's operators in this process.
//!
//! TorchRec's INT8 embedding tables run FBGEMM's table-batched-embedding ops
//! (`fbgemm::int_nbit_split_embedding_codegen_lookup_function` and friends).
//! A TorchScript model resolves every operator its graph names when it is
//! loaded, so the fbgemm_gpu libraries must be in the process first. They
//! need libtorch's symbols globally visible, so `libtorch.so` itself is
//! opened again with `RTLD_GLOBAL` before them.
//!
//! Opening `libtorch.so` also loads `libtorch_cuda.so` (one of its `NEEDED`
//! entries), which registers CUDA with libtorch: the Rust binary links
//! libtorch with `--as-needed` and references no CUDA symbol, so without this
//! step libtorch would see no CUDA device even on a GPU machine. Devices are
//! therefore checked after [`load_fbgemm_ops`].

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use narsil_core::BackendError;

/// Where fbgemm_gpu lives next to the libtorch this binary links: both come
/// from the same Python environment (`site-packages/torch/lib` and
/// `site-packages/fbgemm_gpu`).
pub fn default_fbgemm_dir() -> PathBuf {
    let lib = crate::libtorch_lib_dir();
    let site_packages = lib.parent().and_then(Path::parent).unwrap_or(&lib);
    site_packages.join("fbgemm_gpu")
}

static LOADED: OnceLock<Result<Vec<PathBuf>, String>> = OnceLock::new();

/// Loads every fbgemm_gpu shared library in `dir` once per process. Returns
/// the libraries loaded. A second call returns the first call's outcome.
pub fn load_fbgemm_ops(dir: &Path) -> Result<Vec<PathBuf>, BackendError> {
    LOADED.get_or_init(|| load_all(dir)).clone().map_err(BackendError::setup)
}

fn load_all(dir: &Path) -> Result<Vec<PathBuf>, String> {
    open_global(&crate::libtorch_lib_dir().join("libtorch.so"))?;
    let mut pending = shared_libraries(dir)?;
    if pending.is_empty() {
        return Err(format!(
            "no fbgemm_gpu libraries (*.so) in {}; install fbgemm-gpu-cpu with scripts/setup_python.sh or pass --fbgemm-dir",
            dir.display()
        ));
    }
    // The libraries depend on one another and their order is not recorded
    // anywhere: retry the failures while each pass loads something.
    let mut loaded = Vec::new();
    loop {
        let before = loaded.len();
        let mut failed = Vec::new();
        for path in pending {
            match open_global(&path) {
                Ok(()) => loaded.push(path),
                Err(err) => failed.push((path, err)),
            }
        }
        if failed.is_empty() {
            return Ok(loaded);
        }
        if loaded.len() == before {
            let count = failed.len();
            let first = failed.swap_remove(0).1;
            return Err(format!("cannot load fbgemm_gpu ({count} libraries failed); first: {first}"));
        }
        pending = failed.into_iter().map(|(path, _)| path).collect();
    }
}

fn shared_libraries(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| {
        format!(
            "cannot read the fbgemm_gpu directory {}: {e}; install fbgemm-gpu-cpu with scripts/setup_python.sh or pass --fbgemm-dir",
            dir.display()
        )
    })?;
    let mut libs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|ext| ext == "so"))
        .collect();
    libs.sort();
    Ok(libs)
}

pub(crate) fn open_global(path: &Path) -> Result<(), String> {
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("path with a NUL byte: {}", path.display()))?;
    // SAFETY: dlopen with a valid C string; the handle is kept open for the
    // life of the process on purpose (operators stay registered).
    let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local C string or null.
        let err = unsafe { libc::dlerror() };
        let msg = if err.is_null() {
            "unknown dlopen error".to_string()
        } else {
            // SAFETY: non-null, so a NUL-terminated string dlerror keeps
            // valid until this thread's next dl* call; copied out at once.
            unsafe { CStr::from_ptr(err) }.to_string_lossy().into_owned()
        };
        return Err(format!("{}: {msg}", path.display()));
    }
    Ok(())
}
