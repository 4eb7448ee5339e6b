//! The real `narsil serve` process: SIGTERM under load answers every accepted
//! request and exits 0; with `--drain-grace-secs`, health turns NOT_SERVING
//! at once while calls are still served until the grace period ends.

use std::process::{Command, Stdio};
use std::time::Duration;

use futures_util::future::join_all;
use narsil::proto::predictor_client::PredictorClient;

mod common;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_load_answers_everything_and_exits_zero() {
    let listeners = common::Listeners::new();
    let mut child = Command::new(env!("CARGO_BIN_EXE_narsil"))
        .arg("serve")
        .args(listeners.args(true))
        .args(["--mock-latency-ms", "100", "--mock-table-rows", "1000", "--max-batch-requests", "8"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let bound = listeners.wait(&mut child, common::PATIENCE).await;
    let channel = common::wait_serving(&bound.url(), common::PATIENCE).await;
    // 32 requests, 8 per 100 ms forward: ~400 ms of work queued at SIGTERM.
    let calls = tokio::spawn(join_all((0..32).map(|tag| {
        let mut client = PredictorClient::new(channel.clone());
        async move { client.predict(common::request(tag, 3)).await }
    })));
    // SIGTERM once every request is accepted (one not yet accepted would be
    // refused, rightly); the work they make is still under way.
    common::poll_until("all 32 requests accepted", common::PATIENCE, || async {
        let first = common::scrape(bound.admin()).await;
        let second = common::scrape(bound.admin()).await;
        (common::admitted(&first, &second) >= 32.0).then_some(())
    })
    .await;
    // SAFETY: sending a signal to our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let results = calls.await.unwrap();
    let status = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap()).await.unwrap();
    let failed: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(failed.is_empty(), "requests lost at SIGTERM: {failed:?}");
    assert!(status.status.success(), "exit {:?}: {}", status.status, String::from_utf8_lossy(&status.stderr));
    let log = String::from_utf8_lossy(&status.stderr);
    assert!(log.contains("SIGTERM received") && log.contains("drained"), "{log}");
}

/// `--drain-grace-secs`: long, so that the checks made within it have
/// seconds to spare on a loaded machine.
const GRACE: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn within_the_drain_grace_health_says_not_serving_while_new_calls_are_still_served() {
    let listeners = common::Listeners::new();
    let child = Command::new(env!("CARGO_BIN_EXE_narsil"))
        .arg("serve")
        .args(listeners.args(true))
        .args(["--mock-latency-ms", "1", "--mock-table-rows", "1000"])
        .args(["--drain-grace-secs", &GRACE.as_secs().to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut child = common::KillOnDrop(child);
    let bound = listeners.wait(&mut child.0, common::PATIENCE).await;
    let (url, admin) = (bound.url(), bound.admin());
    let channel = common::wait_serving(&url, common::PATIENCE).await;
    assert_eq!(common::http(admin, "GET", "/healthz").await.0, 200);
    let signalled = std::time::Instant::now();
    // SAFETY: sending a signal to our own child process.
    assert_eq!(unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) }, 0);
    common::poll_until("grpc.health to say NOT_SERVING after SIGTERM", GRACE, || {
        let channel = channel.clone();
        async move { (common::health_status(channel).await.unwrap() == 2).then_some(()) }
    })
    .await;
    assert_eq!(common::http(admin, "GET", "/healthz").await.0, 503);
    // Calls on the open connection and on a new one are still answered.
    PredictorClient::new(channel).predict(common::request(1, 2)).await.unwrap();
    let mut fresh = PredictorClient::connect(url.clone()).await.unwrap();
    fresh.predict(common::request(2, 2)).await.unwrap();
    // (Had the checks run past the grace period, the calls above would
    // have failed: this says why.)
    assert!(signalled.elapsed() < GRACE, "the checks ran past the grace period");
    let status = tokio::task::spawn_blocking(move || child.0.wait().unwrap()).await.unwrap();
    assert!(status.success());
    assert!(signalled.elapsed() >= GRACE, "exited before the grace period ended");
}
