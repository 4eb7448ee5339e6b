//! The scripts that write a model from another one write models `narsil
//! serve` loads: `benchmarks/tables_beyond_ram.py`'s `write_model` (which
//! `big_tables.py` and `deadline_health.py` use too) and
//! `scripts/gpu_check.sh`'s default-size model, each run on the test
//! model's split form as scripts/test.sh exports it today (a dense network,
//! its cut for ranking requests and its packages), then served over real
//! gRPC on loopback and scored. Both copy the source's files through
//! `models/model_files.py`.
#![cfg(feature = "torch")]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::{assert_close, wire, KillOnDrop, Listeners, PATIENCE};
use narsil::proto::predictor_client::PredictorClient;
use narsil_core::golden::{test_model_dir, Golden};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The project venv's python (scripts/setup_python.sh).
fn python() -> PathBuf {
    let python = root().join(".venv/bin/python");
    assert!(python.is_file(), "no project venv at {}: run scripts/setup_python.sh", python.display());
    python
}

/// The test model's split form, checked to name more than its dense
/// network (what the writers used to copy alone).
fn source() -> PathBuf {
    let split = test_model_dir().join("split");
    let schema: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(split.join("schema.json")).unwrap()).unwrap();
    assert!(
        schema["dense_bottom"].is_string() && schema["dense_top"].is_string(),
        "{} names no dense cut: re-export it with scripts/test.sh",
        split.display()
    );
    split
}

/// Runs `command`, panicking with its output if it fails.
fn run(mut command: Command, what: &str) {
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `narsil serve --backend torch --model DIR`, until SERVING; the golden
/// requests' scores, each request alone.
async fn serve_and_score(dir: &Path, golden: &Golden) -> Vec<Vec<f32>> {
    let listeners = Listeners::new();
    let mut command = listeners.serve(false, "error");
    command.args(["--backend", "torch", "--model"]).arg(dir).stderr(Stdio::inherit());
    let mut server = KillOnDrop(command.spawn().unwrap());
    let url = listeners.wait(&mut server.0, PATIENCE).await.url();
    let mut client = PredictorClient::new(common::wait_serving(&url, PATIENCE).await);
    let mut scores = Vec::new();
    for g in &golden.requests {
        scores.push(client.predict(wire(g, "")).await.unwrap().into_inner().scores);
    }
    scores
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_benchmarks_enlarged_table_model_from_todays_export_loads_and_scores_as_its_source() {
    let source = source();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("big");
    let program = "import sys\n\
        sys.path.insert(0, 'benchmarks')\n\
        from tables_beyond_ram import write_model\n\
        write_model(sys.argv[1], sys.argv[2], int(sys.argv[3]))";
    let mut command = Command::new(python());
    // Twice the source's 1,000 rows: the source table repeated, so the
    // golden requests' ids read the same rows.
    command.current_dir(root()).args(["-c", program]).arg(&source).arg(&out).arg("2000");
    run(command, "tables_beyond_ram.write_model");
    let golden = Golden::read(&test_model_dir()).unwrap();
    let scores = serve_and_score(&out, &golden).await;
    for (i, (got, g)) in scores.iter().zip(&golden.requests).enumerate() {
        assert_close(got, &g.scores_int8, &format!("golden request {i} on the enlarged model"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gpu_checks_default_size_model_from_todays_export_loads_and_scores() {
    let source = source();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("default-size");
    let mut command = Command::new("bash");
    // gpu_check.sh runs `python3`: the venv's, as on the GPU machine
    // PyTorch's.
    let venv_bin = python().parent().unwrap().to_path_buf();
    let path = format!("{}:{}", venv_bin.display(), std::env::var("PATH").unwrap_or_default());
    command
        .env("PATH", path)
        .arg(root().join("scripts/gpu_check.sh"))
        .arg("--default-size-model")
        .arg(&source)
        .arg(&out)
        .arg("1000");
    run(command, "gpu_check.sh --default-size-model");
    let schema: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("schema.json")).unwrap()).unwrap();
    assert!(schema.get("dense_package").is_none(), "the CPU's packages are left out: {schema}");
    let golden = Golden::read(&test_model_dir()).unwrap();
    // Random tables: scores, one a sample, each a probability.
    for (i, (got, g)) in serve_and_score(&out, &golden).await.iter().zip(&golden.requests).enumerate() {
        assert_eq!(got.len(), g.scores_int8.len(), "golden request {i}: one score a sample");
        assert!(got.iter().all(|s| (0.0..=1.0).contains(s)), "golden request {i}: {got:?}");
    }
}
