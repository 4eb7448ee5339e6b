//! Raw 64-bit ids end to end over real gRPC on loopback: a copy of the test
//! model's split form whose every table declares an id map (raw ids, large
//! and negative, to rows; one row per table left out of its map and made
//! the table's default row) answers the golden requests, their ids sent as
//! raw ids, with the golden scores: ids the map holds find their rows, ids
//! never seen (`i64::MIN`, `-1`, fresh values) the default row, counted in
//! `narsil_table_unmapped_ids_total`; alone and fused, from memory, mapped
//! and disk tables. A map whose bytes changed fails the load naming its
//! file.
#![cfg(feature = "torch")]

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::{assert_close, batch_mode, start_with, wire};
use narsil_core::golden::{copy_split_model, test_model_dir, Golden, GoldenRequest};
use narsil_embedding::id_map::build;
use narsil_torch::{SplitFactory, TableStore, TorchConfig};

const FEATURES: usize = 26;

/// Row `row`'s raw id in the maps: a large value, negative for about half.
fn raw(table: usize, row: i64) -> i64 {
    ((table as i64 + 1) * 1_000_003 + row).wrapping_mul(0x9e37_79b9_7f4a_7c15u64 as i64)
}

/// Raw ids that no map holds, as production sends them.
const NEVER_SEEN: [i64; 4] = [i64::MIN, -1, i64::MAX, 7_777_777];

/// The test model's split form, copied into `dir` with an id map per
/// table holding every row but its default row: the default rows (the
/// first golden request's first ids, so that the golden requests hold
/// ids of them).
fn mapped_copy(dir: &Path, golden: &Golden) -> Vec<i64> {
    copy_split_model(&test_model_dir().join("split"), dir).unwrap();
    let first = &golden.requests[0];
    let defaults: Vec<i64> = {
        let mut ids = first.ids.iter();
        first.lengths[..FEATURES]
            .iter()
            .map(|&len| *ids.by_ref().take(len as usize).last().unwrap_or(&0))
            .collect()
    };
    let path = dir.join("schema.json");
    let mut schema: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for (t, table) in schema["tables"].as_array_mut().unwrap().iter_mut().enumerate() {
        let rows = table["rows"].as_u64().unwrap();
        let pairs: Vec<(i64, u64)> =
            (0..rows as i64).filter(|&r| r != defaults[t]).map(|r| (raw(t, r), r as u64)).collect();
        let bytes = build(&pairs, rows).unwrap();
        let file = format!("tables/cat_{t}.idmap");
        std::fs::write(dir.join(&file), &bytes).unwrap();
        let sha256: String =
            <sha2::Sha256 as sha2::Digest>::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
        table["ids"] =
            serde_json::json!({"map": {"file": file, "sha256": sha256, "default_row": defaults[t]}});
    }
    std::fs::write(&path, serde_json::to_string_pretty(&schema).unwrap()).unwrap();
    defaults
}

/// `g` with its ids sent raw: each id's raw id, and an id never seen for
/// each default row's id (so it scores as that row). Also returns how many
/// ids were never seen.
fn raw_request(g: &GoldenRequest, defaults: &[i64]) -> (GoldenRequest, u64) {
    let mut sent = g.clone();
    let mut unseen = 0;
    let mut at = 0;
    for (bag, &len) in g.lengths.iter().enumerate() {
        let t = bag % FEATURES;
        for id in &mut sent.ids[at..at + len as usize] {
            *id = if *id == defaults[t] {
                unseen += 1;
                NEVER_SEEN[(unseen as usize) % NEVER_SEEN.len()]
            } else {
                raw(t, *id)
            };
        }
        at += len as usize;
    }
    (sent, unseen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_ids_through_id_maps_serve_the_golden_scores_from_every_local_store_and_new_ids_get_the_default_row(
) {
    const TEST: &str =
        "raw_ids_through_id_maps_serve_the_golden_scores_from_every_local_store_and_new_ids_get_the_default_row";
    let golden = Golden::read(&test_model_dir()).unwrap();
    // On the target's file system: the disk store's direct reads.
    let dir = common::real_fs_tempdir();
    let defaults = mapped_copy(dir.path(), &golden);
    let sent: Vec<(GoldenRequest, u64)> = golden.requests.iter().map(|g| raw_request(g, &defaults)).collect();
    let unseen_per_round: u64 = sent.iter().map(|(_, n)| n).sum();
    assert!(unseen_per_round > 0, "the golden requests hold ids of the default rows");
    let flags = narsil_embedding::StoreFlags {
        cache_bytes: 26 * 40 * (80 + 16),
        fetch_timeout: Duration::from_secs(1),
        missing_rows: narsil_embedding::MissingRows::Error,
    };
    let mut stores = vec![TableStore::Memory, TableStore::Mmap];
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(dir.path().join("schema.json"))
    {
        Ok(_) => stores.push("disk".parse::<TableStore>().unwrap().with_flags(&flags)),
        Err(e) => {
            common::skip_direct_io(&format!("{TEST} (disk store)"), &format!("no direct reads here ({e})"))
        }
    }
    for store in stores {
        let mut config = TorchConfig::new(dir.path());
        config.table_store = store.clone();
        let server =
            start_with(Arc::new(SplitFactory::load(config).unwrap()), batch_mode(1, 16)).await.ready().await;
        let mut client = server.client().await;
        // The lanes' warm-up forwards looked up ids too.
        let before = common::metric(&server.scrape().await, "narsil_table_unmapped_ids_total");
        let info = client.model_info(narsil::proto::ModelInfoRequest::default()).await.unwrap().into_inner();
        assert!(info.sparse_features.iter().all(|f| f.raw_ids), "ModelInfo says the ids are raw");
        for (i, ((request, _), g)) in sent.iter().zip(&golden.requests).enumerate() {
            let response = client.predict(wire(request, "")).await.unwrap().into_inner();
            assert_close(&response.scores, &g.scores_int8, &format!("golden request {i} alone, {store}"));
        }
        let requests: Vec<&GoldenRequest> = sent.iter().map(|(r, _)| r).cycle().take(16).collect();
        let wanted: Vec<&GoldenRequest> = golden.requests.iter().cycle().take(16).collect();
        let responses = common::predict_all(&server.channel().await, &requests).await;
        for (i, (response, g)) in responses.iter().zip(&wanted).enumerate() {
            assert_close(&response.scores, &g.scores_int8, &format!("client {i} fused, {store}"));
        }
        let fused_unseen: u64 = sent.iter().map(|(_, n)| n).cycle().take(16).sum();
        let text = server.scrape().await;
        let counted = common::metric(&text, "narsil_table_unmapped_ids_total") - before;
        assert_eq!(counted as u64, unseen_per_round + fused_unseen, "{store}");
        server.stop().await.unwrap();
    }
}

#[test]
fn an_id_map_that_does_not_match_its_schema_fails_the_load_naming_the_file() {
    let golden = Golden::read(&test_model_dir()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    mapped_copy(dir.path(), &golden);
    let map = dir.path().join("tables/cat_5.idmap");
    let bytes = std::fs::read(&map).unwrap();
    let load_error = || match SplitFactory::load(TorchConfig::new(dir.path())) {
        Ok(_) => panic!("a changed map loads"),
        Err(e) => format!("{e:#}"),
    };
    // One bit of a raw id changed: a map still, but not the one
    // schema.json names (or its entry is out of its run's order).
    let mut changed = bytes.clone();
    let slot = (0..).map(|s| 64 + 16 * s).find(|&at| changed[at + 8..at + 16] != [0xff; 8]).unwrap();
    changed[slot + 7] ^= 0x40;
    std::fs::write(&map, &changed).unwrap();
    let error = load_error();
    assert!(error.contains("cat_5") && error.contains("tables/cat_5.idmap"), "{error}");
    // A row past the table (an empty slot's row changed).
    let mut changed = bytes.clone();
    let last = changed.len() - 1;
    changed[last] ^= 1;
    std::fs::write(&map, &changed).unwrap();
    let error = load_error();
    assert!(error.contains("tables/cat_5.idmap") && error.contains("past the table's 1000 rows"), "{error}");
    // Cut short: its size says so before any hash.
    std::fs::write(&map, &bytes[..bytes.len() - 16]).unwrap();
    let error = load_error();
    assert!(error.contains("tables/cat_5.idmap") && error.contains("truncated"), "{error}");
    std::fs::remove_file(&map).unwrap();
    let error = load_error();
    assert!(error.contains("tables/cat_5.idmap"), "{error}");
}
