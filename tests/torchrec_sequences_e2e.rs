//! A team's own TorchRec sequence models, served end to end over real gRPC
//! on loopback with real libtorch: a DIN and a BST-like ranker written with
//! plain TorchRec (one `EmbeddingCollection` over the history and the
//! candidate, pooled user features, the team's attention and MLPs),
//! packaged the TorchRec way by `models/export_torchrec_din.py`, and their
//! split forms, which `models/extract_split.py` makes from `model.pt` and
//! `model.json` alone (the history in Narsil's stage, looked up once per
//! unit; the packaged graph gathering each row's positions inside itself).
//!
//! Both forms score every golden request (flat, and ranking requests whose
//! history is sent once in the block) as the single file's golden scores,
//! within `SCORE_TOLERANCE` (1e-6); the split form scores grouped requests
//! as their flat twins, alone and fused with other users', and as the
//! single file scores them.
#![cfg(feature = "torch")]

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::ranking::{fused_as_flat, golden_ranking_declaring};
use common::{assert_close, batch_mode, start_with, TestServer};
use narsil::proto::{self, PredictRequest, RequestFeatures};
use narsil_core::golden::Golden;
use narsil_core::BackendFactory;
use narsil_torch::{SplitFactory, TorchConfig, TorchFactory};

/// The exported model `name` (scripts/test.sh exports it with its
/// `extracted/` split form).
fn model_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/generated").join(name);
    assert!(
        dir.join("extracted/schema.json").is_file(),
        "no exported model in {0}: run scripts/test.sh, or .venv/bin/python models/export_torchrec_din.py \
         --out {0} --extract",
        dir.display()
    );
    dir
}

fn single_file(name: &str) -> Arc<dyn BackendFactory> {
    Arc::new(TorchFactory::load(TorchConfig::new(model_dir(name).join("model.pt"))).unwrap())
}

fn split(name: &str) -> Arc<dyn BackendFactory> {
    Arc::new(SplitFactory::load(TorchConfig::new(model_dir(name).join("extracted"))).unwrap())
}

/// User `user`'s ranking request, grouped (user features, history and
/// dense features once in the block) and flat (all of it on every row):
/// `history` positions, `candidates` rows of one item and its category.
fn ranking(
    info: &proto::ModelInfoResponse,
    user: u64,
    history: usize,
    candidates: usize,
) -> (PredictRequest, PredictRequest) {
    let features = &info.sparse_features;
    let rows = |f: usize| features[f].num_rows as i64;
    let dense: Vec<f32> =
        (0..info.num_dense as u64).map(|d| ((user * 37 + d * 11) % 100) as f32 / 100.0).collect();
    let bag = |f: usize| -> Vec<i64> {
        if features[f].sequence == info.sequences[0].name {
            (0..history as i64).map(|p| (user as i64 * 131 + p * 977) % rows(f)).collect()
        } else {
            (0..1 + (user as usize + f) % 3)
                .map(|k| (user as i64 * 7919 + f as i64 * 31 + k as i64 * 17) % rows(f))
                .collect()
        }
    };
    let mut block = RequestFeatures { dense: dense.clone(), ..Default::default() };
    let mut grouped = PredictRequest {
        batch_size: candidates as u32,
        request_id: format!("user-{user}"),
        ..Default::default()
    };
    let mut flat = PredictRequest { batch_size: candidates as u32, ..Default::default() };
    for f in (0..features.len()).filter(|&f| features[f].request_level) {
        let ids = bag(f);
        block.sparse_lengths.push(ids.len() as u32);
        block.sparse_ids.extend(ids);
    }
    for c in 0..candidates as i64 {
        flat.dense.extend(&dense);
        for (f, feature) in features.iter().enumerate() {
            let ids = match feature.request_level {
                true => bag(f),
                false => vec![(c * 104_729 + f as i64 * 13 + user as i64) % rows(f)],
            };
            if !feature.request_level {
                grouped.sparse_lengths.push(ids.len() as u32);
                grouped.sparse_ids.extend(&ids);
            }
            flat.sparse_lengths.push(ids.len() as u32);
            flat.sparse_ids.extend(ids);
        }
    }
    grouped.request = Some(block);
    (grouped, flat)
}

/// The golden requests, flat and grouped, against the single file's
/// golden scores.
async fn scores_as_the_single_file(server: &TestServer, name: &str, what: &str) -> proto::ModelInfoResponse {
    let dir = model_dir(name);
    let mut client = server.client().await;
    let info = client.model_info(proto::ModelInfoRequest::default()).await.unwrap().into_inner();
    assert_eq!(info.sequences[0].name, "history", "{what}: ModelInfo lists the history first");
    let golden = Golden::read(&dir).unwrap();
    for (i, request) in golden.requests.iter().enumerate() {
        let got = client.predict(common::wire(request, &format!("golden-{i}"))).await.unwrap().into_inner();
        assert_close(&got.scores, &request.outputs["default"], &format!("{what}: golden flat request {i}"));
    }
    let declared: Vec<String> = info
        .sparse_features
        .iter()
        .filter(|f| f.request_level)
        .map(|f| f.name.clone())
        .chain(info.dense_request_level.then(|| "dense".to_string()))
        .collect();
    let grouped = golden_ranking_declaring(&dir, &declared);
    assert!(!grouped.is_empty(), "{what}: golden ranking requests");
    for (i, golden) in grouped.into_iter().enumerate() {
        let got = client.predict(golden.grouped).await.unwrap().into_inner().scores;
        assert_close(
            &got,
            &golden.scores_int8,
            &format!("{what}: golden ranking request {i}, its history once"),
        );
    }
    info
}

async fn the_split_form_scores_as_the_single_file(name: &str) {
    // The split form first: its dense network names FBGEMM's operators,
    // which its loader registers when no single file has yet.
    let server = start_with(split(name), batch_mode(1, 16)).await.ready().await;
    let split_info = scores_as_the_single_file(&server, name, &format!("{name} split")).await;
    let single = start_with(single_file(name), batch_mode(1, 16)).await.ready().await;
    let info = scores_as_the_single_file(&single, name, &format!("{name} single file")).await;
    let history = split_info.sparse_features.iter().filter(|f| f.sequence == "history");
    assert!(
        history.clone().count() == 2 && history.clone().all(|f| f.request_level),
        "the history is request-level"
    );
    // Grouped == flat == the single file's, alone: histories of 0, 1, some
    // and the maximum positions, 1 to 300 candidates.
    let max = info.sequences[0].max_len as usize;
    let requests: Vec<_> = [(1, 0, 3), (2, 1, 1), (3, max / 2, 300), (4, max, 40), (5, max + 9, 7)]
        .iter()
        .map(|&(user, len, candidates)| ranking(&info, user, len, candidates))
        .collect();
    let mut split_client = server.client().await;
    let mut single_client = single.client().await;
    let mut flat_scores = Vec::new();
    for (i, (grouped, flat)) in requests.iter().enumerate() {
        let want = single_client.predict(flat.clone()).await.unwrap().into_inner().scores;
        for (form, request) in [("flat", flat), ("grouped", grouped)] {
            let got = split_client.predict(request.clone()).await.unwrap().into_inner().scores;
            assert_close(
                &got,
                &want,
                &format!("{name}: ranking request {i} {form}, split against the single file"),
            );
        }
        flat_scores.push(want);
    }
    // Fused: grouped and flat at once, with other users'.
    fused_as_flat(&server, &requests, &flat_scores, &format!("{name} split, fused")).await;
    server.stop().await.unwrap();
    single.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_teams_torchrec_din_split_by_extract_split_scores_as_its_single_file_flat_grouped_and_fused() {
    the_split_form_scores_as_the_single_file("test-torchrec-din").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_teams_torchrec_bst_split_by_extract_split_scores_as_its_single_file_flat_grouped_and_fused() {
    the_split_form_scores_as_the_single_file("test-torchrec-bst").await;
}
