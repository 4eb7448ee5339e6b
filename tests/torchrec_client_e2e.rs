//! TorchRec's own Python client (`torchrec/inference/client.py` from the
//! venv's torchrec wheel, stubs generated from this project's
//! `proto/predictor/predictor.proto`) against the real `narsil serve` binary
//! on the small exported model. The client sends its ids as int64
//! (`KeyedJaggedTensor.values()`), which TorchRec's C++ server would misread
//! as int32; Narsil tells the width from the byte count.
#![cfg(feature = "torch")]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use narsil_core::golden::test_model_dir;

mod common;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

fn venv_python() -> PathBuf {
    let python = root().join(".venv/bin/python");
    assert!(python.is_file(), "no project venv at {}: run scripts/setup_python.sh", python.display());
    python
}

/// Runs `python args...`, returning stdout; panics with stderr on failure.
fn python(args: &[&str], envs: &[(&str, &Path)]) -> String {
    let mut command = Command::new(venv_python());
    command.args(args);
    for (key, value) in envs {
        command.env(key, value);
    }
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "python {args:?} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torchrecs_shipped_client_gets_one_score_per_sample() {
    let stubs = std::env::temp_dir().join(format!("narsil-torchrec-stubs-{}", std::process::id()));
    std::fs::create_dir_all(&stubs).unwrap();
    let proto_dir = root().join("proto/predictor");
    python(
        &[
            "-m",
            "grpc_tools.protoc",
            &format!("-I{}", proto_dir.display()),
            &format!("--python_out={}", stubs.display()),
            &format!("--grpc_python_out={}", stubs.display()),
            proto_dir.join("predictor.proto").to_str().unwrap(),
        ],
        &[],
    );
    let client = python(
        &["-c", "import os, torchrec.inference as i; print(os.path.join(os.path.dirname(i.__file__), 'client.py'))"],
        &[],
    );
    let client = client.trim().to_string();

    let listeners = common::Listeners::new();
    let model = test_model_dir().join("model_default.pt");
    let mut server = Command::new(env!("CARGO_BIN_EXE_narsil"))
        .args(["serve", "--backend", "torch"])
        .args(listeners.args(false))
        .arg("--model")
        .arg(&model)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let bound = listeners.wait(&mut server, Duration::from_secs(60)).await;
    common::wait_serving(&bound.url(), Duration::from_secs(60)).await;

    let port_arg = bound.grpc.port().to_string();
    let stubs_for_client = stubs.clone();
    let output = tokio::task::spawn_blocking(move || {
        python(
            &[
                &client,
                "--ip",
                "127.0.0.1",
                "--port",
                &port_arg,
                "--batch_size",
                "4",
                "--num_embedding_features",
                "1000",
            ],
            &[("PYTHONPATH", stubs_for_client.as_path())],
        )
    })
    .await;
    common::stop(&mut server);
    let _ = std::fs::remove_dir_all(&stubs);
    let output = output.unwrap();
    // The client prints `Response:  [p0, p1, p2, p3]`.
    let line = output.lines().find(|l| l.starts_with("Response:")).unwrap_or_else(|| panic!("{output}"));
    let list = line.split_once('[').and_then(|(_, rest)| rest.split_once(']')).map(|(list, _)| list);
    let scores: Vec<f32> =
        list.unwrap_or_else(|| panic!("{line}")).split(',').map(|s| s.trim().parse().unwrap()).collect();
    assert_eq!(scores.len(), 4, "{line}");
    assert!(scores.iter().all(|p| *p > 0.0 && *p < 1.0), "{line}");
}
