//! A batch's fetch from `disk` tables: each part's rows from the row cache
//! where it has them, the misses sorted by file offset and covered by
//! whole-block direct reads, every table's reads in flight at once (on an
//! io_uring or on threads), the rows read kept in the cache.

use std::sync::Mutex;
use std::time::Instant;

use super::DiskRows;
use crate::stores::batch::{copy_cached, parts_as};
use crate::stores::disk::reads::{is_deadline_passed, plan, read_on_threads, BlockRead, Read};
use crate::stores::disk::uring;
use crate::stores::row_store::{BatchFetch, BatchGroup, FetchError, FetchPart, Fetched};

/// Most bytes one direct read covers (rows whose blocks touch are read
/// together up to this).
const MAX_READ: usize = 256 << 10;

/// Most threads a batch's reads (every table's) run on at once: that many
/// reads in flight on the disk.
const READERS: usize = 16;

/// A part's cache misses, sorted by offset, and the reads that cover them.
struct Misses {
    /// (place in the part's `out`, id).
    rows: Vec<(usize, i64)>,
    offsets: Vec<u64>,
    reads: Vec<Read>,
}

/// Copies every part's rows into its `out`: rows in the row cache from
/// there, the rest read from the disk, every table's reads at once (on
/// this thread's io_uring, or on up to [`READERS`] threads), then kept in
/// the cache; no read starts once `deadline` (the last of the batch's
/// callers') has passed (the fetch is then abandoned, not failed). Returns
/// what each part fetched, or the failure of the first part whose file
/// could not be read (its index and the error, which names the file).
fn fetch_tables(
    parts: &mut [FetchPart<'_>],
    deadline: Option<Instant>,
) -> Result<Vec<Fetched>, (usize, FetchError)> {
    let tables = parts_as::<DiskRows>(parts, "disk")?;
    if let Some(p) =
        tables.iter().zip(parts.iter()).position(|(table, part)| table.row_bytes != part.row_bytes)
    {
        return Err((p, FetchError::failed("a disk fetch was handed rows of another size than its table's")));
    }
    let mut fetched = Vec::with_capacity(parts.len());
    let mut misses = Vec::with_capacity(parts.len());
    for (part, &table) in parts.iter_mut().zip(&tables) {
        let row_bytes = table.row_bytes;
        let missing = copy_cached(part, table.cache.as_deref(), table.key);
        let mut rows: Vec<(usize, i64)> = missing.into_iter().map(|place| (place, part.ids[place])).collect();
        fetched.push(Fetched { cached: part.ids.len() - rows.len(), zeroed: 0 });
        rows.sort_unstable_by_key(|&(_, id)| table.slot(id));
        let offsets: Vec<u64> = rows.iter().map(|&(_, id)| table.slot(id) * row_bytes as u64).collect();
        let reads = plan(&offsets, row_bytes, MAX_READ.max(row_bytes));
        misses.push(Misses { rows, offsets, reads });
    }
    let (mut reads, mut owners) = (Vec::new(), Vec::new());
    for (p, ((part, m), table)) in parts.iter().zip(&misses).zip(&tables).enumerate() {
        for (r, read) in m.reads.iter().enumerate() {
            let needed = m.offsets[read.rows.end - 1] + table.row_bytes as u64 - read.offset;
            let (file, counters) = (&*table.file, &part.counters.disk);
            reads.push(BlockRead {
                file,
                offset: read.offset,
                len: read.len,
                needed: needed as usize,
                counters,
            });
            owners.push((p, r));
        }
    }
    let outs: Vec<Mutex<&mut [u8]>> = parts.iter_mut().map(|part| Mutex::new(&mut *part.out)).collect();
    // Copies a read's rows out and keeps them in the cache.
    let land = |j: usize, bytes: &[u8]| {
        let (p, r) = owners[j];
        let (table, m) = (tables[p], &misses[p]);
        let (read, row_bytes) = (&m.reads[r], table.row_bytes);
        let mut out = outs[p].lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        for i in read.rows.clone() {
            let (place, id) = m.rows[i];
            let at = (m.offsets[i] - read.offset) as usize;
            let row = &bytes[at..at + row_bytes];
            out[place * row_bytes..(place + 1) * row_bytes].copy_from_slice(row);
            if let Some(cache) = &table.cache {
                cache.insert(table.key, id as u64, row);
            }
        }
    };
    let done = if tables.first().is_some_and(|table| table.io_uring) {
        uring::read_all(&reads, deadline, land)
    } else {
        read_on_threads(&reads, READERS, deadline, land)
    };
    done.map_err(|(j, e)| {
        let p = owners.get(j).map_or(0, |&(p, _)| p);
        let message = format!("reading {}: {e}", tables[p].path.display());
        let error =
            if is_deadline_passed(&e) { FetchError::abandoned(message) } else { FetchError::failed(message) };
        (p, error)
    })?;
    Ok(fetched)
}

/// Every disk table of a batch is read together (on one ring, or one pool
/// of threads).
impl BatchFetch for DiskRows {
    fn group(&self) -> BatchGroup {
        BatchGroup { kind: "disk", instance: 0 }
    }

    fn fetch_parts(
        &self,
        parts: &mut [FetchPart<'_>],
        deadline: Option<Instant>,
    ) -> Result<Vec<Fetched>, (Option<usize>, FetchError)> {
        // A read names the table it was of.
        fetch_tables(parts, deadline).map_err(|(part, error)| (Some(part), error))
    }
}
