//! Pushed ids follow the model, end to end over real HTTP and gRPC on
//! loopback: a repository server (`--model-control`, a token) serving the
//! test model's mapped copy from the `memory` store, and the model's push
//! log on disk beside its versions.
//!
//! Ids pushed to version 1 are served by version 2 once it is published
//! and turns ready (the log replayed into it before), and by the server
//! restarted on the same repository: the golden request whose ids of one
//! table are new scores as the golden one, and none of those ids is served
//! from the default row (`narsil_table_unmapped_ids_total`). A torn tail
//! (a push the server was writing when it stopped) is cut off at the next
//! load, and what came before it is served. A flipped bit in the middle of
//! the log fails the load naming the log and the byte offset, and cuts
//! nothing. Two `narsil serve` processes on one repository, pushing and
//! loading at once, lose no answered push: restarted, both serve every one. A push past
//! `--max-pushed-bytes` is refused naming it, counted, and not logged. With
//! two versions ready, a push one of them refuses is pushed to neither.
#![cfg(feature = "torch")]

mod common;

use std::path::Path;
use std::time::Duration;

use common::pushes::{
    add_to_map, close, default_ids, entries, publish, push, rows_of, with_new_ids, NEW_IDS, TABLE, TOKEN,
};
use narsil_core::golden::{test_model_dir, Golden, GoldenRequest};

/// A repository server with model control behind the token, its tables in
/// memory, `edit` applied to its flags; waits until `versions` are served.
async fn start(
    repo: &Path,
    versions: &[u64],
    edit: impl FnOnce(&mut narsil::cli::ServeArgs),
) -> common::RepoServer {
    let server = common::RepoServer::start(repo, TOKEN, |args| {
        args.backend.table_store = "memory".parse().unwrap();
        edit(args);
    })
    .await;
    wait_serving(&server, versions).await;
    server
}

/// Waits until the ready versions of `dlrm` are `versions`.
async fn wait_serving(server: &common::RepoServer, versions: &[u64]) {
    let models = std::sync::Arc::clone(&server.models);
    common::wait_until(&format!("versions {versions:?} of dlrm ready"), Duration::from_secs(180), || {
        models.live_versions("dlrm").iter().map(|v| v.number).collect::<Vec<_>>() == versions
    })
    .await;
}

/// The scores of `request`, and how many of its ids of table `TABLE` the
/// served version `version` took from the default row.
async fn score(server: &common::RepoServer, request: &GoldenRequest, version: u64) -> (Vec<f32>, u64) {
    let unmapped = |text: &str| {
        let sample = format!(r#"narsil_table_unmapped_ids_total{{table="cat_{TABLE}",version="{version}"}}"#);
        common::metric(text, &sample) as u64
    };
    let before = unmapped(&common::scrape(server.admin).await);
    let scores = server.client().await.predict(common::wire(request, "")).await.unwrap().into_inner().scores;
    (scores, unmapped(&common::scrape(server.admin).await) - before)
}

/// The push log of table `TABLE` in `repo`.
fn log_of(repo: &Path) -> std::path::PathBuf {
    let dir = repo.join("dlrm/.pushed-ids");
    let logs: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.path()).collect();
    let prefix = format!("cat_{TABLE}.");
    let mut ours = logs.into_iter().filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with(&prefix));
    let log = ours.next().expect("a push log of the table");
    assert!(ours.next().is_none());
    log
}

/// The first 40 bytes of an append of 100 bytes: its record's header
/// (length, the length's complement, checksum) and 8 bytes of its body.
fn torn_append() -> Vec<u8> {
    let mut torn = 100u64.to_le_bytes().to_vec();
    torn.extend((!100u64).to_le_bytes());
    torn.extend([7; 24]);
    torn
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ids_pushed_to_version_1_are_served_by_version_2_once_published_and_after_a_restart() {
    let golden = Golden::read(&test_model_dir()).unwrap();
    let repo = tempfile::tempdir().unwrap();
    let defaults = publish(repo.path(), &golden, 1);
    let (rows, row_bytes) = rows_of(&repo.path().join("dlrm/1"), TABLE);
    let g = &golden.requests[1];
    let (request, request_rows) = with_new_ids(g, &defaults);
    let from_defaults = default_ids(g, &defaults);
    let table = format!("cat_{TABLE}");
    let new_ids = request_rows.len() as u64;
    assert!(new_ids > 0);

    let server = start(repo.path(), &[1], |_| {}).await;
    let (before, unmapped) = score(&server, &request, 1).await;
    assert!(!close(&before, &g.scores_int8), "the new ids change the score");
    assert!(unmapped >= from_defaults + new_ids, "{unmapped}");
    // Pushed in two bodies: two records of the log.
    let pairs: Vec<(i64, usize)> =
        request_rows.iter().map(|&r| (common::pushes::NEW_IDS + r as i64, r)).collect();
    let (first, second) = pairs.split_at(pairs.len() / 2);
    for part in [first, second] {
        let (code, body) = push(server.admin, &table, &entries(&rows, row_bytes, part.iter().copied())).await;
        assert_eq!(code, 200, "{body}");
    }
    let (scores, unmapped) = score(&server, &request, 1).await;
    assert!(close(&scores, &g.scores_int8), "{scores:?}");
    assert_eq!(unmapped, from_defaults);
    let log = log_of(repo.path());

    // Version 2 published and switched to: it serves every pushed id.
    publish(repo.path(), &golden, 2);
    let (code, body) =
        common::post(server.admin, "/v1/repository/scan", Some(&format!("Bearer {TOKEN}")), b"").await;
    assert_eq!(code, 200, "{body}");
    wait_serving(&server, &[2]).await;
    let (scores, unmapped) = score(&server, &request, 2).await;
    assert!(close(&scores, &g.scores_int8), "version 2 without the pushed ids: {scores:?}");
    assert_eq!(unmapped, from_defaults, "version 2 served pushed ids from the default row");
    let metrics = common::scrape(server.admin).await;
    let held = format!(r#"narsil_table_pushed_ids{{table="{table}",version="2"}}"#);
    assert_eq!(common::metric(&metrics, &held) as u64, new_ids);
    // Sent again to version 2: held, nothing logged.
    let logged = std::fs::metadata(&log).unwrap().len();
    let (code, body) = push(server.admin, &table, &entries(&rows, row_bytes, pairs.iter().copied())).await;
    assert_eq!((code, &body["versions"][0]["already_held"]), (200, &serde_json::json!(new_ids)), "{body}");
    assert_eq!(std::fs::metadata(&log).unwrap().len(), logged);
    server.stop().await;

    // A push the server was writing when it stopped: a torn tail.
    let mut torn = std::fs::read(&log).unwrap();
    torn.extend_from_slice(&torn_append());
    std::fs::write(&log, &torn).unwrap();
    // Restarted: the log replayed into version 2 before it serves.
    let server = start(repo.path(), &[2], |_| {}).await;
    let (scores, unmapped) = score(&server, &request, 2).await;
    assert!(close(&scores, &g.scores_int8), "after a restart, without the pushed ids: {scores:?}");
    assert_eq!(unmapped, from_defaults, "after a restart, pushed ids served from the default row");
    assert_eq!(std::fs::metadata(&log).unwrap().len(), logged, "the torn tail is cut off");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_past_the_byte_bound_is_refused_naming_it_counted_and_not_logged() {
    let golden = Golden::read(&test_model_dir()).unwrap();
    let repo = tempfile::tempdir().unwrap();
    publish(repo.path(), &golden, 1);
    let (rows, row_bytes) = rows_of(&repo.path().join("dlrm/1"), TABLE);
    let table = format!("cat_{TABLE}");
    // Room for 10 ids: their rows and 32 bytes of index each.
    let bound = 10 * (row_bytes as u64 + 32);
    let server = start(repo.path(), &[1], |args| args.max_pushed_bytes = bound).await;
    let ids = |from: i64, n: usize| (0..n).map(move |k| (0x4255_0000_0000_0000 + from + k as i64, k % 7));
    let (code, body) = push(server.admin, &table, &entries(&rows, row_bytes, ids(0, 6))).await;
    assert_eq!(code, 200, "{body}");
    let logged = std::fs::metadata(log_of(repo.path())).unwrap().len();
    let (code, body) = push(server.admin, &table, &entries(&rows, row_bytes, ids(100, 5))).await;
    assert_eq!(code, 422, "{body}");
    let why = body["error"].as_str().unwrap();
    assert!(why.contains(&format!("--max-pushed-bytes ({bound} bytes a table)")), "{why}");
    assert!(why.contains("holds 6 pushed ids") && why.contains("nothing pushed"), "{why}");
    let metrics = common::scrape(server.admin).await;
    let sample = |name: &str| common::metric(&metrics, &format!(r#"{name}{{table="{table}"}}"#)) as u64;
    assert_eq!(sample("narsil_table_pushes_over_bound_total"), 1);
    assert_eq!(sample("narsil_table_pushed_bytes"), 6 * (row_bytes as u64 + 32));
    assert_eq!(sample("narsil_table_pushed_ids"), 6);
    assert_eq!(std::fs::metadata(log_of(repo.path())).unwrap().len(), logged, "a refused push is not logged");
    // What fits is taken.
    let (code, body) = push(server.admin, &table, &entries(&rows, row_bytes, ids(100, 4))).await;
    assert_eq!((code, &body["versions"][0]["bytes"]), (200, &serde_json::json!(bound)), "{body}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_one_ready_version_refuses_is_pushed_to_none_and_not_logged() {
    let golden = Golden::read(&test_model_dir()).unwrap();
    let repo = tempfile::tempdir().unwrap();
    publish(repo.path(), &golden, 1);
    // Version 2's map holds NEW_IDS + 1, at row 2.
    let staging = repo.path().join("dlrm/.incoming-2");
    common::id_maps::mapped_copy(&staging, &golden);
    add_to_map(&staging, TABLE, &[(NEW_IDS + 1, 2)]);
    std::fs::rename(&staging, repo.path().join("dlrm/2")).unwrap();
    let (rows, row_bytes) = rows_of(&repo.path().join("dlrm/1"), TABLE);
    let table = format!("cat_{TABLE}");
    let server = start(repo.path(), &[1, 2], |args| args.version_policy = "latest:2".parse().unwrap()).await;
    // NEW_IDS + 1 with row 1: new to version 1, held by version 2 with row 2.
    let (code, body) =
        push(server.admin, &table, &entries(&rows, row_bytes, [(NEW_IDS, 0), (NEW_IDS + 1, 1)])).await;
    assert_eq!(code, 422, "{body}");
    assert_eq!(body["versions"].as_array().unwrap().len(), 1, "{body}");
    assert_eq!(body["versions"][0]["version"], "2", "{body}");
    assert!(body["error"].as_str().unwrap().contains("id map (row 2)"), "{body}");
    let metrics = common::scrape(server.admin).await;
    let held = |version: u64| format!(r#"narsil_table_pushed_ids{{table="{table}",version="{version}"}}"#);
    assert_eq!((common::metric(&metrics, &held(1)), common::metric(&metrics, &held(2))), (0.0, 0.0));
    assert!(!repo.path().join("dlrm/.pushed-ids").exists(), "a refused push was logged");
    // Without it: both take it.
    let (code, body) = push(server.admin, &table, &entries(&rows, row_bytes, [(NEW_IDS, 0)])).await;
    assert_eq!(code, 200, "{body}");
    let versions: Vec<_> = body["versions"].as_array().unwrap().iter().map(|v| v["added"].clone()).collect();
    assert_eq!(versions, [serde_json::json!(1), serde_json::json!(1)], "{body}");
    server.stop().await;
}

/// `n` push bodies of `ids` new ids each (raw ids from `first`), rows of
/// table `TABLE` in turn.
fn bodies(rows: &[u8], row_bytes: usize, first: i64, n: usize, ids: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|b| entries(rows, row_bytes, (0..ids).map(|k| (first + (b * ids + k) as i64, k % 7))))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bit_flipped_mid_log_fails_the_load_naming_the_log_and_offset_and_cuts_no_answered_push() {
    let golden = Golden::read(&test_model_dir()).unwrap();
    let repo = tempfile::tempdir().unwrap();
    publish(repo.path(), &golden, 1);
    let (rows, row_bytes) = rows_of(&repo.path().join("dlrm/1"), TABLE);
    let table = format!("cat_{TABLE}");
    let server = start(repo.path(), &[1], |_| {}).await;
    let pushes = bodies(&rows, row_bytes, 0x4249_5400_0000_0000, 10, 3);
    for body in &pushes {
        let (code, answer) = push(server.admin, &table, body).await;
        assert_eq!(code, 200, "{answer}");
    }
    server.stop().await;
    let log = log_of(repo.path());
    let answered = std::fs::read(&log).unwrap();
    // Record 3 (a header, then records of 32 bytes and a body each): a
    // bit of its body flipped.
    let record_3 = 64 + 2 * (32 + pushes[0].len());
    let mut flipped = answered.clone();
    flipped[record_3 + 32 + 5] ^= 0x10;
    std::fs::write(&log, &flipped).unwrap();

    let server = common::RepoServer::start(repo.path(), TOKEN, |args| {
        args.backend.table_store = "memory".parse().unwrap();
    })
    .await;
    let models = std::sync::Arc::clone(&server.models);
    let error = common::poll_until("version 1 of dlrm failed", Duration::from_secs(180), || {
        let version =
            models.list().into_iter().find(|m| m.name == "dlrm").and_then(|m| m.versions.first().cloned());
        std::future::ready(version.filter(|v| v.state == "FAILED").and_then(|v| v.error))
    })
    .await;
    assert!(error.contains(&log.display().to_string()), "{error}");
    assert!(error.contains(&format!("damaged at byte {record_3}:")), "{error}");
    assert_eq!(std::fs::read(&log).unwrap(), flipped, "the log is left as it is: nothing cut");
    server.stop().await;

    // Restored from a backup: every answered push served.
    std::fs::write(&log, &answered).unwrap();
    let server = start(repo.path(), &[1], |_| {}).await;
    let metrics = common::scrape(server.admin).await;
    let held = format!(r#"narsil_table_pushed_ids{{table="{table}",version="1"}}"#);
    assert_eq!(common::metric(&metrics, &held) as u64, 30);
    server.stop().await;
}

/// A `narsil serve` process of `repo` (tables in memory, model control
/// behind `token_file`), its logs in `logs`; once it serves.
async fn spawn_server(
    repo: &Path,
    token_file: &Path,
    logs: &tempfile::NamedTempFile,
) -> (common::KillOnDrop, common::Bound, common::Listeners) {
    let listeners = common::Listeners::new();
    let mut child = common::KillOnDrop(
        listeners
            .serve_repository("info", repo, Some(token_file))
            .args(["--table-store", "memory"])
            .stderr(logs.reopen().unwrap())
            .spawn()
            .unwrap(),
    );
    let bound = listeners.wait(&mut child.0, Duration::from_secs(180)).await;
    common::wait_serving(&bound.url(), Duration::from_secs(180)).await;
    (child, bound, listeners)
}

/// The ready versions of `dlrm` on the server whose admin address is `admin`.
async fn ready_versions(admin: std::net::SocketAddr) -> Vec<String> {
    let (_, body) = common::http(admin, "GET", "/v1/models").await;
    let listed: serde_json::Value = serde_json::from_str(&body).unwrap();
    let models = listed["models"].as_array().cloned().unwrap_or_default();
    let dlrm = models.into_iter().find(|m| m["name"] == "dlrm").unwrap_or_default();
    let versions = dlrm["versions"].as_array().cloned().unwrap_or_default();
    versions
        .into_iter()
        .filter(|v| v["state"] == "READY")
        .map(|v| v["version"].as_str().unwrap().to_owned())
        .collect()
}

fn stop(mut child: common::KillOnDrop) {
    // SAFETY: kill takes plain integers and touches no memory; the pid is
    // our own child's, not yet waited for.
    unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    assert!(child.0.wait().unwrap().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_servers_on_one_repository_pushing_and_loading_at_once_serve_every_answered_push_after_a_restart()
{
    let golden = Golden::read(&test_model_dir()).unwrap();
    let repo = tempfile::tempdir().unwrap();
    publish(repo.path(), &golden, 1);
    let (rows, row_bytes) = rows_of(&repo.path().join("dlrm/1"), TABLE);
    let table = format!("cat_{TABLE}");
    let token_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(token_file.path(), format!("{TOKEN}\n")).unwrap();
    let logs = [tempfile::NamedTempFile::new().unwrap(), tempfile::NamedTempFile::new().unwrap()];
    let (a, a_bound, _a) = spawn_server(repo.path(), token_file.path(), &logs[0]).await;
    let (b, b_bound, _b) = spawn_server(repo.path(), token_file.path(), &logs[1]).await;
    let admins = [a_bound.admin(), b_bound.admin()];

    // Both push at once (neither log there yet: both may create it), and
    // both load version 2 (replaying the log) while the other pushes.
    let per_server = 16;
    let mut pushers = Vec::new();
    for (s, &admin) in admins.iter().enumerate() {
        let bodies = bodies(&rows, row_bytes, 0x5245_5000_0000_0000 + (s as i64) * 1_000_000, per_server, 5);
        let table = table.clone();
        pushers.push(tokio::spawn(async move {
            let mut answered = 0u64;
            for body in bodies {
                let (code, answer) = push(admin, &table, &body).await;
                assert_eq!(code, 200, "{answer}");
                answered += 5;
            }
            answered
        }));
    }
    publish(repo.path(), &golden, 2);
    let token = format!("Bearer {TOKEN}");
    let scans = admins.map(|admin| {
        let token = token.clone();
        tokio::spawn(async move { common::post(admin, "/v1/repository/scan", Some(&token), b"").await })
    });
    let mut answered = 0;
    for pusher in pushers {
        answered += pusher.await.unwrap();
    }
    for scan in scans {
        let (code, body) = scan.await.unwrap();
        assert_eq!(code, 200, "{body}");
    }
    stop(a);
    stop(b);

    // Restarted, both replay the one log: every answered push, on each.
    let (a, a_bound, _a) = spawn_server(repo.path(), token_file.path(), &logs[0]).await;
    let (b, b_bound, _b) = spawn_server(repo.path(), token_file.path(), &logs[1]).await;
    for (name, bound) in [("a", a_bound), ("b", b_bound)] {
        let admin = bound.admin();
        common::poll_until(&format!("server {name} serving version 2"), Duration::from_secs(180), || async {
            (ready_versions(admin).await == ["2"]).then_some(())
        })
        .await;
        let metrics = common::scrape(admin).await;
        let held = format!(r#"narsil_table_pushed_ids{{table="{table}",version="2"}}"#);
        assert_eq!(common::metric(&metrics, &held) as u64, answered, "server {name}");
    }
    stop(a);
    stop(b);
    for log in &logs {
        let logged = std::fs::read_to_string(log.path()).unwrap();
        assert!(!logged.contains("damaged"), "{logged}");
    }
}
