//! Raw 64-bit ids end to end over real gRPC on loopback: a copy of the test
//! model's split form whose every table declares an id map (raw ids, large
//! and negative, to rows; one row per table left out of its map and made
//! the table's default row) answers the golden requests, their ids sent as
//! raw ids, with the golden scores: ids the map holds find their rows, ids
//! never seen (`i64::MIN`, `-1`, fresh values) the default row, counted in
//! `narsil_table_unmapped_ids_total`; alone, fused, and as a ranking
//! request's user sent once; from memory, mapped and disk tables and
//! through the device lane's path on the CPU device. A map whose bytes changed fails the load naming its
//! file.
#![cfg(feature = "torch")]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::id_maps::{mapped_copy, raw_ranking, raw_request, RANKING_CANDIDATES};
use common::{batch_mode, start_with, wire};
use narsil_core::golden::{max_abs_diff, test_model_dir, Golden, GoldenRequest};
use narsil_torch::{SplitFactory, TableStore, TorchConfig};

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
    let config = |store: TableStore| TorchConfig { table_store: store, ..TorchConfig::new(dir.path()) };
    let mut variants = vec![("memory", config(TableStore::Memory)), ("mmap", config(TableStore::Mmap))];
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(dir.path().join("schema.json"))
    {
        Ok(_) => variants.push(("disk", config("disk".parse::<TableStore>().unwrap().with_flags(&flags)))),
        Err(e) => {
            common::skip_direct_io(&format!("{TEST} (disk store)"), &format!("no direct reads here ({e})"))
        }
    }
    // The device lane's path on the CPU device: tables pooled on the host,
    // and looked up as tensors (the GPU's tensor stage).
    let device_path = |on_device: bool| TorchConfig {
        device_path_on_cpu: true,
        dense_form: narsil_torch::DenseForm::TorchScript,
        device_table_bytes: on_device.then_some(u64::MAX),
        ..TorchConfig::new(dir.path())
    };
    variants.push(("device path, host tables", device_path(false)));
    variants.push(("device path, device tables", device_path(true)));
    for (store, config) in variants {
        // The tensor stage pools in FP32 tensor ops (its own tolerance).
        let tolerance = if config.device_path_on_cpu { 1e-5 } else { common::SCORE_TOLERANCE };
        let close = |got: &[f32], want: &[f32], what: String| {
            let diff = max_abs_diff(got, want).unwrap();
            assert!(diff <= tolerance, "{what}, {store}: max |diff| {diff}");
        };
        let server =
            start_with(Arc::new(SplitFactory::load(config).unwrap()), batch_mode(1, 16)).await.ready().await;
        let mut client = server.client().await;
        // The lanes' warm-up forwards looked up ids too.
        let before = common::metric(&server.scrape().await, "narsil_table_unmapped_ids_total");
        let info = client.model_info(narsil::proto::ModelInfoRequest::default()).await.unwrap().into_inner();
        assert!(info.sparse_features.iter().all(|f| f.raw_ids), "ModelInfo says the ids are raw");
        for (i, ((request, _), g)) in sent.iter().zip(&golden.requests).enumerate() {
            let response = client.predict(wire(request, "")).await.unwrap().into_inner();
            close(&response.scores, &g.scores_int8, format!("golden request {i} alone"));
        }
        let requests: Vec<&GoldenRequest> = sent.iter().map(|(r, _)| r).cycle().take(16).collect();
        let wanted: Vec<&GoldenRequest> = golden.requests.iter().cycle().take(16).collect();
        let responses = common::predict_all(&server.channel().await, &requests).await;
        for (i, (response, g)) in responses.iter().zip(&wanted).enumerate() {
            close(&response.scores, &g.scores_int8, format!("client {i} fused"));
        }
        // A ranking request: the user's request-level ids (some never seen)
        // sent once and pooled once, against the user on every row.
        let (grouped, flat) = common::ranking::ranking(3, RANKING_CANDIDATES, 1000);
        let ((grouped, grouped_unseen), (flat, flat_unseen)) =
            (raw_ranking(grouped, &defaults), raw_ranking(flat, &defaults));
        let grouped = client.predict(grouped).await.unwrap().into_inner();
        let flat = client.predict(flat).await.unwrap().into_inner();
        close(&grouped.scores, &flat.scores, "grouped vs flat".into());
        let fused_unseen: u64 = sent.iter().map(|(_, n)| n).cycle().take(16).sum();
        let ranking_unseen = grouped_unseen + flat_unseen;
        assert!(grouped_unseen >= 2 && flat_unseen >= 2 * RANKING_CANDIDATES as u64);
        let text = server.scrape().await;
        let counted = common::metric(&text, "narsil_table_unmapped_ids_total") - before;
        assert_eq!(counted as u64, unseen_per_round + fused_unseen + ranking_unseen, "{store}");
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
