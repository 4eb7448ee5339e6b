//! Raw integer inputs end to end over real gRPC on loopback, through a real
//! libtorch split network: `models/export_raw_echo.py`'s dense network
//! echoes, per row, what reached it (each int64 as three pieces a float32
//! holds exactly), so every check here is exact and computed from the
//! request sent, never from a recorded output.
//!
//! * Values at the full int64 range (`i64::MIN`, -1, `i64::MAX`) arrive
//!   unchanged on all three protocols (`narsil.v1`, KServe v2, TorchRec's
//!   with int64 ids): per-row raw inputs, a request-level one, and a
//!   sequence's raw channels at its first and last positions.
//! * A ranking request's sequence raw channels follow their positions
//!   (cut at the kept end), request-level raw inputs reach every row of
//!   the block, and each unit's request rows are the whole request's
//!   candidates: grouped, flat (1: each row its own unit), cut into parts
//!   by `--max-batch-rows` (every part keeps the whole's count and the
//!   whole's last row's query time) and fused with other users' requests.
//! * The same through the device lane on the CPU device (the sequences'
//!   and raw inputs' tensors copied to the device).
//! * A per-row raw input sent with other than one value is refused with
//!   INVALID_ARGUMENT naming the feature and the sample; ModelInfo marks
//!   the raw inputs and the sequence's request rows.
#![cfg(feature = "torch")]

mod common;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use common::{batch_mode, start_with, TestServer};
use narsil::kserve_proto::grpc_inference_service_client::GrpcInferenceServiceClient;
use narsil::proto::{self, PredictRequest, RequestFeatures};
use narsil::torchrec_proto::predictor_client::PredictorClient as TorchRecClient;
use narsil_torch::{SplitFactory, TorchConfig};

/// The echo model `scripts/test.sh` exports: `models/generated/test-raw-echo`,
/// or `$NARSIL_TEST_RAW_ECHO_DIR`.
fn echo_dir() -> PathBuf {
    let dir = std::env::var_os("NARSIL_TEST_RAW_ECHO_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/generated/test-raw-echo"));
    assert!(
        dir.join("schema.json").is_file(),
        "no exported echo model in {0}: run scripts/test.sh, or .venv/bin/python models/export_raw_echo.py --out {0}",
        dir.display()
    );
    dir
}

/// The schema's features: item, query_time, user_time, then the history's
/// channels hist_ts, hist_item, hist_act (the last four request-level).
const NUM_SPARSE: usize = 6;
/// The history's max_len (its last positions are kept).
const MAX_LEN: usize = 8;
const OUTPUTS: [&str; 20] = [
    "qt_lo",
    "qt_mid",
    "qt_hi",
    "ut_lo",
    "ut_mid",
    "ut_hi",
    "last_ts_lo",
    "last_ts_mid",
    "last_ts_hi",
    "first_act_lo",
    "first_act_mid",
    "first_act_hi",
    "seq_sum",
    "hist_items",
    "unit_rows",
    "positions",
    "item",
    "unit_qt_lo",
    "unit_qt_mid",
    "unit_qt_hi",
];

/// One position of a history: (hist_ts, hist_item, hist_act).
type Position = (i64, i64, i64);

/// A candidate row: its item and query time.
#[derive(Clone, Copy)]
struct Row {
    item: i64,
    query_time: i64,
}

/// One user's request: its user_time, history and candidates.
#[derive(Clone)]
struct UserRequest {
    user_time: i64,
    history: Vec<Position>,
    rows: Vec<Row>,
}

impl UserRequest {
    /// Sent grouped: the user's features once in the request block.
    fn grouped(&self, id: &str) -> PredictRequest {
        let n = self.history.len() as u32;
        let mut block = RequestFeatures { sparse_lengths: vec![1, n, n, n], ..Default::default() };
        block.sparse_ids.push(self.user_time);
        block.sparse_ids.extend(self.history.iter().map(|p| p.0));
        block.sparse_ids.extend(self.history.iter().map(|p| p.1));
        block.sparse_ids.extend(self.history.iter().map(|p| p.2));
        PredictRequest {
            batch_size: self.rows.len() as u32,
            dense: vec![0.25; self.rows.len()],
            sparse_ids: self.rows.iter().flat_map(|r| [r.item, r.query_time]).collect(),
            request: Some(block),
            request_id: id.into(),
            ..Default::default()
        }
    }

    /// Sent flat: every feature on every row.
    fn flat(&self, id: &str) -> PredictRequest {
        let n = self.history.len() as u32;
        let mut request = PredictRequest {
            batch_size: self.rows.len() as u32,
            dense: vec![0.25; self.rows.len()],
            request_id: id.into(),
            ..Default::default()
        };
        for row in &self.rows {
            request.sparse_lengths.extend([1, 1, 1, n, n, n]);
            request.sparse_ids.extend([row.item, row.query_time, self.user_time]);
            request.sparse_ids.extend(self.history.iter().map(|p| p.0));
            request.sparse_ids.extend(self.history.iter().map(|p| p.1));
            request.sparse_ids.extend(self.history.iter().map(|p| p.2));
        }
        request
    }

    /// What the echo network must return for row `r`, output by output,
    /// when the row's unit counts `unit_rows` rows; `seq_sum` only where
    /// `small` (exact in float32).
    fn expected(&self, r: usize, unit_rows: usize, small: bool) -> Vec<Option<f32>> {
        let kept = &self.history[self.history.len().saturating_sub(MAX_LEN)..];
        let row = self.rows[r];
        let last_ts = kept.last().map_or(0, |p| p.0);
        let first_act = kept.first().map_or(0, |p| p.2);
        let mut out: Vec<Option<f32>> = [row.query_time, self.user_time, last_ts, first_act]
            .into_iter()
            .flat_map(|x| pieces(x).map(Some))
            .collect();
        let seq_sum = kept.iter().enumerate().fold(0i64, |sum, (p, &(ts, _, act))| {
            sum.wrapping_add((p as i64 + 1).wrapping_mul(ts.wrapping_add(act.wrapping_mul(3))))
        });
        out.push(small.then_some(seq_sum as f32));
        out.push(Some(kept.iter().map(|p| p.1).sum::<i64>() as f32));
        out.extend([Some(unit_rows as f32), Some(kept.len() as f32), Some(row.item as f32)]);
        // The unit's query time: its whole request's last row's (a row's own
        // where the row is its unit), in every part of a cut request.
        let unit_qt = if unit_rows == 1 { row.query_time } else { self.rows[self.rows.len() - 1].query_time };
        out.extend(pieces(unit_qt).map(Some));
        out
    }
}

/// An int64 as the echo network's three exact pieces.
fn pieces(x: i64) -> [f32; 3] {
    let mask = (1i64 << 21) - 1;
    [(x & mask) as f32, ((x >> 21) & mask) as f32, (x >> 42) as f32]
}

/// Each output's values by name.
type Outputs = HashMap<String, Vec<f32>>;

/// Checks `got` (every output, each row) against `request`'s expectations,
/// each row's unit holding `unit_rows(row)` rows.
fn check(got: &Outputs, request: &UserRequest, unit_rows: impl Fn(usize) -> usize, small: bool, what: &str) {
    for r in 0..request.rows.len() {
        for (name, want) in OUTPUTS.iter().zip(request.expected(r, unit_rows(r), small)) {
            let Some(want) = want else { continue };
            let value = got.get(*name).unwrap_or_else(|| panic!("{what}: no output {name}"))[r];
            assert_eq!(value.to_bits(), want.to_bits(), "{what}: row {r} output {name}: {value} != {want}");
        }
    }
}

/// A `narsil.v1` answer's outputs.
fn v1_outputs(response: &proto::PredictResponse) -> Outputs {
    response.outputs.iter().map(|(name, scores)| (name.clone(), scores.scores.clone())).collect()
}

/// A server of the echo model, at most `max_batch_rows` rows a forward,
/// on the CPU lane or (`device_lane`) the device lane on the CPU device.
async fn start_on(max_batch_rows: usize, device_lane: bool) -> TestServer {
    let mut torch = TorchConfig::new(echo_dir());
    torch.device_path_on_cpu = device_lane;
    let factory = SplitFactory::load(torch).unwrap();
    let mut config = batch_mode(1, 64);
    config.max_batch_rows = max_batch_rows;
    start_with(Arc::new(factory), config).await.ready().await
}

async fn start(max_batch_rows: usize) -> TestServer {
    start_on(max_batch_rows, false).await
}

/// User `user`'s request of `candidates` rows whose history has `len`
/// positions; small values throughout (`seq_sum` exact).
fn user(user: i64, len: usize, candidates: usize) -> UserRequest {
    UserRequest {
        user_time: 1_000 * user + 7,
        history: (0..len as i64)
            .map(|p| (100 * user + p, (user * 13 + p * 7) % 1000, -(p % 5) - user))
            .collect(),
        rows: (0..candidates as i64)
            .map(|c| Row { item: (c * 31 + user) % 1000, query_time: -c - 10 * user })
            .collect(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_values_at_the_full_int64_range_arrive_unchanged_on_every_protocol() {
    full_range_on_every_protocol(start(256).await, "CPU lane").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_values_at_the_full_int64_range_arrive_unchanged_through_the_device_lane_on_the_cpu_device() {
    full_range_on_every_protocol(start_on(256, true).await, "device lane").await;
}

/// `i64::MIN`, -1 and `i64::MAX` as per-row, request-level and sequence
/// raw values, flat and grouped, over each protocol to `server`.
async fn full_range_on_every_protocol(server: TestServer, lane: &str) {
    let channel = server.channel().await;
    let (min, max) = (i64::MIN, i64::MAX);
    let request = UserRequest {
        user_time: max,
        history: vec![(min, 3, max), (-1, 4, min), (7, 5, -1), (max, 6, 0)],
        rows: [min, -1, max, 0]
            .iter()
            .enumerate()
            .map(|(c, &t)| Row { item: c as i64, query_time: t })
            .collect(),
    };
    let flat = request.flat("full-range");
    let mut v1 = proto::predictor_client::PredictorClient::new(channel.clone());
    let response = v1.predict(flat.clone()).await.unwrap().into_inner();
    check(&v1_outputs(&response), &request, |_| 1, false, &format!("{lane}: narsil.v1 flat"));
    let response = v1.predict(request.grouped("full-range-grouped")).await.unwrap().into_inner();
    check(&v1_outputs(&response), &request, |_| 4, false, &format!("{lane}: narsil.v1 grouped"));

    let mut kserve = GrpcInferenceServiceClient::new(channel.clone());
    for (what, sent, rows) in [("KServe flat", flat.clone(), 1), ("KServe grouped", request.grouped("g"), 4)]
    {
        let answer = kserve.model_infer(narsil::wire::kserve::encode(&sent, 1, NUM_SPARSE)).await.unwrap();
        let answer = answer.into_inner();
        let got: Outputs = answer
            .outputs
            .iter()
            .zip(&answer.raw_output_contents)
            .map(|(tensor, bytes)| (tensor.name.clone(), narsil::wire::le::f32s(bytes).unwrap()))
            .collect();
        check(&got, &request, |_| rows, false, &format!("{lane}: {what}"));
    }

    let mut torchrec = TorchRecClient::new(channel.clone());
    let answer =
        torchrec.predict(narsil::wire::torchrec::encode_int64(&flat, NUM_SPARSE)).await.unwrap().into_inner();
    let got: Outputs = answer.predictions.into_iter().map(|(name, values)| (name, values.data)).collect();
    check(&got, &request, |_| 1, false, &format!("{lane}: TorchRec flat (int64 ids)"));
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ranking_request_keeps_its_whole_rows_per_unit_cut_into_parts_and_fused_with_others() {
    // At most 4 rows a forward: user 1's 10 candidates take 3 parts.
    let server = start(4).await;
    let mut client = server.client().await;
    // A history past its maximum (cut to its last 8), one of 3, none.
    let users = [user(1, 12, 10), user(2, 3, 2), user(3, 0, 1), user(4, 8, 3)];
    for (u, request) in users.iter().enumerate() {
        let grouped = client.predict(request.grouped("grouped")).await.unwrap().into_inner();
        let rows = request.rows.len();
        check(&v1_outputs(&grouped), request, |_| rows, true, &format!("user {u} grouped"));
        assert_eq!(grouped.forwards as usize, rows.div_ceil(4), "user {u}: cut by --max-batch-rows 4");
        let flat = client.predict(request.flat("flat")).await.unwrap().into_inner();
        check(&v1_outputs(&flat), request, |_| 1, true, &format!("user {u} flat"));
    }
    // Fused: every user's request at once, grouped and flat, a few rounds
    // until some share a forward.
    let channel = server.channel().await;
    let mut fused = false;
    for round in 0..5 {
        let calls: Vec<_> = users
            .iter()
            .flat_map(|u| [(u.clone(), true), (u.clone(), false), (u.clone(), true)])
            .map(|(request, grouped)| {
                let mut client = proto::predictor_client::PredictorClient::new(channel.clone());
                tokio::spawn(async move {
                    let sent = if grouped { request.grouped("fused") } else { request.flat("fused") };
                    (request, grouped, client.predict(sent).await.unwrap().into_inner())
                })
            })
            .collect();
        for call in calls {
            let (request, grouped, response) = call.await.unwrap();
            let rows = if grouped { request.rows.len() } else { 1 };
            check(&v1_outputs(&response), &request, |_| rows, true, &format!("round {round}, fused"));
            fused |= response.fused_requests > 1;
        }
        if fused {
            break;
        }
    }
    assert!(fused, "no two requests shared a forward in 5 rounds");
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raw_input_with_other_than_one_value_is_refused_naming_it_and_model_info_marks_raw_inputs() {
    let server = start(256).await;
    let mut client = server.client().await;
    let info = client.model_info(proto::ModelInfoRequest::default()).await.unwrap().into_inner();
    let raw: Vec<(&str, bool, u64)> =
        info.sparse_features.iter().map(|f| (f.name.as_str(), f.raw_input, f.num_rows)).collect();
    assert_eq!(
        raw,
        [
            ("item", false, 1000),
            ("query_time", true, 0),
            ("user_time", true, 0),
            ("hist_ts", true, 0),
            ("hist_item", false, 1000),
            ("hist_act", true, 0)
        ]
    );
    assert!(info.sequences[0].request_rows);
    let request = user(5, 2, 2);
    // Row 1 sends two query times.
    let mut two = request.flat("two");
    let at = two.sparse_lengths.len() / 2 + 1;
    two.sparse_lengths[at] = 2;
    // Row 0 holds 9 ids; row 1 its item, then its query times.
    two.sparse_ids.insert(9 + 2, 99);
    let status = client.predict(two).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("sample 1: raw input \"query_time\" has 2 values"),
        "{}",
        status.message()
    );
    // The block sends two user times.
    let mut twice = request.grouped("twice");
    let block = twice.request.as_mut().unwrap();
    block.sparse_lengths[0] = 2;
    block.sparse_ids.insert(0, 1);
    let status = client.predict(twice).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("raw input \"user_time\" has 2 values"), "{}", status.message());
    // The server still serves.
    let fine = client.predict(request.grouped("fine")).await.unwrap().into_inner();
    check(&v1_outputs(&fine), &request, |_| 2, true, "after the refusals");
    server.stop().await.unwrap();
}
