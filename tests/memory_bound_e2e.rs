//! Request memory is bounded before decoding, process-wide
//! (`--max-queue-bytes`, 256 MiB by default): sixteen concurrent
//! `narsil.v1` messages of one sample whose first bag holds 8,000,000 ids
//! (one byte each on the wire, 64 MB decoded), sent to a real `narsil
//! serve` process with default flags, each get OK or RESOURCE_EXHAUSTED
//! naming the flag; the server's peak resident memory (VmHWM) grows by at
//! most the budget plus a measured constant, and its resident memory comes
//! back down after the flood. One request that decodes larger than the
//! budget can never fit and is INVALID_ARGUMENT.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{memory_mib, request, KillOnDrop as Server};
use futures_util::future::join_all;
use narsil::proto::predictor_client::PredictorClient;
use narsil::proto::PredictRequest;
use tonic::Code;

const BUDGET_MIB: f64 = 256.0;
/// What the server holds beyond the budget at its peak: the allocator's
/// slack and the buffers of connections and of the flood's in-flight
/// frames (measured 40-90 MiB on a 2-vCPU machine; REPORTS.md#memory-bound-flood).
const CONSTANT_MIB: f64 = 128.0;

/// One sample; its first bag holds `ids` copies of id 0 (a 1-byte varint).
fn huge_bag(ids: usize) -> PredictRequest {
    let mut r = request(1, 1);
    let first = r.sparse_lengths[0] as usize;
    let rest = r.sparse_ids.split_off(first);
    r.sparse_lengths[0] = ids as u32;
    r.sparse_ids = std::iter::repeat_n(0, ids).chain(rest).collect();
    r
}

async fn serve(extra: &[&str]) -> (Server, String) {
    let listeners = common::Listeners::new();
    let child = Command::new(env!("CARGO_BIN_EXE_narsil"))
        .arg("serve")
        .args(listeners.args(false))
        .args(["--mock-latency-ms", "5"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut server = Server(child);
    let url = listeners.wait(&mut server.0, common::PATIENCE).await.url();
    common::wait_serving(&url, common::PATIENCE).await;
    (server, url)
}

/// A client on a connection of its own.
async fn client(url: &str) -> PredictorClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string()).unwrap().connect().await.unwrap();
    PredictorClient::new(channel).max_encoding_message_size(64 << 20)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_huge_bags_with_default_flags_stays_within_the_budget_and_memory_returns() {
    let (server, url) = serve(&[]).await;
    let pid = server.0.id();
    let client = client(&url).await;
    // Warm the server's allocator with ordinary traffic first.
    client.clone().predict(request(1, 10)).await.unwrap();
    let clients = join_all((0..16).map(|_| self::client(&url))).await;
    let (before, _) = memory_mib(pid);
    let message = huge_bag(8_000_000);
    let calls = join_all(clients.into_iter().map(|mut client| {
        let message = message.clone();
        async move { client.predict(message).await }
    }))
    .await;
    drop(message);
    let (mut ok, mut rejected) = (0, 0);
    for call in &calls {
        match call {
            Ok(response) => {
                assert_eq!(response.get_ref().scores.len(), 1);
                ok += 1;
            }
            Err(status) => {
                assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
                assert!(status.message().contains("--max-queue-bytes"), "{status:?}");
                rejected += 1;
            }
        }
    }
    let (_, peak) = memory_mib(pid);
    let grown = peak - before;
    // Freed memory goes back to the OS within a moment (mimalloc purges
    // freed pages after a short delay).
    let settled = Instant::now() + Duration::from_secs(5);
    let mut after = memory_mib(pid).0;
    while after - before > 64.0 && Instant::now() < settled {
        tokio::time::sleep(Duration::from_millis(100)).await;
        client.clone().predict(request(2, 1)).await.unwrap();
        after = memory_mib(pid).0;
    }
    eprintln!(
        "RSS {before:.0} MiB before, peak {peak:.0} (+{grown:.0}), {after:.0} after; {ok} OK, {rejected} \
         RESOURCE_EXHAUSTED"
    );
    assert!(ok >= 1, "ok {ok}, rejected {rejected}");
    assert!(grown <= BUDGET_MIB + CONSTANT_MIB, "peak RSS grew {grown:.0} MiB");
    assert!(after - before <= 64.0, "RSS stayed {:.0} MiB above its start", after - before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_can_never_fit_is_invalid_argument_naming_the_limit() {
    let (_server, url) = serve(&["--max-queue-bytes", "1048576"]).await;
    let mut client = client(&url).await;
    let status = client.predict(huge_bag(200_000)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("message") && status.message().contains("--max-queue-bytes"),
        "{status:?}"
    );
}
