//! Hashed ids end to end over real gRPC on loopback: copies of the test
//! model's split form whose every table declares `modulo`, one `signed`
//! (as `"modulo"` alone), one `unsigned`, answer requests of extreme 64-bit
//! ids (the top bit set, `i64::MIN`, `-1` = `2^64 - 1`) with the scores the
//! unmodified model gives those ids' rows as Python's arithmetic computes
//! them (`id % rows`; `(id & (2**64 - 1)) % rows`), sent as `int64`
//! over narsil.v1 and TorchRec's protocol and as `UINT64` over KServe v2:
//! the convention the schema states decides, never the protocol.
#![cfg(feature = "torch")]

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use common::{assert_close, batch_mode, start_with, wire, TestServer};
use narsil::kserve_proto::grpc_inference_service_client::GrpcInferenceServiceClient;
use narsil::torchrec_proto::predictor_client::PredictorClient as TorchRecClient;
use narsil::wire::kserve::{encode, first_scores};
use narsil::wire::torchrec::SCORES_KEY;
use narsil_core::golden::{copy_split_model, test_model_dir, Golden, GoldenRequest};
use narsil_torch::{SplitFactory, TorchConfig};

/// Raw ids sent: the top bit set (negative as `int64`, at or above 2^63 as
/// `UINT64`) and a few below it.
const RAW_IDS: [i64; 10] = [
    -1,
    i64::MIN,
    i64::MIN + 999,
    -1000,
    -0x5851_f42d_4c95_7f2d,
    -0x0123_4567_89ab_cdef,
    i64::MAX,
    0x5851_f42d_4c95_7f2d,
    4_294_967_296,
    999,
];

/// The test model's split form in `dir`, every table's `ids` set to `ids`.
fn modulo_copy(dir: &Path, ids: serde_json::Value) {
    copy_split_model(&test_model_dir().join("split"), dir).unwrap();
    let path = dir.join("schema.json");
    let mut schema: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for table in schema["tables"].as_array_mut().unwrap() {
        table["ids"] = ids.clone();
    }
    std::fs::write(&path, schema.to_string()).unwrap();
}

/// Per id of `raw`, its row in a table of `rows` rows as Python computes
/// it: `[signed, unsigned]`.
fn python_rows(raw: &[i64], rows: u64) -> [Vec<i64>; 2] {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    assert!(python.is_file(), "no project venv: run scripts/setup_python.sh");
    let program = "import json, sys\n\
        ids, n = json.loads(sys.argv[1]), int(sys.argv[2])\n\
        print(json.dumps([[i % n for i in ids], [(i & (2**64 - 1)) % n for i in ids]]))";
    let out = Command::new(python)
        .args(["-c", program, &serde_json::to_string(raw).unwrap(), &rows.to_string()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

async fn serve(dir: &Path) -> TestServer {
    let factory = SplitFactory::load(TorchConfig::new(dir)).unwrap();
    start_with(Arc::new(factory), batch_mode(1, 1)).await.ready().await
}

/// The scores `server` gives `request` over each protocol: narsil.v1,
/// TorchRec's (both `int64` ids) and KServe v2 with its ids as `UINT64`.
async fn scores_over_every_protocol(
    server: &TestServer,
    request: &GoldenRequest,
) -> Vec<(&'static str, Vec<f32>)> {
    let request = wire(request, "modulo");
    let channel = server.channel().await;
    let narsil = server.client().await.predict(request.clone()).await.unwrap().into_inner().scores;
    // TorchRec's values as int64 (the test encoder writes int32): encoded
    // with each id's position, which then names its 8 bytes.
    let mut positions = request.clone();
    positions.sparse_ids = (0..request.sparse_ids.len() as i64).collect();
    let mut keyed = narsil::wire::torchrec::encode(&positions, 26);
    let values = &mut keyed.id_list_features.as_mut().expect("id list features").values;
    *values = values
        .chunks_exact(4)
        .flat_map(|at| request.sparse_ids[i32::from_le_bytes(at.try_into().unwrap()) as usize].to_le_bytes())
        .collect::<Vec<u8>>()
        .into();
    let torchrec =
        TorchRecClient::new(channel.clone()).predict(keyed).await.unwrap().into_inner().predictions
            [SCORES_KEY]
            .data
            .clone();
    let mut kserve = encode(&request, 13, 26);
    let ids = kserve.inputs.iter_mut().find(|t| t.name == "ids").expect("an ids input");
    // The same 8 bytes an id: above i64::MAX as UINT64.
    ids.datatype = "UINT64".into();
    let response = GrpcInferenceServiceClient::new(channel).model_infer(kserve).await.unwrap().into_inner();
    let kserve = first_scores(&response).unwrap();
    vec![("narsil.v1", narsil), ("TorchRec", torchrec), ("KServe UINT64", kserve)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modulo_tables_score_extreme_ids_as_the_rows_pythons_signed_or_unsigned_arithmetic_names_on_every_protocol(
) {
    let golden = Golden::read(&test_model_dir()).unwrap();
    let rows = 1000;
    let schema = std::fs::read_to_string(test_model_dir().join("split/schema.json")).unwrap();
    let schema: serde_json::Value = serde_json::from_str(&schema).unwrap();
    assert!(
        schema["tables"].as_array().unwrap().iter().all(|t| t["rows"] == rows),
        "every table has {rows} rows"
    );
    let [signed, unsigned] = python_rows(&RAW_IDS, rows);
    assert_ne!(signed, unsigned, "the conventions differ on these ids");
    // Golden request 0's ids replaced by the raw ids, and by their rows.
    let raw = |g: &GoldenRequest| {
        let mut sent = g.clone();
        for (k, id) in sent.ids.iter_mut().enumerate() {
            *id = RAW_IDS[k % RAW_IDS.len()];
        }
        sent
    };
    let rows_of = |g: &GoldenRequest, rows: &[i64]| {
        let mut sent = g.clone();
        for (k, id) in sent.ids.iter_mut().enumerate() {
            *id = rows[k % rows.len()];
        }
        sent
    };
    let g = &golden.requests[0];
    let plain = serve(&test_model_dir().join("split")).await;
    let mut client = plain.client().await;
    let mut want = Vec::new();
    for rows in [&signed, &unsigned] {
        want.push(client.predict(wire(&rows_of(g, rows), "rows")).await.unwrap().into_inner().scores);
    }
    plain.stop().await.unwrap();
    assert!(want[0] != want[1], "the two conventions' rows score differently");

    for (ids, want, convention) in [
        (serde_json::json!("modulo"), &want[0], "\"modulo\" (signed)"),
        (serde_json::json!({"modulo": "signed"}), &want[0], "signed"),
        (serde_json::json!({"modulo": "unsigned"}), &want[1], "unsigned"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        modulo_copy(dir.path(), ids);
        let server = serve(dir.path()).await;
        for (protocol, scores) in scores_over_every_protocol(&server, &raw(g)).await {
            assert_close(&scores, want, &format!("{convention} over {protocol}"));
        }
        server.stop().await.unwrap();
    }
}
