//! Raw ids pushed to a served model's id maps, end to end over real HTTP
//! and gRPC on loopback: a repository server (`--model-control`, a token)
//! serving the test model's mapped copy ([`common::id_maps`]) from the
//! `memory` and `mmap` stores.
//!
//! A golden request whose ids of one table are sent as raw ids the map
//! has never seen scores as their default row; once those ids are pushed,
//! each with the row of the id it replaced, it scores as the golden
//! request. Pushed in chunks while clients send it in a loop: no request
//! fails, every response is the score without the new ids or the score
//! with all of them (never a mix: a batch sees a push whole or not at
//! all), and every request sent after the push was answered has the new
//! ids. Refusals name why. `narsil tables push-ids` sends a new
//! vocabulary's ids from the command line, and sending them again changes
//! nothing.
//!
//! `NARSIL_PUSH_IDS` (default 10,000), `NARSIL_PUSH_CLIENTS` (4),
//! `NARSIL_PUSH_CHUNK_IDS` (1,000) and `NARSIL_PUSH_PAUSE_MS` (30, between
//! pushes) scale the load test; it prints what it measured.
#![cfg(feature = "torch")]

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::id_maps::{mapped_copy, raw_ranking, NEVER_SEEN, RANKING_CANDIDATES};
use common::pushes::{self, close, entries, rows_of, with_new_ids, NEW_IDS, TABLE, TOKEN};
use narsil::proto::predictor_client::PredictorClient;
use narsil_core::golden::{test_model_dir, Golden, GoldenRequest};
use narsil_embedding::SplitSchema;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Other pushed ids (the load's bulk): `FILLER + n`.
const FILLER: i64 = 0x4649_4c00_0000_0000;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A repository server in the test's runtime, with model control and a
/// token.
struct PushServer(common::RepoServer);

impl PushServer {
    async fn start(repo: &Path, store: &str) -> Self {
        Self::start_with(repo, store, true).await
    }

    async fn start_with(repo: &Path, store: &str, control: bool) -> Self {
        let server = common::RepoServer::start(repo, TOKEN, |args| {
            args.model_control = control;
            args.backend.table_store = store.parse().unwrap();
        })
        .await;
        let started = Instant::now();
        while server.models.live_versions("dlrm").is_empty() {
            assert!(started.elapsed() < Duration::from_secs(120), "{:#?}", server.models.list());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Self(server)
    }

    /// `POST /v1/models/dlrm/tables/{table}/ids` with the token.
    async fn push(&self, table: &str, body: &[u8]) -> (u16, serde_json::Value) {
        let (code, text) =
            post(self.admin, &format!("/v1/models/dlrm/tables/{table}/ids"), Some(TOKEN), body).await;
        (code, serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)))
    }

    async fn stop(self) {
        self.0.stop().await
    }
}

impl std::ops::Deref for PushServer {
    type Target = common::RepoServer;

    fn deref(&self) -> &common::RepoServer {
        &self.0
    }
}

/// `POST path` with the token (if any) and `body`: the status and body.
async fn post(addr: SocketAddr, path: &str, token: Option<&str>, body: &[u8]) -> (u16, String) {
    let authorization = token.map(|token| format!("Bearer {token}"));
    common::post(addr, path, authorization.as_deref(), body).await
}

/// The mapped test model published as version 1 of `dlrm` in `repo`; its
/// default rows.
fn publish(repo: &Path, golden: &Golden) -> Vec<i64> {
    pushes::publish(repo, golden, 1)
}

/// Table `TABLE`'s rows, in id order, and its row bytes.
fn table_rows(dir: &Path) -> (Vec<u8>, usize) {
    rows_of(dir, TABLE)
}

/// One answered request of the load.
struct Answer {
    sent: Instant,
    scores: Result<Vec<f32>, String>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pushed_ids_score_as_their_rows_and_pushes_under_load_fail_no_request_and_never_tear() {
    let golden = Golden::read(&test_model_dir()).unwrap();
    for store in ["memory", "mmap"] {
        let repo = tempfile::tempdir().unwrap();
        let defaults = publish(repo.path(), &golden);
        let (rows, row_bytes) = table_rows(&repo.path().join("dlrm/1"));
        let table = format!("cat_{TABLE}");
        let g = &golden.requests[1];
        let (request, request_rows) = with_new_ids(g, &defaults);
        assert!(!request_rows.is_empty());
        let server = PushServer::start(repo.path(), store).await;
        let client = server.client().await;
        let predict = |mut client: PredictorClient<_>, request: &GoldenRequest| {
            let request = common::wire(request, "");
            async move { client.predict(request).await.map(|r| r.into_inner().scores) }
        };
        // Never seen: the default row.
        let before = predict(client.clone(), &request).await.unwrap();
        assert!(!close(&before, &g.scores_int8), "{store}: the new ids change the score");

        // Refusals, each naming why, and none changes anything.
        let path = format!("/v1/models/dlrm/tables/{table}/ids");
        let one = entries(&rows, row_bytes, [(NEW_IDS + request_rows[0] as i64, request_rows[0])]);
        let (code, body) = post(server.admin, &path, None, &one).await;
        assert_eq!((code, body.as_str()), (401, "unauthorized"));
        let (code, body) = server.push(&table, &one[..one.len() - 1]).await;
        assert_eq!(code, 422, "{body}");
        assert!(body["error"].as_str().unwrap().contains("not whole entries"), "{body}");
        let (code, body) = server.push("no_such_table", &one).await;
        assert!(code == 422 && body["error"].as_str().unwrap().contains("no table"), "{body}");
        let (code, body) = post(server.admin, "/v1/models/nope/tables/cat_3/ids", Some(TOKEN), &one).await;
        assert!(code == 404 && body.contains("nope") && body.contains("is serving"), "{body}");
        // A raw id the map holds, with another row.
        let held = common::id_maps::raw(TABLE, 1);
        let (code, body) = server.push(&table, &entries(&rows, row_bytes, [(held, 2)])).await;
        assert_eq!(code, 422, "{body}");
        assert!(body["error"].as_str().unwrap().contains("already held"), "{body}");
        assert_eq!(predict(client.clone(), &request).await.unwrap(), before);

        // The load: clients send the request in a loop while the ids are
        // pushed in chunks, the request's in the middle one.
        let (total, clients, chunk) = (
            env_or("NARSIL_PUSH_IDS", 10_000),
            env_or("NARSIL_PUSH_CLIENTS", 4),
            env_or("NARSIL_PUSH_CHUNK_IDS", 1000),
        );
        // Between pushes, so that requests run while they land.
        let pause = Duration::from_millis(env_or("NARSIL_PUSH_PAUSE_MS", 30) as u64);
        let table_rows_count = rows.len() / row_bytes;
        let mut pairs: Vec<(i64, usize)> = (0..total.saturating_sub(request_rows.len()))
            .map(|n| (FILLER + n as i64, n % table_rows_count))
            .collect();
        let middle = (total / chunk / 2) * chunk;
        let mine: Vec<(i64, usize)> = request_rows.iter().map(|&r| (NEW_IDS + r as i64, r)).collect();
        pairs.splice(middle.min(pairs.len())..middle.min(pairs.len()), mine);
        let request_chunk = middle.min(pairs.len()) / chunk;
        let stop = Arc::new(AtomicBool::new(false));
        let mut load = Vec::new();
        for _ in 0..clients {
            let (client, request, stop) = (server.client().await, request.clone(), Arc::clone(&stop));
            load.push(tokio::spawn(async move {
                let mut answers = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let sent = Instant::now();
                    let scores = predict(client.clone(), &request).await.map_err(|e| e.to_string());
                    answers.push(Answer { sent, scores });
                }
                answers
            }));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let started = Instant::now();
        let (mut slowest, mut servable) = (Duration::ZERO, None);
        for (c, part) in pairs.chunks(chunk).enumerate() {
            let call = Instant::now();
            let (code, body) = server.push(&table, &entries(&rows, row_bytes, part.iter().copied())).await;
            assert_eq!(code, 200, "{body}");
            assert_eq!(body["versions"][0]["added"], part.len(), "{body}");
            slowest = slowest.max(call.elapsed());
            if c == request_chunk {
                servable = Some((call, Instant::now()));
            }
            tokio::time::sleep(pause).await;
        }
        let pushed_in = started.elapsed();
        tokio::time::sleep(Duration::from_millis(300)).await;
        stop.store(true, Ordering::Relaxed);
        let (sent_at, answered_at) = servable.unwrap();
        let (mut failed, mut old, mut new) = (0, 0, 0);
        for client in load {
            for answer in client.await.unwrap() {
                let scores = match answer.scores {
                    Ok(scores) => scores,
                    Err(e) => {
                        failed += 1;
                        eprintln!("{store}: failed: {e}");
                        continue;
                    }
                };
                if close(&scores, &g.scores_int8) {
                    new += 1;
                } else {
                    assert!(close(&scores, &before), "{store}: a response that is neither: {scores:?}");
                    assert!(
                        answer.sent < answered_at,
                        "{store}: sent after the push was answered, without its ids"
                    );
                    old += 1;
                }
            }
        }
        assert_eq!(failed, 0, "{store}");
        assert!(new > 0, "{store}: no response after the push");
        let after = predict(client.clone(), &request).await.unwrap();
        assert!(close(&after, &g.scores_int8), "{store}: after the push, the golden score");
        let metrics = common::scrape(server.admin).await;
        let held = common::metric(&metrics, &format!(r#"narsil_table_pushed_ids{{table="{table}"}}"#));
        assert_eq!(held as usize, total.max(request_rows.len()), "{store}");
        eprintln!(
            "{store}: pushed {} ids in {} chunks of {chunk} in {:.3} s ({pause:?} between chunks; {:.0} ids/s, slowest push {:.1} ms) under {clients} clients; \
             the request's ids servable {:.1} ms after their push was sent; {} responses: {old} without the new ids, {new} with, 0 torn, {failed} failed",
            pairs.len(),
            pairs.len().div_ceil(chunk),
            pushed_in.as_secs_f64(),
            pairs.len() as f64 / pushed_in.as_secs_f64(),
            slowest.as_secs_f64() * 1e3,
            (answered_at - sent_at).as_secs_f64() * 1e3,
            old + new,
        );
        // Sent again: every id already held, nothing changes.
        let (code, body) = server.push(&table, &entries(&rows, row_bytes, pairs[..10].iter().copied())).await;
        assert_eq!((code, &body["versions"][0]["already_held"]), (200, &serde_json::json!(10)), "{body}");
        // A ranking request's user, sent once and pooled once, finds a
        // pushed id as the flat form (the user on every row) does.
        let (grouped, flat) = common::ranking::ranking(3, RANKING_CANDIDATES, 1000);
        let ((grouped, _), (flat, _)) = (raw_ranking(grouped, &defaults), raw_ranking(flat, &defaults));
        let rank = |request: narsil::proto::PredictRequest| {
            let mut client = client.clone();
            async move { client.predict(request).await.unwrap().into_inner().scores }
        };
        let before_grouped = rank(grouped.clone()).await;
        let (cat_0, cat_0_bytes) = rows_of(&repo.path().join("dlrm/1"), 0);
        let (code, body) = server.push("cat_0", &entries(&cat_0, cat_0_bytes, [(NEVER_SEEN[0], 5)])).await;
        assert_eq!(code, 200, "{body}");
        let (after_grouped, after_flat) = (rank(grouped).await, rank(flat).await);
        assert!(close(&after_grouped, &after_flat), "{store}: grouped and flat differ after a push");
        assert!(!close(&after_grouped, &before_grouped), "{store}: the user's pushed id changed nothing");
        drop(client);
        server.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_push_ids_sends_a_new_vocabulary_s_ids_from_the_command_line_and_again_changes_nothing() {
    let golden = Golden::read(&test_model_dir()).unwrap();
    let repo = tempfile::tempdir().unwrap();
    let defaults = publish(repo.path(), &golden);
    let served = repo.path().join("dlrm/1");
    let g = &golden.requests[1];
    let (request, request_rows) = with_new_ids(g, &defaults);
    // The new vocabulary: the served model with table TABLE's map holding
    // the request's new raw ids too (each the row it replaced).
    let new = tempfile::tempdir().unwrap();
    narsil_core::golden::copy_split_model(&served, new.path()).unwrap();
    let schema = SplitSchema::read(&served).unwrap();
    let spec = &schema.tables[TABLE];
    let narsil_embedding::schema::TableIds::Map(map_spec) = &spec.ids else { panic!("mapped") };
    let (map, _) = narsil_embedding::IdMap::open(&served.join(&map_spec.file), spec.rows).unwrap();
    let mut pairs: Vec<(i64, u64)> = map.iter().collect();
    pairs.extend(request_rows.iter().map(|&r| (NEW_IDS + r as i64, r as u64)));
    let bytes = narsil_embedding::id_map::build(&pairs, spec.rows).unwrap();
    std::fs::write(new.path().join(&map_spec.file), bytes).unwrap();

    let server = PushServer::start(repo.path(), "mmap").await;
    let before = server.client().await.predict(common::wire(&request, "")).await.unwrap().into_inner().scores;
    assert!(!close(&before, &g.scores_int8));
    let run = |server: &PushServer| {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_narsil"))
            .args(["tables", "push-ids"])
            .arg(&served)
            .arg("--from")
            .arg(new.path())
            .args(["--server", &format!("http://{}", server.admin), "--control-token-file"])
            .arg(server.token_file.path())
            .output()
            .unwrap();
        let (out, err) = (
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        );
        assert!(output.status.success(), "{out}\n{err}");
        (out, err)
    };
    let (out, err) = tokio::task::block_in_place(|| run(&server));
    assert!(
        out.contains(&format!("pushed {} new ids of 26 tables of dlrm", request_rows.len())),
        "{out}\n{err}"
    );
    assert!(err.contains(&format!("cat_{TABLE}: {0}/{0} ids", request_rows.len())), "{err}");
    let after = server.client().await.predict(common::wire(&request, "")).await.unwrap().into_inner().scores;
    assert!(close(&after, &g.scores_int8), "{after:?}");
    // Again: the ids are held with their rows; the server says so.
    let (_, err) = tokio::task::block_in_place(|| run(&server));
    assert!(err.contains(&format!("+0 ({} held)", request_rows.len())), "{err}");
    // Without the token: refused, the server's word shown.
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_narsil"))
        .args(["tables", "push-ids"])
        .arg(&served)
        .arg("--from")
        .arg(new.path())
        .args(["--server", &format!("http://{}", server.admin)])
        .env_remove("NARSIL_CONTROL_TOKEN_FILE")
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("401"), "{output:?}");
    server.stop().await;
}

#[test]
fn pushes_to_tables_whose_rows_are_not_in_this_process_are_refused_naming_why() {
    use narsil_core::{BackendFactory, IdPush};
    use narsil_torch::{SplitFactory, TableStore, TorchConfig};
    let golden = Golden::read(&test_model_dir()).unwrap();
    // On the target's file system: the disk store's direct reads.
    let dir = common::real_fs_tempdir();
    mapped_copy(dir.path(), &golden);
    let (rows, row_bytes) = table_rows(dir.path());
    let one = entries(&rows, row_bytes, [(NEW_IDS, 1)]);
    let table = format!("cat_{TABLE}");
    let push = IdPush::apply(&table, &one, u64::MAX, "no bound");
    let refused = |config: TorchConfig| SplitFactory::load(config).unwrap().push_ids(&push).unwrap_err();
    // Tables copied to the device at load (the tensor stage, on the CPU
    // device here).
    let on_device = TorchConfig {
        device_path_on_cpu: true,
        dense_form: narsil_torch::DenseForm::TorchScript,
        device_table_bytes: Some(u64::MAX),
        ..TorchConfig::new(dir.path())
    };
    let why = refused(on_device);
    assert!(why.contains("on the device") && why.contains("publish a new model version"), "{why}");
    // The device path with its tables on the host pools on the CPU: pushes
    // are taken there.
    let on_host = TorchConfig {
        device_path_on_cpu: true,
        dense_form: narsil_torch::DenseForm::TorchScript,
        ..TorchConfig::new(dir.path())
    };
    let pushed = SplitFactory::load(on_host).unwrap().push_ids(&push).unwrap();
    assert_eq!((pushed.added, pushed.pushed), (1, 1));
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(dir.path().join("schema.json"))
    {
        Ok(_) => {
            let flags = narsil_embedding::StoreFlags {
                cache_bytes: 1 << 20,
                fetch_timeout: Duration::from_secs(1),
                missing_rows: narsil_embedding::MissingRows::Error,
            };
            let disk = TorchConfig {
                table_store: "disk".parse::<TableStore>().unwrap().with_flags(&flags),
                ..TorchConfig::new(dir.path())
            };
            let why = refused(disk);
            assert!(why.contains("direct I/O") && why.contains("publish a new model version"), "{why}");
        }
        Err(e) => {
            common::skip_direct_io("push refused by the disk store", &format!("no direct reads here ({e})"))
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_model_control_a_push_is_refused_before_its_body_is_read() {
    let golden = Golden::read(&test_model_dir()).unwrap();
    let repo = tempfile::tempdir().unwrap();
    publish(repo.path(), &golden);
    let server = PushServer::start_with(repo.path(), "memory", false).await;
    // Declared as 8 MiB, none of it sent: refused at once.
    let path = format!("/v1/models/dlrm/tables/cat_{TABLE}/ids");
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: narsil\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        8 << 20
    );
    let mut stream = tokio::net::TcpStream::connect(server.admin).await.unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response)).await.unwrap().unwrap();
    let response = String::from_utf8_lossy(&response);
    assert!(response.starts_with("HTTP/1.1 403") && response.contains("--model-control"), "{response}");
    // Without the token: unauthorized, as every control call.
    let (code, body) = post(server.admin, &path, None, b"").await;
    assert_eq!((code, body.as_str()), (401, "unauthorized"));
    // Over the limit: 413 naming it.
    let (code, body) = post(server.admin, &path, Some(TOKEN), &vec![0; (16 << 20) + 1]).await;
    assert!(code == 413 && body.contains(&(16usize << 20).to_string()), "{code} {body}");
    server.stop().await;
}
