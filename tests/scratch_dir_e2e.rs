//! `narsil serve`'s scratch directory (`src/main/scratch_dir.rs`), on the
//! real binary serving an AOTInductor package (the test model's
//! `split/dense.pt2`, which libtorch extracts under `TMPDIR`): the server
//! extracts into a directory of its own, `narsil-<pid>` under the
//! operator's `TMPDIR`; a server killed with SIGKILL leaves it behind, the
//! next server started beside it removes it, and a server stopped with
//! SIGTERM removes its own, so the temporary directory holds nothing after.
#![cfg(feature = "torch")]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// `narsil serve` of the test model's package under `tmpdir`: the process
/// and its scratch directory.
async fn serve(model: &Path, tmpdir: &Path) -> (common::KillOnDrop, PathBuf) {
    let listeners = common::Listeners::new();
    let child = Command::new(env!("CARGO_BIN_EXE_narsil"))
        .args(["serve", "--log-level", "warn", "--dense-form", "pt2", "--model"])
        .arg(model)
        .args(listeners.args(false))
        .env("TMPDIR", tmpdir)
        .env_remove("NARSIL_SCRATCH_DIR")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut server = common::KillOnDrop(child);
    let url = listeners.wait(&mut server.0, common::PATIENCE).await.url();
    common::wait_serving(&url, common::PATIENCE).await;
    let dir = tmpdir.join(format!("narsil-{}", server.0.id()));
    (server, dir)
}

/// The entries of `dir` whose names start with `prefix`.
fn named(dir: &Path, prefix: &str) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_servers_extracted_package_is_removed_by_the_next_start_and_a_stopped_ones_by_itself() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/generated/test-small/split");
    assert!(model.join("dense.pt2").is_file(), "no {}/dense.pt2: run scripts/test.sh", model.display());
    let tmpdir = tempfile::tempdir().unwrap();
    let (mut first, first_dir) = serve(&model, tmpdir.path()).await;
    assert!(
        !named(&first_dir, "aotinductor_").is_empty(),
        "the package is extracted into {}",
        first_dir.display()
    );
    first.0.kill().unwrap();
    first.0.wait().unwrap();
    assert!(first_dir.is_dir(), "SIGKILL leaves the scratch directory behind");
    let (mut second, second_dir) = serve(&model, tmpdir.path()).await;
    assert!(!first_dir.exists(), "the next start removes the killed server's directory");
    assert!(!named(&second_dir, "aotinductor_").is_empty());
    common::stop(&mut second.0);
    let left = named(tmpdir.path(), "");
    assert!(left.is_empty(), "a stopped server removes its own directory: left {left:?}");
}
