//! No secret in any log line at any level: a full run of `narsil serve`
//! at `--log-level trace` (every crate's events, rustls', hyper's and h2's
//! included) with a model-control token and a TLS key (mutual TLS on both
//! listeners), through gRPC calls over TLS, control calls with the right
//! token, a wrong one and none, a certificate renewal and a drain; then the
//! whole log is searched for the token and for the keys in every form they
//! could be printed in (PEM lines, DER as hex or as a byte list).
#![cfg(feature = "burn")]

mod common;

use std::path::Path;
use std::time::Duration;

use common::tls::{client_config, https, Authority, Leaf, TlsFiles};
use narsil_core::golden::test_model_dir;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::PrivateKeyDer;

const TOKEN: &str = "s3cret-Narsil-control_token.for/log-test";

/// Publishes the test weights as version 1 of `dlrm`.
fn publish(repo: &Path) {
    let dir = repo.join("dlrm").join("1");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(test_model_dir().join("weights_fp32.safetensors"), dir.join("model.safetensors")).unwrap();
}

/// The forms a private key could take in a log line: its PEM lines, and
/// its secret (the scalar of rcgen's P-256 keys, inside PKCS#8's
/// `ECPrivateKey`: `02 01 01 04 20` then 32 bytes) as hex and as a byte
/// list. (The public key that follows it is in the certificate, which may
/// be logged.)
fn key_forms(leaf: &Leaf) -> Vec<String> {
    let der = PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).unwrap().secret_der().to_vec();
    let mut forms: Vec<String> =
        leaf.key.lines().filter(|l| !l.starts_with("-----") && l.len() >= 16).map(String::from).collect();
    let marker = [0x02, 0x01, 0x01, 0x04, 0x20];
    let at = der.windows(marker.len()).position(|w| w == marker).expect("a PKCS#8 P-256 key") + marker.len();
    let scalar = &der[at..at + 32];
    forms.push(scalar.iter().map(|b| format!("{b:02x}")).collect());
    forms.push(scalar.iter().map(|b| format!("{b:02X}")).collect());
    forms.push(format!("{:?}", &scalar[..12]).trim_matches(['[', ']']).to_string());
    forms
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_token_or_key_appears_in_a_trace_level_log_of_a_full_run_over_tls() {
    let repo = tempfile::tempdir().unwrap();
    publish(repo.path());
    let (ca, clients_ca) = (Authority::new("server CA"), Authority::new("client CA"));
    let (first, renewed) = (ca.sign(&["localhost"]), ca.sign(&["localhost"]));
    let files = TlsFiles::new(&first);
    files.write("clients-ca.crt", &clients_ca.pem());
    let token_file = files.write("control-token", &format!("{TOKEN}\n"));
    let client = clients_ca.sign(&["client"]);
    let logs = tempfile::NamedTempFile::new().unwrap();
    let listeners = common::Listeners::new();
    let mut child = common::KillOnDrop(
        listeners
            .serve_repository("trace", repo.path(), Some(&token_file))
            .args(files.serve_args(true))
            .stderr(logs.reopen().unwrap())
            .spawn()
            .unwrap(),
    );
    let bound = listeners.wait(&mut child.0, Duration::from_secs(60)).await;
    let grpc_tls = ca.trusted_by_client().identity(client.identity());
    let channel = common::tls::wait_serving(bound.grpc, grpc_tls, Duration::from_secs(60)).await;
    let mut predictor = narsil::proto::predictor_client::PredictorClient::new(channel);
    predictor.predict(common::request(1, 2)).await.unwrap();

    let (admin, config) = (bound.admin(), client_config(&ca, Some(&client), &[b"http/1.1"]));
    let control = |path: &'static str, authorization: Option<String>| {
        let config = config.clone();
        async move { https(admin, config, "POST", path, authorization.as_deref()).await.unwrap().0 }
    };
    let bearer = format!("Bearer {TOKEN}");
    assert_eq!(control("/v1/models/dlrm/unload", None).await, 401);
    assert_eq!(control("/v1/models/dlrm/unload", Some("Bearer wrong-token".into())).await, 403);
    assert_eq!(control("/v1/models/dlrm/unload", Some(format!("{bearer}x"))).await, 403);
    assert_eq!(control("/v1/models/dlrm/versions/1/unload", Some(bearer.clone())).await, 200);
    assert_eq!(control("/v1/models/dlrm/load", Some(bearer.clone())).await, 200);
    assert_eq!(control("/v1/repository/scan", Some(bearer)).await, 200);
    let (code, _) = https(admin, config.clone(), "GET", "/metrics", None).await.unwrap();
    assert_eq!(code, 200);

    // A renewal: the new key is read too.
    renewed.install(&files.cert(), &files.key());
    common::poll_until("the renewed certificate", Duration::from_secs(10), || {
        let (ca, client, renewed) = (&ca, &client, &renewed);
        async move {
            let served = common::tls::served_certificate(admin, ca, Some(client)).await.ok()?;
            (served == renewed.der).then_some(())
        }
    })
    .await;
    unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    assert!(child.0.wait().unwrap().success());

    let logged = std::fs::read_to_string(logs.path()).unwrap();
    assert!(logged.lines().count() > 100, "a trace-level run logs plenty: {} lines", logged.lines().count());
    assert!(logged.contains("TLS certificate reloaded"), "the renewal happened");
    let secret_lines = |secret: &str| logged.lines().filter(|l| l.contains(secret)).count();
    assert_eq!(secret_lines(TOKEN), 0, "the token is in the logs");
    assert_eq!(secret_lines(&TOKEN[..16]), 0, "a part of the token is in the logs");
    assert_eq!(secret_lines("PRIVATE KEY"), 0, "a PEM key is in the logs");
    for leaf in [&first, &renewed, &client] {
        for form in key_forms(leaf) {
            assert_eq!(secret_lines(&form), 0, "key material {form:?} is in the logs");
        }
    }
}
