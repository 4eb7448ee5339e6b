//! `--request-level` per model, over real gRPC on loopback with real
//! libtorch models: a repository of two models whose features have
//! different names, `dlrm` (the small test DLRM, which declares cat_0 to
//! cat_12 and its dense features request-level in its own schema) and
//! `users` (the TorchRec-signature test DLRM, its model.json's features
//! renamed `u_0`..`u_25`, declaring nothing). A `users:NAMES` form applies
//! to `users` alone, and grouped requests to it score as their flat twins;
//! `dlrm` serves as it declares. A form naming a feature `users` lacks
//! fails the load of `users` only, naming the feature and the model, while
//! `dlrm` serves.
#![cfg(feature = "torch")]

mod common;

use std::path::Path;
use std::time::Duration;

use common::RepoServer;
use narsil::flags::request_level::RequestLevelForm;
use narsil::lifecycle::registry::ModelStatus;
use narsil::proto::{ModelInfoRequest, ModelInfoResponse};
use narsil_core::golden::test_model_dir;

/// Publishes the repository: `dlrm` (test-small's model_default.pt) and
/// `users` (test-torchrec-dlrm's model.pt, its features renamed), version 1
/// each.
fn repository(repo: &Path) {
    let dlrm = repo.join("dlrm/1");
    std::fs::create_dir_all(&dlrm).unwrap();
    std::fs::copy(test_model_dir().join("model_default.pt"), dlrm.join("model.pt")).unwrap();
    let torchrec = test_model_dir().with_file_name("test-torchrec-dlrm");
    assert!(torchrec.join("model.json").is_file(), "no {}: run scripts/test.sh", torchrec.display());
    let users = repo.join("users/1");
    std::fs::create_dir_all(&users).unwrap();
    std::fs::copy(torchrec.join("model.pt"), users.join("model.pt")).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(torchrec.join("model.json")).unwrap()).unwrap();
    for (i, feature) in config["sparse_features"].as_array_mut().unwrap().iter_mut().enumerate() {
        feature["name"] = format!("u_{i}").into();
    }
    assert!(config.get("request_level").is_none(), "users declares nothing request-level itself");
    std::fs::write(users.join("model.json"), config.to_string()).unwrap();
}

fn forms(texts: &[&str]) -> Vec<RequestLevelForm> {
    texts.iter().map(|t| t.parse().unwrap()).collect()
}

/// Starts a server of `repo` with `--request-level` `forms` and waits until
/// neither model is loading.
async fn serve(repo: &Path, request_level: &[&str]) -> RepoServer {
    let request_level = forms(request_level);
    let server = RepoServer::start(repo, "secret", |args| args.request_level = request_level).await;
    let settled = |list: &[ModelStatus]| {
        list.len() == 2
            && list.iter().all(|m| m.versions.iter().all(|v| v.state != "LOADING") && !m.versions.is_empty())
    };
    common::wait_until("both models loaded or failed", Duration::from_secs(120), || {
        settled(&server.models.list())
    })
    .await;
    server
}

fn version_of<'a>(list: &'a [ModelStatus], model: &str) -> &'a narsil::lifecycle::registry::VersionStatus {
    &list.iter().find(|m| m.name == model).unwrap_or_else(|| panic!("no model {model}: {list:#?}")).versions
        [0]
}

async fn info(server: &RepoServer, model: &str) -> ModelInfoResponse {
    server.client().await.model_info(ModelInfoRequest { model: model.into() }).await.unwrap().into_inner()
}

/// The request-level sparse features ModelInfo lists, and whether the dense
/// ones are.
fn declared(info: &ModelInfoResponse) -> (Vec<String>, bool) {
    let names = info.sparse_features.iter().filter(|f| f.request_level).map(|f| f.name.clone()).collect();
    (names, info.dense_request_level)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_models_form_applies_to_that_model_alone_and_the_other_serves_as_it_declares() {
    let repo = tempfile::tempdir().unwrap();
    repository(repo.path());
    let server = serve(repo.path(), &["users:u_0,u_1,dense"]).await;
    let list = server.models.list();
    for model in ["dlrm", "users"] {
        assert_eq!(version_of(&list, model).state, "READY", "{model}: {list:#?}");
    }
    let users = info(&server, "users").await;
    assert_eq!(declared(&users), (vec!["u_0".to_string(), "u_1".to_string()], true), "the form's names");
    let dlrm = info(&server, "dlrm").await;
    let own: Vec<String> = (0..13).map(|i| format!("cat_{i}")).collect();
    assert_eq!(declared(&dlrm), (own, true), "dlrm keeps its own declaration");

    // Grouped ranking requests to `users` (its two request-level features
    // and dense once a request) score as their flat twins.
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        load: narsil::load::LoadArgs,
    }
    let flags = ["load", "--addr", &server.url, "--model", "users", "--candidates", "16", "--requests", "8"];
    let more =
        ["--warmup", "0", "--ranking-form", "grouped", "--compare-flat", "8", "--request-features", "2"];
    let args = <Cli as clap::Parser>::parse_from(flags.iter().chain(&more)).load;
    let report = narsil::load::drive(&args).await.unwrap();
    assert_eq!((report.ok, report.requests), (8, 8), "{:?}", report.by_code);
    assert_eq!(report.ranking_form.as_deref(), Some("grouped"));
    let diff = report.max_abs_diff_vs_flat.expect("grouped answers compared with their flat twins");
    assert!(diff <= f64::from(common::SCORE_TOLERANCE), "grouped vs flat: {diff}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_a_model_lacks_fails_that_models_load_only_naming_the_feature_and_the_model() {
    let repo = tempfile::tempdir().unwrap();
    repository(repo.path());
    let server = serve(repo.path(), &["users:u_0,cat_0", "dlrm:cat_0,dense"]).await;
    let list = server.models.list();
    let users = version_of(&list, "users");
    assert_eq!(users.state, "FAILED", "{list:#?}");
    let error = users.error.as_deref().unwrap_or_default();
    assert!(
        error.contains("--request-level users:u_0,cat_0")
            && error.contains("for model users")
            && error.contains("\"cat_0\" is not a feature"),
        "{error}"
    );
    assert_eq!(version_of(&list, "dlrm").state, "READY", "{list:#?}");
    let dlrm = info(&server, "dlrm").await;
    assert_eq!(declared(&dlrm), (vec!["cat_0".to_string()], true), "dlrm's own form applied");
    let golden = narsil_core::golden::Golden::read(&test_model_dir()).unwrap();
    let request =
        narsil::proto::PredictRequest { model: "dlrm".into(), ..common::wire(&golden.requests[0], "") };
    let response = server.client().await.predict(request).await.unwrap();
    common::assert_close(&response.into_inner().scores, &golden.requests[0].scores_int8, "dlrm");
    server.stop().await;
}
