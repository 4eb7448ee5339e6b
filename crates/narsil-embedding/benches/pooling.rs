//! INT8 row-wise pooling, one thread: the default DLRM's shape (64 values
//! per row, 80-byte rows), bags of 1 and of ~4 ids, 100k-row tables.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use narsil_embedding::{pool_int8, Pooling, PoolingMode};

fn bench(c: &mut Criterion) {
    let (rows, dim, row_bytes) = (100_000usize, 64usize, 80usize);
    let mut state = 7u64;
    let mut next = move || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) as usize
    };
    let mut table = vec![0u8; rows * row_bytes];
    for row in table.chunks_mut(row_bytes) {
        row[..2].copy_from_slice(&0x2000u16.to_le_bytes());
        row[2..4].copy_from_slice(&0x2400u16.to_le_bytes());
        row[4..4 + dim].iter_mut().for_each(|q| *q = next() as u8);
    }
    let mut group = c.benchmark_group("pool_int8");
    for ids_per_bag in [1u32, 4] {
        let bags = 1600;
        let lengths: Vec<i32> =
            (0..bags).map(|_| if ids_per_bag == 1 { 1 } else { (next() % 8) as i32 }).collect();
        let total: usize = lengths.iter().map(|&l| l as usize).sum();
        let ids: Vec<i64> = (0..total).map(|_| (next() % rows) as i64).collect();
        let mut out = vec![0.0f32; bags * dim];
        group.throughput(Throughput::Elements(total as u64));
        group.bench_with_input(BenchmarkId::new("ids_per_bag", ids_per_bag), &ids_per_bag, |b, _| {
            b.iter(|| {
                let pooling = Pooling { mode: PoolingMode::Sum, weights: None };
                pool_int8(&table, row_bytes, dim, &lengths, &ids, pooling, &mut out, dim).unwrap();
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
