//! Fetching the rows of the tables whose stores fetch (not those read in
//! place): each distinct id once, into the lane's scratch; the tables of a
//! store that fetches many at once in one call per group
//! ([`crate::stores::batch`]), the others one by one; and counting each
//! table's fetch (rows fetched, cache hits, missing rows, store errors).
//! A table in this process whose batch found pushed ids has its distinct
//! rows copied too: its own rows (through the slot index where it has
//! one), the pushed ones from the batch's snapshot.

use std::time::Instant;

use narsil_core::KeyedBatch;

use super::{EmbeddingStage, PushedIds, StageError, StageScratch, StageTable};
use crate::stores::batch::group_tables;
use crate::stores::row_store::{FetchError, FetchPart, Fetched};

impl EmbeddingStage {
    /// Copies the distinct rows of every table whose store fetches into
    /// `scratch.fetched`: the tables of a store that fetches many at once
    /// in one call per [`crate::stores::BatchGroup`], the others one
    /// by one.
    pub(super) fn fetch(&self, batch: &KeyedBatch, scratch: &mut StageScratch) -> Result<(), StageError> {
        scratch.fetched.resize_with(self.tables.len(), Vec::new);
        let tables = self.tables.iter().zip(&scratch.distinct).zip(&mut scratch.fetched);
        for (((table, distinct), out), pushed) in tables.zip(&scratch.pushed) {
            let (local, pushed) = (table.store.local_rows(), pushed.as_deref());
            match (local, pushed) {
                (None, _) => out.resize(distinct.distinct().len() * table.spec.row_bytes, 0),
                (Some(_), Some(pushed)) => copy_rows(table, pushed, distinct.distinct(), out),
                (Some(_), None) => {}
            }
        }
        let fetching = self.tables.iter().enumerate().filter(|(_, table)| table.store.local_rows().is_none());
        for (group, tables) in group_tables(fetching.map(|(t, table)| (t, table.store.as_ref()))) {
            let Some(batcher) = group.and_then(|_| self.tables[tables[0]].store.batch_fetch()) else {
                for t in tables {
                    let (table, ids) = (&self.tables[t], scratch.distinct[t].distinct());
                    let fetched =
                        table.store.fetch(ids, table.spec.row_bytes, &mut scratch.fetched[t], batch.deadline);
                    self.count_fetch(t, ids.len(), fetched)?;
                }
                continue;
            };
            let mut outs: Vec<Option<&mut Vec<u8>>> = scratch.fetched.iter_mut().map(Some).collect();
            let mut parts: Vec<FetchPart<'_>> = tables
                .iter()
                .map(|&t| FetchPart {
                    store: self.tables[t].store.as_ref(),
                    ids: scratch.distinct[t].distinct(),
                    row_bytes: self.tables[t].spec.row_bytes,
                    out: outs[t].take().expect("a table is in one group"),
                    counters: &self.tables[t].counters,
                })
                .collect();
            let started = Instant::now();
            let fetched = batcher.fetch_parts(&mut parts, batch.deadline);
            self.metrics.remote_fetch_seconds().observe(started.elapsed().as_secs_f64());
            match fetched {
                Ok(fetched) => {
                    for ((&t, part), fetched) in tables.iter().zip(&parts).zip(fetched) {
                        self.count_fetch(t, part.ids.len(), Ok(fetched))?;
                    }
                }
                Err((failed, error)) => {
                    // A part's failure is its table's store error; a call
                    // that failed as a whole is every table's. The batch
                    // fails either way, naming the failed table (or the
                    // group's first).
                    if failed.is_none() && !error.abandoned {
                        for &t in &tables[1..] {
                            self.tables[t].counters.store_errors.inc();
                        }
                    }
                    let t = tables[failed.unwrap_or(0).min(tables.len() - 1)];
                    self.count_fetch(t, 0, Err(error))?;
                }
            }
        }
        Ok(())
    }

    /// Counts table `t`'s fetch of `distinct` rows, or its failure (a fetch
    /// given up at the batch's deadline is not the store's failure).
    fn count_fetch(
        &self,
        t: usize,
        distinct: usize,
        fetched: Result<Fetched, FetchError>,
    ) -> Result<(), StageError> {
        let table = &self.tables[t];
        let fetched = fetched.map_err(|source| {
            let (table_name, store) = (table.spec.name.clone(), table.store.kind());
            if source.abandoned {
                return StageError::Abandoned { table: table_name, store, source };
            }
            table.counters.store_errors.inc();
            StageError::Fetch { table: table_name, store, source }
        })?;
        table.counters.cache_hits.inc_by(fetched.cached as u64);
        table.counters.missing_rows.inc_by(fetched.zeroed as u64);
        table.counters.rows_fetched.inc_by((distinct - fetched.cached) as u64);
        Ok(())
    }
}

/// Copies the rows of `ids` (distinct, range-checked: rows of `table`,
/// whose rows are in this process, or virtual rows of `pushed`) into
/// `out`, row `i` at `i * row_bytes`.
fn copy_rows(table: &StageTable, pushed: &PushedIds, ids: &[i64], out: &mut Vec<u8>) {
    let (rows, row_bytes) = (table.spec.rows as i64, table.spec.row_bytes);
    out.clear();
    out.reserve(ids.len() * row_bytes);
    for &id in ids {
        if id < rows {
            out.extend_from_slice(table.store.local_row(id, row_bytes).expect("a table in this process"));
        } else {
            out.extend_from_slice(pushed.row((id - rows) as u32));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::time::Instant;

    use super::super::fixtures::{batch, rows, schema};
    use super::super::{EmbeddingStage, StageError, StageScratch};
    use crate::stores::local::table::Table;
    use crate::stores::row_store::{FetchError, FetchPart, Fetched, RowStore};

    /// Rows fetched by a store of its own that batches: every table of a
    /// batch in one call, which it counts; or, once told to, that call's
    /// failure (a part's, or the whole call's) or a fetch given up at the
    /// deadline.
    struct Batching {
        rows: Table,
        calls: Arc<std::sync::atomic::AtomicUsize>,
        fail: Option<(Option<usize>, FetchError)>,
    }

    impl RowStore for Batching {
        fn kind(&self) -> &'static str {
            "batching"
        }
        fn local_rows(&self) -> Option<&[u8]> {
            None
        }
        fn fetch(
            &self,
            _: &[i64],
            _: usize,
            _: &mut [u8],
            _: Option<Instant>,
        ) -> Result<Fetched, FetchError> {
            panic!("a batching store's tables are fetched together")
        }
        fn may_fault(&self) -> bool {
            false
        }
        fn batch_fetch(&self) -> Option<&dyn crate::stores::BatchFetch> {
            Some(self)
        }
    }

    impl crate::stores::BatchFetch for Batching {
        fn group(&self) -> crate::stores::BatchGroup {
            crate::stores::BatchGroup { kind: "batching", instance: 0 }
        }
        fn fetch_parts(
            &self,
            parts: &mut [FetchPart<'_>],
            deadline: Option<Instant>,
        ) -> Result<Vec<Fetched>, (Option<usize>, FetchError)> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            if let Some(fail) = &self.fail {
                assert!(deadline.is_some() || !fail.1.abandoned);
                return Err(fail.clone());
            }
            let mut fetched = Vec::new();
            for part in parts.iter_mut() {
                let rows = &part.store.downcast_ref::<Batching>().unwrap().rows;
                fetched.push(rows.fetch(part.ids, part.row_bytes, part.out, deadline).unwrap());
            }
            Ok(fetched)
        }
    }

    #[test]
    fn a_store_that_batches_gets_every_table_of_a_batch_in_one_call_and_pools_the_same_bags() {
        let schema = schema();
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let local: Vec<Arc<dyn RowStore>> =
            schema.tables.iter().enumerate().map(|(i, t)| Arc::new(rows(t, 3 + i as u8)) as _).collect();
        let batching: Vec<Arc<dyn RowStore>> = schema
            .tables
            .iter()
            .enumerate()
            .map(|(i, t)| {
                Arc::new(Batching { rows: rows(t, 3 + i as u8), calls: calls.clone(), fail: None }) as _
            })
            .collect();
        let batch = batch();
        let pooled = |stores| {
            let (mut scratch, mut pooled) = (StageScratch::default(), Vec::new());
            EmbeddingStage::new(&schema, stores).pool(&batch, &mut scratch, &mut pooled).unwrap();
            pooled
        };
        assert_eq!(pooled(batching), pooled(local));
        assert_eq!(calls.load(Ordering::Relaxed), 1, "both tables in one call");
    }

    #[test]
    fn a_fetch_given_up_at_the_deadline_abandons_the_batch_without_counting_a_store_error() {
        let schema = schema();
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let stores: Vec<Arc<dyn RowStore>> = schema
            .tables
            .iter()
            .map(|t| {
                let fail = Some((Some(1), FetchError::abandoned("every caller's deadline passed")));
                Arc::new(Batching { rows: rows(t, 1), calls: calls.clone(), fail }) as _
            })
            .collect();
        let stage = EmbeddingStage::new(&schema, stores);
        let mut batch = batch();
        batch.deadline = Some(Instant::now());
        let error = stage.pool(&batch, &mut StageScratch::default(), &mut Vec::new()).unwrap_err();
        assert!(matches!(error, StageError::Abandoned { .. }), "{error}");
        for table in ["shared", "own"] {
            assert_eq!(stage.metrics().table(table).store_errors.get(), 0, "{table}");
        }
        let backend = narsil_core::BackendError::from(error);
        assert!(matches!(backend, narsil_core::BackendError::Abandoned { .. }), "{backend}");
    }

    #[test]
    fn a_failed_part_counts_a_store_error_on_its_own_table_and_a_failed_call_on_every_table() {
        let schema = schema();
        let names: Vec<&str> = schema.tables.iter().map(|t| t.name.as_str()).collect();
        // Each case: the failure, the table the batch's error names, each table's store errors.
        let cases = [
            ((Some(1), FetchError::failed("reading tables/own.bin: EIO")), names[1], [0, 1]),
            ((None, FetchError::failed("the cluster's connection was reset")), names[0], [1, 1]),
        ];
        for (fail, named, errors) in cases {
            let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let stores: Vec<Arc<dyn RowStore>> = schema
                .tables
                .iter()
                .map(|t| {
                    Arc::new(Batching { rows: rows(t, 1), calls: calls.clone(), fail: Some(fail.clone()) })
                        as _
                })
                .collect();
            let stage = EmbeddingStage::new(&schema, stores);
            let error = stage.pool(&batch(), &mut StageScratch::default(), &mut Vec::new()).unwrap_err();
            let StageError::Fetch { table, .. } = &error else { panic!("{error}") };
            assert_eq!(table, named, "{fail:?}");
            for (name, want) in names.iter().zip(errors) {
                assert_eq!(stage.metrics().table(name).store_errors.get(), want, "{name} after {fail:?}");
            }
        }
    }
}
