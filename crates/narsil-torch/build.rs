//! Compiles the C++ shims (thread-wide inference mode; the TorchScript module
//! with its precision and freezing; AOTInductor packages) against the libtorch that torch-sys
//! linked, and embeds an rpath to that libtorch so this crate's tests and
//! benches start without LD_LIBRARY_PATH.
use std::path::PathBuf;

fn main() {
    let lib = PathBuf::from(
        std::env::var("DEP_TCH_LIBTORCH_LIB").expect("torch-sys did not report its libtorch lib dir"),
    );
    let include = lib.parent().expect("libtorch lib dir has a parent").join("include");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    println!("cargo:rustc-env=NARSIL_LIBTORCH_LIB={}", lib.display());
    println!("cargo:rerun-if-changed=csrc");
    cc::Build::new()
        .cpp(true)
        .file("csrc/aoti_package.cpp")
        .file("csrc/inference_mode.cpp")
        .file("csrc/script_module.cpp")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .warnings(false)
        .compile("narsil_torch_shim");
}
