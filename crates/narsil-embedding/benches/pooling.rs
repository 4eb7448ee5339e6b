//! INT8 row-wise pooling, one thread: the default DLRM's shape (64 values
//! per row, 80-byte rows), bags of 1 and of ~4 ids, 100k-row tables; and
//! the whole embedding stage (26 such tables, a fused batch of 1,600 rows,
//! one id per bag) against pooling the same bags without deduplication,
//! which is what the stage's dedup and metrics cost a local store; and the
//! stage on ranking requests (3 users x 500 candidates, 13 of the 26
//! features the user's, sent once per request); both in bf16 for a dense
//! network in bf16, rounded as pooled against a pass after the FP32 block.

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use narsil_core::request::{IdPolicy, RequestLimits};
use narsil_core::{assemble, RequestBlock, RequestLevel, RequestSamples};
use narsil_embedding::{
    pool_rows, Bf16, EmbeddingStage, PooledValue, Pooling, PoolingMode, RowStore, SplitSchema, StageScratch,
    Storage, Table, TableSpec,
};

const ROWS: usize = 100_000;
const DIM: usize = 64;
const ROW_BYTES: usize = 80;

fn random() -> impl FnMut() -> usize {
    let mut state = 7u64;
    move || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) as usize
    }
}

fn table_rows(next: &mut impl FnMut() -> usize) -> Vec<u8> {
    let mut table = vec![0u8; ROWS * ROW_BYTES];
    for row in table.chunks_mut(ROW_BYTES) {
        row[..2].copy_from_slice(&0x2000u16.to_le_bytes());
        row[2..4].copy_from_slice(&0x2400u16.to_le_bytes());
        row[4..4 + DIM].iter_mut().for_each(|q| *q = next() as u8);
    }
    table
}

fn pooling(c: &mut Criterion) {
    let mut next = random();
    let table = table_rows(&mut next);
    let mut group = c.benchmark_group("pool_int8");
    for ids_per_bag in [1u32, 4] {
        let bags = 1600;
        let lengths: Vec<i32> =
            (0..bags).map(|_| if ids_per_bag == 1 { 1 } else { (next() % 8) as i32 }).collect();
        let total: usize = lengths.iter().map(|&l| l as usize).sum();
        let ids: Vec<i64> = (0..total).map(|_| (next() % ROWS) as i64).collect();
        let mut out = vec![0.0f32; bags * DIM];
        group.throughput(Throughput::Elements(total as u64));
        group.bench_with_input(BenchmarkId::new("ids_per_bag", ids_per_bag), &ids_per_bag, |b, _| {
            b.iter(|| {
                let pooling = Pooling { mode: PoolingMode::Sum, weights: None };
                pool_rows(
                    Storage::Int8Rowwise,
                    &table,
                    ROW_BYTES,
                    DIM,
                    &lengths,
                    &ids,
                    pooling,
                    &mut out,
                    DIM,
                )
                .unwrap();
            })
        });
    }
    group.finish();
}

fn stage(c: &mut Criterion) {
    const FEATURES: usize = 26;
    const SAMPLES: usize = 1600;
    let mut next = random();
    let specs: Vec<TableSpec> = (0..FEATURES)
        .map(|f| TableSpec {
            name: format!("cat_{f}"),
            rows: ROWS as u64,
            dim: DIM,
            storage: Storage::Int8Rowwise,
            row_bytes: ROW_BYTES,
            file: format!("tables/cat_{f}.bin").into(),
            sha256: String::new(),
            redis: None,
            layout: None,
            ids: Default::default(),
        })
        .collect();
    let schema = SplitSchema::one_table_per_feature("bench", "1", 1, specs.clone(), vec!["default".into()]);
    let tables: Vec<Arc<Table>> =
        specs.iter().map(|s| Arc::new(Table::from_rows(s, table_rows(&mut next)))).collect();
    let request = RequestSamples {
        num_samples: SAMPLES,
        dense: vec![0.0; SAMPLES],
        lengths: vec![1; SAMPLES * FEATURES],
        ids: (0..SAMPLES * FEATURES).map(|_| (next() % ROWS) as i64).collect(),
        ..Default::default()
    };
    let batch = assemble(1, FEATURES, [&request]);
    let stores: Vec<Arc<dyn RowStore>> = tables.iter().map(|t| Arc::clone(t) as Arc<dyn RowStore>).collect();
    let stage = EmbeddingStage::new(&schema, stores);
    let (mut scratch, mut pooled) = (StageScratch::default(), Vec::new());
    let mut group = c.benchmark_group("embedding_stage");
    group.throughput(Throughput::Elements((SAMPLES * FEATURES) as u64));
    group.bench_function("26_tables_1600_rows_dedup_and_pool", |b| {
        b.iter(|| stage.pool(&batch, &mut scratch, &mut pooled).unwrap())
    });
    let width = FEATURES * DIM;
    let mut out = vec![0.0f32; SAMPLES * width];
    group.bench_function("26_tables_1600_rows_pool_only", |b| {
        b.iter(|| {
            for (f, table) in tables.iter().enumerate() {
                let pooling = Pooling { mode: PoolingMode::Sum, weights: None };
                let (lengths, ids) = (batch.feature_lengths(f), batch.feature_ids(f));
                pool_rows(
                    Storage::Int8Rowwise,
                    table.bytes(),
                    ROW_BYTES,
                    DIM,
                    lengths,
                    ids,
                    pooling,
                    &mut out[f * DIM..],
                    width,
                )
                .unwrap();
            }
        })
    });
    // Ranking requests: features 0..13 the user's (one id each, sent once
    // per request), 13..26 each candidate's.
    const CANDIDATES: usize = 500;
    let mut model = schema.model_schema("torch", "cpu");
    let user: Vec<String> = (0..FEATURES / 2).map(|f| format!("cat_{f}")).collect();
    model.request_level = RequestLevel::parse(user.iter().map(String::as_str), &model).unwrap();
    let requests: Vec<RequestSamples> = (0..3)
        .map(|_| {
            let mut request = RequestSamples {
                num_samples: CANDIDATES,
                dense: vec![0.0; CANDIDATES],
                lengths: vec![1; CANDIDATES * (FEATURES - FEATURES / 2)],
                ids: (0..CANDIDATES * (FEATURES - FEATURES / 2)).map(|_| (next() % ROWS) as i64).collect(),
                request: Some(Arc::new(RequestBlock {
                    lengths: vec![1; FEATURES / 2],
                    ids: (0..FEATURES / 2).map(|_| (next() % ROWS) as i64).collect(),
                    ..Default::default()
                })),
                ..Default::default()
            };
            request.validate(&model, RequestLimits::new(4096, IdPolicy::Reject)).unwrap();
            request
        })
        .collect();
    let ranking = assemble(1, FEATURES, requests.iter());
    assert_eq!(ranking.request_blocks.as_ref().map(|b| b.unit_count), Some(3));
    group.throughput(Throughput::Elements((3 * CANDIDATES * FEATURES) as u64));
    group.bench_function("26_tables_ranking_3_users_x_500_candidates", |b| {
        b.iter(|| stage.pool(&ranking, &mut scratch, &mut pooled).unwrap())
    });
    group.finish();
    // A dense network in bf16: the block pooled in FP32 then rounded in a
    // pass of its own (into a block allocated once: less than a cast that
    // allocates its result costs), against each bag rounded as it is pooled.
    let mut group = c.benchmark_group("embedding_stage_bf16");
    let mut rounded: Vec<Bf16> = Vec::new();
    for (name, batch) in
        [("26_tables_1600_rows", &batch), ("26_tables_ranking_3_users_x_500_candidates", &ranking)]
    {
        group.throughput(Throughput::Elements((batch.rows * FEATURES) as u64));
        group.bench_function(format!("{name}_fp32_then_rounded"), |b| {
            b.iter(|| {
                stage.pool(batch, &mut scratch, &mut pooled).unwrap();
                rounded.resize(pooled.len(), Bf16::default());
                Bf16::convert(&pooled, &mut rounded);
            })
        });
        group.bench_function(format!("{name}_bf16_as_pooled"), |b| {
            b.iter(|| stage.pool_into(batch, &mut scratch, &mut rounded).unwrap())
        });
    }
    group.finish();
}

fn dedup(c: &mut Criterion) {
    let mut next = random();
    let ids: Vec<i64> = (0..1600).map(|_| (next() % ROWS) as i64).collect();
    let mut distinct = narsil_embedding::DistinctIds::default();
    let mut group = c.benchmark_group("distinct_ids");
    group.throughput(Throughput::Elements(ids.len() as u64));
    group.bench_function("1600_uniform_ids", |b| {
        b.iter(|| {
            distinct.clear();
            distinct.add(&ids);
            distinct.count()
        })
    });
    group.finish();
}

criterion_group!(benches, pooling, stage, dedup);
criterion_main!(benches);
