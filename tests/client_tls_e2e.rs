//! `narsil load` and `narsil verify` over TLS, as binaries against `narsil
//! serve --tls-cert` with the small exported model (Burn,
//! `models/generated/test-small/weights_fp32.safetensors`): `--tls-ca`
//! (an `https://` address, or an `http://` one it turns into `https://`),
//! `--tls-domain` for a certificate that names `localhost` only, and
//! `--tls-cert`/`--tls-key` for a server with mutual TLS. Without the CA,
//! or the client certificate, they fail saying why.
#![cfg(feature = "burn")]

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use common::tls::{Authority, Leaf, TlsFiles};
use narsil_core::golden::test_model_dir;
use tonic::transport::ClientTlsConfig;

/// `narsil serve` of the test model over TLS with `files` (and their client CA if `mutual`).
async fn serve(
    files: &TlsFiles,
    mutual: bool,
    client_tls: ClientTlsConfig,
) -> (common::KillOnDrop, SocketAddr) {
    let listeners = common::Listeners::new();
    let mut command = listeners.serve(false, "warn");
    command
        .arg("--model")
        .arg(test_model_dir().join("weights_fp32.safetensors"))
        .args(files.serve_args(mutual));
    let mut child = common::KillOnDrop(command.spawn().unwrap());
    let grpc = listeners.wait(&mut child.0, Duration::from_secs(60)).await.grpc;
    common::tls::wait_serving(grpc, client_tls, Duration::from_secs(60)).await;
    (child, grpc)
}

/// Runs `narsil ARGS` to its end.
async fn narsil(args: Vec<String>) -> Output {
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_narsil")).args(&args).env("NARSIL_LOG", "warn").output().unwrap()
    })
    .await
    .unwrap()
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| a.to_string()).collect()
}

fn path(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

/// `narsil load` of 40 requests in `protocol` with `tls` flags; the
/// requests answered OK, or the failure's stderr.
async fn load(addr: &str, protocol: &str, tls: &[String]) -> Result<u64, String> {
    let mut args =
        strings(&["load", "--addr", addr, "--protocol", protocol, "--requests", "40", "--warmup", "4"]);
    args.extend(strings(&[
        "--concurrency",
        "4",
        "--samples-per-request",
        "8",
        "--table-rows",
        "1000",
        "--json",
    ]));
    args.extend_from_slice(tls);
    let out = narsil(args).await;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    Ok(report["ok"].as_u64().unwrap())
}

/// `narsil verify` of the golden FP32 scores with `tls` flags: whether it
/// passed, and its output.
async fn verify(addr: &str, tls: &[String]) -> (bool, String) {
    let mut args = strings(&["verify", "--addr", addr, "--scores", "fp32", "--wait-secs", "3", "--golden"]);
    args.push(path(&test_model_dir()));
    args.extend_from_slice(tls);
    let out = narsil(args).await;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn narsil_load_speaks_every_protocol_over_tls_and_verify_checks_the_golden_scores_over_it() {
    let ca = Authority::new("narsil test CA");
    let files = TlsFiles::new(&ca.sign(&["localhost"]));
    let ca_file = path(&files.write("ca.crt", &ca.pem()));
    let (_server, grpc) = serve(&files, false, ca.trusted_by_client()).await;
    let https = format!("https://{grpc}");
    let with_ca = strings(&["--tls-ca", &ca_file, "--tls-domain", "localhost"]);

    for protocol in ["narsil", "torchrec", "kserve"] {
        assert_eq!(load(&https, protocol, &with_ca).await, Ok(40), "{protocol} over TLS");
    }
    let (passed, output) = verify(&https, &with_ca).await;
    assert!(passed, "{output}");
    assert!(output.contains("golden requests (fp32 scores) match"), "{output}");
    // --tls-ca alone turns an http:// address into https://.
    assert_eq!(load(&format!("http://{grpc}"), "narsil", &with_ca).await, Ok(40));

    let err = load(&https, "narsil", &[]).await.unwrap_err();
    assert!(err.contains("needs --tls-ca"), "{err}");
    let (passed, output) = verify(&https, &strings(&["--tls-ca", &ca_file])).await;
    assert!(!passed, "verified against a certificate for localhost at 127.0.0.1");
    assert!(output.contains("certificate"), "the cause is named: {output}");
    let (passed, output) = verify(&format!("http://{grpc}"), &[]).await;
    assert!(!passed, "plaintext verify passed against a TLS server: {output}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_mutual_tls_load_and_verify_present_their_client_certificate() {
    let (ca, clients_ca) = (Authority::new("server CA"), Authority::new("client CA"));
    let files = TlsFiles::new(&ca.sign(&["localhost"]));
    files.write("clients-ca.crt", &clients_ca.pem());
    let ca_file = path(&files.write("ca.crt", &ca.pem()));
    let client: Leaf = clients_ca.sign(&["client"]);
    let (client_cert, client_key) =
        (files.write("client.crt", &client.cert), files.write("client.key", &client.key));
    let (_server, grpc) = serve(&files, true, ca.trusted_by_client().identity(client.identity())).await;
    let https = format!("https://{grpc}");
    let mut with_cert = strings(&["--tls-ca", &ca_file, "--tls-domain", "localhost", "--tls-cert"]);
    with_cert.extend([path(&client_cert), "--tls-key".into(), path(&client_key)]);

    assert_eq!(load(&https, "narsil", &with_cert).await, Ok(40));
    let (passed, output) = verify(&https, &with_cert).await;
    assert!(passed, "{output}");
    let without = strings(&["--tls-ca", &ca_file, "--tls-domain", "localhost"]);
    assert!(load(&https, "narsil", &without).await.is_err(), "served a load without a client certificate");
    let (passed, _) = verify(&https, &without).await;
    assert!(!passed, "verified without a client certificate");
}
