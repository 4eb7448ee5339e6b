//! Split models end to end over real gRPC on loopback: the test model's
//! split form (`models/export_dlrm.py --split`, written by `scripts/test.sh`),
//! its tables pooled by Narsil's embedding stage and its TorchScript dense
//! network, must answer the single-file INT8 model's golden scores, alone
//! and fused, in batch and worker modes, over narsil.v1 and TorchRec's
//! protocol; FP32 tables (`--split-fp32`) answer the FP32 model's scores;
//! the dense network compiled by AOTInductor answers the same scores;
//! a table file that does not match the schema fails at load,
//! naming the table and the file.
#![cfg(feature = "torch")]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{assert_close, batch_mode, start_with, wire, worker_mode, TestServer};
use narsil_core::golden::{copy_split_model, test_model_dir, Golden, GoldenRequest};
use narsil_embedding::TableStore;
use narsil_engine::EngineConfig;
use narsil_torch::{SplitFactory, TorchConfig};

async fn start_split(config: EngineConfig, store: TableStore) -> TestServer {
    let mut torch = TorchConfig::new(test_model_dir().join("split"));
    torch.table_store = store;
    let factory = SplitFactory::load(torch).unwrap();
    start_with(Arc::new(factory), config).await.ready().await
}

/// What the embedding stage counted for table `cat_0`, and the batches
/// the lanes ran through the staged path (`--stage-ahead`).
struct TableCounts {
    ids: f64,
    distinct: f64,
    staged: f64,
}

impl TableCounts {
    async fn scrape(server: &TestServer) -> Self {
        let text = server.scrape().await;
        assert!(common::metric(&text, r#"narsil_table_fetch_seconds_count{table="cat_25"}"#) > 0.0, "{text}");
        Self {
            ids: common::metric(&text, r#"narsil_table_ids_total{table="cat_0"}"#),
            distinct: common::metric(&text, r#"narsil_table_distinct_ids_total{table="cat_0"}"#),
            staged: common::metric(&text, "narsil_batches_staged_total"),
        }
    }
}

/// Returns whether any of the concurrent requests shared a forward, and
/// what the stage counted during the concurrent rounds (tables in `store`).
async fn golden_scores_alone_and_fused(config: EngineConfig, store: TableStore) -> (bool, TableCounts) {
    let store_name = store.to_string();
    let deduplicates = store_name != "memory";
    let server = start_split(config, store).await;
    let golden = Golden::read(&test_model_dir()).unwrap();
    let mut client = server.client().await;
    for (i, g) in golden.requests.iter().enumerate() {
        let response = client.predict(wire(g, "")).await.unwrap().into_inner();
        assert_close(&response.scores, &g.scores_int8, &format!("golden request {i} alone"));
    }
    let mut torchrec = narsil::torchrec_proto::predictor_client::PredictorClient::new(server.channel().await);
    for (i, g) in golden.requests.iter().enumerate() {
        let request = narsil::wire::torchrec::encode(&wire(g, ""), 26);
        let mut response = torchrec.predict(request).await.unwrap().into_inner();
        let scores = response.predictions.remove(narsil::wire::torchrec::SCORES_KEY).unwrap().data;
        assert_close(&scores, &g.scores_int8, &format!("golden request {i} over TorchRec's protocol"));
    }
    let requests: Vec<&GoldenRequest> = golden.requests.iter().cycle().take(16).collect();
    let before = TableCounts::scrape(&server).await;
    let channel = server.channel().await;
    let mut fused = false;
    for round in 0..4 {
        let responses = common::predict_all(&channel, &requests).await;
        for (i, (response, g)) in responses.iter().zip(&requests).enumerate() {
            assert_close(&response.scores, &g.scores_int8, &format!("round {round} client {i}"));
        }
        fused |= responses.iter().any(|r| r.fused_requests > 1);
    }
    let after = TableCounts::scrape(&server).await;
    let counts = TableCounts {
        ids: after.ids - before.ids,
        distinct: after.distinct - before.distinct,
        staged: after.staged - before.staged,
    };
    // Tables in process memory are read in place, each id's row: their ids
    // are counted, not deduplicated.
    let distinct_counted = if deduplicates { counts.distinct > 0.0 } else { counts.distinct == 0.0 };
    assert!(
        counts.ids >= counts.distinct && counts.ids > 0.0 && distinct_counted,
        "{} ids, {} distinct ({store_name} store)",
        counts.ids,
        counts.distinct
    );
    server.stop().await.unwrap();
    (fused, counts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_model_serves_the_single_file_models_scores_in_batch_mode() {
    for (store, deduplicates) in [(TableStore::Memory, false), (TableStore::Mmap, true)] {
        let (fused, counts) = golden_scores_alone_and_fused(batch_mode(1, 16), store).await;
        assert!(fused, "16 concurrent requests never shared a forward");
        assert_eq!(counts.staged, 0.0, "no stage ahead, no staged batch");
        if deduplicates {
            // The 16 concurrent requests repeat the golden requests: a fused
            // forward reads their rows once.
            assert!(
                counts.ids > counts.distinct,
                "no id deduplicated: {} ids, {} distinct",
                counts.ids,
                counts.distinct
            );
        }
    }
}

/// The same scores with the stage one batch ahead, and the staged path
/// really ran (the scores alone would be the same if it were skipped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_model_staged_one_batch_ahead_serves_the_same_scores_alone_and_fused() {
    for lanes in [1, 2] {
        let mut config = batch_mode(lanes, 16);
        config.stage_ahead = true;
        let (fused, counts) = golden_scores_alone_and_fused(config, TableStore::Memory).await;
        assert!(fused, "{lanes} lane(s): 16 concurrent requests never shared a forward");
        assert!(counts.staged >= 4.0, "{lanes} lane(s): {} batches staged in 4 rounds", counts.staged);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_model_serves_the_single_file_models_scores_in_worker_mode() {
    assert!(
        !golden_scores_alone_and_fused(worker_mode(2), TableStore::Memory).await.0,
        "worker mode fused requests"
    );
}

#[test]
fn a_truncated_table_fails_at_load_naming_the_table_and_the_file() {
    let source = test_model_dir().join("split");
    let copy = std::env::temp_dir().join(format!("narsil-split-{}", std::process::id()));
    copy_split_model(&source, &copy).unwrap();
    let table = copy.join("tables/cat_7.bin");
    let bytes = std::fs::read(&table).unwrap();
    std::fs::write(&table, &bytes[..bytes.len() - 80]).unwrap();
    let error = match SplitFactory::load(TorchConfig::new(&copy)) {
        Ok(_) => panic!("a truncated table loaded"),
        Err(e) => narsil_core::error_chain(&e),
    };
    assert!(error.contains("cat_7") && error.contains("tables/cat_7.bin"), "{error}");
    std::fs::remove_dir_all(copy).unwrap();
}

/// A server of the test model's split form loaded with `config`, checked
/// to answer every golden request alone (`what` names the case).
async fn serve_golden_alone(config: TorchConfig, what: &str) -> (TestServer, Golden) {
    let server =
        start_with(Arc::new(SplitFactory::load(config).unwrap()), batch_mode(1, 16)).await.ready().await;
    let golden = Golden::read(&test_model_dir()).unwrap();
    let mut client = server.client().await;
    for (i, g) in golden.requests.iter().enumerate() {
        let response = client.predict(wire(g, "")).await.unwrap().into_inner();
        assert_close(&response.scores, &g.scores_int8, &format!("golden request {i}, {what}"));
    }
    (server, golden)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mapped_tables_serve_the_same_scores() {
    let mut config = TorchConfig::new(test_model_dir().join("split"));
    config.table_store = narsil_torch::TableStore::Mmap;
    let (server, _) = serve_golden_alone(config, "mapped tables").await;
    let text = server.scrape().await;
    assert!(common::metric(&text, r#"narsil_table_major_faults_total{table="cat_0"}"#) >= 0.0);
    server.stop().await.unwrap();
}

/// Tables read from their files with direct I/O (`--table-store disk`)
/// through a row cache of ~40 of each table's 1,000 rows: the golden scores
/// alone and fused, most rows read from the disk, the cached ones too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_tables_serve_the_same_scores_alone_and_fused_with_most_rows_from_disk() {
    use std::os::unix::fs::OpenOptionsExt;
    let table = test_model_dir().join("split/tables/cat_0.bin");
    if let Err(e) = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&table) {
        let why = format!("{} refuses direct reads ({e})", table.display());
        return common::skip_direct_io(
            "disk_tables_serve_the_same_scores_alone_and_fused_with_most_rows_from_disk",
            &why,
        );
    }
    let mut config = TorchConfig::new(test_model_dir().join("split"));
    let flags = narsil_embedding::StoreFlags {
        cache_bytes: 26 * 40 * (80 + 16),
        fetch_timeout: Duration::from_secs(1),
        missing_rows: narsil_embedding::MissingRows::Error,
    };
    config.table_store = "disk".parse::<narsil_torch::TableStore>().unwrap().with_flags(&flags);
    let (server, golden) = serve_golden_alone(config, "disk tables").await;
    let requests: Vec<&GoldenRequest> = golden.requests.iter().cycle().take(16).collect();
    for round in 0..3 {
        let responses = common::predict_all(&server.channel().await, &requests).await;
        for (i, (response, g)) in responses.iter().zip(&requests).enumerate() {
            assert_close(&response.scores, &g.scores_int8, &format!("round {round}, client {i}"));
        }
    }
    let text = server.scrape().await;
    let from_disk = common::metric(&text, "narsil_table_rows_fetched_total");
    let cached = common::metric(&text, "narsil_table_cache_hits_total");
    assert!(from_disk > cached && cached > 0.0, "{from_disk} rows from disk, {cached} from the cache");
    server.stop().await.unwrap();
}

/// The dense network compiled by AOTInductor (`--dense-form pt2`) answers
/// the golden scores over gRPC, alone and fused with 15 others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_aot_compiled_dense_network_serves_the_same_scores_alone_and_fused() {
    let mut config = TorchConfig::new(test_model_dir().join("split"));
    config.dense_form = narsil_torch::DenseForm::Pt2;
    let (server, golden) = serve_golden_alone(config, "dense.pt2").await;
    let requests: Vec<&GoldenRequest> = golden.requests.iter().cycle().take(16).collect();
    let responses = common::predict_all(&server.channel().await, &requests).await;
    for (i, (response, g)) in responses.iter().zip(&requests).enumerate() {
        assert_close(&response.scores, &g.scores_int8, &format!("client {i}, dense.pt2"));
    }
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fp32_tables_serve_the_fp32_models_scores_alone_and_fused() {
    let golden = Golden::read(&test_model_dir()).unwrap();
    for store in [narsil_torch::TableStore::Memory, narsil_torch::TableStore::Mmap] {
        let mut config = TorchConfig::new(test_model_dir().join("split_fp32"));
        config.table_store = store.clone();
        let factory = SplitFactory::load(config).unwrap();
        let server = start_with(Arc::new(factory), batch_mode(1, 16)).await.ready().await;
        let mut client = server.client().await;
        for (i, g) in golden.requests.iter().enumerate() {
            let response = client.predict(wire(g, "")).await.unwrap().into_inner();
            assert_close(&response.scores, &g.scores_fp32, &format!("golden request {i} alone, {store}"));
        }
        let requests: Vec<&GoldenRequest> = golden.requests.iter().cycle().take(16).collect();
        let responses = common::predict_all(&server.channel().await, &requests).await;
        for (i, (response, g)) in responses.iter().zip(&requests).enumerate() {
            assert_close(&response.scores, &g.scores_fp32, &format!("client {i}, {store}"));
        }
        server.stop().await.unwrap();
    }
}

/// `narsil tables order` lays the test model's tables out with the golden
/// requests' ids first (an id log of their traffic); the copy answers every
/// golden request alone with the very bits of the model in id order, from
/// memory, mapped and disk tables (a row cache of ~40 rows per table: most
/// rows read through the slot index from the disk), and fused within the
/// golden tolerance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_in_popularity_order_serve_the_same_scores_from_every_local_store() {
    const TEST: &str = "tables_in_popularity_order_serve_the_same_scores_from_every_local_store";
    let split = test_model_dir().join("split");
    let golden = Golden::read(&test_model_dir()).unwrap();
    // On the target's file system: /tmp may be a tmpfs, where the disk
    // store's direct reads are refused.
    let dir = common::real_fs_tempdir();
    let mut lines = Vec::new();
    for g in &golden.requests {
        let mut ids = g.ids.iter();
        for (bag, &len) in g.lengths.iter().enumerate() {
            for id in ids.by_ref().take(len as usize) {
                lines.push((bag % 26, format!("cat_{} {id}\n", bag % 26)));
            }
        }
    }
    let log: String = lines.iter().map(|(_, line)| line.as_str()).collect();
    std::fs::write(dir.path().join("ids.log"), log).unwrap();
    // Another order for half the tables: the same ids, last seen first.
    let again: String = lines.iter().rev().filter(|(t, _)| *t < 13).map(|(_, line)| line.as_str()).collect();
    std::fs::write(dir.path().join("again.log"), again).unwrap();
    let ordered = dir.path().join("ordered");
    let reordered = dir.path().join("reordered");
    // `narsil tables order` of `model` by the log `log` in `dir` into `out`.
    let order = |model: &std::path::Path, log: &str, out: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_narsil"))
            .args(["tables", "order"])
            .arg(model)
            .arg("--id-log")
            .arg(dir.path().join(log))
            .arg("--out")
            .arg(out)
            .output()
            .unwrap()
    };
    for (bad, says) in [
        ("cat_0 7\ncat_0 x\n", "line 2 (\"cat_0 x\"): the id is not a number"),
        ("nosuch 5\n", "\"nosuch\" is no feature or table"),
        ("cat_3 1000\n", "id 1000 is past table \"cat_3\"'s 1000 rows"),
    ] {
        std::fs::write(dir.path().join("bad.log"), bad).unwrap();
        let out = order(&split, "bad.log", &ordered);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(says) && stderr.contains("bad.log"),
            "{bad:?}: {stderr}"
        );
        assert!(!ordered.exists(), "a refused log writes nothing");
    }
    let out = order(&split, "ids.log", &ordered);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let schema = narsil_embedding::SplitSchema::read(&ordered).unwrap();
    assert!(schema.tables.iter().all(|t| t.layout.is_some()), "every table is named in the log");
    assert_ne!(
        std::fs::read(ordered.join("tables/cat_0.bin")).unwrap(),
        std::fs::read(split.join("tables/cat_0.bin")).unwrap(),
        "the rows moved"
    );
    // Ordering the ordered copy writes a third copy and leaves the second
    // as it was: not a byte of it changes (its `.slots` once shared an
    // inode with the new copy's and was written through).
    let files = |root: &std::path::Path| {
        let mut found = std::collections::BTreeMap::new();
        for sub in ["", "tables"] {
            for entry in std::fs::read_dir(root.join(sub)).unwrap() {
                let path = entry.unwrap().path();
                if path.is_file() {
                    found.insert(path.strip_prefix(root).unwrap().to_owned(), std::fs::read(&path).unwrap());
                }
            }
        }
        found
    };
    let before = files(&ordered);
    let out = order(&ordered, "again.log", &reordered);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let after = files(&ordered);
    assert!(before.keys().eq(after.keys()), "the ordered copy's files changed: {:?}", after.keys());
    for (path, bytes) in &before {
        assert!(&after[path] == bytes, "ordering the ordered copy changed its {}", path.display());
    }
    assert_ne!(
        std::fs::read(reordered.join("tables/cat_0.slots")).unwrap(),
        before[std::path::Path::new("tables/cat_0.slots")],
        "the second log orders cat_0 otherwise"
    );

    let (reference, _) = serve_golden_alone(TorchConfig::new(split), "id order").await;
    let mut client = reference.client().await;
    let mut want = Vec::new();
    for g in &golden.requests {
        want.push(client.predict(wire(g, "")).await.unwrap().into_inner().scores);
    }
    reference.stop().await.unwrap();

    let flags = narsil_embedding::StoreFlags {
        cache_bytes: 26 * 40 * (80 + 16),
        fetch_timeout: Duration::from_secs(1),
        missing_rows: narsil_embedding::MissingRows::Error,
    };
    for store in ["memory", "mmap", "disk"] {
        if store == "disk" {
            use std::os::unix::fs::OpenOptionsExt;
            let table = ordered.join("tables/cat_0.bin");
            if let Err(e) = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&table) {
                let why = format!("the disk store's case: {} refuses direct reads ({e})", table.display());
                common::skip_direct_io(TEST, &why);
                continue;
            }
        }
        for (model, layout) in [(&ordered, "popularity order"), (&reordered, "popularity order twice")] {
            let mut config = TorchConfig::new(model.clone());
            config.table_store = store.parse::<narsil_torch::TableStore>().unwrap().with_flags(&flags);
            let what = format!("{layout}, {store} store");
            let (server, _) = serve_golden_alone(config, &what).await;
            let mut client = server.client().await;
            for (i, (g, want)) in golden.requests.iter().zip(&want).enumerate() {
                let scores = client.predict(wire(g, "")).await.unwrap().into_inner().scores;
                assert_eq!(&scores, want, "golden request {i}, {what}: not the bits of id order");
            }
            let requests: Vec<&GoldenRequest> = golden.requests.iter().cycle().take(16).collect();
            let responses = common::predict_all(&server.channel().await, &requests).await;
            for (i, (response, g)) in responses.iter().zip(&requests).enumerate() {
                assert_close(&response.scores, &g.scores_int8, &format!("client {i} fused, {what}"));
            }
            server.stop().await.unwrap();
        }
    }
}
