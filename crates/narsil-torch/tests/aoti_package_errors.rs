//! The AOTInductor shim's failure paths come back as errors naming what
//! libtorch said, never as an abort: a file that is not a package fails at
//! its metadata, and a package whose metadata reads but whose kernels do
//! not load fails in the shim's load.
//!
//! Needs the test model's `split/dense.pt2` (`scripts/test.sh` exports
//! `models/generated/test-small`); without it the test says `skipped`, or
//! fails under `NARSIL_REQUIRE_TEST_MODEL=1` (CI).

/// Set to `1`, a test without the exported test model fails instead of
/// skipping.
const REQUIRE_TEST_MODEL: &str = "NARSIL_REQUIRE_TEST_MODEL";

use narsil_core::golden::test_model_dir;
use narsil_torch::aoti_package::{AotiPackage, CPU_FLAGS_KEY};

fn temp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("narsil-aoti-{}-{name}", std::process::id()))
}

/// A clear message: not the Rust side's fallback for a null one.
fn assert_clear(what: &str, err: &str) {
    eprintln!("{what}: {err}");
    assert!(!err.trim().is_empty() && !err.contains("unknown error"), "{what}: {err:?}");
}

#[test]
fn a_file_that_is_not_a_package_is_an_error_not_an_abort() {
    let path = temp_path("not-a-package.pt2");
    std::fs::write(&path, b"not a package").unwrap();
    let metadata = AotiPackage::metadata(&path, CPU_FLAGS_KEY).expect_err("metadata of a non-package");
    let load = AotiPackage::load(&path, 1, &[]).err().expect("a non-package loaded");
    std::fs::remove_file(&path).unwrap();
    assert_clear("metadata", &metadata.to_string());
    assert_clear("load", &load.to_string());
}

#[test]
fn a_package_whose_kernels_do_not_load_is_an_error_not_an_abort() {
    let test = "a_package_whose_kernels_do_not_load_is_an_error_not_an_abort";
    let source = test_model_dir().join("split/dense.pt2");
    let Ok(mut bytes) = std::fs::read(&source) else {
        let why = format!("no {} (scripts/test.sh exports it)", source.display());
        narsil_core::skip::skip_or_fail(REQUIRE_TEST_MODEL, test, &why);
        return;
    };
    // The package stores its kernels' shared object uncompressed: break its
    // ELF magic, leaving the metadata entries as they are.
    let elf = bytes.windows(4).position(|w| w == b"\x7fELF").expect("the package holds a shared object");
    bytes[elf + 1] = b'X';
    let path = temp_path("broken-kernels.pt2");
    std::fs::write(&path, &bytes).unwrap();
    let flags = AotiPackage::metadata(&path, CPU_FLAGS_KEY).unwrap().expect("flags recorded");
    let flags: Vec<&str> = flags.split_whitespace().collect();
    let err = AotiPackage::load(&path, 1, &flags).err().map(|e| e.to_string());
    std::fs::remove_file(&path).unwrap();
    remove_extractions_holding(b"\x7fXLF");
    assert_clear("load", &err.expect("a package with broken kernels loaded"));
}

/// libtorch extracts a package it loads into `$TMPDIR/aotinductor_*` and
/// removes that only when the loaded package is dropped: a load that
/// throws leaves it behind (`narsil serve` keeps such leftovers in its own
/// scratch directory; a test binary has none). Removes the extractions
/// holding a file that starts with `magic` (this test's broken kernels
/// only, never another process's package).
fn remove_extractions_holding(magic: &[u8]) {
    fn holds(dir: &std::path::Path, magic: &[u8]) -> bool {
        std::fs::read_dir(dir).into_iter().flatten().flatten().any(|entry| {
            let path = entry.path();
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                return holds(&path, magic);
            }
            let mut start = vec![0; magic.len()];
            std::fs::File::open(&path)
                .and_then(|mut file| std::io::Read::read_exact(&mut file, &mut start))
                .is_ok_and(|()| start == magic)
        })
    }
    for entry in std::fs::read_dir(std::env::temp_dir()).into_iter().flatten().flatten() {
        let path = entry.path();
        if entry.file_name().to_string_lossy().starts_with("aotinductor_") && holds(&path, magic) {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}
