//! What id maps cost the embedding stage (issue 53): the default DLRM's
//! shape (26 tables of INT8 rows, 64 values, 80-byte rows, in memory; a
//! fused batch of 1,600 rows, one id per bag), each table of 1M rows with
//! an id map of all its rows. `identity`: the stage without maps, sent
//! rows; `mapped`: the same tables and their maps, sent the same rows as
//! raw ids (the same pooled output, checked once), each map looked up as a
//! hash table (`NARSIL_ID_MAP_LAYOUT=off`); `laid_out`: the same, the tables
//! laid out by their maps as the server holds them
//! (`EmbeddingStage::lay_out_mapped_tables`); `map_ids_copy_and_map`: the
//! hash-table stage's copy of the batch and its mapping alone; `batch_copy_into`: the
//! copy alone; `map_into`: the 26 tables' `IdMap::map_into` alone (41,600
//! ids). Zipf 1.05 and uniform ids; each iteration takes the next of 32
//! batches, so that their rows and slots do not all stay in the caches (2
//! GB of rows, 26 maps of 33.6 MB).
//! Before criterion's numbers, each distribution prints identity, mapped
//! and laid out timed in alternation, and the medians of their ratios to
//! identity: on a shared
//! machine the drift between criterion's runs of the two is larger than
//! the difference measured.
//!
//! `ID_MAP_BENCH_ROWS=N` measures tables (and maps) of N rows instead.
//!
//! In test mode (`cargo test --benches`: no `--bench`) the tables are of
//! 10k rows, so that building them and their maps stays quick.

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use narsil_core::{assemble, KeyedBatch, RequestSamples};
use narsil_embedding::id_map::{build, SlottedMap};
use narsil_embedding::{
    EmbeddingStage, IdMap, IdMapSpec, RowStore, SplitSchema, StageScratch, Storage, Table, TableIds,
    TableSpec,
};

const FEATURES: usize = 26;
const SAMPLES: usize = 1600;
const DIM: usize = 64;
const ROW_BYTES: usize = 80;

/// Criterion's own rule: benchmarks run with `--bench` and without `--test`.
fn bench_mode() -> bool {
    let args: Vec<String> = std::env::args().collect();
    args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--test")
}

/// Rows per table and batches rotated through.
fn shape() -> (usize, usize) {
    if bench_mode() {
        let rows = std::env::var("ID_MAP_BENCH_ROWS").map_or(1_000_000, |r| r.parse().expect("rows"));
        (rows, 32)
    } else {
        (10_000, 2)
    }
}

fn random(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed;
    move || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        state
    }
}

fn table_rows(rows: usize, next: &mut impl FnMut() -> u64) -> Vec<u8> {
    let mut table = vec![0u8; rows * ROW_BYTES];
    for row in table.chunks_mut(ROW_BYTES) {
        row[..2].copy_from_slice(&0x2000u16.to_le_bytes());
        row[2..4].copy_from_slice(&0x2400u16.to_le_bytes());
        for q in row[4..4 + DIM].chunks_mut(8) {
            q.copy_from_slice(&next().to_le_bytes());
        }
    }
    table
}

/// The raw id of table `t`'s row `row`: a 64-bit mix, distinct per row.
fn raw(t: usize, row: i64) -> i64 {
    ((row as u64) ^ ((t as u64) << 40)).wrapping_mul(0x9e37_79b9_7f4a_7c15) as i64
}

#[derive(Clone, Copy)]
enum Ids {
    Zipf,
    Uniform,
}

/// `SAMPLES * FEATURES` rows, sample-major (as `RequestSamples` holds
/// them): Zipf 1.05 ranks scattered over each table's rows, or uniform.
fn draw_rows(ids: Ids, rows: usize, cumulative: &[f64], next: &mut impl FnMut() -> u64) -> Vec<i64> {
    (0..SAMPLES * FEATURES)
        .map(|k| match ids {
            Ids::Uniform => ((next() >> 33) % rows as u64) as i64,
            Ids::Zipf => {
                let u = (next() >> 11) as f64 / (1u64 << 53) as f64;
                let rank = cumulative.partition_point(|&c| c < u).min(rows - 1) as u64;
                // An affine bijection of the ranks, one per table.
                let t = (k % FEATURES) as u64;
                (rank.wrapping_mul(2_654_435_761).wrapping_add(t * 7919) % rows as u64) as i64
            }
        })
        .collect()
}

fn batch_of(ids: Vec<i64>) -> KeyedBatch {
    let request = RequestSamples {
        num_samples: SAMPLES,
        dense: vec![0.0; SAMPLES],
        lengths: vec![1; SAMPLES * FEATURES],
        ids,
        ..Default::default()
    };
    assemble(1, FEATURES, [&request])
}

fn id_maps(c: &mut Criterion) {
    let (rows, batches) = shape();
    let mut next = random(7);
    let spec = |f: usize, ids: TableIds| TableSpec {
        name: format!("cat_{f}"),
        rows: rows as u64,
        dim: DIM,
        storage: Storage::Int8Rowwise,
        row_bytes: ROW_BYTES,
        file: format!("tables/cat_{f}.bin").into(),
        sha256: String::new(),
        redis: None,
        layout: None,
        ids,
    };
    let plain: Vec<TableSpec> = (0..FEATURES).map(|f| spec(f, TableIds::Identity)).collect();
    let declared = |f| {
        TableIds::Map(IdMapSpec {
            file: format!("tables/cat_{f}.idmap").into(),
            sha256: "00".repeat(32),
            default_row: 0,
        })
    };
    let mapped: Vec<TableSpec> = (0..FEATURES).map(|f| spec(f, declared(f))).collect();
    let schema = |specs: &[TableSpec]| {
        SplitSchema::one_table_per_feature("bench", "1", 1, specs.to_vec(), vec!["default".into()])
    };
    let tables: Vec<Arc<dyn RowStore>> = plain
        .iter()
        .map(|s| Arc::new(Table::from_rows(s, table_rows(rows, &mut next))) as Arc<dyn RowStore>)
        .collect();
    let maps: Vec<Arc<IdMap>> = (0..FEATURES)
        .map(|t| {
            let pairs: Vec<(i64, u64)> = (0..rows as i64).map(|r| (raw(t, r), r as u64)).collect();
            Arc::new(IdMap::from_bytes(build(&pairs, rows as u64).unwrap(), rows as u64).unwrap())
        })
        .collect();
    // The layouts alone, for their pieces' timings (ID_MAP_BENCH_PIECES=1:
    // another copy of the tables).
    let slotted: Option<Vec<SlottedMap>> = std::env::var("ID_MAP_BENCH_PIECES").is_ok().then(|| {
        let lay_out = |f: usize| SlottedMap::lay_out(&mapped[f], tables[f].clone(), &maps[f], 0);
        (0..FEATURES).map(|f| lay_out(f).unwrap_or_else(|(why, _)| panic!("{why}"))).collect()
    });
    let identity = EmbeddingStage::new(&schema(&plain), tables.clone());
    let with_maps = EmbeddingStage::with_id_maps(
        &schema(&mapped),
        tables.clone(),
        maps.iter().cloned().map(Some).collect(),
    );
    let mut laid_out =
        EmbeddingStage::with_id_maps(&schema(&mapped), tables, maps.iter().cloned().map(Some).collect());
    let started = std::time::Instant::now();
    assert_eq!(laid_out.lay_out_mapped_tables(), FEATURES, "every table laid out by its map");
    println!(
        "{FEATURES} tables of {rows} rows laid out by their maps in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    assert!(with_maps.maps_ids() && !identity.maps_ids());

    let weights: Vec<f64> = (1..=rows).map(|rank| (rank as f64).powf(-1.05)).collect();
    let total: f64 = weights.iter().sum();
    let cumulative: Vec<f64> = weights
        .iter()
        .scan(0.0, |sum, w| {
            *sum += w / total;
            Some(*sum)
        })
        .collect();

    for (ids, name) in [(Ids::Zipf, "zipf"), (Ids::Uniform, "uniform")] {
        let row_batches: Vec<KeyedBatch> =
            (0..batches).map(|_| batch_of(draw_rows(ids, rows, &cumulative, &mut next))).collect();
        let raw_batches: Vec<KeyedBatch> = row_batches
            .iter()
            .map(|b| {
                let mut raws = b.clone();
                for f in 0..FEATURES {
                    let range = b.feature_offsets[f]..b.feature_offsets[f + 1];
                    raws.ids[range.clone()].iter_mut().for_each(|id| *id = raw(f, *id));
                }
                raws
            })
            .collect();
        let (mut scratch, mut expected, mut pooled) = (StageScratch::default(), Vec::new(), Vec::new());
        for (rows_batch, raw_batch) in row_batches.iter().zip(&raw_batches) {
            identity.pool(rows_batch, &mut scratch, &mut expected).unwrap();
            with_maps.pool(raw_batch, &mut scratch, &mut pooled).unwrap();
            assert_eq!(pooled, expected, "{name}: mapped and identity pool the same rows alike");
            laid_out.pool(raw_batch, &mut scratch, &mut pooled).unwrap();
            assert_eq!(pooled, expected, "{name}: laid out and identity pool the same rows alike");
        }

        if bench_mode() {
            interleaved(
                name,
                batches,
                &mut [
                    ("identity", &mut |at, scratch, pooled| {
                        identity.pool(&row_batches[at], scratch, pooled).unwrap()
                    }),
                    ("mapped", &mut |at, scratch, pooled| {
                        with_maps.pool(&raw_batches[at], scratch, pooled).unwrap()
                    }),
                    ("laid_out", &mut |at, scratch, pooled| {
                        laid_out.pool(&raw_batches[at], scratch, pooled).unwrap()
                    }),
                ],
            );
        }

        let mut group = c.benchmark_group(format!("id_map_{name}"));
        group.throughput(Throughput::Elements((SAMPLES * FEATURES) as u64));
        let mut at = 0;
        group.bench_function("identity_stage", |b| {
            b.iter(|| {
                at = (at + 1) % batches;
                identity.pool(&row_batches[at], &mut scratch, &mut pooled).unwrap()
            })
        });
        group.bench_function("mapped_stage", |b| {
            b.iter(|| {
                at = (at + 1) % batches;
                with_maps.pool(&raw_batches[at], &mut scratch, &mut pooled).unwrap()
            })
        });
        group.bench_function("laid_out_stage", |b| {
            b.iter(|| {
                at = (at + 1) % batches;
                laid_out.pool(&raw_batches[at], &mut scratch, &mut pooled).unwrap()
            })
        });
        let mut copy = KeyedBatch::default();
        group.bench_function("map_ids_copy_and_map", |b| {
            b.iter(|| {
                at = (at + 1) % batches;
                with_maps.map_ids_skipping_pushes(&raw_batches[at], &mut copy).ids.len()
            })
        });
        group.bench_function("batch_copy_into", |b| {
            b.iter(|| {
                at = (at + 1) % batches;
                raw_batches[at].copy_into(&mut copy);
                copy.ids.len()
            })
        });
        let mut out = vec![0i64; SAMPLES];
        group.bench_function("map_into_26x1600", |b| {
            b.iter(|| {
                at = (at + 1) % batches;
                let batch = &raw_batches[at];
                maps.iter()
                    .enumerate()
                    .map(|(f, map)| map.map_into(batch.feature_ids(f), &mut out, 0))
                    .sum::<u64>()
            })
        });
        if let Some(slotted) = &slotted {
            let mut rows = Vec::new();
            group.bench_function("candidate_rows_26x1600", |b| {
                b.iter(|| {
                    at = (at + 1) % batches;
                    let batch = &raw_batches[at];
                    for (f, map) in slotted.iter().enumerate() {
                        map.candidate_rows_into(batch.feature_ids(f), &mut rows);
                    }
                    rows.len()
                })
            });
            group.bench_function("candidate_rows_and_check_26x1600", |b| {
                b.iter(|| {
                    at = (at + 1) % batches;
                    let batch = &raw_batches[at];
                    let mut held = 0;
                    for (f, map) in slotted.iter().enumerate() {
                        let raws = batch.feature_ids(f);
                        map.candidate_rows_into(raws, &mut rows);
                        held +=
                            raws.iter().zip(&rows).filter(|&(&raw, &row)| map.holds(raw, row as u64)).count();
                    }
                    held
                })
            });
        }
        group.finish();
    }
}

/// A stage's run over batch `at`.
type Run<'a> = &'a mut dyn FnMut(usize, &mut StageScratch, &mut Vec<f32>);

/// The stages timed in alternation (rounds of one pass over the batches
/// each, so that the machine's drift hits all alike), printed before
/// criterion's numbers: the median per-batch time of each and the median
/// of the rounds' ratios to the first.
fn interleaved(name: &str, batches: usize, runs: &mut [(&str, Run<'_>)]) {
    const ROUNDS: usize = 41;
    let (mut scratch, mut pooled) = (StageScratch::default(), Vec::new());
    let mut times = vec![Vec::new(); runs.len()];
    let mut ratios = vec![Vec::new(); runs.len()];
    for _ in 0..ROUNDS {
        for (k, (_, run)) in runs.iter_mut().enumerate() {
            let start = std::time::Instant::now();
            for at in 0..batches {
                run(at, &mut scratch, &mut pooled);
            }
            times[k].push(start.elapsed().as_secs_f64() * 1e3 / batches as f64);
        }
        for k in 0..runs.len() {
            let ratio = times[k][times[k].len() - 1] / times[0][times[0].len() - 1];
            ratios[k].push(ratio);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut line = format!("{name}: interleaved, {ROUNDS} rounds, per batch (medians):");
    for (k, (stage, _)) in runs.iter().enumerate() {
        let (t, r) = (median(&mut times[k]), median(&mut ratios[k]));
        line += &format!(" {stage} {t:.3} ms ({r:.3}x);");
    }
    println!("{line} ratios: median of rounds, to {}", runs[0].0);
}

criterion_group!(benches, id_maps);
criterion_main!(benches);
