//! Certificates reloaded under a running server: `narsil serve --tls-cert`
//! is given a renewed certificate on disk (renamed into place, as a
//! renewal does) and serves it to new connections, on gRPC and on the
//! admin address, within 5 s, while calls on a connection made before keep
//! succeeding; a broken file then keeps the renewed certificate in service
//! with one warning naming the file. A client CA replaced on disk lets the
//! new CA's clients in and keeps the old one's out. Reloads refused and
//! taken are counted in `narsil_tls_reloads_total`.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::tls::{
    client_config, https, predict, served_certificate, Authority, Leaf, MockTlsServer, TlsFiles,
};
use narsil::proto::predictor_client::PredictorClient;
use narsil::server::tls::{ServerTls, CHECK_EVERY};

/// The most a renewed certificate may take to reach new connections.
const RELOAD_WITHIN: Duration = Duration::from_secs(5);

/// Polls until the server at `addr` presents `leaf` to a new connection;
/// how long that took, or none within [`RELOAD_WITHIN`].
async fn until_served(addr: SocketAddr, ca: &Authority, leaf: &Leaf, since: Instant) -> Option<Duration> {
    while since.elapsed() < RELOAD_WITHIN {
        if served_certificate(addr, ca, None).await.ok().as_deref() == Some(leaf.der.as_slice()) {
            return Some(since.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_certificate_reaches_new_connections_within_5_s_and_calls_on_old_ones_never_fail() {
    let ca = Authority::new("narsil test CA");
    let first = ca.sign_named(&["localhost"], "first");
    let files = TlsFiles::new(&first);
    let logs = tempfile::NamedTempFile::new().unwrap();
    let listeners = common::Listeners::new();
    let mut child = common::KillOnDrop(
        listeners
            .serve(true, "info")
            .args(files.serve_args(false))
            .stderr(logs.reopen().unwrap())
            .spawn()
            .unwrap(),
    );
    let bound = listeners.wait(&mut child.0, Duration::from_secs(60)).await;
    let (grpc, admin) = (bound.grpc, bound.admin());
    let channel = common::tls::wait_serving(grpc, ca.trusted_by_client(), Duration::from_secs(60)).await;
    assert_eq!(served_certificate(grpc, &ca, None).await.unwrap(), first.der);
    assert_eq!(served_certificate(admin, &ca, None).await.unwrap(), first.der);

    // Calls on the connection made before the renewal, all through it.
    let stop = Arc::new(AtomicBool::new(false));
    let caller = tokio::spawn({
        let (stop, mut client) = (Arc::clone(&stop), PredictorClient::new(channel));
        async move {
            let (mut served, mut failed) = (0u32, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                match client.predict(common::request(served as u64, 3)).await {
                    Ok(response) if response.get_ref().scores.len() == 3 => served += 1,
                    other => failed.push(format!("{other:?}")),
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (served, failed)
        }
    });

    let second = ca.sign_named(&["localhost"], "second");
    let renewed = Instant::now();
    second.install(&files.cert(), &files.key());
    let took = until_served(grpc, &ca, &second, renewed).await;
    assert!(took.is_some(), "gRPC still serves the first certificate {RELOAD_WITHIN:?} after the renewal");
    assert!(until_served(admin, &ca, &second, renewed).await.is_some(), "the admin address did not follow");
    eprintln!("renewed certificate served after {took:?}");

    // A broken certificate file: the renewed one stays in service.
    std::fs::write(files.dir.path().join("broken"), "not a certificate\n").unwrap();
    std::fs::rename(files.dir.path().join("broken"), files.cert()).unwrap();
    let broken = Instant::now();
    while broken.elapsed() < Duration::from_secs(3) {
        assert_eq!(
            served_certificate(grpc, &ca, None).await.unwrap(),
            second.der,
            "a broken file was served"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    stop.store(true, Ordering::Relaxed);
    let (served, failed) = caller.await.unwrap();
    assert!(failed.is_empty(), "calls on the old connection failed: {failed:?}");
    assert!(served > 20, "only {served} calls on the old connection");
    unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    assert!(child.0.wait().unwrap().success());
    let logged = std::fs::read_to_string(logs.path()).unwrap();
    assert!(logged.contains("TLS certificate reloaded"), "{logged}");
    let cert = files.cert().display().to_string();
    let refusals: Vec<&str> = logged
        .lines()
        .filter(|l| l.contains("cannot reload TLS") && l.contains("holds no PEM certificate"))
        .collect();
    assert_eq!(refusals.len(), 1, "one warning for the broken file: {logged}");
    assert!(refusals[0].contains("WARN") && refusals[0].contains(&format!("--tls-cert {cert}")), "{logged}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_client_ca_lets_the_new_ca_s_clients_in_and_keeps_the_old_one_s_out() {
    let (ca, old_clients, new_clients) =
        (Authority::new("server CA"), Authority::new("old client CA"), Authority::new("new client CA"));
    let files = TlsFiles::new(&ca.sign(&["localhost"]));
    files.write("clients-ca.crt", &old_clients.pem());
    let tls = ServerTls::read(&files.cert(), &files.key(), Some(&files.client_ca())).unwrap();
    let server = MockTlsServer::start(tls, false).await;
    let addr = server.grpc;
    let (old_client, new_client) = (old_clients.sign(&["client"]), new_clients.sign(&["client"]));
    let with = |leaf: &Leaf| ca.trusted_by_client().identity(leaf.identity());
    assert_eq!(predict(addr, with(&old_client)).await, Ok(2));
    assert!(predict(addr, with(&new_client)).await.is_err());

    let staging = files.write("clients-ca.staging", &new_clients.pem());
    std::fs::rename(staging, files.client_ca()).unwrap();
    let replaced = Instant::now();
    while predict(addr, with(&new_client)).await.is_err() {
        assert!(
            replaced.elapsed() < RELOAD_WITHIN,
            "the new client CA is not in force after {RELOAD_WITHIN:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(predict(addr, with(&old_client)).await.is_err(), "the old client CA is still trusted");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_refused_and_taken_are_counted() {
    let ca = Authority::new("narsil test CA");
    let files = TlsFiles::new(&ca.sign_named(&["localhost"], "first"));
    let tls = ServerTls::read(&files.cert(), &files.key(), None).unwrap();
    let server = MockTlsServer::start(tls, true).await;
    let admin = server.admin();
    let reloads = |outcome: &'static str| {
        let config = client_config(&ca, None, &[b"http/1.1"]);
        async move {
            let (code, text) = https(admin, config, "GET", "/metrics", None).await.unwrap();
            assert_eq!(code, 200, "{text}");
            common::metric(&text, &format!(r#"narsil_tls_reloads_total{{outcome="{outcome}"}}"#))
        }
    };
    assert_eq!((reloads("ok").await, reloads("failed").await), (0.0, 0.0));

    std::fs::write(files.dir.path().join("broken"), "not a certificate\n").unwrap();
    std::fs::rename(files.dir.path().join("broken"), files.cert()).unwrap();
    let broken = Instant::now();
    while reloads("failed").await < 1.0 {
        assert!(broken.elapsed() < RELOAD_WITHIN, "a refused reload was not counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Looked at again and again, the same broken file counts once.
    tokio::time::sleep(CHECK_EVERY * 5 / 2).await;
    assert_eq!(reloads("failed").await, 1.0, "the broken file was counted more than once");
    ca.sign_named(&["localhost"], "second").install(&files.cert(), &files.key());
    let renewed = Instant::now();
    while reloads("ok").await < 1.0 {
        assert!(renewed.elapsed() < RELOAD_WITHIN, "a reload taken was not counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server.stop().await;
}
