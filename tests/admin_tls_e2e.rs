//! The admin address (`--metrics-addr`) over TLS, on loopback with
//! certificates made in the test: with `--tls-cert` it serves `/metrics`
//! over HTTPS to a client trusting the CA and answers no plaintext; with
//! `--tls-client-ca` it refuses a client without a certificate, as gRPC
//! does, unless `--metrics-tls no-client-cert`; `--metrics-tls off` keeps
//! it plain HTTP. The server is the mock backend in the test's runtime.

mod common;

use std::net::SocketAddr;

use common::tls::{client_config, https, plaintext_get, predict, Authority, Leaf, MockTlsServer};
use narsil::server::tls::{AdminTls, ServerTls};

/// `GET path` over HTTPS as a client trusting `ca` with `identity`.
async fn get(
    addr: SocketAddr,
    ca: &Authority,
    identity: Option<&Leaf>,
    path: &str,
) -> Result<(u16, String), String> {
    https(addr, client_config(ca, identity, &[b"http/1.1"]), "GET", path, None).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_over_https_are_served_to_a_client_trusting_the_ca_and_plaintext_gets_no_answer() {
    let ca = Authority::new("narsil test CA");
    let leaf = ca.sign(&["localhost"]);
    let server = MockTlsServer::start(
        ServerTls::from_pem(leaf.cert.as_bytes(), leaf.key.as_bytes(), None).unwrap(),
        true,
    )
    .await;

    let (code, body) = get(server.admin(), &ca, None, "/metrics").await.unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("narsil_"), "{body}");
    let (code, _) = get(server.admin(), &ca, None, "/v1/models").await.unwrap();
    assert_eq!(code, 200);
    // A client that does not trust the CA, and one offering only h2, are refused.
    assert!(get(server.admin(), &Authority::new("another CA"), None, "/metrics").await.is_err());
    let h2_only = https(server.admin(), client_config(&ca, None, &[b"h2"]), "GET", "/metrics", None).await;
    assert!(h2_only.is_err(), "the admin address speaks HTTP/1.1: {h2_only:?}");

    let plaintext = plaintext_get(server.admin(), "/metrics").await;
    assert!(!plaintext.starts_with("HTTP/"), "plaintext answered: {plaintext:?}");
    assert_eq!(predict(server.grpc, ca.trusted_by_client()).await, Ok(2), "gRPC still served over TLS");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_client_ca_the_admin_address_refuses_a_client_without_a_certificate_it_signed() {
    let (ca, clients_ca) = (Authority::new("server CA"), Authority::new("client CA"));
    let leaf = ca.sign(&["localhost"]);
    let tls =
        ServerTls::from_pem(leaf.cert.as_bytes(), leaf.key.as_bytes(), Some(clients_ca.pem().as_bytes()));
    let server = MockTlsServer::start(tls.unwrap(), true).await;
    let client = clients_ca.sign(&["client"]);

    let (code, body) = get(server.admin(), &ca, Some(&client), "/metrics").await.unwrap();
    assert_eq!(code, 200, "{body}");
    let anonymous = get(server.admin(), &ca, None, "/metrics").await;
    assert!(anonymous.is_err(), "a client without a certificate was served: {anonymous:?}");
    let forged =
        get(server.admin(), &ca, Some(&Authority::new("another CA").sign(&["client"])), "/metrics").await;
    assert!(forged.is_err(), "a client certificate from another CA was accepted: {forged:?}");
    assert!(!plaintext_get(server.admin(), "/healthz").await.starts_with("HTTP/"));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_tls_no_client_cert_serves_scrapers_without_one_while_grpc_stays_mutual() {
    let (ca, clients_ca) = (Authority::new("server CA"), Authority::new("client CA"));
    let leaf = ca.sign(&["localhost"]);
    let tls =
        ServerTls::from_pem(leaf.cert.as_bytes(), leaf.key.as_bytes(), Some(clients_ca.pem().as_bytes()))
            .unwrap()
            .with_admin(AdminTls::NoClientCert);
    let server = MockTlsServer::start(tls, true).await;

    let (code, body) = get(server.admin(), &ca, None, "/metrics").await.unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(
        predict(server.grpc, ca.trusted_by_client()).await.is_err(),
        "gRPC served a client without a certificate"
    );
    let client = clients_ca.sign(&["client"]);
    assert_eq!(predict(server.grpc, ca.trusted_by_client().identity(client.identity())).await, Ok(2));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_tls_off_keeps_the_admin_address_plain_beside_grpc_over_tls() {
    let ca = Authority::new("narsil test CA");
    let leaf = ca.sign(&["localhost"]);
    let tls = ServerTls::from_pem(leaf.cert.as_bytes(), leaf.key.as_bytes(), None)
        .unwrap()
        .with_admin(AdminTls::Off);
    let server = MockTlsServer::start(tls, true).await;
    assert!(common::scrape(server.admin()).await.contains("narsil_"));
    assert!(get(server.admin(), &ca, None, "/metrics").await.is_err(), "no TLS on a plain admin address");
    assert_eq!(predict(server.grpc, ca.trusted_by_client()).await, Ok(2));
    server.stop().await;
}
