//! The `redis` table store against a real Redis Cluster (3 masters, 3
//! replicas, started by `scripts/redis_cluster.sh`): a split model's tables
//! loaded by `narsil tables load`, served with scores equal to the memory
//! store's, bit for bit; a model whose tables were never loaded fails at
//! start-up naming the command that loads them; rows pushed while two
//! `narsil serve` processes answer load reach both (no failed request, then
//! the new rows' scores); with the cluster unreachable, requests get
//! UNAVAILABLE (never a score from missing rows) and health NOT_SERVING
//! (without any traffic, from the store's own pings),
//! a batch's fetch gives up at its callers' deadline, and both recover
//! when it answers again; a row the cluster lost fails its batch unless
//! the operator chose `--missing-rows zero`, which pools it as zeros;
//! ranking requests (the user's features once) score as the same requests
//! sent flat; raw ids through a table's id map fetch their rows.
#![cfg(feature = "torch")]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{assert_close, batch_mode, start_with, wire, SCORE_TOLERANCE};
use narsil_core::conformance::{self, golden_parity};
use narsil_core::golden::{copy_split_model, test_model_dir, Golden, GoldenRequest};
use narsil_core::request::IdPolicy;
use narsil_embedding::{MissingRows, RedisSeeds, RedisStoreConfig};
use narsil_engine::EngineConfig;
use narsil_torch::{SplitFactory, TableStore, TorchConfig};
use tonic::Code;

/// A cluster of this test's own, stopped (and its directory removed) on
/// drop.
struct Cluster {
    dir: PathBuf,
    seeds: String,
}

impl Cluster {
    fn start(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("narsil-redis-{name}-{}", std::process::id()));
        let output = Command::new("bash")
            .arg(script())
            .arg("start")
            .arg(&dir)
            .output()
            .expect("running scripts/redis_cluster.sh");
        assert!(
            output.status.success(),
            "redis_cluster.sh start: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let seeds = String::from_utf8(output.stdout).unwrap().trim().to_owned();
        Self { dir, seeds }
    }

    fn store(&self) -> TableStore {
        self.seeds.parse().unwrap()
    }

    /// The `redis` store's configuration for these seeds, to change.
    fn config(&self) -> RedisStoreConfig {
        RedisStoreConfig::new(RedisSeeds::parse(&self.seeds).unwrap())
    }

    fn stop(&self) {
        let status = Command::new("bash").arg(script()).arg("stop").arg(&self.dir).status().unwrap();
        assert!(status.success());
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
    }
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/redis_cluster.sh")
}

/// A copy of the test model's split form in a fresh directory.
fn split_copy(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("narsil-redis-model-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    copy_split_model(&test_model_dir().join("split"), &dir).unwrap();
    dir
}

/// `narsil tables load DIR --store SEEDS`; its stdout.
fn tables_load(dir: &Path, seeds: &str) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_narsil"))
        .args(["tables", "load"])
        .arg(dir)
        .args(["--store", seeds, "--buckets", "16"])
        .output()
        .unwrap();
    assert!(output.status.success(), "tables load: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).unwrap()
}

/// The store the cluster gives, with `--missing-rows` and
/// `--table-fetch-timeout-ms` set.
fn store_with(cluster: &Cluster, missing_rows: MissingRows, fetch_timeout: Duration) -> TableStore {
    let mut config = cluster.config();
    config.missing_rows = missing_rows;
    config.fetch_timeout = fetch_timeout;
    TableStore::new(config)
}

/// One forward of `request` alone on a new lane of `factory`, whose
/// callers wait until `deadline`.
fn forward_alone(
    factory: &SplitFactory,
    request: &narsil_core::RequestSamples,
    deadline: Option<Instant>,
) -> Result<Vec<f32>, narsil_core::BackendError> {
    let schema = narsil_core::BackendFactory::schema(factory);
    let mut batch = narsil_core::assemble(schema.num_dense, schema.num_sparse(), [request]);
    batch.deadline = deadline;
    narsil_core::BackendFactory::create_lane(factory, 0).unwrap().forward(&batch)
}

fn factory(dir: &Path, store: TableStore) -> SplitFactory {
    let mut config = TorchConfig::new(dir.to_path_buf());
    config.table_store = store;
    SplitFactory::load(config).unwrap()
}

#[test]
fn scores_through_the_redis_store_equal_the_memory_stores_bit_for_bit() {
    let cluster = Cluster::start("equal");
    let dir = split_copy("equal");
    let report = tables_load(&dir, &cluster.seeds);
    assert!(report.contains("26 tables (26000 rows"), "{report}");
    // Loading again rewrites the same keys (idempotent).
    tables_load(&dir, &cluster.seeds);

    let golden = Golden::read(&test_model_dir()).unwrap();
    let memory = factory(&dir, TableStore::Memory);
    // A generous fetch timeout: this test compares scores, and runs beside
    // six other clusters on the same cores.
    let redis = factory(&dir, store_with(&cluster, MissingRows::Error, Duration::from_secs(5)));
    golden_parity(&redis, &golden, |g| g.scores_int8.clone(), SCORE_TOLERANCE);
    let requests = conformance::requests(&redis, &golden, IdPolicy::Reject);
    let from_memory = conformance::scores_alone(&memory, &requests);
    let from_redis = conformance::scores_alone(&redis, &requests);
    for (i, (a, b)) in from_memory.iter().zip(&from_redis).enumerate() {
        assert_eq!(common::bits(a), common::bits(b), "golden request {i}: redis store != memory store");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_from_redis_fused_requests_get_their_golden_scores() {
    let cluster = Cluster::start("served");
    let dir = split_copy("served");
    tables_load(&dir, &cluster.seeds);
    // Scores are what this checks, not the fetch timeout (the unreachable
    // test does): 250 ms failed a fetch once while seven test clusters
    // shared two cores.
    let store = store_with(&cluster, MissingRows::Error, Duration::from_secs(5));
    let config = EngineConfig { request_level: Some(common::ranking::request_level()), ..batch_mode(1, 16) };
    let server = start_with(Arc::new(factory(&dir, store)), config).await.ready().await;
    let golden = Golden::read(&test_model_dir()).unwrap();
    let requests: Vec<&GoldenRequest> = golden.requests.iter().cycle().take(16).collect();
    let channel = server.channel().await;
    for round in 0..3 {
        let responses = common::predict_all(&channel, &requests).await;
        for (i, (response, g)) in responses.iter().zip(&requests).enumerate() {
            assert_close(&response.scores, &g.scores_int8, &format!("round {round} client {i}"));
        }
    }
    // Ranking requests: each user's bags fetched from the cluster and
    // pooled once per request score as the same requests sent flat.
    let mut client = server.client().await;
    for (user, candidates) in [(1, 40), (2, 7), (1, 3)] {
        let (grouped, flat) = common::ranking::ranking(user, candidates, 1000);
        let want = client.predict(flat).await.unwrap().into_inner().scores;
        let got = client.predict(grouped).await.unwrap().into_inner().scores;
        assert_close(&got, &want, &format!("ranking request of user {user}, {candidates} candidates"));
    }
    let text = server.scrape().await;
    assert!(common::metric(&text, r#"narsil_table_rows_fetched_total{table="cat_0"}"#) > 0.0, "{text}");
    assert!(common::metric(&text, "narsil_request_level_bags_pooled_total") >= 3.0 * 13.0, "{text}");
    server.stop().await.unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

/// A sequence model (the DIN ranker `models/export_din.py` exports): its
/// users' histories looked up unpooled from the cluster, once per request,
/// score as TorchRec's eager forward does, flat and grouped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_models_histories_fetched_from_redis_score_as_torchrec() {
    let cluster = Cluster::start("sequences");
    let din = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/generated/test-din");
    let dir = std::env::temp_dir().join(format!("narsil-redis-model-din-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    copy_split_model(&din.join("split"), &dir).unwrap();
    tables_load(&dir, &cluster.seeds);
    let store = store_with(&cluster, MissingRows::Error, Duration::from_secs(5));
    let server = start_with(Arc::new(factory(&dir, store)), batch_mode(1, 16)).await.ready().await;
    let golden = Golden::read(&din).unwrap();
    let requests: Vec<&GoldenRequest> = golden.requests.iter().collect();
    let responses = common::predict_all(&server.channel().await, &requests).await;
    for (i, (response, g)) in responses.iter().zip(&requests).enumerate() {
        assert_close(&response.scores, &g.outputs["default"], &format!("DIN golden request {i} (flat)"));
    }
    let declared: Vec<String> =
        ["user_0", "user_1", "user_2", "hist_item", "hist_cat", "dense"].map(String::from).into();
    let mut client = server.client().await;
    for ranking in common::ranking::golden_ranking_declaring(&din, &declared) {
        let got = client.predict(ranking.grouped).await.unwrap().into_inner().scores;
        assert_close(&got, &ranking.scores_int8, "DIN golden ranking request (grouped)");
    }
    let text = server.scrape().await;
    assert!(common::metric(&text, r#"narsil_table_rows_fetched_total{table="item"}"#) > 0.0, "{text}");
    server.stop().await.unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

/// A model whose tables map raw ids (an id map beside each table in the
/// model directory, its rows on the cluster): the golden requests sent
/// with raw ids, some never seen, get their golden scores, the ids mapped
/// before the cluster is asked for rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_ids_through_id_maps_fetch_their_rows_from_redis() {
    let cluster = Cluster::start("mapped");
    let dir = std::env::temp_dir().join(format!("narsil-redis-model-mapped-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let golden = Golden::read(&test_model_dir()).unwrap();
    let defaults = common::id_maps::mapped_copy(&dir, &golden);
    tables_load(&dir, &cluster.seeds);
    let store = store_with(&cluster, MissingRows::Error, Duration::from_secs(5));
    let server = start_with(Arc::new(factory(&dir, store)), batch_mode(1, 16)).await.ready().await;
    let mut client = server.client().await;
    let before = common::metric(&server.scrape().await, "narsil_table_unmapped_ids_total");
    let mut unseen = 0;
    for (i, g) in golden.requests.iter().enumerate() {
        let (sent, never_seen) = common::id_maps::raw_request(g, &defaults);
        unseen += never_seen;
        let response = client.predict(wire(&sent, "")).await.unwrap().into_inner();
        assert_close(&response.scores, &g.scores_int8, &format!("golden request {i} with raw ids"));
    }
    let text = server.scrape().await;
    assert_eq!(common::metric(&text, "narsil_table_unmapped_ids_total") - before, unseen as f64);
    server.stop().await.unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_model_whose_tables_were_never_loaded_fails_naming_the_load_command() {
    let cluster = Cluster::start("unloaded");
    let dir = split_copy("unloaded");
    let mut config = TorchConfig::new(dir.clone());
    config.table_store = cluster.store();
    let error = narsil_core::error_chain(&SplitFactory::load(config).err().expect("no Redis location"));
    assert!(error.contains("narsil tables load") && error.contains("cat_0"), "{error}");

    // Named in the schema, but the cluster lost the rows (a flushed node).
    tables_load(&dir, &cluster.seeds);
    for port in cluster.seeds.split(',').map(|s| s.rsplit(':').next().unwrap()) {
        let status = Command::new("redis-cli").args(["-p", port, "flushall"]).output().unwrap();
        assert!(status.status.success());
    }
    let mut config = TorchConfig::new(dir.clone());
    config.table_store = cluster.store();
    let error = narsil_core::error_chain(&SplitFactory::load(config).err().expect("rows gone"));
    assert!(error.contains("not loaded") && error.contains("narsil tables load"), "{error}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_row_the_cluster_lost_fails_its_batch_unless_the_operator_chose_zeros() {
    let cluster = Cluster::start("missing");
    let dir = split_copy("missing");
    tables_load(&dir, &cluster.seeds);
    let golden = Golden::read(&test_model_dir()).unwrap();
    let memory = factory(&dir, TableStore::Memory);
    let requests = conformance::requests(&memory, &golden, IdPolicy::Reject);
    // Sample 0's first id of feature 0 (table cat_0, the schema's first).
    let request = &requests[0];
    assert!(request.lengths[0] > 0);
    let id = request.ids[0] as u64;
    let schema: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("schema.json")).unwrap()).unwrap();
    let table = &schema["tables"][0];
    assert_eq!(table["name"], "cat_0");
    let (prefix, buckets) =
        (table["redis"]["prefix"].as_str().unwrap(), table["redis"]["buckets"].as_u64().unwrap());
    let key = format!("{{{prefix}/{}}}{id}", id % buckets);
    let port = cluster.seeds.split(',').next().unwrap().rsplit(':').next().unwrap();
    let deleted = Command::new("redis-cli").args(["-c", "-p", port, "del", &key]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&deleted.stdout).trim(), "1", "{key} deleted");

    // The default: the batch fails, naming the row and the policy.
    let erroring = factory(&dir, store_with(&cluster, MissingRows::Error, Duration::from_secs(1)));
    let error = forward_alone(&erroring, request, None).unwrap_err();
    assert!(matches!(error, narsil_core::BackendError::Unavailable { .. }), "{error:?}");
    let message = narsil_core::error_chain(&error);
    assert!(
        message.contains(&format!("row {id} is missing")) && message.contains("--missing-rows zero"),
        "{message}"
    );

    // `zero`: the scores of the same model with that row zeroed.
    let zeroed_copy = split_copy("missing-zeroed");
    let file = zeroed_copy.join(table["file"].as_str().unwrap());
    let row_bytes = table["row_bytes"].as_u64().unwrap() as usize;
    let mut rows = std::fs::read(&file).unwrap();
    rows[id as usize * row_bytes..(id as usize + 1) * row_bytes].fill(0);
    std::fs::write(&file, rows).unwrap();
    let mut zeroed_schema = schema.clone();
    zeroed_schema["tables"][0]["sha256"] = "".into();
    std::fs::write(zeroed_copy.join("schema.json"), zeroed_schema.to_string()).unwrap();
    let expected = forward_alone(&factory(&zeroed_copy, TableStore::Memory), request, None).unwrap();
    let zeroing = factory(&dir, store_with(&cluster, MissingRows::Zero, Duration::from_secs(1)));
    let scores = forward_alone(&zeroing, request, None).unwrap();
    assert_eq!(common::bits(&scores), common::bits(&expected), "the lost row pooled as zeros");
    assert_ne!(common::bits(&scores), common::bits(&forward_alone(&memory, request, None).unwrap()));
    let mut registry = prometheus_client::registry::Registry::with_prefix("narsil");
    narsil_core::BackendFactory::register_metrics(&zeroing, &mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert_eq!(common::metric(&text, r#"narsil_table_missing_rows_total{table="cat_0"}"#), 1.0, "{text}");
    std::fs::remove_dir_all(dir).unwrap();
    std::fs::remove_dir_all(zeroed_copy).unwrap();
}

/// A copy of `dir` whose every table's row `i` is the old row `i + 1`
/// (new values for every id), not shared by content with anything.
fn rotated_copy(dir: &Path, name: &str) -> PathBuf {
    let new = split_copy(name);
    let mut schema: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("schema.json")).unwrap()).unwrap();
    for table in schema["tables"].as_array_mut().unwrap() {
        let file = new.join(table["file"].as_str().unwrap());
        let row_bytes = table["row_bytes"].as_u64().unwrap() as usize;
        let mut rows = std::fs::read(&file).unwrap();
        rows.rotate_left(row_bytes);
        std::fs::write(&file, rows).unwrap();
        table["sha256"] = "".into();
    }
    std::fs::write(new.join("schema.json"), serde_json::to_string_pretty(&schema).unwrap()).unwrap();
    new
}

/// `narsil serve` on the split model `dir` with the Redis store, on port
/// 0; its gRPC URL once it has bound.
async fn serve_process(dir: &Path, seeds: &str) -> (common::KillOnDrop, String) {
    let listeners = common::Listeners::new();
    let child = Command::new(env!("CARGO_BIN_EXE_narsil"))
        .args(["serve", "--log-level", "warn"])
        .args(listeners.args(true))
        .arg("--model")
        .arg(dir)
        .args(["--table-store", seeds])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut child = common::KillOnDrop(child);
    let url = listeners.wait(&mut child.0, Duration::from_secs(60)).await.url();
    (child, url)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_pushed_under_load_reach_two_replicas_with_no_failed_request() {
    let cluster = Cluster::start("push");
    let dir = split_copy("push");
    tables_load(&dir, &cluster.seeds);
    let new = rotated_copy(&dir, "push-new");
    let golden = Golden::read(&test_model_dir()).unwrap();
    let expected = {
        let memory = factory(&new, TableStore::Memory);
        conformance::scores_alone(&memory, &conformance::requests(&memory, &golden, IdPolicy::Reject))
    };
    assert_ne!(expected[3], golden.requests[3].scores_int8, "the new rows change the scores");

    let mut replicas = Vec::new();
    for _ in 0..2 {
        replicas.push(serve_process(&dir, &cluster.seeds).await);
    }
    let mut channels = Vec::new();
    for (_, url) in &replicas {
        let channel = common::wait_serving(url, Duration::from_secs(60)).await;
        let mut client = narsil::proto::predictor_client::PredictorClient::new(channel.clone());
        for (i, g) in golden.requests.iter().enumerate() {
            let scores = client.predict(wire(g, "")).await.unwrap().into_inner().scores;
            assert_close(&scores, &g.scores_int8, &format!("replica {url}, request {i} before the push"));
        }
        channels.push(channel);
    }

    // Load on both replicas while the rows are pushed: every call answered.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load: Vec<_> = channels
        .iter()
        .map(|channel| {
            let (channel, stop, requests) = (channel.clone(), stop.clone(), golden.requests.clone());
            tokio::spawn(async move {
                let mut client = narsil::proto::predictor_client::PredictorClient::new(channel);
                let mut answered = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    for g in &requests {
                        client.predict(wire(g, "")).await.expect("a call failed during the push");
                        answered += 1;
                    }
                }
                answered
            })
        })
        .collect();
    let (dir2, new2, seeds) = (dir.clone(), new.clone(), cluster.seeds.clone());
    let push = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_narsil"))
            .args(["tables", "push"])
            .arg(&dir2)
            .args(["--store", &seeds, "--from"])
            .arg(&new2)
            .args(["--rows-per-second", "20000"])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(push.status.success(), "tables push: {}", String::from_utf8_lossy(&push.stderr));
    assert!(String::from_utf8_lossy(&push.stdout).contains("pushed 26000 changed rows"));
    let pushed = Instant::now();

    // Then both replicas answer the new rows' scores.
    for (channel, (_, url)) in channels.iter().zip(&replicas) {
        let mut client = narsil::proto::predictor_client::PredictorClient::new(channel.clone());
        loop {
            let mut all_new = true;
            for (g, want) in golden.requests.iter().zip(&expected) {
                let scores = client.predict(wire(g, "")).await.unwrap().into_inner().scores;
                all_new &= common::bits(&scores) == common::bits(want);
            }
            if all_new {
                break;
            }
            assert!(pushed.elapsed() < common::PATIENCE, "replica {url} still answers old rows");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        println!("replica {url}: new rows' scores {:?} after the push finished", pushed.elapsed());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for task in load {
        assert!(task.await.unwrap() > 0, "each replica answered calls during the push");
    }
    std::fs::remove_dir_all(dir).unwrap();
    std::fs::remove_dir_all(new).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_killed_under_load_gives_no_wrong_score_and_service_recovers_after_failover() {
    fail_a_master_under_load("failover", libc::SIGKILL, false).await;
}

/// Operators often name one node (or a service name) as the only seed: the
/// store must learn the new topology from the nodes it has seen, not only
/// from its seeds, when that very seed's master dies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_only_seed_s_master_killed_under_load_gives_no_wrong_score_and_service_recovers() {
    fail_a_master_under_load("one-seed", libc::SIGKILL, true).await;
}

/// A master that stops answering without closing its connections (a hung
/// machine, a partition) rather than dying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_stopped_under_load_gives_no_wrong_score_and_service_recovers_after_failover() {
    fail_a_master_under_load("stopped", libc::SIGSTOP, false).await;
}

/// Four clients call a server on the cluster (no cache) for 14 s; 2 s in,
/// the first seed's master gets `signal` (with `only_seed`, the store knows
/// that node alone as its seed). Every call is OK with its golden scores or
/// UNAVAILABLE after the signal, the non-OK answers end within 10 s, calls
/// succeed again after them, and the health pings never conclude that the
/// whole store is gone.
async fn fail_a_master_under_load(name: &str, signal: i32, only_seed: bool) {
    let cluster = Cluster::start(name);
    let dir = split_copy(name);
    tables_load(&dir, &cluster.seeds);
    let first_seed = cluster.seeds.split(',').next().unwrap();
    let seeds = if only_seed { first_seed } else { &cluster.seeds };
    // No cache: every batch reads the cluster.
    let mut config = RedisStoreConfig::new(RedisSeeds::parse(seeds).unwrap());
    config.cache_bytes = 0;
    let server = start_with(Arc::new(factory(&dir, TableStore::new(config.clone()))), batch_mode(1, 16))
        .await
        .ready()
        .await;
    // What the health pings conclude, through the server's own connection.
    let heard = Arc::new(std::sync::Mutex::new(Vec::new()));
    let handle = narsil_embedding::RedisCluster::shared(&config).unwrap();
    let h = heard.clone();
    handle.watch_reachability(Box::new(move |answers| {
        h.lock().unwrap().push(answers);
        true
    }));
    let golden = Arc::new(Golden::read(&test_model_dir()).unwrap());
    let channel = server.channel().await;
    let started = Instant::now();
    let clients: Vec<_> = (0..4)
        .map(|c| {
            let (channel, golden) = (channel.clone(), golden.clone());
            tokio::spawn(async move {
                let mut client = narsil::proto::predictor_client::PredictorClient::new(channel);
                let mut outcomes = Vec::new();
                let mut i = c;
                while started.elapsed() < Duration::from_secs(14) {
                    let g = &golden.requests[i % golden.requests.len()];
                    let result = client.predict(wire(g, "")).await;
                    let at = started.elapsed();
                    match result {
                        Ok(response) => {
                            assert_close(
                                &response.into_inner().scores,
                                &g.scores_int8,
                                "a score during failover",
                            );
                            outcomes.push((at, None));
                        }
                        Err(status) => outcomes.push((at, Some(status.code()))),
                    }
                    i += 1;
                }
                outcomes
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let port = first_seed.rsplit(':').next().unwrap();
    let pid = std::fs::read_to_string(cluster.dir.join(port).join("redis.pid")).unwrap();
    let pid: i32 = pid.trim().parse().unwrap();
    // SAFETY: signalling a Redis master this test started.
    unsafe { libc::kill(pid, signal) };
    let killed = started.elapsed();
    let mut outcomes = Vec::new();
    for client in clients {
        outcomes.extend(client.await.unwrap());
    }
    if signal == libc::SIGSTOP {
        // SAFETY: as above; it rejoins as a replica of its successor.
        unsafe { libc::kill(pid, libc::SIGCONT) };
    }
    let failed: Vec<_> = outcomes.iter().filter_map(|(at, code)| code.map(|code| (*at, code))).collect();
    for (at, code) in &failed {
        assert_eq!(*code, Code::Unavailable, "at {at:?}");
        assert!(*at >= killed, "a failure before the kill, at {at:?}");
    }
    let window = failed.last().map(|(at, _)| *at - killed);
    let ok_after =
        outcomes.iter().filter(|(at, code)| code.is_none() && Some(*at) > failed.last().map(|f| f.0)).count();
    println!(
        "{} calls, {} UNAVAILABLE, non-OK window {window:?} after the kill, {ok_after} OK after it",
        outcomes.len(),
        failed.len()
    );
    assert!(window.unwrap_or_default() < Duration::from_secs(10), "failover window {window:?}");
    assert!(ok_after > 0, "served again after the failover");
    // The other masters answered throughout: one master's failover never
    // reads as the whole store gone (every replica NOT_SERVING at once).
    assert_eq!(*heard.lock().unwrap(), [true], "the pings found no master answering");
    drop(handle);
    server.stop().await.unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

/// Sends `signal` to every node of the cluster.
fn signal_nodes(cluster: &Cluster, signal: i32) {
    for entry in std::fs::read_dir(&cluster.dir).unwrap() {
        let pid_file = entry.unwrap().path().join("redis.pid");
        if let Ok(pid) = std::fs::read_to_string(pid_file) {
            // SAFETY: signalling a Redis node this test started.
            unsafe { libc::kill(pid.trim().parse().unwrap(), signal) };
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_cluster_gives_unavailable_and_not_serving_then_recovers() {
    let cluster = Cluster::start("unreachable");
    let dir = split_copy("unreachable");
    tables_load(&dir, &cluster.seeds);
    let server = start_with(Arc::new(factory(&dir, cluster.store())), batch_mode(1, 16)).await.ready().await;
    let golden = Golden::read(&test_model_dir()).unwrap();
    // Without a cache, and with a fetch timeout far beyond any deadline.
    let patient = {
        let mut config = cluster.config();
        config.fetch_timeout = Duration::from_secs(30);
        config.cache_bytes = 0;
        factory(&dir, TableStore::new(config))
    };
    let patient_request = &conformance::requests(&patient, &golden, IdPolicy::Reject)[0];
    let channel = server.channel().await;
    let mut client = server.client().await;
    let g = &golden.requests[3];
    let response = client.predict(wire(g, "")).await.unwrap().into_inner();
    assert_close(&response.scores, &g.scores_int8, "before the cluster stops answering");
    assert_eq!(common::health_status(channel.clone()).await.unwrap(), 1, "SERVING");

    // Every node stops answering (as behind a partition). With no traffic
    // at all, health turns NOT_SERVING: the store's own pings tell it.
    signal_nodes(&cluster, libc::SIGSTOP);
    let stopped = Instant::now();
    while common::health_status(channel.clone()).await.unwrap() != 2 {
        assert!(stopped.elapsed() < Duration::from_secs(10), "still SERVING with the cluster stopped");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let not_serving_after = stopped.elapsed();
    // Nothing cached for these requests' other rows, so each call needs
    // the cluster: UNAVAILABLE, within a bound.
    for attempt in 0..6 {
        let started = Instant::now();
        let request = &golden.requests[attempt % golden.requests.len()];
        match client.predict(wire(request, "")).await {
            Err(status) => {
                assert_eq!(status.code(), Code::Unavailable, "attempt {attempt}: {status:?}");
                assert!(status.message().contains("redis"), "{status:?}");
            }
            // Rows the hot-row cache holds are still served, correctly.
            Ok(response) => {
                assert_close(&response.into_inner().scores, &request.scores_int8, "from the cache")
            }
        }
        assert!(started.elapsed() < Duration::from_secs(3), "answered in {:?}", started.elapsed());
    }
    // A batch whose callers all wait 200 ms gives its fetch up then, not
    // after the store's 30 s timeout.
    let started = Instant::now();
    let error =
        forward_alone(&patient, patient_request, Some(started + Duration::from_millis(200))).unwrap_err();
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(5), "gave up after {waited:?}");
    assert!(narsil_core::error_chain(&error).contains("every caller's deadline passed"), "{error:?}");
    let text = server.scrape().await;
    assert!(common::metric(&text, r#"narsil_table_store_errors_total{table="cat_0"}"#) > 0.0, "{text}");
    println!("NOT_SERVING {not_serving_after:?} after the cluster stopped answering, with no traffic");

    signal_nodes(&cluster, libc::SIGCONT);
    let resumed = Instant::now();
    while common::health_status(channel.clone()).await.unwrap() != 1 {
        assert!(resumed.elapsed() < Duration::from_secs(15), "health did not return to SERVING");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("SERVING {:?} after the cluster answered again", resumed.elapsed());
    for (i, g) in golden.requests.iter().enumerate() {
        let response = client.predict(wire(g, "")).await.unwrap().into_inner();
        assert_close(&response.scores, &g.scores_int8, &format!("request {i} after recovery"));
    }
    server.stop().await.unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}

/// A store that cannot be reached when the server starts fails the start
/// (exit status 1) with a message naming the store and its flag: a
/// misconfigured address shows at deploy time, not as a server that
/// answers nothing. (A store that goes away later turns the server
/// NOT_SERVING until it answers again: the test above.)
#[test]
fn a_store_unreachable_at_start_fails_the_start_naming_the_store_and_the_flag() {
    let dir = split_copy("unreachable-at-start");
    let output = Command::new(env!("CARGO_BIN_EXE_narsil"))
        .args([
            "serve",
            "--log-level",
            "warn",
            "--addr",
            "127.0.0.1:0",
            "--table-store",
            "redis://127.0.0.1:1",
        ])
        .arg("--model")
        .arg(&dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("redis://127.0.0.1:1") && stderr.contains("--table-store"), "{stderr}");
    std::fs::remove_dir_all(dir).unwrap();
}
