//! `narsil load`'s exit status, from the real binaries over loopback: a run
//! in which measured requests failed exits 1 and says how many failed, of
//! how many, by status code (its report still printed); `--allow-failures`
//! exits 0 with the same counts in the report; a run whose requests all
//! succeed exits 0.

mod common;

use std::process::{Command, Output};
use std::time::Duration;

/// `narsil load` against `url` over KServe v2 (which reads the model's
/// shape from the server, and draws ids below `table_rows`): 4 samples a
/// request, 20 measured requests, no warm-up, JSON report, and `extra`
/// flags.
async fn load(url: &str, table_rows: u64, extra: &[&str]) -> Output {
    let mut args: Vec<String> =
        ["load", "--addr", url, "--protocol", "kserve", "--samples-per-request", "4", "--requests", "20"]
            .iter()
            .map(|a| a.to_string())
            .collect();
    args.extend(["--warmup", "0", "--json", "--table-rows"].map(String::from));
    args.push(table_rows.to_string());
    args.extend(extra.iter().map(|a| a.to_string()));
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_narsil")).args(&args).env("NARSIL_LOG", "warn").output().unwrap()
    })
    .await
    .unwrap()
}

fn report(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("no JSON report ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_whose_requests_fail_exits_nonzero_saying_how_many_failed_of_how_many() {
    let listeners = common::Listeners::new();
    // Tables of 100 rows: ids drawn below 10^9 are refused (INVALID_ARGUMENT).
    let mut serve = listeners.serve(false, "warn");
    serve.args(["--backend", "mock", "--mock-table-rows", "100"]);
    let mut server = common::KillOnDrop(serve.spawn().unwrap());
    let url = listeners.wait(&mut server.0, Duration::from_secs(60)).await.url();
    common::wait_serving(&url, Duration::from_secs(60)).await;

    let refused = load(&url, 1_000_000_000, &[]).await;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "every request failed, yet: {stderr}");
    assert!(stderr.contains("20 of 20 requests failed: InvalidArgument=20"), "{stderr}");
    assert!(stderr.contains("--allow-failures"), "the way to accept failures is named: {stderr}");
    let json = report(&refused);
    assert_eq!(
        (json["requests"].as_u64(), json["ok"].as_u64()),
        (Some(20), Some(0)),
        "the report is printed"
    );

    let allowed = load(&url, 1_000_000_000, &["--allow-failures"]).await;
    assert!(allowed.status.success(), "{}", String::from_utf8_lossy(&allowed.stderr));
    assert_eq!(report(&allowed)["by_code"]["InvalidArgument"], 20);

    let served = load(&url, 100, &[]).await;
    assert!(served.status.success(), "{}", String::from_utf8_lossy(&served.stderr));
    assert_eq!(report(&served)["ok"], 20);
}
