//! `narsil load` against a model with raw integer inputs, from the real
//! binaries over loopback: the generative ranker imported from GR's
//! streaming checkpoint (`models/generated/gr-streaming-pytorch`,
//! `scripts/test.sh` imports it) served by libtorch, loaded with the
//! ranking workload (`--candidates 16`: histories of raw timestamps and
//! action bitmasks, per-candidate raw ratings and query times), grouped and
//! flat, and without `--candidates`: every request is answered, none
//! refused.

#![cfg(feature = "torch")]

mod common;

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

/// The imported GR model.
fn gr_model() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/generated/gr-streaming-pytorch");
    assert!(
        dir.join("schema.json").is_file(),
        "no imported model in {}: run scripts/test.sh (it imports GR's test checkpoints)",
        dir.display()
    );
    dir
}

/// `narsil load` against `url`: 24 measured requests, 2 callers, no
/// warm-up, JSON report, and `extra` flags.
async fn load(url: &str, extra: &[&str]) -> Output {
    let mut args: Vec<String> = ["load", "--addr", url, "--requests", "24", "--concurrency", "2"]
        .iter()
        .chain(["--warmup", "0", "--json", "--distinct-requests", "8"].iter())
        .chain(extra)
        .map(|a| a.to_string())
        .collect();
    args.extend(["--seed", "5"].map(String::from));
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_narsil")).args(&args).env("NARSIL_LOG", "warn").output().unwrap()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gr_model_with_raw_inputs_takes_narsil_loads_ranking_requests_grouped_and_flat_without_errors() {
    let listeners = common::Listeners::new();
    let child = Command::new(env!("CARGO_BIN_EXE_narsil"))
        .args(["serve", "--log-level", "warn"])
        .args(listeners.args(false))
        .arg("--model")
        .arg(gr_model())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut server = common::KillOnDrop(child);
    let url = listeners.wait(&mut server.0, common::PATIENCE).await.url();
    common::wait_serving(&url, common::PATIENCE).await;

    for (form, candidates) in [("grouped", "16"), ("flat", "16"), ("", "0")] {
        let mut flags = vec!["--candidates", candidates];
        if !form.is_empty() {
            flags.extend(["--ranking-form", form]);
        } else {
            flags.extend(["--samples-per-request", "4", "--ids-per-feature", "8"]);
        }
        let out = load(&url, &flags).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{form:?}: narsil load failed: {stderr}");
        let json: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{form:?}: no JSON report ({e}): {stderr}"));
        assert_eq!(
            (json["requests"].as_u64(), json["ok"].as_u64()),
            (Some(24), Some(24)),
            "{form:?}: {json}"
        );
        assert_eq!(json["by_code"], serde_json::json!({"OK": 24}), "{form:?}: no request refused");
        if !form.is_empty() {
            assert_eq!(json["ranking_form"], form);
            assert_eq!(json["candidates_per_request"], 16);
        }
    }
}
