//! Compiles the C++ shims (thread-wide inference mode; the TorchScript module
//! with its precision and freezing; AOTInductor packages; a non-blocking
//! tensor copy) against the libtorch that torch-sys linked, and embeds an
//! rpath to that libtorch so this crate's tests and benches start without
//! LD_LIBRARY_PATH.
//!
//! When that libtorch has CUDA headers (ATen/cuda/CUDAGraph.h, and the CUDA
//! runtime's headers, `cuda_runtime_api.h` and `crt/host_config.h`:
//! `NARSIL_CUDA_INCLUDE` (directories, `:`-separated), CUDA_HOME,
//! /usr/local/cuda, or the nvidia-* wheels beside a PyPI torch, where the
//! `crt/` headers come with `nvidia-cuda-crt`), it also builds `csrc/cuda_shim.cpp` into a shared
//! library of its own, `libnarsil_cuda_shim.so` (streams, events, CUDA
//! graphs), which Narsil opens only when a model is served on CUDA: nothing
//! here makes the binary need a CUDA library to start. Without CUDA headers
//! no shim is built and the CUDA graph API reports itself unavailable.
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let lib = PathBuf::from(
        std::env::var("DEP_TCH_LIBTORCH_LIB").expect("torch-sys did not report its libtorch lib dir"),
    );
    let include = lib.parent().expect("libtorch lib dir has a parent").join("include");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    println!("cargo:rustc-env=NARSIL_LIBTORCH_LIB={}", lib.display());
    println!("cargo:rerun-if-changed=csrc");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-env-changed=NARSIL_NO_CUDA_SHIM");
    println!("cargo:rerun-if-env-changed=NARSIL_CUDA_INCLUDE");
    cc::Build::new()
        .cpp(true)
        .file("csrc/aoti_package.cpp")
        .file("csrc/inference_mode.cpp")
        .file("csrc/script_module.cpp")
        .file("csrc/tensor_copy.cpp")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .warnings(false)
        .compile("narsil_torch_shim");
    let shim = cuda_shim(&lib, &include);
    println!("cargo:rustc-env=NARSIL_CUDA_SHIM_BUILT={}", shim.as_deref().unwrap_or(""));
}

/// Builds libnarsil_cuda_shim.so where CUDA headers are found; its path, or
/// why not (a warning).
fn cuda_shim(lib: &Path, include: &Path) -> Option<String> {
    if std::env::var_os("NARSIL_NO_CUDA_SHIM").is_some() {
        return None;
    }
    if !include.join("ATen/cuda/CUDAGraph.h").is_file() {
        return None;
    }
    let Some(cuda_include) = cuda_runtime_include(lib) else {
        if std::env::var_os("NARSIL_CUDA_INCLUDE").is_some() {
            println!(
                "cargo:warning=libtorch has CUDA headers but cuda_runtime_api.h and crt/host_config.h were not \
                 both found (NARSIL_CUDA_INCLUDE, CUDA_HOME, /usr/local/cuda, nvidia-* wheels): no CUDA shim"
            );
        }
        return None;
    };
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("libnarsil_cuda_shim.so");
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let status = Command::new(&compiler)
        .args(["-shared", "-fPIC", "-O2", "-std=c++17", "-D_GLIBCXX_USE_CXX11_ABI=1", "-w"])
        .arg("-I")
        .arg(include)
        .arg("-I")
        .arg(include.join("torch/csrc/api/include"))
        .args(cuda_include.iter().flat_map(|dir| [std::ffi::OsStr::new("-I"), dir.as_os_str()]))
        .arg("csrc/cuda_shim.cpp")
        .arg("-o")
        .arg(&out)
        .arg(format!("-L{}", lib.display()))
        .args(["-Wl,--no-as-needed", "-ltorch_cuda", "-lc10_cuda", "-ltorch_cpu", "-lc10"])
        .arg("-Wl,--allow-shlib-undefined")
        .status();
    match status {
        Ok(s) if s.success() => Some(out.display().to_string()),
        Ok(s) => {
            println!("cargo:warning=the CUDA shim did not compile ({s}): CUDA graphs unavailable");
            None
        }
        Err(e) => {
            println!("cargo:warning=cannot run {compiler} for the CUDA shim ({e}): CUDA graphs unavailable");
            None
        }
    }
}

/// The directories holding cuda_runtime_api.h and crt/host_config.h (the
/// CUDA runtime's headers), if both are found.
fn cuda_runtime_include(lib: &Path) -> Option<Vec<PathBuf>> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(dirs) = std::env::var_os("NARSIL_CUDA_INCLUDE") {
        candidates.extend(std::env::split_paths(&dirs));
    }
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        candidates.push(PathBuf::from(home).join("include"));
    }
    candidates.push("/usr/local/cuda/include".into());
    // A PyPI torch: site-packages/torch/lib -> site-packages/nvidia/*/include.
    if let Some(site) = lib.parent().and_then(Path::parent) {
        if let Ok(entries) = std::fs::read_dir(site.join("nvidia")) {
            let mut dirs: Vec<PathBuf> =
                entries.filter_map(|e| e.ok().map(|e| e.path().join("include"))).collect();
            dirs.sort();
            candidates.extend(dirs);
        }
    }
    let runtime = candidates.iter().find(|dir| dir.join("cuda_runtime_api.h").is_file())?;
    let crt = candidates.iter().find(|dir| dir.join("crt/host_config.h").is_file())?;
    Some(if runtime == crt { vec![runtime.clone()] } else { vec![runtime.clone(), crt.clone()] })
}
