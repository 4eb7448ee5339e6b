//! `narsil tables push-ids` over TLS, and the token's risk on a plaintext
//! admin address, against spawned `narsil serve` processes on loopback
//! with certificates made in the test.
//!
//! A server whose admin address serves mutual TLS (`--tls-cert`,
//! `--tls-client-ca`) takes a push from `narsil tables push-ids --server
//! https://…` with the CA and a client certificate, and then scores the
//! request with the new ids as the golden one; without the CA, or without
//! a client certificate, or over plain HTTP, the command fails naming why.
//! A control token on a non-loopback plaintext admin address starts with a
//! warning that it crosses the network in clear; over TLS, or on loopback,
//! without one.
#![cfg(feature = "torch")]

mod common;

use std::ffi::OsString;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::pushes::{close, publish, with_new_ids, NEW_IDS, TABLE, TOKEN};
use common::tls::{Authority, TlsFiles};
use narsil::proto::predictor_client::PredictorClient;
use narsil_core::golden::{test_model_dir, Golden};

/// `narsil tables push-ids MODEL --from NEW --server SERVER` with the token
/// and `tls` flags: whether it succeeded, and its output.
fn push_ids(model: &Path, new: &Path, server: &str, token: &Path, tls: &[OsString]) -> (bool, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_narsil"))
        .args(["tables", "push-ids"])
        .arg(model)
        .arg("--from")
        .arg(new)
        .args(["--server", server, "--table", &format!("cat_{TABLE}"), "--control-token-file"])
        .arg(token)
        .args(tls)
        .output()
        .unwrap();
    let text =
        format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    (output.status.success(), text)
}

/// A copy of the served version whose table `TABLE`'s map also holds the
/// request's new raw ids (each the row it replaced).
fn new_vocabulary(served: &Path, rows: &[usize]) -> tempfile::TempDir {
    let new = tempfile::tempdir().unwrap();
    narsil_core::golden::copy_split_model(served, new.path()).unwrap();
    let schema = narsil_embedding::SplitSchema::read(served).unwrap();
    let spec = &schema.tables[TABLE];
    let narsil_embedding::schema::TableIds::Map(map_spec) = &spec.ids else { panic!("mapped") };
    let (map, _) = narsil_embedding::IdMap::open(&served.join(&map_spec.file), spec.rows).unwrap();
    let mut pairs: Vec<(i64, u64)> = map.iter().collect();
    pairs.extend(rows.iter().map(|&r| (NEW_IDS + r as i64, r as u64)));
    let bytes = narsil_embedding::id_map::build(&pairs, spec.rows).unwrap();
    std::fs::write(new.path().join(&map_spec.file), bytes).unwrap();
    new
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_ids_speaks_mutual_tls_to_an_admin_address_that_serves_it() {
    let golden = Golden::read(&test_model_dir()).unwrap();
    let repo = tempfile::tempdir().unwrap();
    let defaults = publish(repo.path(), &golden, 1);
    let served = repo.path().join("dlrm/1");
    let g = &golden.requests[1];
    let (request, request_rows) = with_new_ids(g, &defaults);
    let new = new_vocabulary(&served, &request_rows);
    let (ca, clients_ca) = (Authority::new("server CA"), Authority::new("client CA"));
    let files = TlsFiles::new(&ca.sign(&["localhost"]));
    files.write("clients-ca.crt", &clients_ca.pem());
    let client = clients_ca.sign(&["push-ids"]);
    let ca_file = files.write("ca.crt", &ca.pem());
    let (client_cert, client_key) =
        (files.write("client.crt", &client.cert), files.write("client.key", &client.key));
    let token = files.write("token", &format!("{TOKEN}\n"));

    let listeners = common::Listeners::new();
    let mut child = common::KillOnDrop(
        listeners
            .serve_repository("warn", repo.path(), Some(&token))
            .args(files.serve_args(true))
            .args(["--table-store", "memory"])
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let bound = listeners.wait(&mut child.0, Duration::from_secs(60)).await;
    let tls = ca.trusted_by_client().identity(client.identity());
    let channel = common::tls::wait_serving(bound.grpc, tls, Duration::from_secs(120)).await;
    let score = |channel| {
        let request = common::wire(&request, "");
        async move { PredictorClient::new(channel).predict(request).await.unwrap().into_inner().scores }
    };
    assert!(!close(&score(channel.clone()).await, &g.scores_int8), "the new ids change the score");

    let https = format!("https://127.0.0.1:{}", bound.admin().port());
    let flags = |with: &[(&str, &Path)]| -> Vec<OsString> {
        let mut flags: Vec<OsString> = vec!["--tls-domain".into(), "localhost".into()];
        for (flag, path) in with {
            flags.extend([OsString::from(*flag), path.as_os_str().to_owned()]);
        }
        flags
    };
    let run = |server: &str, tls: Vec<OsString>| {
        tokio::task::block_in_place(|| push_ids(&served, new.path(), server, &token, &tls))
    };
    // Refused, each naming why, and nothing pushed.
    let (ok, said) = run(&https, flags(&[]));
    assert!(!ok && said.contains("needs --tls-ca"), "{said}");
    let (ok, said) = run(&https, flags(&[("--tls-ca", &ca_file)]));
    assert!(!ok && said.contains(&https), "without a client certificate: {said}");
    let plain = format!("http://127.0.0.1:{}", bound.admin().port());
    let (ok, said) = run(&plain, Vec::new());
    assert!(!ok && said.contains(&plain), "plain HTTP to a TLS address: {said}");
    assert!(!close(&score(channel.clone()).await, &g.scores_int8));

    let full = flags(&[("--tls-ca", &ca_file), ("--tls-cert", &client_cert), ("--tls-key", &client_key)]);
    let (ok, said) = run(&https, full);
    assert!(ok, "{said}");
    assert!(said.contains(&format!("pushed {} new ids of 1 tables of dlrm", request_rows.len())), "{said}");
    assert!(said.contains(&https), "{said}");
    assert!(close(&score(channel).await, &g.scores_int8), "pushed over TLS, the golden score");
    unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    assert!(child.0.wait().unwrap().success());
}

/// Starts `narsil serve` on an empty repository with model control and a
/// token, its admin address on `metrics_addr`, with `extra` flags; its
/// log up to the line that says the admin address serves.
async fn startup_log(metrics_addr: &str, extra: &[OsString]) -> String {
    let repo = tempfile::tempdir().unwrap();
    let token = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(token.path(), format!("{TOKEN}\n")).unwrap();
    let logs = tempfile::NamedTempFile::new().unwrap();
    let mut child = common::KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_narsil"))
            .args(["serve", "--log-level", "info", "--addr", "127.0.0.1:0", "--metrics-addr", metrics_addr])
            .args(["--repository-poll-secs", "0", "--model-control", "--model-repository"])
            .arg(repo.path())
            .arg("--control-token-file")
            .arg(token.path())
            .args(extra)
            .stdout(std::process::Stdio::null())
            .stderr(logs.reopen().unwrap())
            .spawn()
            .unwrap(),
    );
    let logged = common::poll_until("the admin address to serve", Duration::from_secs(60), || {
        if let Some(status) = child.0.try_wait().unwrap() {
            panic!("narsil serve exited ({status}): {}", std::fs::read_to_string(logs.path()).unwrap());
        }
        let text = std::fs::read_to_string(logs.path()).unwrap();
        std::future::ready(text.contains("serving /metrics").then_some(text))
    })
    .await;
    unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    let _ = child.0.wait();
    logged
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_on_a_plaintext_admin_address_other_hosts_reach_starts_with_a_warning() {
    let risk = "crosses the network in clear";
    let logged = startup_log("0.0.0.0:0", &[]).await;
    assert!(logged.contains(risk) && logged.contains("--metrics-addr 0.0.0.0:"), "{logged}");
    assert_eq!(logged.matches(risk).count(), 1, "{logged}");
    // Over TLS: no warning.
    let ca = Authority::new("server CA");
    let files = TlsFiles::new(&ca.sign(&["localhost"]));
    let logged = startup_log("0.0.0.0:0", &files.serve_args(false)).await;
    assert!(!logged.contains(risk), "{logged}");
    // TLS on gRPC only (`--metrics-tls off`): the warning again.
    let mut off = files.serve_args(false);
    off.extend(["--metrics-tls".into(), "off".into()]);
    assert!(startup_log("0.0.0.0:0", &off).await.contains(risk));
    // On loopback: none.
    assert!(!startup_log("127.0.0.1:0", &[]).await.contains(risk));
}
