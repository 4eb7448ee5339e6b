//! gRPC over TLS on loopback, with certificates made in the test (rcgen): a
//! client trusting the CA is served, a plaintext client is not; with a
//! client CA (mutual TLS), a client without a certificate, or with one
//! another CA signed, is refused at the handshake. The server is the mock
//! backend in the test's runtime; `narsil serve --tls-cert` is checked to
//! come up serving TLS too.

mod common;

use std::time::Duration;

use common::tls::{Authority, Leaf, MockTlsServer, TlsFiles};
use narsil::proto::predictor_client::PredictorClient;
use narsil::server::tls::ServerTls;
use tonic::transport::{Channel, ClientTlsConfig};

/// One Predict over a fresh connection to `url` with `tls` (none:
/// plaintext): the scores' count, or why it failed.
async fn predict(url: String, tls: Option<ClientTlsConfig>) -> Result<usize, String> {
    let mut endpoint = Channel::from_shared(url).unwrap().connect_timeout(Duration::from_secs(5));
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).map_err(|e| format!("{e:?}"))?;
    }
    let channel = endpoint.connect().await.map_err(|e| format!("connect: {e:?}"))?;
    let mut client = PredictorClient::new(channel);
    let mut request = tonic::Request::new(common::request(1, 3));
    request.set_timeout(Duration::from_secs(10));
    match client.predict(request).await {
        Ok(response) => Ok(response.into_inner().scores.len()),
        Err(status) => Err(format!("{status:?}")),
    }
}

fn trusting(ca: &Authority) -> ClientTlsConfig {
    ca.trusted_by_client()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_trusting_the_ca_is_served_over_tls_and_a_plaintext_client_is_refused() {
    let ca = Authority::new("narsil test CA");
    let server_cert = ca.sign(&["localhost", "127.0.0.1"]);
    let tls = ServerTls::from_pem(server_cert.cert.as_bytes(), server_cert.key.as_bytes(), None).unwrap();
    assert!(!format!("{tls:?}").contains("PRIVATE KEY"));
    let server = MockTlsServer::start(tls, false).await;
    let https = format!("https://127.0.0.1:{}", server.grpc.port());
    common::poll_until("the TLS server to answer", Duration::from_secs(30), || {
        let (url, tls) = (https.clone(), trusting(&ca));
        async move { predict(url, Some(tls)).await.ok() }
    })
    .await;
    assert_eq!(predict(https.clone(), Some(trusting(&ca))).await, Ok(3));

    let plaintext = predict(format!("http://127.0.0.1:{}", server.grpc.port()), None).await;
    assert!(plaintext.is_err(), "plaintext served: {plaintext:?}");
    let stranger = Authority::new("another CA");
    let untrusted = predict(https, Some(trusting(&stranger))).await;
    assert!(untrusted.is_err(), "a client that does not trust the server's CA went on: {untrusted:?}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_client_ca_only_clients_with_a_certificate_it_signed_are_served() {
    let (ca, clients_ca, stranger) =
        (Authority::new("server CA"), Authority::new("client CA"), Authority::new("another CA"));
    let server_cert = ca.sign(&["localhost"]);
    let tls = ServerTls::from_pem(
        server_cert.cert.as_bytes(),
        server_cert.key.as_bytes(),
        Some(clients_ca.pem().as_bytes()),
    )
    .unwrap();
    assert!(tls.mutual);
    let server = MockTlsServer::start(tls, false).await;
    let https = format!("https://127.0.0.1:{}", server.grpc.port());
    let with = |leaf: &Leaf| trusting(&ca).identity(leaf.identity());
    let client = clients_ca.sign(&["client"]);
    common::poll_until("the mTLS server to answer", Duration::from_secs(30), || {
        let (url, tls) = (https.clone(), with(&client));
        async move { predict(url, Some(tls)).await.ok() }
    })
    .await;
    assert_eq!(predict(https.clone(), Some(with(&client))).await, Ok(3));

    let anonymous = predict(https.clone(), Some(trusting(&ca))).await;
    assert!(anonymous.is_err(), "a client without a certificate was served: {anonymous:?}");
    let forged = predict(https.clone(), Some(with(&stranger.sign(&["client"])))).await;
    assert!(forged.is_err(), "a client certificate from another CA was accepted: {forged:?}");
    let plaintext = predict(format!("http://127.0.0.1:{}", server.grpc.port()), None).await;
    assert!(plaintext.is_err(), "plaintext served: {plaintext:?}");
    server.stop().await;
}

#[test]
fn a_key_that_is_not_the_certificate_s_is_refused_at_start() {
    let ca = Authority::new("narsil test CA");
    let (one, other) = (ca.sign(&["localhost"]), ca.sign(&["localhost"]));
    let err = ServerTls::from_pem(one.cert.as_bytes(), other.key.as_bytes(), None).unwrap_err();
    assert!(err.to_string().contains("cannot serve TLS with --tls-cert, --tls-key"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn narsil_serve_with_tls_cert_serves_grpc_health_over_tls_and_logs_no_key() {
    let ca = Authority::new("narsil test CA");
    let leaf = ca.sign(&["localhost"]);
    let files = TlsFiles::new(&leaf);
    let logs = tempfile::NamedTempFile::new().unwrap();
    let listeners = common::Listeners::new();
    let mut child = common::KillOnDrop(
        listeners
            .serve(false, "debug")
            .args(files.serve_args(false))
            .stderr(logs.reopen().unwrap())
            .spawn()
            .unwrap(),
    );
    let bound = listeners.wait(&mut child.0, Duration::from_secs(60)).await;
    common::tls::wait_serving(bound.grpc, trusting(&ca), Duration::from_secs(60)).await;
    assert!(predict(bound.url(), None).await.is_err(), "plaintext served");
    unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    assert!(child.0.wait().unwrap().success());
    let logged = std::fs::read_to_string(logs.path()).unwrap();
    assert!(logged.contains("tls=\"on\"") || logged.contains("tls=on"), "{logged}");
    let key_body = leaf.key.lines().nth(1).unwrap();
    assert!(!logged.contains("PRIVATE KEY") && !logged.contains(key_body), "the key is in the logs");
}
