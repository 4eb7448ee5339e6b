//! TLS connections end with their age (`--tls-max-connection-age-secs`,
//! `--tls-connection-age-grace-secs`), so that what their handshake
//! checked is checked again: a client whose CA was taken out of
//! `--tls-client-ca` is shut out within the reload, the age and the grace,
//! even on a channel it opened before; a call still in flight at age +
//! grace is cut; an idle HTTP/1.1 keep-alive connection to the admin
//! address is closed at its age.

mod common;

use std::time::{Duration, Instant};

use common::tls::{client_config, Authority, Leaf, MockTlsServer, TlsFiles};
use narsil::proto::predictor_client::PredictorClient;
use narsil::server::tls::{ConnectionAge, ServerTls, CHECK_EVERY};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls::pki_types::ServerName;
use tonic::transport::Channel;

const AGE: ConnectionAge = ConnectionAge { max: Duration::from_secs(2), grace: Duration::from_secs(1) };

/// Room for a loaded machine on top of what the age and the reload take.
const SLACK: Duration = Duration::from_secs(5);

async fn channel(addr: std::net::SocketAddr, ca: &Authority, identity: Option<&Leaf>) -> Channel {
    let mut tls = ca.trusted_by_client();
    if let Some(leaf) = identity {
        tls = tls.identity(leaf.identity());
    }
    let endpoint = Channel::from_shared(format!("https://{addr}")).unwrap().tls_config(tls).unwrap();
    endpoint.connect().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_whose_ca_was_removed_is_shut_out_on_the_channel_it_opened_before() {
    let (ca, old_clients, new_clients) =
        (Authority::new("server CA"), Authority::new("old client CA"), Authority::new("new client CA"));
    let files = TlsFiles::new(&ca.sign(&["localhost"]));
    files.write("clients-ca.crt", &old_clients.pem());
    let tls = ServerTls::read(&files.cert(), &files.key(), Some(&files.client_ca())).unwrap();
    let server = MockTlsServer::start(tls.with_connection_age(Some(AGE)), false).await;
    let old_client = old_clients.sign(&["client"]);
    let mut client = PredictorClient::new(channel(server.grpc, &ca, Some(&old_client)).await);
    assert!(client.predict(common::request(0, 2)).await.is_ok());

    let staging = files.write("clients-ca.staging", &new_clients.pem());
    std::fs::rename(staging, files.client_ca()).unwrap();
    let (replaced, bound) = (Instant::now(), CHECK_EVERY + AGE.max + AGE.grace + SLACK);
    let mut served = 0;
    let refused = loop {
        match client.predict(common::request(served, 2)).await {
            Ok(_) => served += 1,
            Err(status) => break status,
        }
        assert!(
            replaced.elapsed() < bound,
            "the removed CA's client was still served {bound:?} after the change ({served} calls)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("shut out after {:?} ({served} calls served meanwhile): {refused:?}", replaced.elapsed());
    for n in 0..3 {
        assert!(client.predict(common::request(n, 2)).await.is_err(), "served again after the refusal");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_still_in_flight_at_age_plus_grace_is_cut() {
    let ca = Authority::new("server CA");
    let leaf = ca.sign(&["localhost"]);
    let tls = ServerTls::from_pem(leaf.cert.as_bytes(), leaf.key.as_bytes(), None).unwrap();
    let latency = AGE.max + AGE.grace + SLACK;
    let server = MockTlsServer::start_slow(tls.with_connection_age(Some(AGE)), false, latency).await;
    let ready = common::tls::wait_serving(server.grpc, ca.trusted_by_client(), common::PATIENCE);
    drop(ready.await);
    let mut client = PredictorClient::new(channel(server.grpc, &ca, None).await);
    let started = Instant::now();
    let cut = client.predict(common::request(0, 2)).await;
    let took = started.elapsed();
    eprintln!("a call of {latency:?} on a connection of age {AGE:?} ended after {took:?}: {cut:?}");
    assert!(cut.is_err(), "answered after {took:?}, past the connection's age and grace");
    assert!(took < latency, "cut only after {took:?}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keep_alive_connection_to_the_admin_address_is_closed_at_its_age() {
    let ca = Authority::new("server CA");
    let leaf = ca.sign(&["localhost"]);
    let tls = ServerTls::from_pem(leaf.cert.as_bytes(), leaf.key.as_bytes(), None).unwrap();
    let server = MockTlsServer::start(tls.with_connection_age(Some(AGE)), true).await;
    let tcp = tokio::net::TcpStream::connect(server.admin()).await.unwrap();
    let connector = tokio_rustls::TlsConnector::from(client_config(&ca, None, &[b"http/1.1"]));
    let mut stream = connector.connect(ServerName::try_from("localhost").unwrap(), tcp).await.unwrap();
    let opened = Instant::now();
    stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: narsil\r\n\r\n").await.unwrap();
    let mut answer = vec![0u8; 4096];
    let n = stream.read(&mut answer).await.unwrap();
    assert!(String::from_utf8_lossy(&answer[..n]).starts_with("HTTP/1.1 "), "{:?}", &answer[..n]);
    let bound = AGE.max + AGE.grace + SLACK;
    let rest = tokio::time::timeout(bound, stream.read_to_end(&mut answer)).await;
    let closed = opened.elapsed();
    eprintln!("the idle admin connection ended after {closed:?}: {rest:?}");
    assert!(rest.is_ok(), "still open {bound:?} after it was made");
    assert!(closed >= AGE.max - Duration::from_millis(200), "closed after {closed:?}, before its age");
    server.stop().await;
}
