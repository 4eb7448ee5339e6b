//! What laying mapped tables out by their id maps costs in memory and
//! time (`EmbeddingStage::lay_out_mapped_tables`, as a server's load does):
//! `FEATURES` (26) INT8 tables of `ROWS` (1M) rows of 80 bytes in memory,
//! each with an id map of all its rows, held by the stage alone; prints
//! the process's resident memory before, its peak while the tables are laid
//! out (`VmHWM`, reset first through `/proc/self/clear_refs`) and after.
//!
//! `cargo run --release -p narsil-embedding --example layout_peak`
use std::sync::Arc;

use narsil_embedding::id_map::build;
use narsil_embedding::{
    EmbeddingStage, IdMap, IdMapSpec, RowStore, SplitSchema, Storage, Table, TableIds, TableSpec,
};

fn status(key: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with(key)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() / 1024
}

fn main() {
    let (features, rows): (usize, usize) = (
        std::env::var("FEATURES").map_or(26, |r| r.parse().unwrap()),
        std::env::var("ROWS").map_or(1_000_000, |r| r.parse().unwrap()),
    );
    let spec = |f: usize| TableSpec {
        name: format!("cat_{f}"),
        rows: rows as u64,
        dim: 64,
        storage: Storage::Int8Rowwise,
        row_bytes: 80,
        file: format!("tables/cat_{f}.bin").into(),
        sha256: String::new(),
        redis: None,
        layout: None,
        ids: TableIds::Map(IdMapSpec {
            file: format!("tables/cat_{f}.idmap").into(),
            sha256: "00".repeat(32),
            default_row: 0,
        }),
    };
    let specs: Vec<TableSpec> = (0..features).map(spec).collect();
    let schema = SplitSchema::one_table_per_feature("peak", "1", 1, specs.clone(), vec!["default".into()]);
    let mut state = 7u64;
    let stores: Vec<Arc<dyn RowStore>> = specs
        .iter()
        .map(|s| {
            let data: Vec<u8> = (0..rows * 80)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                    (state >> 56) as u8
                })
                .collect();
            Arc::new(Table::from_rows(s, data)) as Arc<dyn RowStore>
        })
        .collect();
    let maps: Vec<Option<Arc<IdMap>>> = (0..features)
        .map(|t| {
            let pairs: Vec<(i64, u64)> = (0..rows as i64)
                .map(|r| {
                    (((r as u64) ^ ((t as u64) << 40)).wrapping_mul(0x9e37_79b9_7f4a_7c15) as i64, r as u64)
                })
                .collect();
            Some(Arc::new(IdMap::from_bytes(build(&pairs, rows as u64).unwrap(), rows as u64).unwrap()))
        })
        .collect();
    let mut stage = EmbeddingStage::with_id_maps(&schema, stores, maps);
    let before = status("VmRSS:");
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let started = std::time::Instant::now();
    let n = stage.lay_out_mapped_tables();
    let took = started.elapsed().as_secs_f64();
    println!(
        "laid out {n} tables of {rows} rows in {took:.1} s: RSS before {before} MiB, peak during {} MiB (+{}), after {} MiB",
        status("VmHWM:"),
        status("VmHWM:") - before,
        status("VmRSS:")
    );
}
