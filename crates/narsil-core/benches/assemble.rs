//! Criterion benches for the pure pieces of the data path: reorder/assemble
//! of 16 requests x 100 samples x 26 features, its two halves (one request
//! reordered key-major, on its caller's thread; 16 key-major requests fused,
//! on the lane), the split of scores, and the deduplication of a fused
//! batch's request blocks (units).

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use narsil_core::request::{IdPolicy, RequestLimits};
use narsil_core::{assemble, fuse, ModelSchema, RequestBlock, RequestBlocks, RequestLevel, RequestSamples};

// The same allocator as the server binary.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const DENSE: usize = 13;
const SPARSE: usize = 26;

fn request(seed: usize, samples: usize, ids_per_bag: u32) -> RequestSamples {
    let bags = samples * SPARSE;
    RequestSamples {
        num_samples: samples,
        dense: (0..samples * DENSE).map(|i| (i + seed) as f32 * 1e-3).collect(),
        lengths: vec![ids_per_bag; bags],
        ids: (0..bags * ids_per_bag as usize).map(|i| ((i * 31 + seed) % 100_000) as i64).collect(),
        ..Default::default()
    }
}

fn bench_assemble(c: &mut Criterion) {
    let mut group = c.benchmark_group("assemble_16x100x26");
    for ids_per_bag in [1u32, 4] {
        let requests: Vec<_> = (0..16).map(|s| request(s, 100, ids_per_bag)).collect();
        group.throughput(Throughput::Elements(1600));
        group.bench_with_input(BenchmarkId::new("ids_per_bag", ids_per_bag), &requests, |b, reqs| {
            b.iter(|| assemble(DENSE, SPARSE, reqs))
        });
    }
    group.finish();
    let mut group = c.benchmark_group("reorder_one_100x26");
    for ids_per_bag in [1u32, 4] {
        let one = request(0, 100, ids_per_bag);
        group.throughput(Throughput::Elements(100));
        group.bench_with_input(BenchmarkId::new("ids_per_bag", ids_per_bag), &one, |b, one| {
            b.iter_batched(|| one.clone(), |r| r.into_key_major(SPARSE), criterion::BatchSize::SmallInput)
        });
    }
    group.finish();
    let mut group = c.benchmark_group("fuse_16x100x26");
    for ids_per_bag in [1u32, 4] {
        let key_major: Vec<_> =
            (0..16).map(|s| request(s, 100, ids_per_bag).into_key_major(SPARSE)).collect();
        group.throughput(Throughput::Elements(1600));
        group.bench_with_input(BenchmarkId::new("ids_per_bag", ids_per_bag), &key_major, |b, reqs| {
            b.iter_batched(|| reqs.clone(), |r| fuse(DENSE, SPARSE, r), criterion::BatchSize::SmallInput)
        });
    }
    group.finish();
}

fn bench_split(c: &mut Criterion) {
    let requests: Vec<_> = (0..16).map(|s| request(s, 100, 1)).collect();
    let batch = assemble(DENSE, SPARSE, &requests);
    let scores = vec![0.5f32; batch.rows];
    c.bench_function("split_16x100", |b| {
        b.iter(|| batch.split(&scores).map(|part| part.to_vec()).collect::<Vec<_>>())
    });
}

/// `users` distinct users' ranking requests (the 13 dense features and
/// 13 request-level features of 20 ids each, one candidate row), each user
/// sent `times` times (separate requests: equal blocks, not one `Arc`),
/// validated as the server does.
fn ranking_blocks(users: usize, times: usize) -> Vec<Option<Arc<RequestBlock>>> {
    let mut schema = ModelSchema::dlrm("bench", "cpu", 100_000);
    let user: Vec<String> = (0..SPARSE / 2).map(|f| format!("cat_{f}")).collect();
    let declared = user.iter().map(String::as_str).chain(["dense"]);
    schema.request_level = RequestLevel::parse(declared, &schema).unwrap();
    let limits = RequestLimits::new(4096, IdPolicy::Reject);
    (0..users * times)
        .map(|r| {
            let u = r % users;
            let mut request = RequestSamples {
                num_samples: 1,
                ids: vec![1; SPARSE - SPARSE / 2],
                request: Some(Arc::new(RequestBlock {
                    dense: (0..DENSE).map(|d| (u * DENSE + d) as f32 * 1e-3).collect(),
                    lengths: vec![20; SPARSE / 2],
                    ids: (0..20 * SPARSE / 2).map(|i| ((i * 7919 + u * 31) % 100_000) as i64).collect(),
                    ..Default::default()
                })),
                ..Default::default()
            };
            request.validate(&schema, limits).unwrap();
            request.request
        })
        .collect()
}

fn bench_units(c: &mut Criterion) {
    let mut group = c.benchmark_group("request_blocks_gather");
    for (users, times) in [(16, 1), (400, 1), (100, 4)] {
        let blocks = ranking_blocks(users, times);
        group.throughput(Throughput::Elements(blocks.len() as u64));
        let name = format!("{users}_users_x_{times}");
        group.bench_with_input(BenchmarkId::from_parameter(name), &blocks, |b, blocks| {
            b.iter(|| RequestBlocks::gather(blocks).map(|units| units.unit_count))
        });
    }
    group.finish();
}

criterion_group!(benches, bench_assemble, bench_split, bench_units);
criterion_main!(benches);
