//! Writing a map file ([`super`]'s layout): [`SortedWriter`] from entries
//! in `(home slot, raw id)` order, front to back (what `narsil tables map`
//! writes with after sorting on disk), and [`build`] from pairs in any
//! order, sorted in memory.

use std::io::{Seek, SeekFrom, Write};

use super::{home, home_slots_for, invalid, IdMapError, EMPTY, HEADER_BYTES, MAGIC, SLOT_BYTES};

/// Writes a map's slots front to back from entries given in `(home slot,
/// raw id)` order (module docs), then its header: what [`build`] and
/// `narsil tables map` write with.
pub struct SortedWriter<W: Write + Seek> {
    out: W,
    home_slots: u64,
    rows: u64,
    /// Slots written so far.
    written: u64,
    entries: u64,
    previous: Option<(u64, i64)>,
}

impl<W: Write + Seek> SortedWriter<W> {
    /// A writer of a map of `entries` ids (which sizes its home slots) to a
    /// table of `rows` rows, into `out` at its start.
    pub fn new(mut out: W, entries: u64, rows: u64) -> std::io::Result<Self> {
        out.seek(SeekFrom::Start(0))?;
        out.write_all(&[0; HEADER_BYTES])?;
        Ok(Self { out, home_slots: home_slots_for(entries), rows, written: 0, entries: 0, previous: None })
    }

    /// The home slots of the map being written.
    pub fn home_slots(&self) -> u64 {
        self.home_slots
    }

    /// Appends `raw -> row`: its `(home, raw)` must follow the last one's.
    pub fn push(&mut self, raw: i64, row: u64) -> Result<(), IdMapError> {
        if row >= self.rows {
            return Err(invalid(format!(
                "raw id {raw} maps to row {row}, past the table's {} rows",
                self.rows
            )));
        }
        let home = home(raw, self.home_slots);
        match self.previous {
            Some((h, r)) if (h, r) == (home, raw) => {
                return Err(invalid(format!("raw id {raw} is given twice")));
            }
            Some(before) if before > (home, raw) => {
                return Err(invalid(format!("raw id {raw} comes out of (home slot, raw id) order")));
            }
            _ => {}
        }
        self.previous = Some((home, raw));
        let at = home.max(self.written);
        self.write_empty(at - self.written)?;
        let mut slot = [0u8; SLOT_BYTES];
        slot[..8].copy_from_slice(&(raw as u64).to_le_bytes());
        slot[8..].copy_from_slice(&row.to_le_bytes());
        self.out.write_all(&slot)?;
        self.written = at + 1;
        self.entries += 1;
        Ok(())
    }

    fn write_empty(&mut self, slots: u64) -> std::io::Result<()> {
        let mut empty = [0u8; SLOT_BYTES];
        empty[8..].copy_from_slice(&EMPTY.to_le_bytes());
        for _ in 0..slots {
            self.out.write_all(&empty)?;
        }
        Ok(())
    }

    /// Pads the slots to `home_slots` (at least), writes the header and
    /// returns the output and the map's slots.
    pub fn finish(mut self) -> std::io::Result<(W, u64)> {
        let slots = self.written.max(self.home_slots);
        self.write_empty(slots - self.written)?;
        let mut header = [0u8; HEADER_BYTES];
        header[..16].copy_from_slice(MAGIC);
        for (at, value) in [(16, self.home_slots), (24, slots), (32, self.entries), (40, self.rows)] {
            header[at..at + 8].copy_from_slice(&value.to_le_bytes());
        }
        self.out.seek(SeekFrom::Start(0))?;
        self.out.write_all(&header)?;
        self.out.seek(SeekFrom::End(0))?;
        self.out.flush()?;
        Ok((self.out, slots))
    }
}

/// The bytes of a map holding `pairs` (`(raw id, row)`, any order) for a
/// table of `rows` rows: sorted in memory (for maps built in a process:
/// tests, pushes; `narsil tables map` sorts on disk).
pub fn build(pairs: &[(i64, u64)], rows: u64) -> Result<Vec<u8>, IdMapError> {
    let home_slots = home_slots_for(pairs.len() as u64);
    let mut sorted: Vec<(u64, i64, u64)> =
        pairs.iter().map(|&(raw, row)| (home(raw, home_slots), raw, row)).collect();
    sorted.sort_unstable();
    let mut writer = SortedWriter::new(std::io::Cursor::new(Vec::new()), pairs.len() as u64, rows)?;
    for (_, raw, row) in sorted {
        writer.push(raw, row)?;
    }
    Ok(writer.finish()?.0.into_inner())
}
