//! A flood at the TLS door: 1,100 sockets held open on the gRPC port from
//! 5 loopback addresses, a third of them silent, a third sending the first
//! bytes of a ClientHello and a third a whole ClientHello, and then
//! nothing, each reconnecting as soon as the server drops it. Real TLS
//! clients on a path that delivers what they send 50 ms late, each on a
//! fresh connection, must all get their grpc.health answer within their
//! 5 s deadline (their p99 printed): the listener accepts whatever the
//! flood, sheds past its cap the handshakes that have gone longest without
//! progress, and drops a silent client at its ClientHello deadline, and
//! says so in `narsil_tls_handshakes_total`.
//!
//! A connection that sends no whole ClientHello is dropped at its deadline
//! and counted, flood or not.
//!
//! Over loopback in one process (server and flood share the test's
//! runtime), so each socket costs two file descriptors: the soft limit is
//! raised to the hard one if it is too low, and the test is skipped, saying
//! so, only if even the hard limit is.

mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use common::flood::{real_clients, room_for_files, Flood, Sends, PARTIAL_HELLO};
use common::tls::{client_config, https, Authority, MockTlsServer};
use narsil::server::tls::{ServerTls, CLIENT_HELLO_TIMEOUT};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Sockets the flood holds open.
const IDLE: usize = 1100;

/// The loopback addresses the flood comes from (127.0.0.2 and on), so that
/// no address holds more than the per-peer cap and the listener's own cap
/// is what sheds.
const SOURCES: usize = 5;

/// How long the real clients call while the flood goes on: past the
/// ClientHello deadline (5 s), so that the flood's sockets are dropped and
/// come back while they call.
const WINDOW: Duration = Duration::from_secs(8);

/// Real clients calling at once, each over and over.
const REAL_CLIENTS: usize = 4;

/// What the path adds to everything a real client sends.
const PATH_DELAY: Duration = Duration::from_millis(50);

/// Each real client's deadline: connect, handshake and health check. A door
/// locked by the flood keeps a client out for about 10 s (the handshake
/// timeout).
const DEADLINE: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_tls_clients_are_answered_while_1100_idle_sockets_hold_the_port() {
    const TEST: &str = "real_tls_clients_are_answered_while_1100_idle_sockets_hold_the_port";
    // The flood's end and the server's end of each socket, and some to spare.
    if let Err(why) = room_for_files(2 * IDLE as u64 + 512) {
        return common::skip(TEST, &why);
    }
    let ca = Authority::new("narsil test CA");
    let leaf = ca.sign(&["localhost"]);
    let tls = ServerTls::from_pem(leaf.cert.as_bytes(), leaf.key.as_bytes(), None).unwrap();
    let server = MockTlsServer::start(tls, true).await;
    let grpc = server.grpc;
    common::tls::wait_serving(grpc, ca.trusted_by_client(), common::PATIENCE).await;

    let sources: Vec<IpAddr> =
        (0..SOURCES).map(|n| IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2 + n as u8))).collect();
    let sends = |i: usize| [Sends::Nothing, Sends::HalfHello, Sends::WholeHello][(i / SOURCES) % 3];
    let flood = Flood::start(grpc, IDLE, &sources, sends).await;
    let served = real_clients(grpc, ca.trusted_by_client(), REAL_CLIENTS, PATH_DELAY, DEADLINE, WINDOW).await;
    let connects = flood.connects();
    drop(flood);
    eprintln!(
        "{} under a flood of {IDLE} idle sockets ({connects} connects in all); path delay {PATH_DELAY:?}",
        served.summary()
    );
    assert!(served.failures.is_empty(), "real clients failed: {:?}", served.failures);
    assert!(served.latencies.len() >= 10, "only {} real clients in {WINDOW:?}", served.latencies.len());

    let config = client_config(&ca, None, &[b"http/1.1"]);
    let (code, metrics) = https(server.admin(), config, "GET", "/metrics", None).await.unwrap();
    assert_eq!(code, 200, "{metrics}");
    let count = |outcome: &str| {
        common::metric(
            &metrics,
            &format!(r#"narsil_tls_handshakes_total{{listener="grpc",outcome="{outcome}"}}"#),
        )
    };
    let (shed, hello_timeouts) = (count("shed_oldest") + count("shed_peer"), count("hello_timeout"));
    let progressing = common::metric(&metrics, r#"narsil_tls_shed_progressing_total{listener="grpc"}"#);
    eprintln!(
        "handshakes shed: {shed} ({progressing} by the listener's cap not yet stalled), timed out waiting for the ClientHello: \
         {hello_timeouts}"
    );
    assert!(shed + hello_timeouts > 0.0, "the flood was neither shed nor timed out:\n{metrics}");
    assert!(count("ok") >= served.latencies.len() as f64, "{metrics}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_without_a_whole_client_hello_is_dropped_at_its_deadline_and_counted() {
    let ca = Authority::new("narsil test CA");
    let leaf = ca.sign(&["localhost"]);
    let tls = ServerTls::from_pem(leaf.cert.as_bytes(), leaf.key.as_bytes(), None).unwrap();
    let server = MockTlsServer::start(tls, true).await;
    let (grpc, started) = (server.grpc, Instant::now());
    let held = |hello: bool| async move {
        let mut stream = tokio::net::TcpStream::connect(grpc).await.unwrap();
        if hello {
            stream.write_all(&PARTIAL_HELLO).await.unwrap();
        }
        let mut answer = Vec::new();
        let bound = CLIENT_HELLO_TIMEOUT + Duration::from_secs(5);
        let ended = tokio::time::timeout(bound, stream.read_to_end(&mut answer)).await;
        assert!(ended.is_ok(), "still open {bound:?} after the connect (hello: {hello})");
        started.elapsed()
    };
    let (silent, half) = tokio::join!(held(false), held(true));
    eprintln!("dropped after {silent:?} (silent) and {half:?} (half a ClientHello)");
    for took in [silent, half] {
        assert!(took >= CLIENT_HELLO_TIMEOUT - Duration::from_millis(100), "dropped after {took:?}");
    }
    let config = client_config(&ca, None, &[b"http/1.1"]);
    let (_, metrics) = https(server.admin(), config, "GET", "/metrics", None).await.unwrap();
    let timed_out = r#"narsil_tls_handshakes_total{listener="grpc",outcome="hello_timeout"}"#;
    assert_eq!(common::metric(&metrics, timed_out), 2.0, "{metrics}");
    server.stop().await;
}
