//! Memory is bounded by decoded bytes, not just rows: a flood of worst-case
//! `narsil.v1` messages (one sample whose first bag holds 900,000 ids, one
//! byte each on the wire, 7.2 MB decoded) against a 16 MiB
//! `--max-queue-bytes` gets every request answered (OK or
//! RESOURCE_EXHAUSTED naming the limit), the queue never holds more than the
//! limit, and the process (client and server) grows by less than 256 MiB.
//! The RSS bound is loose on purpose: requests are decoded before they are
//! admitted, so concurrent decodes add a transient peak the queue limit does
//! not cover (77 and 131 MiB in two runs). One request larger than the limit
//! can never fit and is INVALID_ARGUMENT.
//! In a file of its own: it reads this process's resident memory.

mod common;

use common::{request, start};
use futures_util::future::join_all;
use narsil::proto::PredictRequest;
use tonic::Code;

const QUEUE_BYTES: usize = 16 << 20;
const IDS_IN_FIRST_BAG: usize = 900_000;

/// One sample; its first bag holds `ids` copies of id 0 (a 1-byte varint).
fn huge_bag(ids: usize) -> PredictRequest {
    let mut r = request(1, 1);
    let others: usize = r.sparse_lengths[1..].iter().map(|&l| l as usize).sum();
    let first = r.sparse_lengths[0] as usize;
    let rest = r.sparse_ids.split_off(first);
    assert_eq!(rest.len(), others);
    r.sparse_lengths[0] = ids as u32;
    r.sparse_ids = std::iter::repeat_n(0, ids).chain(rest).collect();
    r
}

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<f64>().unwrap() / 1024.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_huge_bags_is_bounded_by_queue_bytes_and_answered() {
    let config = common::config(|c| {
        c.max_queue_bytes = QUEUE_BYTES;
        c.max_batch_requests = 1;
    });
    let server = start(config, 200).await.ready().await;
    let channel = server.channel().await;

    let before = rss_mib();
    let calls = join_all((0..32).map(|_| {
        let mut client = narsil::proto::predictor_client::PredictorClient::new(channel.clone());
        async move { client.predict(huge_bag(IDS_IN_FIRST_BAG)).await }
    }))
    .await;
    let grown = rss_mib() - before;
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
    assert!(ok >= 1 && rejected >= 1, "ok {ok}, rejected {rejected}");
    let peak = server.engine.queue_bytes_peak();
    assert!(peak > 0 && peak <= QUEUE_BYTES, "queue held {peak} bytes at most");
    // Queued all at once they would decode to 32 x 7.2 MB = 230 MB.
    eprintln!("RSS grew {grown:.0} MiB; {ok} OK, {rejected} RESOURCE_EXHAUSTED");
    assert!(grown < 256.0, "RSS grew {grown:.0} MiB");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_can_never_fit_is_invalid_argument_naming_the_limit() {
    let config = common::config(|c| c.max_queue_bytes = 1 << 20);
    let server = start(config, 0).await.ready().await;
    let mut client = server.client().await;
    let status = client.predict(huge_bag(200_000)).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("message") && status.message().contains("--max-queue-bytes"),
        "{status:?}"
    );
    assert_eq!(server.engine.stats().forwards, 0);
    server.stop().await.unwrap();
}
