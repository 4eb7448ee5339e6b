//! Ranking requests for the end-to-end tests: one user and many
//! candidates to the test model (13 dense features, 26 sparse features),
//! the user's features request-level (cat_0..cat_12 and the dense ones).

use narsil::proto::{PredictRequest, RequestFeatures};

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
