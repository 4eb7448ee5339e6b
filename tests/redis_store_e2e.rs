//! The `redis` table store against a real Redis Cluster (3 masters, 3
//! replicas, started by `scripts/redis_cluster.sh`): a split model's tables
//! loaded by `narsil tables load`, served with scores equal to the memory
//! store's, bit for bit; a model whose tables were never loaded fails at
//! start-up naming the command that loads them; with the cluster gone,
//! requests get UNAVAILABLE, never a score.
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
    let redis = factory(&dir, cluster.store());
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
    let server = start_with(Arc::new(factory(&dir, cluster.store())), batch_mode(1, 16)).await.ready().await;
    let golden = Golden::read(&test_model_dir()).unwrap();
    let requests: Vec<&GoldenRequest> = golden.requests.iter().cycle().take(16).collect();
    let channel = server.channel().await;
    for round in 0..3 {
        let responses = common::predict_all(&channel, &requests).await;
        for (i, (response, g)) in responses.iter().zip(&requests).enumerate() {
            assert_close(&response.scores, &g.scores_int8, &format!("round {round} client {i}"));
        }
    }
    let text = server.scrape().await;
    assert!(common::metric(&text, r#"narsil_table_rows_fetched_total{table="cat_0"}"#) > 0.0, "{text}");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_cluster_gone_requests_get_unavailable_not_a_score() {
    let cluster = Cluster::start("gone");
    let dir = split_copy("gone");
    tables_load(&dir, &cluster.seeds);
    let server = start_with(Arc::new(factory(&dir, cluster.store())), batch_mode(1, 16)).await.ready().await;
    let golden = Golden::read(&test_model_dir()).unwrap();
    let mut client = server.client().await;
    let g = &golden.requests[3];
    let response = client.predict(wire(g, "")).await.unwrap().into_inner();
    assert_close(&response.scores, &g.scores_int8, "before the cluster stops");

    cluster.stop();
    for attempt in 0..3 {
        let started = Instant::now();
        let status = client.predict(wire(g, "")).await.expect_err("no rows, no score");
        assert_eq!(status.code(), Code::Unavailable, "attempt {attempt}: {status:?}");
        assert!(status.message().contains("redis"), "{status:?}");
        assert!(started.elapsed() < Duration::from_secs(5), "answered in {:?}", started.elapsed());
    }
    server.stop().await.unwrap();
    std::fs::remove_dir_all(dir).unwrap();
}
