//! Criterion benches for the front of the request path: a 100-sample,
//! 26-feature request from its wire bytes to a validated [`RequestSamples`],
//! in each protocol (prost decoding from `Bytes`, as the server's codec
//! does, the protocol's conversion, and `RequestSamples::validate`).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use narsil::proto::PredictRequest;
use narsil::protocols::{convert, torchrec};
use narsil::torchrec_proto::PredictionRequest;
use narsil_core::request::{IdPolicy, RequestLimits};
use narsil_core::ModelSchema;
use prost::Message;

// The same allocator as the server binary.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const SAMPLES: usize = 100;

fn narsil_request(schema: &ModelSchema) -> PredictRequest {
    let bags = SAMPLES * schema.num_sparse();
    PredictRequest {
        batch_size: SAMPLES as u32,
        dense: (0..SAMPLES * schema.num_dense).map(|i| i as f32 * 1e-3).collect(),
        sparse_ids: (0..bags).map(|i| ((i * 7919) % 100_000) as i64).collect(),
        ..Default::default()
    }
}

fn bench_decode(c: &mut Criterion) {
    let schema = ModelSchema::dlrm("bench", "cpu", 100_000);
    let limits = RequestLimits::new(10_000, IdPolicy::Reject);
    let narsil = narsil_request(&schema);
    let narsil_bytes = prost::bytes::Bytes::from(narsil.encode_to_vec());
    let torchrec_bytes = prost::bytes::Bytes::from(
        narsil::wire::torchrec::encode(&narsil, schema.num_sparse()).encode_to_vec(),
    );
    let mut group = c.benchmark_group("decode_validate_100x26");
    group.throughput(Throughput::Elements(SAMPLES as u64));
    group.bench_function("narsil_v1", |b| {
        b.iter(|| {
            let message = PredictRequest::decode(narsil_bytes.clone()).unwrap();
            let mut batch = convert::request_samples(message);
            batch.validate(&schema, limits).unwrap();
            batch
        })
    });
    group.bench_function("torchrec", |b| {
        b.iter(|| {
            let message = PredictionRequest::decode(torchrec_bytes.clone()).unwrap();
            let mut batch =
                torchrec::decode(message, schema.num_dense, schema.num_unweighted(), schema.num_sparse())
                    .unwrap();
            batch.validate(&schema, limits).unwrap();
            batch
        })
    });
    group.finish();
}

criterion_group!(benches, bench_decode);
criterion_main!(benches);
