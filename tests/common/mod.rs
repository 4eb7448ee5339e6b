//! Shared helpers for the end-to-end tests: a real server on 127.0.0.1:0 with
//! the mock backend, gRPC clients, and request builders.
#![allow(dead_code)]

pub mod flood;
pub mod id_maps;
pub mod pushes;
pub mod ranking;
pub mod tls;

use std::sync::Arc;
use std::time::Duration;

use narsil::cli::ServeArgs;
use narsil::lifecycle::ModelRegistry;
use narsil::proto::predictor_client::PredictorClient;
use narsil::proto::PredictRequest;
use narsil::server::{Listen, Server};
use narsil_core::mock::{MockConfig, MockFactory};
use narsil_core::{BackendFactory, ModelSchema};
use narsil_engine::{EngineConfig, EngineHandle, ExecutionMode};
use tokio::sync::oneshot;
use tonic::transport::Channel;

/// `--max-message-bytes` of test servers.
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;

/// A server running in the test's runtime.
pub struct TestServer {
    pub url: String,
    /// Address of the Prometheus endpoint.
    pub metrics_addr: std::net::SocketAddr,
    pub engine: EngineHandle,
    running: Running,
}

impl TestServer {
    /// Stops accepting, drains, and returns the server's result.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.running.finish().await
    }

    pub async fn client(&self) -> PredictorClient<Channel> {
        PredictorClient::connect(self.url.clone()).await.unwrap()
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(self.url.clone()).unwrap().connect().await.unwrap()
    }

    /// The Prometheus text from `GET /metrics`, over real HTTP.
    pub async fn scrape(&self) -> String {
        scrape(self.metrics_addr).await
    }

    /// Waits until every lane is warm.
    pub async fn ready(self) -> Self {
        self.engine.wait_ready().await.unwrap();
        self
    }
}

/// One HTTP/1.1 call without a body to `addr`: the status code and body.
pub async fn http(addr: std::net::SocketAddr, method: &str, path: &str) -> (u16, String) {
    let (head, body) = http_exchange(addr, method, path).await;
    let code = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("{head}"));
    (code, body)
}

async fn http_exchange(addr: std::net::SocketAddr, method: &str, path: &str) -> (String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request =
        format!("{method} {path} HTTP/1.1\r\nHost: narsil\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    (head.to_string(), body.to_string())
}

/// Sends `request` (a whole HTTP/1.1 message) to `addr`; the status code and body.
pub async fn exchange(addr: std::net::SocketAddr, request: &[u8]) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    // The server may answer (and close) before reading all of a large body.
    let _ = stream.write_all(request).await;
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response).await;
    let response = String::from_utf8_lossy(&response).into_owned();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or_else(|| panic!("{response:?}"));
    let code = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("{head}"));
    (code, body.to_string())
}

/// `POST path` with `authorization` (if any) and `body`.
pub async fn post(
    addr: std::net::SocketAddr,
    path: &str,
    authorization: Option<&str>,
    body: &[u8],
) -> (u16, String) {
    let mut request = format!("POST {path} HTTP/1.1\r\nHost: narsil\r\nConnection: close\r\n");
    if let Some(value) = authorization {
        request.push_str(&format!("Authorization: {value}\r\n"));
    }
    request.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let mut bytes = request.into_bytes();
    bytes.extend_from_slice(body);
    exchange(addr, &bytes).await
}

/// The Prometheus text from `GET /metrics` on `addr`, over real HTTP.
pub async fn scrape(addr: std::net::SocketAddr) -> String {
    let (head, body) = http_exchange(addr, "GET", "/metrics").await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("application/openmetrics-text"), "{head}");
    body
}

/// Engine settings from the CLI defaults, adjusted by `edit`.
pub fn config(edit: impl FnOnce(&mut EngineConfig)) -> EngineConfig {
    let mut config = ServeArgs::defaults().engine_config().unwrap();
    edit(&mut config);
    config
}

pub fn batch_mode(lanes: usize, batch_size: usize) -> EngineConfig {
    config(|c| {
        c.mode = ExecutionMode::Batch;
        c.lanes = lanes;
        c.max_batch_requests = batch_size;
    })
}

pub fn worker_mode(lanes: usize) -> EngineConfig {
    config(|c| {
        c.mode = ExecutionMode::Worker;
        c.lanes = lanes;
    })
}

/// The mock's schema used by the tests: the DLRM shape with small tables.
pub fn schema() -> ModelSchema {
    ModelSchema::dlrm("mock", "cpu", 1000)
}

/// Starts a mock server with `latency_ms` per forward.
pub async fn start(config: EngineConfig, latency_ms: u64) -> TestServer {
    let factory = Arc::new(MockFactory::new(
        schema(),
        MockConfig { latency: Duration::from_millis(latency_ms), per_row: Duration::ZERO },
    ));
    start_with(factory, config).await
}

/// Starts a server over any backend.
pub async fn start_with(factory: Arc<dyn BackendFactory>, config: EngineConfig) -> TestServer {
    let server = Server::start(listen(true), factory, config).await.unwrap();
    let url = format!("http://{}", server.local_addr());
    let metrics_addr = server.metrics_addr().unwrap();
    let engine = server.engine().expect("a server of one model");
    TestServer { url, metrics_addr, engine, running: Running::spawn(server) }
}

/// The listeners of a server started in the test's runtime: gRPC on
/// 127.0.0.1:0 and, with `admin`, the admin address on 127.0.0.1:0 too.
pub fn listen(admin: bool) -> Listen {
    Listen {
        addr: "127.0.0.1:0".parse().unwrap(),
        metrics_addr: admin.then(|| "127.0.0.1:0".parse().unwrap()),
        max_message_bytes: MAX_MESSAGE_BYTES,
    }
}

/// A started server running in the test's runtime until it is stopped.
pub struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Running {
    /// Runs `server` in a task of the test's runtime.
    pub fn spawn(server: Server) -> Self {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(server.run(async {
            let _ = stopped.await;
        }));
        Self { stop: Some(stop), task }
    }

    /// Stops accepting, drains, and returns the server's result.
    pub async fn finish(mut self) -> anyhow::Result<()> {
        let _ = self.stop.take().unwrap().send(());
        self.task.await.unwrap()
    }

    /// Stops accepting and drains; panics if the server failed.
    pub async fn stop(self) {
        self.finish().await.unwrap()
    }
}

/// A repository server in the test's runtime: `repo` polled only when
/// asked, model control on behind `token` (read from a file), and the rest
/// of `narsil serve`'s defaults as `edit` leaves them.
pub struct RepoServer {
    pub url: String,
    pub admin: std::net::SocketAddr,
    pub models: Arc<ModelRegistry>,
    pub token_file: tempfile::NamedTempFile,
    running: Running,
}

impl RepoServer {
    pub async fn start(repo: &std::path::Path, token: &str, edit: impl FnOnce(&mut ServeArgs)) -> Self {
        let token_file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(token_file.path(), format!("{token}\n")).unwrap();
        let mut args = ServeArgs::defaults();
        args.model_repository = Some(repo.to_path_buf());
        args.repository_poll_secs = 0.0;
        args.model_control = true;
        args.control_token_file = Some(token_file.path().to_path_buf());
        edit(&mut args);
        let repository = args.repository(args.engine_config().unwrap()).unwrap().unwrap();
        let server = Server::start_repository(listen(true), repository).await.unwrap();
        let url = format!("http://{}", server.local_addr());
        let (admin, models) = (server.metrics_addr().unwrap(), server.models());
        Self { url, admin, models, token_file, running: Running::spawn(server) }
    }

    pub async fn client(&self) -> PredictorClient<Channel> {
        PredictorClient::connect(self.url.clone()).await.unwrap()
    }

    /// Stops accepting and drains; panics if the server failed.
    pub async fn stop(self) {
        self.running.stop().await
    }
}

/// A deterministic request of `b` samples; `tag` varies its content. Bag
/// sizes cycle through 0..=3 (multi-hot, empty bags included).
pub fn request(tag: u64, b: usize) -> PredictRequest {
    let schema = schema();
    let num_sparse = schema.num_sparse();
    let mut lengths = Vec::with_capacity(b * num_sparse);
    let mut ids = Vec::new();
    for s in 0..b {
        for f in 0..num_sparse {
            let len = ((tag as usize + s * 7 + f * 3) % 4) as u32;
            lengths.push(len);
            for k in 0..len as u64 {
                ids.push(((tag * 7919 + s as u64 * 104_729 + f as u64 * 31 + k * 17) % 1000) as i64);
            }
        }
    }
    PredictRequest {
        batch_size: b as u32,
        dense: (0..b * schema.num_dense)
            .map(|i| ((tag as usize * 131 + i * 17) % 1000) as f32 / 1000.0)
            .collect(),
        sparse_lengths: lengths,
        sparse_ids: ids,
        request_id: format!("req-{tag}"),
        model: String::new(),
        model_version: String::new(),
        sparse_weights: vec![],
        request: None,
    }
}

/// Golden requests sent all at once, one client each on a shared channel;
/// the responses in request order.
#[allow(dead_code)]
pub async fn predict_all(
    channel: &Channel,
    requests: &[&narsil_core::golden::GoldenRequest],
) -> Vec<narsil::proto::PredictResponse> {
    futures_util::future::join_all(requests.iter().enumerate().map(|(i, g)| {
        let mut client = PredictorClient::new(channel.clone());
        let request = wire(g, &format!("c{i}"));
        async move { client.predict(request).await.unwrap().into_inner() }
    }))
    .await
}

/// Bit patterns of scores, for exact comparison.
pub fn bits(scores: &[f32]) -> Vec<u32> {
    scores.iter().map(|s| s.to_bits()).collect()
}

/// A golden request (from the exported test model) as a `narsil.v1` request.
pub fn wire(g: &narsil_core::golden::GoldenRequest, id: &str) -> PredictRequest {
    PredictRequest::from_golden(g, id)
}

/// The sum of the samples of `sample` (`name{labels}`) in Prometheus text:
/// every line of that name whose labels include the given ones (a served
/// model's lines also carry `model` and `version`).
pub fn metric(text: &str, sample: &str) -> f64 {
    let (name, wanted) = split_sample(sample);
    let values: Vec<f64> = text
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (line_name, labels) = split_sample(series);
            (line_name == name && wanted.iter().all(|l| labels.contains(l))).then(|| value.parse().ok())?
        })
        .collect();
    assert!(!values.is_empty(), "no sample {sample} in:\n{text}");
    values.iter().sum()
}

fn split_sample(sample: &str) -> (&str, Vec<&str>) {
    match sample.split_once('{') {
        Some((name, labels)) => {
            (name, labels.trim_end_matches('}').split(',').filter(|l| !l.is_empty()).collect())
        }
        None => (sample, Vec::new()),
    }
}

/// How long a test waits for a state it polls for: far beyond what any of
/// them needs on an idle machine, so that a loaded 2-vCPU machine only
/// makes a test slower, never fail.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// Polls `done` every 10 ms until it holds; panics naming `what` if it
/// still does not after `timeout`.
pub async fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    poll_until(what, timeout, || std::future::ready(done().then_some(()))).await
}

/// Polls `check` (an async check) every 10 ms until it gives `Some`, and
/// returns that; panics naming `what` if it still gives `None` after
/// `timeout`.
pub async fn poll_until<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> F,
) -> T {
    let started = std::time::Instant::now();
    loop {
        if let Some(found) = check().await {
            return found;
        }
        assert!(started.elapsed() < timeout, "waited {timeout:?} for {what}, in vain");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Says on stderr that `test` is skipped and why (`skipped: TEST: WHY`),
/// for a test that returns early because it cannot run here; the caller
/// returns right after.
pub fn skip(test: &str, why: &str) {
    eprintln!("skipped: {test}: {why}");
}

/// [`skip`] for a test (or a case) that needs direct I/O, io_uring or a
/// file system that takes them; under `NARSIL_REQUIRE_DIRECT_IO=1` (CI sets
/// it) it fails the test instead, so such a test never passes by not
/// running where the machine should run it.
pub fn skip_direct_io(test: &str, why: &str) {
    if std::env::var("NARSIL_REQUIRE_DIRECT_IO").is_ok_and(|v| v == "1") {
        panic!("{test}: {why}, and NARSIL_REQUIRE_DIRECT_IO=1 forbids skipping it");
    }
    skip(test, why);
}

/// A temporary directory on the file system of the build's target directory
/// (a real one, where `/tmp` may be a tmpfs that takes no direct reads).
pub fn real_fs_tempdir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// Requests admitted so far, by two metrics texts scraped one after the
/// other: those whose forward had started by the first
/// (`narsil_queue_seconds_count`, observed as each forward starts) plus
/// those still queued at the second (`narsil_queue_depth`). No request is
/// counted twice (one whose forward started is never queued again), so
/// this is never more than the truth; a request between the queue and its
/// forward is missed for a moment, so poll it.
pub fn admitted(first: &str, second: &str) -> f64 {
    metric(first, "narsil_queue_seconds_count") + metric(second, "narsil_queue_depth")
}

/// The listeners of a spawned `narsil serve`: it is started on port 0 with
/// `--bound-addresses-file`, and the test reads the ports the kernel chose
/// from that file, so no port is picked by hand (and none can be taken by
/// another test in between).
pub struct Listeners {
    dir: tempfile::TempDir,
}

/// The addresses a spawned server bound.
#[derive(Debug, Clone, Copy)]
pub struct Bound {
    /// `--addr`: every gRPC service.
    pub grpc: std::net::SocketAddr,
    /// `--metrics-addr`, if it was asked for.
    pub metrics: Option<std::net::SocketAddr>,
}

impl Bound {
    /// The gRPC URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// The admin endpoint (metrics, `/healthz`, the model calls).
    pub fn admin(&self) -> std::net::SocketAddr {
        self.metrics.expect("the server was started with --metrics-addr")
    }
}

impl Default for Listeners {
    fn default() -> Self {
        Self::new()
    }
}

impl Listeners {
    pub fn new() -> Self {
        Self { dir: tempfile::tempdir().unwrap() }
    }

    /// The file the server writes its addresses to.
    pub fn file(&self) -> std::path::PathBuf {
        self.dir.path().join("bound-addresses")
    }

    /// The `narsil serve` flags: `--addr 127.0.0.1:0`, with `metrics` also
    /// `--metrics-addr 127.0.0.1:0`, and `--bound-addresses-file`.
    pub fn args(&self, metrics: bool) -> Vec<std::ffi::OsString> {
        let mut args: Vec<std::ffi::OsString> = vec!["--addr".into(), "127.0.0.1:0".into()];
        if metrics {
            args.extend(["--metrics-addr".into(), "127.0.0.1:0".into()]);
        }
        args.extend(["--bound-addresses-file".into(), self.file().into()]);
        args
    }

    /// `narsil serve --log-level LEVEL` on these listeners (with `metrics`
    /// the admin address too), its stdout discarded; the test adds the
    /// rest and spawns it.
    pub fn serve(&self, metrics: bool, level: &str) -> std::process::Command {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_narsil"));
        command
            .args(["serve", "--log-level", level])
            .args(self.args(metrics))
            .stdout(std::process::Stdio::null());
        command
    }

    /// [`Listeners::serve`] with the admin address, of the repository
    /// `repo` (polled only when asked) with model control, behind
    /// `token_file` if any.
    pub fn serve_repository(
        &self,
        level: &str,
        repo: &std::path::Path,
        token_file: Option<&std::path::Path>,
    ) -> std::process::Command {
        let mut command = self.serve(true, level);
        command.args(["--repository-poll-secs", "0", "--model-control", "--model-repository"]).arg(repo);
        if let Some(file) = token_file {
            command.arg("--control-token-file").arg(file);
        }
        command
    }

    /// Waits until `server` has written its addresses; panics if it exits
    /// first, or after `timeout`.
    pub async fn wait(&self, server: &mut std::process::Child, timeout: Duration) -> Bound {
        let file = self.file();
        let text = poll_until("the server to write --bound-addresses-file", timeout, || {
            if let Some(status) = server.try_wait().unwrap() {
                panic!("narsil serve exited ({status}) before binding its listeners");
            }
            std::future::ready(std::fs::read_to_string(&file).ok())
        })
        .await;
        let listeners = narsil::server::bound::parse(&text).unwrap();
        let find = |name: &str| listeners.iter().find(|(n, _)| n == name).map(|(_, addr)| *addr);
        let grpc = find(narsil::server::bound::GRPC).unwrap_or_else(|| panic!("no gRPC address in {text:?}"));
        Bound { grpc, metrics: find(narsil::server::bound::METRICS) }
    }
}

/// grpc.health's overall status (1 SERVING, 2 NOT_SERVING).
#[allow(dead_code)]
pub async fn health_status(channel: Channel) -> Result<i32, tonic::Status> {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let response = HealthClient::new(channel).check(HealthCheckRequest { service: String::new() }).await?;
    Ok(response.into_inner().status)
}

/// Waits until a spawned server at `url` reports SERVING on grpc.health;
/// returns a channel to it.
#[allow(dead_code)]
pub async fn wait_serving(url: &str, timeout: Duration) -> Channel {
    poll_until(&format!("the server at {url} to be SERVING"), timeout, || async {
        let channel = Channel::from_shared(url.to_string()).unwrap().connect().await.ok()?;
        matches!(health_status(channel.clone()).await, Ok(1)).then_some(channel)
    })
    .await
}

/// A spawned server process, stopped when dropped (also where the test
/// fails first): SIGTERM, then SIGKILL if it has not exited within
/// `STOP_PATIENCE`. A server stopped by SIGTERM drops its models, and
/// with them what libtorch extracted for them (an AOTInductor package's
/// `/tmp/aotinductor_*` directory, which SIGKILL leaves behind).
pub struct KillOnDrop(pub std::process::Child);

/// How long a stopped server may take to exit before it is killed.
pub const STOP_PATIENCE: Duration = Duration::from_secs(10);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        stop(&mut self.0);
    }
}

/// Stops `child` as [`KillOnDrop`] does and reaps it.
pub fn stop(child: &mut std::process::Child) {
    if matches!(child.try_wait(), Ok(None)) {
        // SAFETY: `kill` takes a pid and a signal number and touches no
        // memory; the pid is our own unreaped child's, so it names no
        // other process.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = std::time::Instant::now() + STOP_PATIENCE;
        while matches!(child.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// How far a served score may be from Python's golden one, or from the same
/// request's score alone: the same libtorch kernels compute both (a split
/// model's pooling equals FBGEMM's bit for bit); a fused batch's GEMM
/// blocking may change the last bits.
pub const SCORE_TOLERANCE: f32 = 1e-6;

/// Asserts that `got` holds as many scores as `want`, each within
/// [`SCORE_TOLERANCE`].
pub fn assert_close(got: &[f32], want: &[f32], what: &str) {
    let diff = narsil_core::golden::max_abs_diff(got, want)
        .unwrap_or_else(|| panic!("{what}: {} scores, want {}", got.len(), want.len()));
    assert!(diff <= SCORE_TOLERANCE, "{what}: max |diff| {diff} > {SCORE_TOLERANCE}");
}

/// (VmRSS, VmHWM) of a process, MiB.
#[allow(dead_code)]
pub fn memory_mib(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap();
        line.split_whitespace().nth(1).unwrap().parse::<f64>().unwrap() / 1024.0
    };
    (field("VmRSS:"), field("VmHWM:"))
}
