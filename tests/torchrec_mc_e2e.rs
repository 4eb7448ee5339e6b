//! TorchRec managed-collision models served as they are: a TorchRec DLRM
//! whose sparse arch is a `ManagedCollisionEmbeddingBagCollection` (one
//! `MCHManagedCollisionModule` per table), its remapping filled with raw
//! 64-bit ids (large, negative, the extremes) and quantized the TorchRec way
//! (`models/export_torchrec_mc.py`, exported by `scripts/test.sh` into
//! `models/generated/test-torchrec-mc`, or the export named by
//! `NARSIL_TORCHREC_MC_DIR`).
//!
//! Served over real gRPC on loopback in its three forms: single-file
//! (`model.pt`, raw ids passed to the model as int64 by `"raw_ids": true` in
//! model.json, TorchRec's remapping inside the model), split (`split/`: its
//! tables, with id maps written by `models/id_map.py` from the MCH modules'
//! remapping buffers) and extracted (`extracted/`: the same made from
//! model.pt alone by `models/extract_split.py`), the split forms from the
//! memory, mmap and disk stores. Every golden request (ids held by the
//! remapping, evicted from it, fed but never admitted, never seen, and
//! INT64_MIN / INT64_MAX / -1 / 0) must score as TorchRec's eager quantized
//! forward scored it, within 1e-6, alone and fused (narsil.v1; TorchRec's
//! protocol with int64 ids for some, alone); the split forms count
//! the ids their maps lack in `narsil_table_unmapped_ids_total`; the maps
//! Python wrote are the bytes Narsil's own writer writes; a changed map
//! fails the load naming its file.
#![cfg(feature = "torch")]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::{batch_mode, start_with, wire, SCORE_TOLERANCE};
use narsil::torchrec_proto::predictor_client::PredictorClient as TorchRecClient;
use narsil::torchrec_proto::PredictionRequest;
use narsil_core::golden::{copy_split_model, max_abs_diff, Golden, GoldenRequest};
use narsil_core::{error_chain, BackendFactory};
use narsil_embedding::id_map::{build, IdMap};
use narsil_embedding::{SplitSchema, StoreFlags, TableIds, TableStore};
use narsil_torch::{SplitFactory, TorchConfig, TorchFactory};

/// The exported MC model: `NARSIL_TORCHREC_MC_DIR`, or the test export.
fn model_dir() -> PathBuf {
    let dir = std::env::var_os("NARSIL_TORCHREC_MC_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("models/generated/test-torchrec-mc"));
    assert!(
        dir.join("golden.json").is_file() && dir.join("split/schema.json").is_file(),
        "no exported MC model in {0}: run scripts/test.sh, or .venv/bin/python models/export_torchrec_mc.py \
         --split --out {0}",
        dir.display()
    );
    dir
}

/// `mc.json`: what the golden requests hold (ids per class, and per table
/// how many ids its map lacks).
struct Summary {
    requests: usize,
    ids: BTreeMap<String, u64>,
    unmapped: BTreeMap<String, u64>,
}

impl Summary {
    fn read(dir: &Path) -> Self {
        let text = std::fs::read_to_string(dir.join("mc.json")).unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        let counts = |key: &str| -> BTreeMap<String, u64> {
            json[key]
                .as_object()
                .unwrap_or_else(|| panic!("mc.json has no {key}"))
                .iter()
                .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
                .collect()
        };
        Self {
            requests: json["requests"].as_u64().unwrap() as usize,
            ids: counts("ids"),
            unmapped: counts("unmapped"),
        }
    }
}

/// The store configs of the split forms: memory, mmap, and disk (direct
/// I/O through a row cache of a third of each table) where the file system
/// takes direct reads.
fn stores(dir: &Path) -> Vec<TableStore> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut stores = vec![TableStore::Memory, TableStore::Mmap];
    let table = std::fs::read_dir(dir.join("split/tables"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "bin"))
        .unwrap();
    match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&table) {
        Ok(_) => {
            let flags = StoreFlags {
                cache_bytes: 4 * 100 * (32 + 16),
                fetch_timeout: Duration::from_secs(1),
                missing_rows: narsil_embedding::MissingRows::Error,
            };
            stores.push("disk".parse::<TableStore>().unwrap().with_flags(&flags));
        }
        Err(e) => common::skip_direct_io(
            "split_mc_models_serve_torchrec_scores_from_every_store_alone_and_fused (disk store)",
            &format!("{} refuses direct reads ({e})", table.display()),
        ),
    }
    stores
}

fn load_single_file(dir: &Path) -> Arc<dyn BackendFactory> {
    Arc::new(
        TorchFactory::load(TorchConfig::new(dir.join("model.pt")))
            .unwrap_or_else(|e| panic!("{}: {}", dir.display(), error_chain(&e))),
    )
}

fn load_split(dir: &Path, store: TableStore) -> Arc<dyn BackendFactory> {
    let mut config = TorchConfig::new(dir.to_path_buf());
    config.table_store = store;
    Arc::new(SplitFactory::load(config).unwrap_or_else(|e| panic!("{}: {}", dir.display(), error_chain(&e))))
}

/// A golden request on TorchRec's protocol with its raw ids whole: int64
/// values (as TorchRec's Python client sends `KeyedJaggedTensor.values()`),
/// key-major as the protocol orders them.
fn torchrec_request(g: &GoldenRequest, num_sparse: usize) -> PredictionRequest {
    // Encoded with each id's position in place of the id, to learn the order.
    let mut positions = wire(g, "");
    positions.sparse_ids = (0..g.ids.len() as i64).collect();
    let mut request = narsil::wire::torchrec::encode(&positions, num_sparse);
    let group = request.id_list_features.as_mut().expect("unweighted features");
    let order: Vec<usize> =
        group.values.chunks_exact(4).map(|b| i32::from_le_bytes(b.try_into().unwrap()) as usize).collect();
    group.values = order.iter().flat_map(|&k| g.ids[k].to_le_bytes()).collect::<Vec<u8>>().into();
    request
}

/// The sum of `narsil_table_unmapped_ids_total` per table.
fn unmapped(text: &str, tables: &[String]) -> BTreeMap<String, u64> {
    tables
        .iter()
        .map(|t| {
            (
                t.clone(),
                common::metric(text, &format!(r#"narsil_table_unmapped_ids_total{{table="{t}"}}"#)) as u64,
            )
        })
        .collect()
}

/// Serves `factory`; sends every golden request alone, the first 32 (every
/// batch size) again on TorchRec's protocol with int64 ids, then all of
/// them again 16 at a time on 16 concurrent clients (fused); each within
/// [`SCORE_TOLERANCE`] of TorchRec's. With `tables`, also checks that the
/// alone pass counted exactly the ids the maps lack. Returns the largest
/// difference from TorchRec's scores.
async fn golden_alone_and_fused(
    factory: Arc<dyn BackendFactory>,
    what: &str,
    tables: Option<&[String]>,
) -> f32 {
    let dir = model_dir();
    let golden = Golden::read(&dir).unwrap();
    let summary = Summary::read(&dir);
    assert_eq!(golden.requests.len(), summary.requests, "mc.json describes golden.json");
    let server = start_with(factory, batch_mode(1, 16)).await.ready().await;
    let before = match tables {
        Some(t) => Some(unmapped(&server.scrape().await, t)),
        None => None,
    };
    let mut client = server.client().await;
    let mut worst = 0f32;
    let mut check = |got: &[f32], g: &GoldenRequest, label: String| {
        let diff =
            max_abs_diff(got, &g.outputs["default"]).unwrap_or_else(|| panic!("{label}: wrong score count"));
        assert!(diff <= SCORE_TOLERANCE, "{label}: max |diff| {diff} from TorchRec's scores");
        worst = worst.max(diff);
    };
    for (i, g) in golden.requests.iter().enumerate() {
        let response = client.predict(wire(g, "")).await.unwrap().into_inner();
        check(&response.scores, g, format!("{what}: golden request {i} alone"));
    }
    if let (Some(tables), Some(before)) = (tables, before) {
        let after = unmapped(&server.scrape().await, tables);
        let counted: BTreeMap<String, u64> = after.iter().map(|(t, n)| (t.clone(), n - before[t])).collect();
        assert_eq!(counted, summary.unmapped, "{what}: the ids each map lacks, counted once each");
    }
    let mut torchrec = TorchRecClient::new(server.channel().await);
    let num_sparse = server.engine.schema().num_sparse();
    for (i, g) in golden.requests.iter().enumerate().take(32) {
        let response = torchrec.predict(torchrec_request(g, num_sparse)).await.unwrap().into_inner();
        check(
            &response.predictions["default"].data,
            g,
            format!("{what}: golden request {i} on TorchRec's protocol"),
        );
    }
    let channel = server.channel().await;
    let mut fused = 0;
    for (round, chunk) in golden.requests.chunks(16).enumerate() {
        let requests: Vec<&GoldenRequest> = chunk.iter().collect();
        let responses = common::predict_all(&channel, &requests).await;
        for (k, (response, g)) in responses.iter().zip(chunk).enumerate() {
            check(&response.scores, g, format!("{what}: round {round} client {k} (fused)"));
            fused += usize::from(response.fused_requests > 1);
        }
    }
    assert!(fused > 0, "{what}: no request was fused with another");
    server.stop().await.unwrap();
    eprintln!(
        "{what}: {} requests ({:?} ids) alone and fused ({fused} fused): max |diff| from TorchRec {worst:e}",
        golden.requests.len(),
        summary.ids
    );
    worst
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_file_mc_model_serves_torchrecs_scores_for_seen_evicted_and_never_seen_raw_ids() {
    let dir = model_dir();
    let factory = load_single_file(&dir);
    assert!(factory.schema().takes_raw_ids(), "model.json marks the features raw_ids");
    golden_alone_and_fused(factory, "model.pt", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_mc_models_serve_torchrecs_scores_from_every_store_alone_and_fused() {
    let dir = model_dir();
    for form in ["split", "extracted"] {
        let split = dir.join(form);
        let schema = SplitSchema::read(&split).unwrap();
        let tables: Vec<String> = schema.tables.iter().map(|t| t.name.clone()).collect();
        assert!(
            schema.tables.iter().all(|t| matches!(t.ids, TableIds::Map(_))),
            "{form}: every table carries its id map"
        );
        for store in stores(&dir) {
            let what = format!("{form} ({store} store)");
            golden_alone_and_fused(load_split(&split, store), &what, Some(&tables)).await;
        }
    }
}

/// The maps `models/id_map.py` wrote hold what TorchRec's remapping holds
/// and are, byte for byte, what Narsil's writer makes of the same pairs
/// (their SHA-256 is the one in the schema); the written and the
/// extracted forms' maps are the same files.
#[test]
fn python_written_id_maps_are_the_bytes_narsils_own_writer_writes() {
    let dir = model_dir();
    for form in ["split", "extracted"] {
        let schema = SplitSchema::read(&dir.join(form)).unwrap();
        for table in &schema.tables {
            let TableIds::Map(spec) = &table.ids else {
                panic!("{form}: table {} has no id map", table.name)
            };
            let path = dir.join(form).join(&spec.file);
            let (map, sha) =
                IdMap::open(&path, table.rows).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert_eq!(sha, spec.sha256, "{}: the schema's sha256", path.display());
            assert!(
                map.entries() > 0 && spec.default_row == table.rows - 1,
                "{}: TorchRec's default row",
                table.name
            );
            let pairs: Vec<(i64, u64)> = map.iter().collect();
            assert_eq!(
                build(&pairs, table.rows).unwrap(),
                std::fs::read(&path).unwrap(),
                "{}",
                path.display()
            );
            if form == "extracted" {
                let written = dir.join("split").join(&spec.file);
                assert_eq!(
                    std::fs::read(&written).unwrap(),
                    std::fs::read(&path).unwrap(),
                    "{}",
                    path.display()
                );
            }
        }
    }
}

/// `models/id_map.py`, run as a command, writes the bytes Narsil's writer
/// writes for the same pairs: the extremes, and runs that spill past the
/// last home slot.
#[test]
fn python_id_map_writer_gives_narsils_bytes_for_extreme_ids_and_runs_past_the_last_home_slot() {
    use narsil_embedding::id_map::{home, home_slots_for};
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = root.join(".venv/bin/python");
    assert!(python.is_file(), "no project venv at {}: run scripts/setup_python.sh", python.display());
    let mut raws: Vec<i64> = (1..=1997i64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15u64 as i64)).collect();
    raws.extend([i64::MIN, i64::MAX, -1]);
    let home_slots = home_slots_for(raws.len() as u64 + 6);
    let last: Vec<i64> =
        (0i64..).filter(|r| home(*r, home_slots) == home_slots - 1 && !raws.contains(r)).take(6).collect();
    raws.extend(last);
    let pairs: Vec<(i64, u64)> = raws.iter().enumerate().map(|(i, &raw)| (raw, i as u64 % 97)).collect();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t.idmap");
    let mut child = std::process::Command::new(python)
        .arg(root.join("models/id_map.py"))
        .arg(&out)
        .args(["--rows", "97"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let text: String = pairs.iter().map(|(raw, row)| format!("{raw} {row}\n")).collect();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), text.as_bytes()).unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "models/id_map.py failed");
    let written = std::fs::read(&out).unwrap();
    let built = build(&pairs, 97).unwrap();
    assert_eq!(
        written.len(),
        built.len(),
        "sizes (slots past the last home slot: {})",
        built.len() / 16 - 4 - home_slots as usize
    );
    assert!(written == built, "models/id_map.py and narsil's writer give different bytes");
    let (map, sha) = IdMap::open(&out, 97).unwrap();
    assert_eq!(String::from_utf8(output.stdout).unwrap().trim(), sha, "the SHA-256 it prints");
    assert!(pairs.iter().all(|&(raw, row)| map.row(raw) == Some(row)));
}

/// A map file whose bytes changed fails the load naming the file: against
/// the schema's SHA-256, and (the schema's hash updated too) by the check
/// of every slot.
#[test]
fn a_changed_id_map_fails_the_load_naming_the_file() {
    let source = model_dir().join("split");
    let schema = SplitSchema::read(&source).unwrap();
    let table = &schema.tables[1];
    let TableIds::Map(spec) = &table.ids else { panic!("table {} has no id map", table.name) };
    let file = spec.file.file_name().unwrap().to_str().unwrap().to_string();
    for rehash in [false, true] {
        let copy = tempfile::tempdir().unwrap();
        copy_split_model(&source, copy.path()).unwrap();
        let path = copy.path().join(&spec.file);
        let mut bytes = std::fs::read(&path).unwrap();
        // The first entry's row, now past the table.
        let first = (0..).map(|s| 64 + 16 * s).find(|&at| bytes[at + 8..at + 16] != [0xff; 8]).unwrap();
        bytes[first + 8..first + 16].copy_from_slice(&(table.rows + 5).to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        if rehash {
            let sha = narsil_embedding::sha256::sha256_of_bytes(&bytes);
            let text = std::fs::read_to_string(copy.path().join("schema.json")).unwrap();
            std::fs::write(copy.path().join("schema.json"), text.replace(&spec.sha256, &sha)).unwrap();
        }
        let error = SplitFactory::load(TorchConfig::new(copy.path().to_path_buf()))
            .err()
            .map(|e| error_chain(&e))
            .unwrap_or_else(|| panic!("a changed {file} (schema rehashed: {rehash}) loaded"));
        assert!(error.contains(&file), "rehash {rehash}: the error names {file}: {error}");
        if rehash {
            assert!(error.contains("past the table"), "rehash {rehash}: says what is wrong: {error}");
        }
    }
}

/// Without `"raw_ids": true` the single-file model would get its ids as
/// int32, which TorchRec's remapping cannot take (its `index_put_` of int64
/// rows into an int32 tensor). Narsil recognises the model by its MCH
/// modules' buffers and refuses it at load, naming `raw_ids`, the
/// model.json to fix and the MCH tables, not with TorchScript's dtype error.
#[test]
fn a_single_file_mc_model_without_raw_ids_in_model_json_is_refused_at_load_naming_raw_ids() {
    let dir = model_dir();
    let copy = tempfile::tempdir().unwrap();
    std::fs::copy(dir.join("model.pt"), copy.path().join("model.pt")).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("model.json")).unwrap()).unwrap();
    for feature in config["sparse_features"].as_array_mut().unwrap() {
        feature.as_object_mut().unwrap().remove("raw_ids");
    }
    std::fs::write(copy.path().join("model.json"), config.to_string()).unwrap();
    let error = TorchFactory::load(TorchConfig::new(copy.path().join("model.pt")))
        .err()
        .map(|e| error_chain(&e))
        .expect("an MC model fed int32 ids must not load");
    let config = copy.path().join("model.json");
    assert!(
        error.contains("managed-collision model")
            && error.contains(r#"marks no feature "raw_ids": true"#)
            && error.contains(&config.display().to_string())
            && error.contains("t_cat_2"),
        "names the model's kind, raw_ids, the model.json and the MCH tables: {error}"
    );
    assert!(!error.contains("dtypes match"), "refused before any forward: {error}");
    // With raw_ids marked again in the copy, the same files load.
    std::fs::copy(dir.join("model.json"), &config).unwrap();
    let factory = TorchFactory::load(TorchConfig::new(copy.path().join("model.pt")))
        .unwrap_or_else(|e| panic!("{}", error_chain(&e)));
    assert!(factory.schema().takes_raw_ids());
}
