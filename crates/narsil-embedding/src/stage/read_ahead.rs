//! Reading a batch's mapped rows ahead: once lookups of a memory-mapped
//! table wait on the disk, every distinct row is touched from [`READERS`]
//! threads at once, so that their page reads are in flight together
//! instead of one synchronous fault at a time on the lane; and counting the
//! major page faults a thread takes ([`thread_major_faults`]), which is how
//! the stage knows its lookups wait on the disk.

use std::time::Instant;

use super::{EmbeddingStage, StageTable};
use crate::dedup::DistinctIds;

/// Threads that read a batch's mapped rows ahead, in parallel, once lookups
/// wait on the disk: that many page reads in flight instead of one.
pub(super) const READERS: usize = 16;

impl EmbeddingStage {
    /// Touches every distinct row of the tables whose reads can wait on the
    /// disk, from [`READERS`] threads at once, so that their page reads are
    /// in flight together; returns the major faults taken (counted per
    /// table).
    pub(super) fn read_ahead(&self, distinct: &[DistinctIds]) -> u64 {
        let started = Instant::now();
        let work: Vec<(usize, &StageTable, &[i64])> = self
            .tables
            .iter()
            .zip(distinct)
            .enumerate()
            .filter(|(_, (table, _))| table.store.may_fault() && table.store.local_rows().is_some())
            .map(|(t, (table, ids))| (t, table, ids.distinct()))
            .collect();
        let mut faults = vec![0u64; self.tables.len()];
        std::thread::scope(|scope| {
            let readers: Vec<_> = (0..READERS)
                .map(|reader| {
                    let work = &work;
                    scope.spawn(move || {
                        let mut faults = vec![0u64; work.len()];
                        for (w, &(_, table, ids)) in work.iter().enumerate() {
                            let rows = table.store.local_rows().unwrap_or_default();
                            let (row_bytes, slots) = (table.spec.row_bytes, table.store.slots());
                            let before = thread_major_faults();
                            // Pushed ids' virtual rows (`rows..`) are in memory.
                            let in_file = ids.iter().filter(|&&id| (id as u64) < table.spec.rows);
                            for &id in in_file.skip(reader).step_by(READERS) {
                                let at = slots.map_or(id, |index| index.slot(id));
                                // A row can span two pages: its first and last byte.
                                let start = at as usize * row_bytes;
                                std::hint::black_box((rows[start], rows[start + row_bytes - 1]));
                            }
                            faults[w] = thread_major_faults().saturating_sub(before);
                        }
                        faults
                    })
                })
                .collect();
            for reader in readers {
                let taken = reader.join().expect("a read-ahead thread only reads");
                for (w, n) in taken.into_iter().enumerate() {
                    faults[work[w].0] += n;
                }
            }
        });
        for (table, &n) in self.tables.iter().zip(&faults) {
            table.counters.major_faults.inc_by(n);
        }
        self.metrics.read_ahead_seconds().observe(started.elapsed().as_secs_f64());
        faults.iter().sum()
    }
}

/// Major page faults taken by the calling thread so far.
pub(super) fn thread_major_faults() -> u64 {
    // SAFETY: all zeros is a valid `rusage` (integers and `timeval`s), and
    // getrusage writes one rusage into memory we own.
    unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_THREAD, &mut usage) != 0 {
            return 0;
        }
        usage.ru_majflt as u64
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use super::super::fixtures::{batch, rows, schema};
    use super::super::{EmbeddingStage, StageScratch};
    use crate::stores::local::table::{LocalRows, Table};
    use crate::stores::row_store::RowStore;

    #[test]
    fn reading_mapped_rows_ahead_pools_the_same_bags() {
        let schema = schema();
        let dir = tempfile_dir("narsil-stage-read-ahead");
        std::fs::create_dir_all(dir.join("tables")).unwrap();
        let stores: Vec<Arc<dyn RowStore>> = schema
            .tables
            .iter()
            .enumerate()
            .map(|(i, spec)| {
                std::fs::write(dir.join(&spec.file), rows(spec, 3 + i as u8).bytes()).unwrap();
                Arc::new(Table::load(&dir, spec, LocalRows::Mmap).unwrap()) as Arc<dyn RowStore>
            })
            .collect();
        let stage = EmbeddingStage::new(&schema, stores);
        let batch = batch();
        let (mut scratch, mut plain, mut ahead) = (StageScratch::default(), Vec::new(), Vec::new());
        stage.pool(&batch, &mut scratch, &mut plain).unwrap();
        stage.faulting.store(true, Ordering::Relaxed);
        stage.pool(&batch, &mut scratch, &mut ahead).unwrap();
        assert_eq!(plain, ahead);
        let mut registry = prometheus_client::registry::Registry::with_prefix("narsil");
        stage.metrics().register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(text.contains("narsil_table_read_ahead_seconds_count 1\n"), "{text}");
        // The rows were cached: no fault, so the next batch does not read ahead.
        assert!(!stage.faulting.load(Ordering::Relaxed));
        std::fs::remove_dir_all(dir).unwrap();
    }

    fn tempfile_dir(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("{name}-{}", std::process::id()))
    }
}
