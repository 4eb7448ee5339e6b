//! The admin address's front door, over real HTTP on loopback: model
//! control behind `--control-token-file` (a flood of calls without the
//! token or with a wrong one changes nothing, each answered 401/403 and
//! counted), bodies over the limit and malformed paths refused, the server
//! refusing to start with control open on a non-loopback address or with a
//! bad token file, and the token never in the logs.
//!
//! The repository holds the small test DLRM's Burn weights
//! (`models/generated/test-small/weights_fp32.safetensors`, from
//! scripts/test.sh) as `dlrm/<version>/model.safetensors`.
#![cfg(feature = "burn")]

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use narsil::cli::ServeArgs;
use narsil::lifecycle::control::MAX_CONTROL_BODY_BYTES;
use narsil::lifecycle::ModelRegistry;
use narsil::server::{Listen, Server};
use narsil_core::golden::test_model_dir;

const TOKEN: &str = "n4rsil-Control-t0ken_for/tests";

/// Publishes the test weights as `version` of `dlrm`.
fn publish(repo: &Path, version: u64) {
    let staging = repo.join("dlrm").join(format!(".incoming-{version}"));
    std::fs::create_dir_all(&staging).unwrap();
    std::fs::copy(test_model_dir().join("weights_fp32.safetensors"), staging.join("model.safetensors"))
        .unwrap();
    std::fs::rename(&staging, repo.join("dlrm").join(version.to_string())).unwrap();
}

/// `dlrm`'s versions by state.
fn states(models: &ModelRegistry) -> BTreeMap<String, &'static str> {
    models
        .list()
        .iter()
        .filter(|m| m.name == "dlrm")
        .flat_map(|m| m.versions.iter().map(|v| (v.version.clone(), v.state)))
        .collect()
}

fn ready(versions: &[&str]) -> BTreeMap<String, &'static str> {
    versions.iter().map(|v| (v.to_string(), "READY")).collect()
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// A repository server in the test's runtime, with model control and the
/// token, polling the repository only when asked.
struct DoorServer(common::RepoServer);

impl DoorServer {
    async fn start(repo: &Path) -> Self {
        Self(common::RepoServer::start(repo, TOKEN, |_| {}).await)
    }

    async fn wait_for(&self, wanted: BTreeMap<String, &'static str>) {
        let started = Instant::now();
        while states(&self.models) != wanted {
            assert!(started.elapsed() < Duration::from_secs(60), "{wanted:?}: {:#?}", self.models.list());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn stop(self) {
        self.0.stop().await
    }
}

impl std::ops::Deref for DoorServer {
    type Target = common::RepoServer;

    fn deref(&self) -> &common::RepoServer {
        &self.0
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_calls_without_the_token_or_with_a_wrong_one_change_nothing_and_are_counted() {
    let repo = tempfile::tempdir().unwrap();
    publish(repo.path(), 1);
    publish(repo.path(), 2);
    let server = DoorServer::start(repo.path()).await;
    server.wait_for(ready(&["2"])).await;
    // Version 3 waits for a scan, which only a call with the token may ask for.
    publish(repo.path(), 3);

    let paths = [
        "/v1/repository/scan",
        "/v1/models/dlrm/unload",
        "/v1/models/dlrm/load",
        "/v1/models/dlrm/versions/2/unload",
        "/v1/models/dlrm/versions/1/load",
    ];
    let wrong_prefix = bearer(&TOKEN[..TOKEN.len() - 1]);
    let wrong_longer = bearer(&format!("{TOKEN}x"));
    let basic = format!("Basic {TOKEN}");
    // (Authorization header, expected status, reason counted)
    let credentials: [(Option<&str>, u16, &str); 5] = [
        (None, 401, "missing"),
        (Some(&basic), 401, "missing"),
        (Some("Bearer wrong"), 403, "wrong"),
        (Some(&wrong_prefix), 403, "wrong"),
        (Some(&wrong_longer), 403, "wrong"),
    ];
    let calls: Vec<(String, Option<String>, u16)> = (0..1000)
        .map(|i| {
            let (authorization, code, _) = credentials[i % credentials.len()];
            (paths[(i / credentials.len()) % paths.len()].to_string(), authorization.map(String::from), code)
        })
        .collect();
    let expected_missing = calls.iter().filter(|(_, _, code)| *code == 401).count() as f64;
    let (admin, calls) = (server.admin, Arc::new(tokio::sync::Mutex::new(calls)));
    let mut clients = Vec::new();
    for _ in 0..16 {
        let calls = Arc::clone(&calls);
        clients.push(tokio::spawn(async move {
            let mut answered = Vec::new();
            while let Some((path, authorization, expected)) = calls.lock().await.pop() {
                let sent = Instant::now();
                let (code, body) = common::post(admin, &path, authorization.as_deref(), b"").await;
                answered.push((path, authorization, expected, code, body, sent.elapsed()));
            }
            answered
        }));
    }
    let mut latencies = Vec::new();
    for client in clients {
        for (path, authorization, expected, code, body, took) in client.await.unwrap() {
            assert_eq!((code, body.as_str()), (expected, "unauthorized"), "{path} with {authorization:?}");
            latencies.push(took);
        }
    }
    assert_eq!(latencies.len(), 1000);
    latencies.sort();
    eprintln!("refusals: p50 {:?}, p99 {:?}", latencies[500], latencies[989]);

    // Nothing changed: version 2 still the one served, 3 never scanned in.
    assert_eq!(states(&server.models), ready(&["2"]));
    let metrics = common::scrape(admin).await;
    let counted = |reason: &str| {
        common::metric(&metrics, &format!(r#"narsil_control_unauthorized_total{{reason="{reason}"}}"#))
    };
    assert_eq!(counted("missing"), expected_missing);
    assert_eq!(counted("wrong"), 1000.0 - expected_missing);

    // Listing stays open; the token itself opens the door.
    let (code, _) = common::http(admin, "GET", "/v1/models").await;
    assert_eq!(code, 200);
    let (code, body) = common::post(admin, "/v1/repository/scan", Some(&bearer(TOKEN)), b"").await;
    assert_eq!(code, 200, "{body}");
    server.wait_for(ready(&["3"])).await;
    let (code, body) =
        common::post(admin, "/v1/models/dlrm/versions/2/load", Some(&format!("bearer  {TOKEN} ")), b"").await;
    assert_eq!(code, 200, "the scheme in any case, spaces around the token: {body}");
    assert_eq!(states(&server.models), ready(&["2", "3"]));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_bodies_get_413_and_malformed_paths_are_refused_without_touching_the_repository() {
    let repo = tempfile::tempdir().unwrap();
    publish(repo.path(), 1);
    let server = DoorServer::start(repo.path()).await;
    server.wait_for(ready(&["1"])).await;
    let (admin, token) = (server.admin, bearer(TOKEN));

    // Declared over the limit: refused before the token is even looked at.
    let big = vec![b'{'; MAX_CONTROL_BODY_BYTES + 1];
    for authorization in [Some(token.as_str()), None] {
        let (code, body) = common::post(admin, "/v1/models/dlrm/unload", authorization, &big).await;
        assert_eq!(code, 413, "{authorization:?}: {body}");
    }
    // Chunked, so no length declared: read up to the limit, then refused.
    let mut chunked = format!(
        "POST /v1/models/dlrm/unload HTTP/1.1\r\nHost: narsil\r\nConnection: close\r\n\
         Authorization: {token}\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    .into_bytes();
    for _ in 0..3 {
        chunked.extend_from_slice(format!("{:x}\r\n", 32 << 10).as_bytes());
        chunked.extend(std::iter::repeat_n(b'x', 32 << 10));
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let (code, body) = common::exchange(admin, &chunked).await;
    assert_eq!(code, 413, "{body}");
    assert_eq!(states(&server.models), ready(&["1"]), "no oversized call unloaded anything");

    // Paths that try to leave the repository or name no version.
    for (path, expected) in [
        ("/v1/models/..%2F..%2Fetc/unload", 404),
        ("/v1/models/..%2Fdlrm/unload", 404),
        ("/v1/models/%2E%2E/load", 404),
        ("/v1/models/dlrm/versions/abc/unload", 400),
        ("/v1/models/dlrm/versions/-1/load", 400),
        ("/v1/models/dlrm/versions/1%2F..%2F2/load", 400),
    ] {
        let (code, body) = common::post(admin, path, Some(&token), b"").await;
        assert_eq!(code, expected, "{path}: {body}");
        // Without the token the door answers first, whatever the path.
        let (code, body) = common::post(admin, path, None, b"").await;
        assert_eq!((code, body.as_str()), (401, "unauthorized"), "{path}");
    }
    assert_eq!(states(&server.models), ready(&["1"]));
    assert_eq!(std::fs::read_dir(repo.path()).unwrap().count(), 1, "nothing written beside dlrm/");

    // A small body with the token is fine (the calls need none).
    let (code, body) = common::post(admin, "/v1/models/dlrm/unload", Some(&token), b"{}").await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(states(&server.models), BTreeMap::new());
    server.stop().await;
}

/// `narsil serve` over `repo` with model control and `args`: its exit
/// status and stderr, once it has exited (within 60 s).
fn serve_exits(repo: &Path, args: &[&str]) -> (std::process::ExitStatus, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_narsil"))
        .args(["serve", "--log-level", "info", "--addr", "127.0.0.1:0", "--model-control"])
        .arg("--model-repository")
        .arg(repo)
        .args(args)
        .env_remove("NARSIL_CONTROL_TOKEN_FILE")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("narsil serve {args:?} did not exit");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().unwrap();
    (output.status, String::from_utf8_lossy(&output.stderr).into_owned())
}

#[test]
fn model_control_without_a_token_refuses_a_non_loopback_admin_address_naming_the_flag() {
    let repo = tempfile::tempdir().unwrap();
    publish(repo.path(), 1);
    for admin in ["0.0.0.0:0", "[::]:0"] {
        let (status, stderr) = serve_exits(repo.path(), &["--metrics-addr", admin]);
        assert!(!status.success(), "{admin}: {stderr}");
        assert!(stderr.contains("needs --control-token-file"), "{admin}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedder_cannot_open_model_control_on_a_non_loopback_address_either() {
    let repo = tempfile::tempdir().unwrap();
    publish(repo.path(), 1);
    let mut args = ServeArgs::defaults();
    args.model_repository = Some(repo.path().to_path_buf());
    args.model_control = true;
    let repository = args.repository(args.engine_config().unwrap()).unwrap().unwrap();
    let listen = Listen {
        addr: "127.0.0.1:0".parse().unwrap(),
        metrics_addr: Some("0.0.0.0:0".parse().unwrap()),
        max_message_bytes: common::MAX_MESSAGE_BYTES,
    };
    let Err(err) = Server::start_repository(listen, repository).await else {
        panic!("served open model control on 0.0.0.0");
    };
    assert!(err.to_string().contains("needs --control-token-file"), "{err}");
}

#[test]
fn an_empty_or_unreadable_token_file_stops_the_start_naming_the_file() {
    let repo = tempfile::tempdir().unwrap();
    publish(repo.path(), 1);
    let empty = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(empty.path(), "\n").unwrap();
    let missing = repo.path().join("no-such-token");
    for (file, why) in [(empty.path(), "is empty"), (missing.as_path(), "cannot read")] {
        let file = file.to_str().unwrap();
        let (status, stderr) =
            serve_exits(repo.path(), &["--metrics-addr", "0.0.0.0:0", "--control-token-file", file]);
        assert!(!status.success(), "{stderr}");
        assert!(stderr.contains(why) && stderr.contains(file), "{file}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_never_appears_in_the_logs_of_a_full_run_at_trace_level() {
    let repo = tempfile::tempdir().unwrap();
    publish(repo.path(), 1);
    let token_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(token_file.path(), format!("{TOKEN}\n")).unwrap();
    let logs = tempfile::NamedTempFile::new().unwrap();
    let listeners = common::Listeners::new();
    let mut child = common::KillOnDrop(
        listeners
            .serve_repository("trace", repo.path(), Some(token_file.path()))
            .stderr(logs.reopen().unwrap())
            .spawn()
            .unwrap(),
    );
    let bound = listeners.wait(&mut child.0, Duration::from_secs(60)).await;
    let admin = bound.admin();
    common::wait_serving(&bound.url(), Duration::from_secs(60)).await;
    let token = bearer(TOKEN);
    assert_eq!(common::post(admin, "/v1/models/dlrm/unload", Some("Bearer not-it"), b"").await.0, 403);
    assert_eq!(common::post(admin, "/v1/models/dlrm/versions/1/unload", Some(&token), b"").await.0, 200);
    assert_eq!(common::post(admin, "/v1/models/dlrm/load", Some(&token), b"").await.0, 200);
    assert_eq!(common::post(admin, "/v1/repository/scan", Some(&token), b"").await.0, 200);
    unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    assert!(child.0.wait().unwrap().success());
    let logged = std::fs::read_to_string(logs.path()).unwrap();
    assert!(logged.lines().count() > 20, "a trace-level run logs plenty: {logged}");
    // The calls that carried the token were served, and logged what they did.
    let events: Vec<&str> = logged
        .lines()
        .filter(|line| line.contains(r#"model="dlrm""#))
        .filter_map(|line| ["loading version", "version retired"].into_iter().find(|e| line.contains(e)))
        .collect();
    let (load, retire) = ("loading version", "version retired");
    assert_eq!(events, [load, retire, load, retire], "the start, unload, load, the stop: {logged}");
    assert!(!logged.contains(TOKEN), "the token is in the logs");
    assert!(!logged.contains("model control is open"), "a token was set: {logged}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_model_control_on_loopback_says_so_once() {
    let repo = tempfile::tempdir().unwrap();
    publish(repo.path(), 1);
    let logs = tempfile::NamedTempFile::new().unwrap();
    let listeners = common::Listeners::new();
    let mut child = common::KillOnDrop(
        listeners
            .serve_repository("warn", repo.path(), None)
            .env_remove("NARSIL_CONTROL_TOKEN_FILE")
            .stderr(logs.reopen().unwrap())
            .spawn()
            .unwrap(),
    );
    let admin = listeners.wait(&mut child.0, Duration::from_secs(60)).await.admin();
    let (code, body) = common::post(admin, "/v1/repository/scan", None, b"").await;
    assert_eq!(code, 200, "open on loopback: {body}");
    unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    assert!(child.0.wait().unwrap().success());
    let logged = std::fs::read_to_string(logs.path()).unwrap();
    let warnings: Vec<&str> = logged.lines().filter(|l| l.contains("model control is open")).collect();
    assert_eq!(warnings.len(), 1, "{logged}");
    assert!(warnings[0].contains("WARN"), "{logged}");
}

#[test]
fn the_shipped_images_and_manifests_leave_model_control_off_or_behind_a_token_file() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    let shipped = [
        "kubernetes/narsil.yaml",
        "kserve/narsil-runtime.yaml",
        "images/narsil.Containerfile",
        "images/narsil-torch.Containerfile",
    ];
    for name in shipped {
        let text = std::fs::read_to_string(root.join(name)).unwrap();
        // What is in force: every line less its comment.
        let live: Vec<&str> = text.lines().map(|l| l.split('#').next().unwrap_or_default()).collect();
        let says = |what: &str| live.iter().any(|l| l.contains(what));
        assert!(says("narsil"), "{name}: read nothing");
        let control = says("--model-control") || says("NARSIL_MODEL_CONTROL");
        let token = says("NARSIL_CONTROL_TOKEN_FILE") || says("--control-token-file");
        assert!(!control || token, "{name} turns model control on without a token file");
        assert!(!says("--control-token="), "{name}: a token is never an argument");
    }
    // The commented-out stanza names the variable the binary reads.
    let kubernetes = std::fs::read_to_string(root.join("kubernetes/narsil.yaml")).unwrap();
    assert!(kubernetes.contains("{name: NARSIL_CONTROL_TOKEN_FILE, value: /var/run/secrets/narsil/token}"));
    assert!(kubernetes.contains("secretName: narsil-control-token"));
}
