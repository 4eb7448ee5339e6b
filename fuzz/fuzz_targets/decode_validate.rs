//! Decode + validate, every protocol: arbitrary bytes as a `narsil.v1`
//! PredictRequest, a TorchRec PredictionRequest or (selector bit 7) a KServe
//! v2 ModelInferRequest, converted and validated
//! exactly as the services do. Nothing may panic; a request that passes
//! validation must then be safe to split, reorder into a key-major batch and
//! score, with every id inside its table.
#![no_main]

use libfuzzer_sys::fuzz_target;
use narsil::protocols::{convert, kserve, torchrec};
use narsil::{kserve_proto, proto, torchrec_proto};
use narsil_core::mock::mock_scores;
use narsil_core::request::{IdPolicy, RequestLimits};
use narsil_core::{assemble, ModelSchema};
use prost::Message;

/// A small DLRM-like schema (2 dense, 3 sparse features of 10 rows), so
/// that valid requests are within the fuzzer's reach.
fn schema() -> ModelSchema {
    let mut schema = ModelSchema::dlrm("fuzz", "cpu", 10);
    schema.num_dense = 2;
    schema.sparse.truncate(3);
    schema
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, bytes)) = data.split_first() else { return };
    let schema = schema();
    let policy = if selector & 2 == 0 { IdPolicy::Reject } else { IdPolicy::Modulo };
    let limits = RequestLimits::new(64, policy);
    let decoded = if selector & 0x80 != 0 {
        let Ok(request) = kserve_proto::ModelInferRequest::decode(bytes) else { return };
        match kserve::decode(&request, &schema) {
            Ok(batch) => batch,
            Err(invalid) => {
                assert!(!kserve::field_name(invalid.field).is_empty() && !invalid.message.is_empty());
                return;
            }
        }
    } else if selector & 1 == 0 {
        let Ok(request) = proto::PredictRequest::decode(bytes) else { return };
        convert::request_samples(request)
    } else {
        let Ok(request) = torchrec_proto::PredictionRequest::decode(bytes) else { return };
        match torchrec::decode(request, schema.num_dense, schema.num_unweighted(), schema.num_sparse()) {
            Ok(batch) => batch,
            Err(invalid) => {
                assert!(!torchrec::field_name(invalid.field).is_empty() && !invalid.message.is_empty());
                return;
            }
        }
    };
    let mut batch = decoded;
    if let Err(invalid) = batch.validate(&schema, limits) {
        assert!(!invalid.field.name().is_empty() && !invalid.message.is_empty());
        return;
    }
    let rows = batch.num_samples;
    let parts = batch.split_rows(1 + usize::from(selector >> 2) % 8, schema.num_sparse());
    assert_eq!(parts.iter().map(|p| p.num_samples).sum::<usize>(), rows);
    let keyed = assemble(schema.num_dense, schema.num_sparse(), &parts);
    assert_eq!(keyed.rows, rows);
    for (f, feature) in schema.sparse.iter().enumerate() {
        assert!(keyed.feature_ids(f).iter().all(|&id| (0..feature.num_rows as i64).contains(&id)));
    }
    assert_eq!(mock_scores(&keyed).len(), rows);
});
