//! Raw ids pushed to a served split model, for the end-to-end tests: the
//! test model's mapped copy published in a repository, push bodies built
//! from a table's rows, and the golden request whose ids of one table are
//! sent as raw ids no map holds (which, once pushed with the rows of the
//! ids they replaced, scores as the golden request).

use std::net::SocketAddr;
use std::path::Path;

use narsil_core::golden::{max_abs_diff, Golden, GoldenRequest};
use narsil_embedding::SplitSchema;

use super::id_maps::{mapped_copy, raw_request, FEATURES};

/// The model-control token of the push tests' servers.
pub const TOKEN: &str = "push-1ds_T0ken/for.tests";
/// The table whose ids are pushed.
pub const TABLE: usize = 3;
/// New raw ids of the request: `NEW_IDS + row` gets row `row`'s row.
pub const NEW_IDS: i64 = 0x4e45_5700_0000_0000;
/// How close a response must be to the score it should equal (fused
/// batches of other sizes round differently).
pub const TOLERANCE: f32 = 1e-5;

/// The mapped test model published as version `version` of `dlrm` in
/// `repo` (written under a dot-name, then renamed into place); its default
/// rows.
pub fn publish(repo: &Path, golden: &Golden, version: u64) -> Vec<i64> {
    let staging = repo.join(format!("dlrm/.incoming-{version}"));
    let defaults = mapped_copy(&staging, golden);
    std::fs::rename(&staging, repo.join(format!("dlrm/{version}"))).unwrap();
    defaults
}

/// Table `t`'s rows, in id order, and its row bytes.
pub fn rows_of(dir: &Path, t: usize) -> (Vec<u8>, usize) {
    let schema = SplitSchema::read(dir).unwrap();
    let spec = &schema.tables[t];
    (std::fs::read(dir.join(&spec.file)).unwrap(), spec.row_bytes)
}

/// Push entries: each raw id with row `row`'s bytes.
pub fn entries(rows: &[u8], row_bytes: usize, pairs: impl IntoIterator<Item = (i64, usize)>) -> Vec<u8> {
    let mut body = Vec::new();
    for (raw, row) in pairs {
        body.extend_from_slice(&raw.to_le_bytes());
        body.extend_from_slice(&rows[row * row_bytes..(row + 1) * row_bytes]);
    }
    body
}

/// Golden request `g` with raw ids, its ids of table `TABLE` (but the
/// default row's) sent as new raw ids (`NEW_IDS + row`); and those rows.
pub fn with_new_ids(g: &GoldenRequest, defaults: &[i64]) -> (GoldenRequest, Vec<usize>) {
    let (mut sent, _) = raw_request(g, defaults);
    let mut rows = Vec::new();
    let mut at = 0;
    for (bag, &len) in g.lengths.iter().enumerate() {
        for k in at..at + len as usize {
            if bag % FEATURES == TABLE && g.ids[k] != defaults[TABLE] {
                sent.ids[k] = NEW_IDS + g.ids[k];
                rows.push(g.ids[k] as usize);
            }
        }
        at += len as usize;
    }
    rows.sort_unstable();
    rows.dedup();
    (sent, rows)
}

/// Ids of table `TABLE` that golden request `g` sends as its default row's
/// (never seen, by design): what its table's unmapped count grows by once
/// every other id of it is pushed.
pub fn default_ids(g: &GoldenRequest, defaults: &[i64]) -> u64 {
    let mut at = 0;
    let mut count = 0;
    for (bag, &len) in g.lengths.iter().enumerate() {
        if bag % FEATURES == TABLE {
            count += g.ids[at..at + len as usize].iter().filter(|&&id| id == defaults[TABLE]).count() as u64;
        }
        at += len as usize;
    }
    count
}

pub fn close(got: &[f32], want: &[f32]) -> bool {
    max_abs_diff(got, want).is_some_and(|d| d <= TOLERANCE)
}

/// `POST /v1/models/dlrm/tables/{table}/ids` with the token: the status and
/// the answer's JSON.
pub async fn push(admin: SocketAddr, table: &str, body: &[u8]) -> (u16, serde_json::Value) {
    let path = format!("/v1/models/dlrm/tables/{table}/ids");
    let (code, text) = super::post(admin, &path, Some(&format!("Bearer {TOKEN}")), body).await;
    (code, serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)))
}

/// Adds `pairs` (raw id, row) to table `table`'s id map of the split model
/// in `dir`, its SHA-256 in schema.json updated: a version whose map holds
/// ids the served one lacks.
pub fn add_to_map(dir: &Path, table: usize, pairs: &[(i64, u64)]) {
    let schema = SplitSchema::read(dir).unwrap();
    let spec = &schema.tables[table];
    let narsil_embedding::schema::TableIds::Map(map_spec) = &spec.ids else { panic!("mapped") };
    let (map, _) = narsil_embedding::IdMap::open(&dir.join(&map_spec.file), spec.rows).unwrap();
    let mut all: Vec<(i64, u64)> = map.iter().collect();
    all.extend_from_slice(pairs);
    let bytes = narsil_embedding::id_map::build(&all, spec.rows).unwrap();
    std::fs::write(dir.join(&map_spec.file), &bytes).unwrap();
    let sha256: String =
        <sha2::Sha256 as sha2::Digest>::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
    let path = dir.join("schema.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json["tables"][table]["ids"]["map"]["sha256"] = sha256.into();
    std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).unwrap();
}
