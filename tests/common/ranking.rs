//! Ranking requests for the end-to-end tests: one user and many
//! candidates to the test model (13 dense features, 26 sparse features),
//! the user's features request-level (cat_0..cat_12 and the dense ones).

use narsil::proto::{self, PredictRequest, RequestFeatures};

use super::{assert_close, TestServer};

/// Three rounds of every (grouped, flat) pair of `requests` sent at once
/// (grouped, flat, grouped again), each answer within the tolerance of its
/// flat twin's `flat_scores`; asserts that some requests shared a forward.
#[allow(dead_code)]
pub async fn fused_as_flat(
    server: &TestServer,
    requests: &[(PredictRequest, PredictRequest)],
    flat_scores: &[Vec<f32>],
    what: &str,
) {
    let channel = server.channel().await;
    let mut fused = false;
    for round in 0..3 {
        let calls = requests.iter().flat_map(|(g, f)| [g.clone(), f.clone(), g.clone()]).map(|request| {
            let mut client = proto::predictor_client::PredictorClient::new(channel.clone());
            tokio::spawn(async move { client.predict(request).await.unwrap().into_inner() })
        });
        let responses: Vec<_> =
            futures_util::future::join_all(calls).await.into_iter().map(Result::unwrap).collect();
        for (i, response) in responses.iter().enumerate() {
            assert_close(&response.scores, &flat_scores[i / 3], &format!("{what}: round {round} call {i}"));
        }
        fused |= responses.iter().any(|r| r.fused_requests > 1);
    }
    assert!(fused, "{what}: some requests shared a forward");
}

/// The request-level features of the goals' workload, as `--request-level`
/// names them.
pub fn request_level() -> Vec<String> {
    (0..13).map(|f| format!("cat_{f}")).chain(["dense".into()]).collect()
}

/// User `user`'s ranking request of `candidates` candidates to the test
/// model (13 dense features, 26 sparse of `rows` rows each), as `narsil.v1`
/// requests grouped (the user's 13 bags of 1 to 20 ids and its dense
/// features in the request block) and flat (the user on every row).
pub fn ranking(user: u64, candidates: usize, rows: u64) -> (PredictRequest, PredictRequest) {
    let dense: Vec<f32> = (0..13u64).map(|d| ((user * 37 + d * 11) % 100) as f32 / 100.0).collect();
    let user_bags: Vec<Vec<i64>> = (0..13u64)
        .map(|f| {
            let len = 1 + (user * 7 + f * 3) % 20;
            (0..len).map(|k| ((user * 7919 + f * 31 + k * 17) % rows) as i64).collect()
        })
        .collect();
    let candidate = |c: u64, f: u64| ((c * 104_729 + f * 13 + user) % rows) as i64;
    let mut grouped = PredictRequest {
        batch_size: candidates as u32,
        request: Some(RequestFeatures {
            dense: dense.clone(),
            sparse_lengths: user_bags.iter().map(|b| b.len() as u32).collect(),
            sparse_ids: user_bags.concat(),
            sparse_weights: vec![],
        }),
        request_id: format!("user-{user}"),
        ..Default::default()
    };
    let mut flat = PredictRequest { batch_size: candidates as u32, ..Default::default() };
    for c in 0..candidates as u64 {
        flat.dense.extend(&dense);
        for f in 0..26u64 {
            match user_bags.get(f as usize) {
                Some(bag) => {
                    flat.sparse_lengths.push(bag.len() as u32);
                    flat.sparse_ids.extend(bag);
                }
                None => {
                    flat.sparse_lengths.push(1);
                    grouped.sparse_lengths.push(1);
                    flat.sparse_ids.push(candidate(c, f));
                    grouped.sparse_ids.push(candidate(c, f));
                }
            }
        }
    }
    (grouped, flat)
}

/// A ranking request the exporter scored outside Narsil
/// (`golden_ranking.json`): TorchRec's eager DLRM forward over the flat
/// batch the exporter made by tiling the user onto each candidate row.
#[allow(dead_code)]
pub struct GoldenRanking {
    /// The request as `narsil.v1` sends it grouped.
    pub grouped: PredictRequest,
    /// The eager forward's scores with the INT8 tables.
    pub scores_int8: Vec<f32>,
}

/// The test model's golden ranking requests; `request_level` is what its
/// export declared (checked against [`request_level`]).
#[allow(dead_code)]
pub fn golden_ranking(model_dir: &std::path::Path) -> Vec<GoldenRanking> {
    golden_ranking_declaring(model_dir, &request_level())
}

/// A model's golden ranking requests (`golden_ranking.json` in
/// `model_dir`), whose export declared `declared` request-level.
#[allow(dead_code)]
pub fn golden_ranking_declaring(model_dir: &std::path::Path, declared: &[String]) -> Vec<GoldenRanking> {
    #[derive(serde::Deserialize)]
    struct File {
        request_level: Vec<String>,
        requests: Vec<Request>,
    }
    #[derive(serde::Deserialize)]
    struct Request {
        user: User,
        candidates: u32,
        dense: Vec<f32>,
        lengths: Vec<u32>,
        ids: Vec<i64>,
        scores_int8: Vec<f32>,
    }
    #[derive(serde::Deserialize)]
    struct User {
        dense: Vec<f32>,
        lengths: Vec<u32>,
        ids: Vec<i64>,
    }
    let path = model_dir.join("golden_ranking.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (export the test model again: scripts/test.sh)", path.display()));
    let file: File = serde_json::from_str(&text).unwrap();
    assert_eq!(file.request_level, declared, "{}: the user's features", path.display());
    file.requests
        .into_iter()
        .enumerate()
        .map(|(i, r)| GoldenRanking {
            grouped: PredictRequest {
                batch_size: r.candidates,
                dense: r.dense,
                sparse_lengths: r.lengths,
                sparse_ids: r.ids,
                request: Some(RequestFeatures {
                    dense: r.user.dense,
                    sparse_lengths: r.user.lengths,
                    sparse_ids: r.user.ids,
                    sparse_weights: vec![],
                }),
                request_id: format!("golden-ranking-{i}"),
                ..Default::default()
            },
            scores_int8: r.scores_int8,
        })
        .collect()
}
