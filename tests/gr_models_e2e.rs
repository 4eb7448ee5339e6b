//! Generative rankers trained with Meta's generative-recommenders (GR),
//! served as trained, end to end over real gRPC on loopback: the small
//! `DlrmHSTU` checkpoints GR's own `save_dmp_checkpoint` wrote
//! (`models/testdata/gr/{streaming,kuairand}/`: MLPerf DLRMv3's feature set,
//! one task, `user_id` gated; kuairand's, eight tasks, six contextual
//! features, millisecond timestamps), imported by `models/import_gr.py`
//! (`scripts/test.sh` imports each with both time-bucket clamps), must score
//! every candidate and task as GR's own eager forward scores that user
//! alone (`golden.json`, written by `models/gr/make_gr_golden.py` with GR's
//! code) within `GR_BOUND` (1e-5, FP32):
//!
//!   * each golden user as a ranking request (contexts and history in the
//!     request block, sent once; raw timestamps and action bitmasks as
//!     sent), its one-candidate users also flat;
//!   * the golden batches' users sent at once, fused into shared forwards:
//!     each equal to itself alone within 1e-6 (GR's own scores move by up
//!     to ~1e-2 with who shares its forward; Narsil's do not);
//!   * a request cut into parts by `--max-batch-rows` keeps its own N and
//!     its own query time (its last candidate's, also where its
//!     candidates' query times differ);
//!   * on the memory, mmap and disk stores and through the device lane on
//!     the CPU device (TorchScript), and through kuairand's AOTInductor
//!     package (`--pt2`, millisecond timestamps); both clamps; empty
//!     histories, the contextual gate's edge, maximal histories, 1 and the
//!     most candidates (the golden cases);
//!   * the memory bound charges each form the working set of how it
//!     attends (`dense.pt` unit after unit, the `.pt2` every block pair).
#![cfg(feature = "torch")]

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::{batch_mode, config, start_with, TestServer};
use narsil::proto::{self, PredictRequest, RequestFeatures};
use narsil_core::working_set::{Unit, WorkingSet};
use narsil_core::BackendFactory;
use narsil_torch::{SplitFactory, TorchConfig};
use serde::Deserialize;

/// Served scores against GR's own alone (FP32, per candidate and task).
const GR_BOUND: f32 = 1e-5;
/// Fused with other users' requests, or cut into parts, against alone.
const FUSED_BOUND: f32 = 1e-6;

/// One user of a golden case: GR's KJT values by feature name and GR's
/// scores of the user alone, by task.
#[derive(Deserialize)]
struct User {
    uih: HashMap<String, Vec<i64>>,
    candidates: HashMap<String, Vec<i64>>,
    scores_alone: BTreeMap<String, Vec<f32>>,
}

impl User {
    fn candidates(&self) -> usize {
        self.scores_alone.values().next().map_or(0, Vec::len)
    }
}

/// Whether every candidate of `user` has the same query time (as GR's
/// data sends: one query, its candidates).
fn one_query_time(user: &User) -> bool {
    user.candidates.get("item_query_time").is_some_and(|times| times.windows(2).all(|w| w[0] == w[1]))
}

/// One GR forward: its users.
#[derive(Deserialize)]
struct Case {
    name: String,
    users: Vec<User>,
}

#[derive(Deserialize)]
struct GoldenFile {
    clamp: HashMap<String, Vec<Case>>,
}

/// The committed oracle data of feature set `set`.
fn testdata(set: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/testdata/gr").join(set)
}

/// GR's golden cases of `set` under `clamp`.
fn golden(set: &str, clamp: &str) -> Vec<Case> {
    let path = testdata(set).join("golden.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut file: GoldenFile = serde_json::from_str(&text).unwrap();
    file.clamp.remove(clamp).unwrap_or_else(|| panic!("{}: no {clamp} cases", path.display()))
}

/// The imported model (`scripts/test.sh` imports it): `models/generated/gr-SET-CLAMP`.
fn imported(set: &str, clamp: &str) -> PathBuf {
    let name = format!("gr-{set}-{clamp}");
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/generated").join(&name);
    assert!(
        dir.join("schema.json").is_file(),
        "no imported model in {0}: run scripts/test.sh, or .venv/bin/python models/import_gr.py {1}/checkpoint \
         {1}/hparams.json {0} --clamp {clamp}",
        dir.display(),
        testdata(set).display()
    );
    dir
}

/// A user's bag of feature `name`: its history's or contexts' (request
/// level), or candidate `c`'s one value.
fn bag<'a>(user: &'a User, name: &str, c: Option<usize>) -> &'a [i64] {
    match c {
        None => user.uih.get(name).unwrap_or_else(|| panic!("golden user has no {name}")),
        Some(c) => {
            let values = user.candidates.get(name).unwrap_or_else(|| panic!("golden user has no {name}"));
            &values[c..c + 1]
        }
    }
}

/// `user` as a ranking request (its contexts and history once, in the
/// block) and, flat, every row carrying them.
fn requests(info: &proto::ModelInfoResponse, user: &User, id: &str) -> (PredictRequest, PredictRequest) {
    assert_eq!(info.num_dense, 0, "a GR model has no dense features");
    let candidates = user.candidates();
    let mut block = RequestFeatures::default();
    for f in info.sparse_features.iter().filter(|f| f.request_level) {
        let values = bag(user, &f.name, None);
        block.sparse_lengths.push(values.len() as u32);
        block.sparse_ids.extend(values);
    }
    let mut grouped = PredictRequest {
        batch_size: candidates as u32,
        request: Some(block),
        request_id: id.into(),
        ..Default::default()
    };
    let mut flat = PredictRequest {
        batch_size: candidates as u32,
        request_id: format!("{id}-flat"),
        ..Default::default()
    };
    for c in 0..candidates {
        for f in &info.sparse_features {
            let row = (!f.request_level).then_some(c);
            let values = bag(user, &f.name, row);
            flat.sparse_lengths.push(values.len() as u32);
            flat.sparse_ids.extend(values);
            if row.is_some() {
                grouped.sparse_lengths.push(1);
                grouped.sparse_ids.extend(values);
            }
        }
    }
    (grouped, flat)
}

/// A response's scores by task (the model's outputs).
fn by_task(info: &proto::ModelInfoResponse, response: &proto::PredictResponse) -> BTreeMap<String, Vec<f32>> {
    match info.outputs.len() {
        1 => BTreeMap::from([(info.outputs[0].clone(), response.scores.clone())]),
        _ => info.outputs.iter().map(|task| (task.clone(), response.outputs[task].scores.clone())).collect(),
    }
}

/// The largest |got - want| over every task, checking they name the same tasks.
fn worst(got: &BTreeMap<String, Vec<f32>>, want: &BTreeMap<String, Vec<f32>>, what: &str) -> f32 {
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{what}: tasks");
    got.iter()
        .map(|(task, scores)| {
            narsil_core::golden::max_abs_diff(scores, &want[task]).unwrap_or_else(|| {
                panic!("{what}: {task}: {} scores, want {}", scores.len(), want[task].len())
            })
        })
        .fold(0f32, f32::max)
}

/// Serves `factory` and checks every golden case of `set` under `clamp`:
/// alone grouped (and flat for one-candidate users) against GR, the
/// batches' users fused against themselves alone. Returns the server.
async fn scores_as_gr(factory: Arc<dyn BackendFactory>, set: &str, clamp: &str, what: &str) -> TestServer {
    let server = start_with(factory, batch_mode(1, 64)).await.ready().await;
    let mut client = server.client().await;
    let info = client.model_info(proto::ModelInfoRequest::default()).await.unwrap().into_inner();
    assert!(
        info.sparse_features.iter().any(|f| f.raw_input && !f.sequence.is_empty()),
        "{what}: ModelInfo marks the history's timestamps and bitmasks raw"
    );
    let cases = golden(set, clamp);
    let mut largest = 0f32;
    let mut alone: Vec<Vec<BTreeMap<String, Vec<f32>>>> = Vec::new();
    for case in &cases {
        let mut scores = Vec::new();
        for (u, user) in case.users.iter().enumerate() {
            let (grouped, flat) = requests(&info, user, &format!("{}-{u}", case.name));
            let got = by_task(&info, &client.predict(grouped).await.unwrap().into_inner());
            let diff = worst(&got, &user.scores_alone, &format!("{what}: {} user {u}", case.name));
            assert!(
                diff <= GR_BOUND,
                "{what}: {} user {u}: max |diff| from GR alone {diff} > {GR_BOUND}",
                case.name
            );
            largest = largest.max(diff);
            if user.candidates() == 1 {
                let flat = by_task(&info, &client.predict(flat).await.unwrap().into_inner());
                let diff = worst(&flat, &user.scores_alone, &format!("{what}: {} user {u} flat", case.name));
                assert!(diff <= GR_BOUND, "{what}: {} user {u} flat: {diff} > {GR_BOUND}", case.name);
            }
            scores.push(got);
        }
        alone.push(scores);
    }
    eprintln!("{what}: {} cases, max |served - GR alone| {largest:e}", cases.len());
    // Each batch's users at once (three times each): fused, as alone.
    let channel = server.channel().await;
    let mut fused = false;
    for (case, scores) in cases.iter().zip(&alone).filter(|(c, _)| c.users.len() > 1) {
        let calls = (0..3).flat_map(|_| case.users.iter().enumerate()).map(|(u, user)| {
            let (grouped, _) = requests(&info, user, &format!("{}-{u}-fused", case.name));
            let mut client = proto::predictor_client::PredictorClient::new(channel.clone());
            tokio::spawn(async move { (u, client.predict(grouped).await.unwrap().into_inner()) })
        });
        for call in futures_util::future::join_all(calls).await {
            let (u, response) = call.unwrap();
            fused |= response.fused_requests > 1;
            let diff = worst(&by_task(&info, &response), &scores[u], &format!("{what}: {} fused", case.name));
            assert!(
                diff <= FUSED_BOUND,
                "{what}: {} user {u} fused: {diff} from alone > {FUSED_BOUND}",
                case.name
            );
        }
    }
    assert!(fused, "{what}: some requests shared a forward");
    server
}

fn split_config(dir: &Path) -> TorchConfig {
    TorchConfig::new(dir.to_path_buf())
}

async fn check(config: TorchConfig, set: &str, clamp: &str, what: &str) {
    let factory = Arc::new(SplitFactory::load(config).unwrap());
    scores_as_gr(factory, set, clamp, what).await.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gr_dlrmv3_checkpoint_scores_as_gr_alone_with_both_clamps_on_tables_in_memory_and_mapped() {
    for clamp in ["pytorch", "triton"] {
        let dir = imported("streaming", clamp);
        check(split_config(&dir), "streaming", clamp, &format!("streaming, {clamp} clamp, memory")).await;
        let mut mapped = split_config(&dir);
        mapped.table_store = narsil_torch::TableStore::Mmap;
        check(mapped, "streaming", clamp, &format!("streaming, {clamp} clamp, mapped")).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gr_kuairand_checkpoint_scores_every_task_as_gr_alone_with_both_clamps() {
    for clamp in ["pytorch", "triton"] {
        let mut config = split_config(&imported("kuairand", clamp));
        config.dense_form = narsil_torch::DenseForm::TorchScript;
        check(config, "kuairand", clamp, &format!("kuairand, {clamp} clamp")).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gr_kuairand_checkpoint_scores_every_task_as_gr_alone_through_its_aoti_package() {
    // scripts/test.sh imports kuairand with `--pt2`: the importer keeps the
    // package only within 1e-5 of the network on batches of millisecond
    // timestamps (float32 hours near 5e8, where Inductor's own remainder
    // was off by a whole period), so its absence is a failure here.
    let dir = imported("kuairand", "pytorch");
    assert!(dir.join("dense.pt2").is_file(), "no dense.pt2 in {}: the importer dropped it", dir.display());
    let mut config = split_config(&dir);
    config.dense_form = narsil_torch::DenseForm::Pt2;
    check(config, "kuairand", "pytorch", "kuairand, dense.pt2").await;
}

#[test]
fn each_form_of_a_gr_import_is_charged_the_working_set_of_how_it_attends() {
    // dense.pt attends unit after unit (`unit_attention`: linear in a
    // unit's history); the .pt2 every block pair of every unit at once
    // (`block_attention`, declared as `package_working_set`). The memory
    // bound charges the form served.
    let dir = imported("kuairand", "pytorch");
    let charged = |form| {
        let mut config = split_config(&dir);
        config.dense_form = form;
        let factory = SplitFactory::load(config).unwrap();
        assert_eq!(factory.dense_form(), form);
        factory.schema().sequences[0].working_set()
    };
    let script = charged(narsil_torch::DenseForm::TorchScript);
    let package = charged(narsil_torch::DenseForm::Pt2);
    assert!(matches!(script, WorkingSet::UnitAttention { .. }), "{script:?}");
    assert!(matches!(package, WorkingSet::BlockAttention { .. }), "{package:?}");
    // One user's maximal history (256 positions) and 64 candidates.
    let units = [Unit { positions: 256, rows: 64 }];
    assert!(script.bytes(&units) < package.bytes(&units), "{script:?} vs {package:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gr_checkpoint_scores_as_gr_alone_through_the_device_lane_on_the_cpu_device() {
    for set in ["streaming", "kuairand"] {
        let mut config = split_config(&imported(set, "pytorch"));
        config.device_path_on_cpu = true;
        config.dense_form = narsil_torch::DenseForm::TorchScript;
        check(config, set, "pytorch", &format!("{set}, device lane")).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gr_checkpoint_scores_as_gr_alone_on_disk_tables() {
    let dir = imported("streaming", "pytorch");
    let table = std::fs::read_dir(dir.join("tables")).unwrap().next().unwrap().unwrap().path();
    use std::os::unix::fs::OpenOptionsExt;
    if let Err(e) = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&table) {
        let why = format!("{} refuses direct reads ({e})", table.display());
        return common::skip_direct_io("a_gr_checkpoint_scores_as_gr_alone_on_disk_tables", &why);
    }
    let mut disk = split_config(&dir);
    let flags = narsil_embedding::StoreFlags {
        // A small cache: most positions read from the disk.
        cache_bytes: 64 * 1024,
        fetch_timeout: Duration::from_secs(2),
        missing_rows: narsil_embedding::MissingRows::Error,
    };
    disk.table_store = "disk".parse::<narsil_torch::TableStore>().unwrap().with_flags(&flags);
    check(disk, "streaming", "pytorch", "streaming, disk tables").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gr_request_cut_into_parts_keeps_its_own_n() {
    // Rows cut at 3: the golden users' 16 candidates go in parts of 3, each
    // part a forward of its own (or fused with another part); GR's N counts
    // all 16, and so must each part's.
    for set in ["streaming", "kuairand"] {
        let dir = imported(set, "pytorch");
        let factory = Arc::new(SplitFactory::load(split_config(&dir)).unwrap());
        let server = start_with(factory, config(|c| c.max_batch_rows = 3)).await.ready().await;
        let mut client = server.client().await;
        let info = client.model_info(proto::ModelInfoRequest::default()).await.unwrap().into_inner();
        let (mut cut, mut varied) = (0, 0);
        for case in golden(set, "pytorch") {
            for (u, user) in case.users.iter().enumerate().filter(|(_, user)| user.candidates() > 3) {
                // GR's time buckets count from the request's last candidate's
                // query time: every part gets it from the stage
                // (`seq0_unit_raw`), also where the candidates' times differ.
                varied += usize::from(!one_query_time(user));
                let (grouped, _) = requests(&info, user, &format!("{}-{u}-cut", case.name));
                let response = client.predict(grouped).await.unwrap().into_inner();
                let diff = worst(
                    &by_task(&info, &response),
                    &user.scores_alone,
                    &format!("{set}: {} cut", case.name),
                );
                assert!(
                    diff <= GR_BOUND,
                    "{set}: {} user {u} cut into parts: {diff} from GR alone",
                    case.name
                );
                cut += 1;
            }
        }
        assert!(varied > 0, "{set}: some golden user cut has candidates of different query times");
        assert!(cut > 0, "{set}: some golden user has more than 3 candidates");
        server.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_gr_users_in_flight_fit_a_bound_far_below_their_own_working_sets_summed() {
    // dense.pt runs a batch as groups of at most 2,048 positions and rows:
    // one lane holds one group's states however many users are queued, so
    // a bound of one group's working set and the requests' values serves
    // every golden user of every case four times at once, each as GR
    // scores it alone. One request a forward keeps them queued together.
    // (Each charged its own working set from admission, refusals began
    // past 15 in flight: one run of two failed here; the engine's test of
    // queued requests holding one batch's working set, in
    // `engine/predict.rs`, fails on that every time.)
    let dir = imported("kuairand", "pytorch");
    let factory = Arc::new(SplitFactory::load(split_config(&dir)).unwrap());
    let users: Vec<User> = golden("kuairand", "pytorch").into_iter().flat_map(|case| case.users).collect();
    let calls = 4 * users.len();
    let users = Arc::new(users);
    let sequence = &factory.schema().sequences[0];
    let largest = Unit { positions: sequence.max_len, rows: 16 };
    let own = sequence.working_set().bytes(&[largest]);
    let group = sequence.working_set().batch_bound(&vec![largest; calls]);
    // Room for one group and about 200 kB of values a request.
    let memory = narsil_engine::MemoryBudget::new(group + calls * (200 << 10));
    assert!(calls * own > 2 * memory.max(), "{calls} x {own} bytes of their own against {}", memory.max());
    let one_at_a_time = config(|c| (c.lanes, c.max_batch_requests, c.memory) = (1, 1, memory.clone()));
    let server = start_with(factory, one_at_a_time).await.ready().await;
    let mut client = server.client().await;
    let info = client.model_info(proto::ModelInfoRequest::default()).await.unwrap().into_inner();
    // Each on a connection of its own, built before any is sent.
    let mut prepared = Vec::with_capacity(calls);
    for call in 0..calls {
        let u = call % users.len();
        let (grouped, _) = requests(&info, &users[u], &format!("in-flight-{call}"));
        prepared.push((u, server.client().await, grouped));
    }
    let sent = prepared
        .into_iter()
        .map(|(u, mut client, grouped)| tokio::spawn(async move { (u, client.predict(grouped).await) }));
    for call in futures_util::future::join_all(sent).await {
        let (u, response) = call.unwrap();
        let response = response.unwrap_or_else(|status| panic!("user {u}: {status:?}")).into_inner();
        let diff = worst(&by_task(&info, &response), &users[u].scores_alone, &format!("user {u} in flight"));
        assert!(diff <= GR_BOUND + FUSED_BOUND, "user {u} among many in flight: {diff} from GR alone");
    }
    eprintln!(
        "{calls} requests at once under a bound of {} bytes: {own} bytes a user's own working \
         set, {group} one group's; peak held {}",
        memory.max(),
        memory.peak()
    );
    server.stop().await.unwrap();
}
