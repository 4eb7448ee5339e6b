//! Split models whose tables map raw 64-bit ids, for the end-to-end
//! tests: a copy of the test model's split form with an id map per table
//! (every row but a default row, raw ids large and negative), and the
//! golden and ranking requests with their ids sent raw.

use std::path::Path;

use narsil::proto::PredictRequest;
use narsil_core::golden::{copy_split_model, test_model_dir, Golden, GoldenRequest};
use narsil_embedding::id_map::build;

pub const FEATURES: usize = 26;

/// Row `row`'s raw id in the maps: a large value, negative for about half.
pub fn raw(table: usize, row: i64) -> i64 {
    ((table as i64 + 1) * 1_000_003 + row).wrapping_mul(0x9e37_79b9_7f4a_7c15u64 as i64)
}

/// Raw ids that no map holds, as production sends them.
pub const NEVER_SEEN: [i64; 4] = [i64::MIN, -1, i64::MAX, 7_777_777];

/// The test model's split form, copied into `dir` with an id map per
/// table holding every row but its default row: the default rows (the
/// first golden request's first ids, so that the golden requests hold
/// ids of them).
pub fn mapped_copy(dir: &Path, golden: &Golden) -> Vec<i64> {
    copy_split_model(&test_model_dir().join("split"), dir).unwrap();
    let first = &golden.requests[0];
    let defaults: Vec<i64> = {
        let mut ids = first.ids.iter();
        first.lengths[..FEATURES]
            .iter()
            .map(|&len| *ids.by_ref().take(len as usize).last().unwrap_or(&0))
            .collect()
    };
    let path = dir.join("schema.json");
    let mut schema: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for (t, table) in schema["tables"].as_array_mut().unwrap().iter_mut().enumerate() {
        let rows = table["rows"].as_u64().unwrap();
        let pairs: Vec<(i64, u64)> =
            (0..rows as i64).filter(|&r| r != defaults[t]).map(|r| (raw(t, r), r as u64)).collect();
        let bytes = build(&pairs, rows).unwrap();
        let file = format!("tables/cat_{t}.idmap");
        std::fs::write(dir.join(&file), &bytes).unwrap();
        let sha256 = narsil_embedding::sha256::sha256_of_bytes(&bytes);
        table["ids"] =
            serde_json::json!({"map": {"file": file, "sha256": sha256, "default_row": defaults[t]}});
    }
    std::fs::write(&path, serde_json::to_string_pretty(&schema).unwrap()).unwrap();
    defaults
}

/// `g` with its ids sent raw: each id's raw id, and an id never seen for
/// each default row's id (so it scores as that row). Also returns how many
/// ids were never seen.
pub fn raw_request(g: &GoldenRequest, defaults: &[i64]) -> (GoldenRequest, u64) {
    let mut sent = g.clone();
    let mut unseen = 0;
    let mut at = 0;
    for (bag, &len) in g.lengths.iter().enumerate() {
        let t = bag % FEATURES;
        for id in &mut sent.ids[at..at + len as usize] {
            *id = if *id == defaults[t] {
                unseen += 1;
                NEVER_SEEN[(unseen as usize) % NEVER_SEEN.len()]
            } else {
                raw(t, *id)
            };
        }
        at += len as usize;
    }
    (sent, unseen)
}

/// Candidates of the ranking request.
pub const RANKING_CANDIDATES: usize = 40;

/// A ranking request of [`super::ranking::ranking`] (row ids) with raw
/// ids, its user's first ids of cat_0 and cat_1 never seen (the flat form
/// sends them on every row), and the ids it holds that the maps do not.
pub fn raw_ranking(mut request: PredictRequest, defaults: &[i64]) -> (PredictRequest, u64) {
    let mut unseen = 0;
    let mut raw_bags = |lengths: &[u32], ids: &mut [i64], table_of: &dyn Fn(usize) -> usize| {
        let mut at = 0;
        for (bag, &len) in lengths.iter().enumerate() {
            let t = table_of(bag);
            for (k, id) in ids[at..at + len as usize].iter_mut().enumerate() {
                // A default row's id is one the map does not hold either.
                unseen += u64::from((t < 2 && k == 0) || *id == defaults[t]);
                *id = if t < 2 && k == 0 { NEVER_SEEN[t] } else { raw(t, *id) };
            }
            at += len as usize;
        }
    };
    match &mut request.request {
        Some(user) => {
            raw_bags(&user.sparse_lengths, &mut user.sparse_ids, &|bag| bag);
            // The rows carry the 13 candidate features, cat_13..cat_25.
            raw_bags(&request.sparse_lengths, &mut request.sparse_ids, &|bag| 13 + bag % 13);
        }
        None => raw_bags(&request.sparse_lengths, &mut request.sparse_ids, &|bag| bag % FEATURES),
    }
    (request, unseen)
}
