//! Ranking requests end to end over real gRPC on loopback: one user and
//! many candidates per call, the user's features (13 multi-hot sparse
//! features and the dense features) sent once in `narsil.v1`'s request
//! block. Every candidate must score as the same request sent flat (the
//! user repeated on every row) scores, within `SCORE_TOLERANCE` (1e-6),
//! alone and fused with other users' requests and flat ones, and as
//! TorchRec's eager forward scores the exporter's ranking requests (the
//! user tiled by the exporter: an oracle outside the server): the test
//! model's split form on every local store (memory, mmap, disk) and through
//! the device lane on the CPU device, and its single-file form (whose lanes
//! take the batch made flat). Bad blocks are refused naming the field.
#![cfg(feature = "torch")]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::ranking::{golden_ranking, request_level};
use common::{assert_close, batch_mode, start_with, TestServer};
use narsil::proto::{self, PredictRequest};
use narsil_core::golden::test_model_dir;
use narsil_core::BackendFactory;
use narsil_engine::EngineConfig;
use narsil_torch::{SplitFactory, TorchConfig, TorchFactory};

fn config() -> EngineConfig {
    EngineConfig { request_level: Some(request_level()), max_batch_rows: 128, ..batch_mode(1, 16) }
}

/// User `user`'s request of `candidates` candidates to the served test
/// model, grouped and flat.
fn ranking(
    info: &proto::ModelInfoResponse,
    user: u64,
    candidates: usize,
) -> (PredictRequest, PredictRequest) {
    assert_eq!((info.num_dense, info.sparse_features.len()), (13, 26), "the test model's shape");
    common::ranking::ranking(user, candidates, info.sparse_features[0].num_rows)
}

/// Serves `factory` with the workload's request-level features and checks
/// grouped == flat alone and fused; returns the server.
async fn grouped_scores_equal_flat(factory: Arc<dyn BackendFactory>, what: &str) -> TestServer {
    let server = start_with(factory, config()).await.ready().await;
    let mut client = server.client().await;
    let info = client.model_info(proto::ModelInfoRequest::default()).await.unwrap().into_inner();
    let declared: Vec<&str> =
        info.sparse_features.iter().filter(|f| f.request_level).map(|f| f.name.as_str()).collect();
    assert_eq!((declared.len(), info.dense_request_level), (13, true), "{what}: ModelInfo declares them");
    // Alone: users 1..4, 1 to 300 candidates (more than one forward's rows
    // for the largest: split, its block shared by the parts).
    let mut flat_scores = Vec::new();
    let requests: Vec<_> =
        [(1, 40), (2, 1), (3, 300), (1, 7)].iter().map(|&(u, c)| ranking(&info, u, c)).collect();
    for (i, (grouped, flat)) in requests.iter().enumerate() {
        let want = client.predict(flat.clone()).await.unwrap().into_inner().scores;
        let got = client.predict(grouped.clone()).await.unwrap().into_inner();
        assert_close(&got.scores, &want, &format!("{what}: ranking request {i} alone"));
        assert_eq!(got.request_id, grouped.request_id);
        flat_scores.push(want);
    }
    // Against an oracle outside the server: the exporter's ranking requests,
    // scored by TorchRec's eager forward with the user tiled by the
    // exporter (a convention the server's grouped and flat paths shared
    // would show here).
    for golden in golden_ranking(&test_model_dir()) {
        let what = format!("{what}: {} against TorchRec's eager forward", golden.grouped.request_id);
        let got = client.predict(golden.grouped).await.unwrap().into_inner().scores;
        assert_close(&got, &golden.scores_int8, &what);
    }
    // Fused: the same requests grouped, twice over, beside their flat twins.
    common::ranking::fused_as_flat(&server, &requests, &flat_scores, what).await;
    server
}

fn split_config() -> TorchConfig {
    TorchConfig::new(test_model_dir().join("split"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grouped_requests_score_as_flat_ones_on_tables_in_memory_and_pool_user_bags_once() {
    let factory = Arc::new(SplitFactory::load(split_config()).unwrap());
    let server = grouped_scores_equal_flat(factory, "memory tables").await;
    let text = server.scrape().await;
    let bags = common::metric(&text, "narsil_request_level_bags_pooled_total");
    let rows = common::metric(&text, "narsil_request_level_rows_broadcast_total");
    assert!(bags > 0.0 && rows > 10.0 * bags / 13.0, "{bags} request-level bags pooled for {rows} rows");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grouped_requests_score_as_flat_ones_on_mapped_and_disk_tables() {
    let mut mapped = split_config();
    mapped.table_store = narsil_torch::TableStore::Mmap;
    grouped_scores_equal_flat(Arc::new(SplitFactory::load(mapped).unwrap()), "mapped tables")
        .await
        .stop()
        .await
        .unwrap();
    let table = test_model_dir().join("split/tables/cat_0.bin");
    use std::os::unix::fs::OpenOptionsExt;
    if let Err(e) = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&table) {
        let why = format!("{} refuses direct reads ({e})", table.display());
        return common::skip_direct_io(
            "grouped_requests_score_as_flat_ones_on_mapped_and_disk_tables (disk)",
            &why,
        );
    }
    let mut disk = split_config();
    let flags = narsil_embedding::StoreFlags {
        cache_bytes: 26 * 40 * (80 + 16),
        fetch_timeout: Duration::from_secs(1),
        missing_rows: narsil_embedding::MissingRows::Error,
    };
    disk.table_store = "disk".parse::<narsil_torch::TableStore>().unwrap().with_flags(&flags);
    let server = grouped_scores_equal_flat(Arc::new(SplitFactory::load(disk).unwrap()), "disk tables").await;
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grouped_requests_score_as_flat_ones_through_the_device_lane_on_the_cpu_device() {
    for device_tables in [true, false] {
        let mut config = split_config();
        config.device_path_on_cpu = true;
        config.dense_form = narsil_torch::DenseForm::TorchScript;
        if !device_tables {
            config.device_table_bytes = Some(0);
        }
        let what =
            if device_tables { "device lane, tables on the device" } else { "device lane, host tables" };
        grouped_scores_equal_flat(Arc::new(SplitFactory::load(config).unwrap()), what)
            .await
            .stop()
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_file_model_takes_grouped_requests_made_flat() {
    let factory = TorchFactory::load(TorchConfig::new(test_model_dir().join("model_default.pt"))).unwrap();
    grouped_scores_equal_flat(Arc::new(factory), "single-file model").await.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_request_blocks_are_refused_naming_the_field() {
    let factory = || Arc::new(SplitFactory::load(split_config()).unwrap());
    let mut limited = config();
    limited.limits.max_samples = 400;
    let server = start_with(factory(), limited).await.ready().await;
    let mut client = server.client().await;
    let info = client.model_info(proto::ModelInfoRequest::default()).await.unwrap().into_inner();
    assert_eq!(info.max_batch_size, 400);
    let (grouped, _) = ranking(&info, 5, 3);
    let refused = |edit: &dyn Fn(&mut PredictRequest)| {
        let mut request = grouped.clone();
        edit(&mut request);
        request
    };
    let cases: [(&str, PredictRequest); 5] = [
        (
            "request.sparse_lengths",
            refused(&|r| r.request.as_mut().unwrap().sparse_lengths.pop().map(drop).unwrap()),
        ),
        ("request.sparse_ids", refused(&|r| r.request.as_mut().unwrap().sparse_ids[0] = 1 << 40)),
        ("request.dense", refused(&|r| r.request.as_mut().unwrap().dense.push(f32::NAN))),
        ("sparse_lengths", refused(&|r| r.sparse_lengths = vec![1; 3 * 26])),
        ("batch_size", refused(&|r| r.batch_size = 0)),
    ];
    // The candidates count against --max-request-samples, as samples do.
    let (too_many, _) = ranking(&info, 5, info.max_batch_size as usize + 1);
    let cases = cases.into_iter().chain([("batch_size", too_many)]);
    for (field, request) in cases {
        let status = client.predict(request).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{field}: {status:?}");
        assert!(status.message().starts_with(&format!("invalid {field}:")), "{field}: {}", status.message());
    }
    server.stop().await.unwrap();
    // A model served declaring no request-level feature (`--request-level
    // none`; the test model's export declares some) refuses a block.
    let none = EngineConfig { request_level: Some(vec!["none".into()]), ..batch_mode(1, 16) };
    let server = start_with(factory(), none).await.ready().await;
    let status = server.client().await.predict(grouped).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().contains("invalid request:")
            && status.message().contains("declares no request-level")
    );
    server.stop().await.unwrap();
}
