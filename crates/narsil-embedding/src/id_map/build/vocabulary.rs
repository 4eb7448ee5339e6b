//! The vocabulary a map is built from (`narsil tables map --vocabulary`): the raw id of each row of the
//! table, row 0 first, as decimal text (signed or unsigned 64-bit ids, one
//! a line) or little-endian `i64`s; counted, then read id by id, every
//! error naming the place in the file.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use anyhow::Context;

use super::{Progress, FILE_BUFFER_BYTES};

/// How a vocabulary file holds its raw ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabularyFormat {
    /// One decimal 64-bit id a line, signed or unsigned (above i64::MAX:
    /// its two's complement i64).
    Text,
    /// Little-endian i64s, 8 bytes each.
    I64le,
}

/// The vocabulary file and how it holds its ids.
pub struct Vocabulary<'a> {
    /// The file (errors name it as `--vocabulary PATH`).
    pub path: &'a Path,
    /// How it holds the ids.
    pub format: VocabularyFormat,
}

impl Vocabulary<'_> {
    fn open(&self) -> anyhow::Result<File> {
        File::open(self.path).with_context(|| format!("--vocabulary {}", self.path.display()))
    }

    /// Where row `row`'s id is in the file, as an error names it.
    pub fn place(&self, row: u64) -> String {
        match self.format {
            VocabularyFormat::Text => format!("line {}", row + 1),
            VocabularyFormat::I64le => format!("id {} (byte {})", row + 1, row * 8),
        }
    }

    /// How many ids it holds: an `i64le` file's size says it, a `text`
    /// file's lines are counted.
    pub fn count(&self, progress: &mut dyn Progress) -> anyhow::Result<u64> {
        let file = self.open()?;
        let size = file.metadata()?.len();
        match self.format {
            VocabularyFormat::I64le => {
                anyhow::ensure!(
                    size.is_multiple_of(8),
                    "--vocabulary {}: {size} bytes, not a whole number of 8-byte ids (i64le)",
                    self.path.display()
                );
                Ok(size / 8)
            }
            VocabularyFormat::Text => {
                progress.start("vocabulary: count".into());
                let mut reader = BufReader::with_capacity(FILE_BUFFER_BYTES, file);
                let (mut lines, mut last) = (0u64, b'\n');
                loop {
                    let buffer = reader.fill_buf()?;
                    let Some(&end) = buffer.last() else { break };
                    lines += buffer.iter().filter(|&&b| b == b'\n').count() as u64;
                    last = end;
                    let n = buffer.len();
                    reader.consume(n);
                    progress.tick(&|| format!("{lines} lines"));
                }
                let lines = lines + u64::from(last != b'\n');
                progress.done(format!("{lines} lines"));
                Ok(lines)
            }
        }
    }

    /// Reads every id, row by row, into `entry(row, raw)`.
    pub fn read(&self, mut entry: impl FnMut(u64, i64) -> anyhow::Result<()>) -> anyhow::Result<()> {
        let mut reader = BufReader::with_capacity(FILE_BUFFER_BYTES, self.open()?);
        let mut row = 0u64;
        match self.format {
            VocabularyFormat::I64le => {
                let mut id = [0u8; 8];
                while !reader.fill_buf()?.is_empty() {
                    reader.read_exact(&mut id)?;
                    entry(row, i64::from_le_bytes(id))?;
                    row += 1;
                }
            }
            VocabularyFormat::Text => {
                let mut line = Vec::with_capacity(32);
                loop {
                    line.clear();
                    if reader.read_until(b'\n', &mut line)? == 0 {
                        break;
                    }
                    let raw = parse_id(&line).with_context(|| {
                        format!(
                            "--vocabulary {}: {} ({:?}): {}",
                            self.path.display(),
                            self.place(row),
                            String::from_utf8_lossy(&line).trim_end_matches(['\n', '\r']),
                            if line.trim_ascii().is_empty() {
                                "a blank line (each line is the raw id of one row)"
                            } else {
                                "not a decimal 64-bit id"
                            }
                        )
                    })?;
                    entry(row, raw)?;
                    row += 1;
                }
            }
        }
        Ok(())
    }
}

/// The id a text line holds (its `\n`, `\r` and spaces around it aside).
fn parse_id(line: &[u8]) -> Option<i64> {
    let text = std::str::from_utf8(line.trim_ascii()).ok()?;
    if text.starts_with('-') {
        text.parse::<i64>().ok()
    } else {
        // Above i64::MAX: the two's complement, as KServe's UINT64 sends it.
        text.parse::<u64>().ok().map(|id| id as i64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_ids_are_signed_or_unsigned_64_bit_decimals() {
        assert_eq!(parse_id(b"42\n"), Some(42));
        assert_eq!(parse_id(b" -9223372036854775808\r\n"), Some(i64::MIN));
        assert_eq!(parse_id(b"18446744073709551615"), Some(-1));
        assert_eq!(parse_id(b"9223372036854775808"), Some(i64::MIN));
        for junk in [&b"\n"[..], b"1.5", b"0x10", b"-9223372036854775809", b"1 2", b"\xff"] {
            assert_eq!(parse_id(junk), None, "{:?}", String::from_utf8_lossy(junk));
        }
    }
}
