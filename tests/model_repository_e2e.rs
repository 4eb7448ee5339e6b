//! Serving from a model repository, over real gRPC with real libtorch
//! models: versions published under load, broken versions refused, no
//! memory kept by retired versions, and two models served side by side.
//!
//! Two exports of the small test DLRM with different weights
//! (`models/generated/test-small` and `test-small-b`, from scripts/test.sh)
//! are published as alternating versions, so an answer computed by the
//! wrong version has the wrong scores.
// Cases are tables of (name, input, expected) tuples, read best inline.
#![allow(clippy::type_complexity)]
#![cfg(feature = "torch")]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{assert_close, wire, MAX_MESSAGE_BYTES};
use narsil::cli::ServeArgs;
use narsil::lifecycle::registry::ModelStatus;
use narsil::lifecycle::ModelRegistry;
use narsil::proto::predictor_client::PredictorClient;
use narsil::proto::ModelInfoRequest;
use narsil::server::{Listen, Server};
use narsil::torchrec_proto::predictor_client::PredictorClient as TorchRecClient;
use narsil::wire::torchrec::{encode, MODEL_HEADER, MODEL_VERSION_HEADER, SCORES_KEY};
use narsil_core::golden::{test_model_dir, Golden};
use tokio::sync::oneshot;
use tonic::Code;

/// Export `a` (test-small) or `b` (test-small-b).
fn export(which: char) -> PathBuf {
    let a = test_model_dir();
    match which {
        'a' => a,
        _ => {
            let b = a.with_file_name("test-small-b");
            assert!(b.join("golden.json").is_file(), "no {}: run scripts/test.sh", b.display());
            b
        }
    }
}

/// Publishes `file` of `export` (and its model.json, if any) as `version`
/// of `model`: written under a dot-name, then renamed into place.
fn publish(repo: &Path, model: &str, version: u64, export: &Path, file: &str) {
    let staging = repo.join(model).join(format!(".incoming-{version}"));
    std::fs::create_dir_all(&staging).unwrap();
    std::fs::copy(export.join(file), staging.join("model.pt")).unwrap();
    if export.join("model.json").is_file() {
        std::fs::copy(export.join("model.json"), staging.join("model.json")).unwrap();
    }
    std::fs::rename(&staging, repo.join(model).join(version.to_string())).unwrap();
}

/// Versions of `model` by state.
fn states(list: &[ModelStatus], model: &str) -> BTreeMap<String, &'static str> {
    list.iter()
        .filter(|m| m.name == model)
        .flat_map(|m| m.versions.iter().map(|v| (v.version.clone(), v.state)))
        .collect()
}

struct RepoServer {
    url: String,
    metrics_addr: std::net::SocketAddr,
    models: Arc<ModelRegistry>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl RepoServer {
    async fn start(repo: &Path, edit: impl FnOnce(&mut ServeArgs)) -> Self {
        let mut args = ServeArgs::defaults();
        args.model_repository = Some(repo.to_path_buf());
        args.repository_poll_secs = 0.1;
        edit(&mut args);
        let repository = args.repository(args.engine_config().unwrap()).unwrap().unwrap();
        let listen = Listen {
            addr: "127.0.0.1:0".parse().unwrap(),
            metrics_addr: Some("127.0.0.1:0".parse().unwrap()),
            max_message_bytes: MAX_MESSAGE_BYTES,
        };
        let server = Server::start_repository(listen, repository).await.unwrap();
        let url = format!("http://{}", server.local_addr());
        let (metrics_addr, models) = (server.metrics_addr().unwrap(), server.models());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server.run(async {
            let _ = stopped.await;
        }));
        Self { url, metrics_addr, models, stop: Some(stop), task }
    }

    /// Waits until `done` holds for the listed models (60 s at most).
    async fn wait_until(&self, what: &str, done: impl Fn(&[ModelStatus]) -> bool) {
        let started = Instant::now();
        while !done(&self.models.list()) {
            assert!(started.elapsed() < Duration::from_secs(60), "{what}: {:#?}", self.models.list());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn client(&self) -> PredictorClient<tonic::transport::Channel> {
        PredictorClient::connect(self.url.clone()).await.unwrap()
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap().unwrap();
    }
}

/// One answered request of the load.
struct Answer {
    sent: Instant,
    version: u64,
    golden_index: usize,
    scores: Vec<f32>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_versions_published_under_load_lose_no_request_and_answer_with_their_own_scores() {
    let repo = tempfile::tempdir().unwrap();
    let (a, b) = (export('a'), export('b'));
    // Odd versions are export a, even ones export b.
    let export_of = |version: u64| if !version.is_multiple_of(2) { &a } else { &b };
    let goldens = [Golden::read(&a).unwrap(), Golden::read(&b).unwrap()];
    let golden_of = |version: u64| &goldens[usize::from(version.is_multiple_of(2))];
    publish(repo.path(), "dlrm", 1, export_of(1), "model_default.pt");
    let server = RepoServer::start(repo.path(), |_| {}).await;
    server.wait_until("version 1 ready", |l| states(l, "dlrm").get("1") == Some(&"READY")).await;
    common::wait_serving(&server.url, Duration::from_secs(30)).await;

    // When each version was published, and when it was seen retired.
    let published = Arc::new(Mutex::new(BTreeMap::from([(1u64, Instant::now())])));
    let retired = Arc::new(Mutex::new(BTreeMap::<u64, Instant>::new()));
    // At least 20 s, and until the last version has served for a while.
    let load_started = Instant::now();
    let load_over = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let channel =
        tonic::transport::Channel::from_shared(server.url.clone()).unwrap().connect().await.unwrap();
    let requests = Arc::new(goldens[0].requests.clone());
    let clients: Vec<_> = (0..16)
        .map(|c| {
            let mut client = PredictorClient::new(channel.clone());
            let requests = Arc::clone(&requests);
            let load_over = Arc::clone(&load_over);
            tokio::spawn(async move {
                let (mut answers, mut failures) = (Vec::new(), Vec::new());
                let mut i = c;
                while !load_over.load(std::sync::atomic::Ordering::Relaxed) {
                    let golden_index = i % requests.len();
                    i += 16;
                    let sent = Instant::now();
                    match client.predict(wire(&requests[golden_index], "load")).await {
                        Ok(response) => {
                            let response = response.into_inner();
                            let version = response.model_version.parse().unwrap();
                            answers.push(Answer { sent, version, golden_index, scores: response.scores });
                        }
                        Err(status) => failures.push(status),
                    }
                }
                (answers, failures)
            })
        })
        .collect();
    for version in 2..=6u64 {
        tokio::time::sleep(Duration::from_millis(2500)).await;
        publish(repo.path(), "dlrm", version, export_of(version), "model_default.pt");
        published.lock().unwrap().insert(version, Instant::now());
        let (now, before) = (version.to_string(), (version - 1).to_string());
        server
            .wait_until("the new version replaces the old", |l| {
                let s = states(l, "dlrm");
                s.get(&now) == Some(&"READY") && !s.contains_key(&before)
            })
            .await;
        retired.lock().unwrap().insert(version - 1, Instant::now());
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    tokio::time::sleep_until((load_started + Duration::from_secs(20)).into()).await;
    load_over.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut answers = Vec::new();
    for client in clients {
        let (mine, failures) = client.await.unwrap();
        assert!(failures.is_empty(), "non-OK answers during publishes: {failures:?}");
        answers.extend(mine);
    }
    let (published, retired) = (published.lock().unwrap().clone(), retired.lock().unwrap().clone());
    let mut per_version = BTreeMap::<u64, usize>::new();
    for answer in &answers {
        let v = answer.version;
        *per_version.entry(v).or_default() += 1;
        assert!(published[&v] <= answer.sent, "version {v} answered a request sent before it was published");
        if let Some(gone) = retired.get(&v) {
            assert!(answer.sent <= *gone, "version {v} answered a request sent after it was retired");
        }
        let golden = &golden_of(v).requests[answer.golden_index];
        assert_close(
            &answer.scores,
            &golden.scores_int8,
            &format!("version {v}, golden request {}", answer.golden_index),
        );
    }
    assert_eq!(per_version.keys().copied().collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6], "{per_version:?}");
    let metrics = common::scrape(server.metrics_addr).await;
    assert_eq!(common::metric(&metrics, r#"narsil_model_loads_total{model="dlrm",outcome="ok"}"#), 6.0);
    assert_eq!(common::metric(&metrics, r#"narsil_model_versions{model="dlrm",state="ready"}"#), 1.0);
    assert!(metrics.contains(r#"narsil_requests_total{model="dlrm",version="6",outcome="ok"}"#), "{metrics}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_versions_are_refused_while_the_old_one_keeps_serving() {
    let repo = tempfile::tempdir().unwrap();
    let (a, b) = (export('a'), export('b'));
    publish(repo.path(), "dlrm", 1, &a, "model_default.pt");
    let server = RepoServer::start(repo.path(), |_| {}).await;
    server.wait_until("version 1 ready", |l| states(l, "dlrm").get("1") == Some(&"READY")).await;
    let golden = Golden::read(&a).unwrap();

    let mut client = server.client().await;
    // Each bad version in turn: a truncated file (as a half-finished copy
    // leaves it), a model taking other inputs (weighted features, two
    // outputs), a directory without a model file.
    let truncated = repo.path().join("dlrm/.incoming-2");
    std::fs::create_dir_all(&truncated).unwrap();
    let bytes = std::fs::read(a.join("model_default.pt")).unwrap();
    std::fs::write(truncated.join("model.pt"), &bytes[..bytes.len() / 2]).unwrap();
    let multitask = a.with_file_name("test-torchrec-multitask");
    let bad_versions: [(u64, Box<dyn Fn()>, &str); 3] = [
        (2, Box::new(|| std::fs::rename(&truncated, repo.path().join("dlrm/2")).unwrap()), "model.pt"),
        (
            3,
            Box::new(|| publish(repo.path(), "dlrm", 3, &multitask, "model.pt")),
            "does not match the served schema",
        ),
        (4, Box::new(|| std::fs::create_dir_all(repo.path().join("dlrm/4")).unwrap()), "holds no model file"),
    ];
    for (version, publish_it, reason) in bad_versions {
        publish_it();
        let label = version.to_string();
        server
            .wait_until("the bad version failed", |l| states(l, "dlrm").get(&label) == Some(&"FAILED"))
            .await;
        let info = client.model_info(ModelInfoRequest::default()).await.unwrap().into_inner();
        assert_eq!(info.version, "1", "the old version still takes the requests");
        let failed = info.versions.iter().find(|v| v.version == label).unwrap();
        assert_eq!(failed.state, "FAILED");
        assert!(failed.error.contains(reason), "version {version}: {failed:?}");
    }
    for (i, g) in golden.requests.iter().enumerate() {
        let response = client.predict(wire(g, "after")).await.unwrap().into_inner();
        assert_eq!(response.model_version, "1");
        assert_close(&response.scores, &g.scores_int8, &format!("golden request {i}"));
    }
    let channel =
        tonic::transport::Channel::from_shared(server.url.clone()).unwrap().connect().await.unwrap();
    assert_eq!(common::health_status(channel).await.unwrap(), 1, "still SERVING");
    let metrics = common::scrape(server.metrics_addr).await;
    assert_eq!(common::metric(&metrics, r#"narsil_model_loads_total{model="dlrm",outcome="failed"}"#), 3.0);
    // Superseded failures are forgotten: only the latest is listed.
    assert_eq!(common::metric(&metrics, r#"narsil_model_versions{model="dlrm",state="failed"}"#), 1.0);

    // A good version after them is served; the failed ones are retried only
    // when their files change.
    publish(repo.path(), "dlrm", 5, &b, "model_default.pt");
    server
        .wait_until("version 5 replaces 1", |l| {
            let s = states(l, "dlrm");
            s.get("5") == Some(&"READY") && !s.contains_key("1")
        })
        .await;
    let response = client.predict(wire(&golden.requests[0], "new")).await.unwrap().into_inner();
    assert_eq!(response.model_version, "5");
    assert_close(&response.scores, &Golden::read(&b).unwrap().requests[0].scores_int8, "version 5");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_models_are_served_at_once_routed_by_name_and_never_fused() {
    let repo = tempfile::tempdir().unwrap();
    let (a, b) = (export('a'), export('b'));
    publish(repo.path(), "alpha", 1, &a, "model_default.pt");
    publish(repo.path(), "beta", 7, &b, "model_default.pt");
    let server = RepoServer::start(repo.path(), |args| args.default_model = Some("alpha".into())).await;
    let channel = common::wait_serving(&server.url, Duration::from_secs(60)).await;
    let goldens = BTreeMap::from([("alpha", Golden::read(&a).unwrap()), ("beta", Golden::read(&b).unwrap())]);

    // 16 concurrent requests per model, interleaved, fused where possible.
    let mut calls = Vec::new();
    for i in 0..16 {
        for model in ["alpha", "beta"] {
            let mut client = PredictorClient::new(channel.clone());
            let mut request = wire(&goldens[model].requests[i % 8], "mixed");
            request.model = model.into();
            calls.push(tokio::spawn(async move {
                (model, i, client.predict(request).await.unwrap().into_inner())
            }));
        }
    }
    for call in calls {
        let (model, i, response) = call.await.unwrap();
        let expected = if model == "alpha" { "1" } else { "7" };
        assert_eq!(response.model_version, expected);
        assert_close(
            &response.scores,
            &goldens[model].requests[i % 8].scores_int8,
            &format!("{model} request {i}"),
        );
    }
    // Each model's forwards computed exactly its own requests.
    let metrics = common::scrape(server.metrics_addr).await;
    for model in ["alpha", "beta"] {
        let computed = common::metric(&metrics, &format!(r#"narsil_batch_requests_sum{{model="{model}"}}"#));
        assert_eq!(computed, 16.0, "{model}");
    }
    // No model named: the default one. TorchRec's protocol picks by header.
    let mut client = server.client().await;
    let response = client.predict(wire(&goldens["alpha"].requests[0], "default")).await.unwrap().into_inner();
    assert_eq!(response.model_version, "1");
    let mut torchrec = TorchRecClient::new(channel.clone());
    for (header, model, version) in [(None, "alpha", "1"), (Some("beta"), "beta", "7")] {
        let mut request = tonic::Request::new(encode(&wire(&goldens[model].requests[0], "torchrec"), 26));
        if let Some(name) = header {
            request.metadata_mut().insert(MODEL_HEADER, name.parse().unwrap());
        }
        let response = torchrec.predict(request).await.unwrap();
        assert_eq!(response.metadata().get(MODEL_VERSION_HEADER).unwrap(), version);
        let scores = &response.into_inner().predictions[SCORES_KEY].data;
        assert_close(scores, &goldens[model].requests[0].scores_int8, &format!("TorchRec protocol, {model}"));
    }
    let info = client.model_info(ModelInfoRequest { model: "beta".into() }).await.unwrap().into_inner();
    assert_eq!((info.name.as_str(), info.version.as_str()), ("beta", "7"));
    let mut unknown = wire(&goldens["alpha"].requests[0], "unknown");
    unknown.model = "gamma".into();
    let status = client.predict(unknown).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains(r#"unknown model "gamma"; this server serves ["alpha", "beta"]"#),
        "{status:?}"
    );
    // Per-model health under each model's name.
    for model in ["alpha", "beta"] {
        use tonic_health::pb::health_client::HealthClient;
        use tonic_health::pb::HealthCheckRequest;
        let check =
            HealthClient::new(channel.clone()).check(HealthCheckRequest { service: model.into() }).await;
        assert_eq!(check.unwrap().into_inner().status, 1, "{model} SERVING");
    }
    // Without --model-control the control calls change nothing.
    let (code, body) = common::http(server.metrics_addr, "POST", "/v1/models/beta/unload").await;
    assert_eq!(code, 403, "{body}");
    assert!(body.contains("--model-control"), "{body}");
    let (code, body) = common::http(server.metrics_addr, "GET", "/v1/models").await;
    assert_eq!(code, 200);
    let listed: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(listed["models"][1]["name"], "beta");
    assert_eq!(listed["models"][1]["versions"][0]["state"], "READY");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latest_two_are_served_by_name_and_removing_a_directory_unloads_all_but_the_last() {
    let repo = tempfile::tempdir().unwrap();
    let (a, b) = (export('a'), export('b'));
    publish(repo.path(), "dlrm", 1, &a, "model_default.pt");
    publish(repo.path(), "dlrm", 2, &b, "model_default.pt");
    publish(repo.path(), "dlrm", 3, &a, "model_default.pt");
    let server =
        RepoServer::start(repo.path(), |args| args.version_policy = "latest:2".parse().unwrap()).await;
    server
        .wait_until("versions 2 and 3", |l| {
            states(l, "dlrm") == BTreeMap::from([("2".into(), "READY"), ("3".into(), "READY")])
        })
        .await;
    let goldens = [Golden::read(&a).unwrap(), Golden::read(&b).unwrap()];
    let mut client = server.client().await;
    let ask = |version: &str| {
        let mut request = wire(&goldens[0].requests[1], "named");
        request.model_version = version.into();
        request
    };
    for (version, golden) in [("", &goldens[0]), ("3", &goldens[0]), ("2", &goldens[1])] {
        let response = client.predict(ask(version)).await.unwrap().into_inner();
        assert_eq!(response.model_version, if version.is_empty() { "3" } else { version });
        assert_close(&response.scores, &golden.requests[1].scores_int8, &format!("version {version:?}"));
    }
    let status = client.predict(ask("1")).await.unwrap_err();
    assert_eq!(
        (status.code(), status.message()),
        (Code::InvalidArgument, r#"invalid model_version: version "1" of model "dlrm" is not served"#)
    );

    // Version 3 removed: the policy's two are now 1 and 2.
    std::fs::remove_dir_all(repo.path().join("dlrm/3")).unwrap();
    server
        .wait_until("versions 1 and 2", |l| {
            states(l, "dlrm") == BTreeMap::from([("1".into(), "READY"), ("2".into(), "READY")])
        })
        .await;
    // Every directory removed: the last ready version keeps serving.
    std::fs::remove_dir_all(repo.path().join("dlrm/1")).unwrap();
    std::fs::remove_dir_all(repo.path().join("dlrm/2")).unwrap();
    server.wait_until("one version left", |l| states(l, "dlrm").len() == 1).await;
    tokio::time::sleep(Duration::from_millis(500)).await; // a few more polls
    assert_eq!(states(&server.models.list(), "dlrm"), BTreeMap::from([("2".into(), "READY")]));
    let response = client.predict(ask("")).await.unwrap().into_inner();
    assert_eq!(response.model_version, "2");
    server.stop().await;
}

/// Resident memory of process `pid`, KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_and_unload_cycles_release_each_version_s_memory() {
    let repo = tempfile::tempdir().unwrap();
    // The FP32 export: ~10 MB of weights, so a version kept alive shows.
    let (a, b) = (export('a'), export('b'));
    let export_of = |version: u64| if version % 2 == 1 { &a } else { &b };
    publish(repo.path(), "dlrm", 1, &a, "model_fp32.pt");
    let listeners = common::Listeners::new();
    let mut child = common::KillOnDrop(
        std::process::Command::new(env!("CARGO_BIN_EXE_narsil"))
            .args(["serve", "--log-level", "warn", "--repository-poll-secs", "0", "--model-control"])
            .arg("--model-repository")
            .arg(repo.path())
            .args(listeners.args(true))
            .spawn()
            .unwrap(),
    );
    let bound = listeners.wait(&mut child.0, Duration::from_secs(60)).await;
    let admin = bound.admin();
    let channel = common::wait_serving(&bound.url(), Duration::from_secs(60)).await;
    let mut client = PredictorClient::new(channel);
    let golden = Golden::read(&a).unwrap();
    let mut rss = Vec::new();
    for version in 2..=11u64 {
        publish(repo.path(), "dlrm", version, export_of(version), "model_fp32.pt");
        let (code, body) = common::http(admin, "POST", "/v1/repository/scan").await;
        assert_eq!(code, 200, "{body}");
        // The scan answers once the new version serves; the old one drains.
        let response = client.predict(wire(&golden.requests[0], "cycle")).await.unwrap().into_inner();
        assert_eq!(response.model_version, version.to_string());
        // Once the old version is unloaded, give the allocators a moment to
        // return what it freed (the measurement, not a wait for state).
        let old = (version - 1).to_string();
        common::poll_until(&format!("version {old} to be unloaded"), common::PATIENCE, || async {
            let (_, body) = common::http(admin, "GET", "/v1/models").await;
            let listed: serde_json::Value = serde_json::from_str(&body).unwrap();
            let versions = listed["models"][0]["versions"].as_array().cloned().unwrap_or_default();
            (!versions.iter().any(|v| v["version"] == old.as_str())).then_some(())
        })
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        rss.push(rss_kib(child.0.id()));
    }
    // Unloading a version lets the policy pick among the others; unloading
    // the model takes even its last version away; loading it lifts both.
    let version_of = |response: narsil::proto::PredictResponse| response.model_version;
    let (code, body) = common::http(admin, "POST", "/v1/models/dlrm/versions/11/unload").await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        version_of(client.predict(wire(&golden.requests[0], "v10")).await.unwrap().into_inner()),
        "10"
    );
    let (code, body) = common::http(admin, "POST", "/v1/models/dlrm/unload").await;
    assert_eq!(code, 200, "{body}");
    let status = client.predict(wire(&golden.requests[0], "unloaded")).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    let (code, body) = common::http(admin, "POST", "/v1/models/dlrm/load").await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        version_of(client.predict(wire(&golden.requests[0], "back")).await.unwrap().into_inner()),
        "11"
    );
    unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    assert!(child.0.wait().unwrap().success());
    // Each version holds ~10 MiB of FP32 weights, so nine cycles that each
    // kept their version would add 90 MiB or more. The allocators' own
    // growth over the first three cycles was 25-40 MiB here, flat after.
    let (first, last) = (rss[0], *rss.last().unwrap());
    eprintln!("RSS after each cycle (KiB): {rss:?}");
    assert!(
        last <= first + 64 * 1024,
        "RSS grew from {first} KiB after cycle 1 to {last} KiB after cycle 10: {rss:?}"
    );
}

/// Publishes a copy of the split model `split` as `version` of `model`,
/// after `edit` has changed the copy.
fn publish_split(repo: &Path, model: &str, version: u64, split: &Path, edit: impl FnOnce(&Path)) {
    let staging = repo.join(model).join(format!(".incoming-{version}"));
    narsil_core::golden::copy_split_model(split, &staging).unwrap();
    edit(&staging);
    std::fs::rename(&staging, repo.join(model).join(version.to_string())).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_versions_share_the_tables_they_have_in_common() {
    let repo = tempfile::tempdir().unwrap();
    let split = export('a').join("split");
    let table_bytes = |name: &str| std::fs::metadata(split.join("tables").join(name)).unwrap().len() as f64;
    let all_tables: f64 = (0..26).map(|f| table_bytes(&format!("cat_{f}.bin"))).sum();
    publish_split(repo.path(), "dlrm", 1, &split, |_| {});
    let server =
        RepoServer::start(repo.path(), |args| args.version_policy = "latest:2".parse().unwrap()).await;
    let ready = |versions: &'static [&'static str]| {
        move |l: &[ModelStatus]| {
            states(l, "dlrm") == versions.iter().map(|v| (v.to_string(), "READY")).collect()
        }
    };
    server.wait_until("version 1", ready(&["1"])).await;
    let held =
        || async { common::metric(&common::scrape(server.metrics_addr).await, "narsil_table_bytes_held") };
    assert_eq!(held().await, all_tables);

    // Version 2 has the same tables: both versions live, the tables once.
    publish_split(repo.path(), "dlrm", 2, &split, |_| {});
    server.wait_until("versions 1 and 2", ready(&["1", "2"])).await;
    assert_eq!(held().await, all_tables);
    let golden = Golden::read(&export('a')).unwrap();
    let mut client = server.client().await;
    for version in ["1", "2"] {
        let mut request = wire(&golden.requests[1], "split");
        request.model_version = version.into();
        let response = client.predict(request).await.unwrap().into_inner();
        assert_close(&response.scores, &golden.requests[1].scores_int8, &format!("version {version}"));
    }

    // Version 3 changes one table: only that one is read again, and
    // version 1 (retired by latest:2) gives nothing back that 2 still holds.
    publish_split(repo.path(), "dlrm", 3, &split, |dir| {
        let table = dir.join("tables/cat_3.bin");
        let mut rows = std::fs::read(&table).unwrap();
        rows[4] ^= 1;
        std::fs::write(&table, &rows).unwrap();
        let schema = std::fs::read_to_string(dir.join("schema.json")).unwrap();
        let mut schema: serde_json::Value = serde_json::from_str(&schema).unwrap();
        schema["tables"][3]["sha256"] = narsil_embedding::sha256::sha256_of_bytes(&rows).into();
        std::fs::write(dir.join("schema.json"), schema.to_string()).unwrap();
    });
    server.wait_until("versions 2 and 3", ready(&["2", "3"])).await;
    assert_eq!(held().await, all_tables + table_bytes("cat_3.bin"));
    server.stop().await;
}
