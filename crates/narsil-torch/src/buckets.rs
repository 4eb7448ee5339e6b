//! Batch-size buckets for CUDA graphs: a graph replays one fixed shape, so a
//! lane captures one graph per bucket (rows) at warm-up and serves a batch
//! of `R` rows with the smallest bucket of at least `R` rows, its input rows
//! padded up to the bucket and its scores sliced back to `R`.
//!
//! Padding cannot change a real row's score: a DLRM-style dense network
//! computes each row from that row's inputs alone (the engine's
//! [`narsil_core::ModelBackend::forward`] contract), so the padded rows'
//! values (zeros at capture, then whatever the last batch left there) only
//! reach padded rows' scores, which are dropped. Tested on the CPU with the
//! real dense network (`tests/device_path.rs`).
//!
//! The default buckets come from the H200 measurements in the issue: a
//! graph's replay is launch-bound below ~1,600 rows (52 µs at 1 row, 109 µs
//! at 100, 218 µs at 1,600 in FP32), so padding a small batch up to 128
//! rows costs ~nothing, and powers of two keep the padding under half a
//! bucket above that. Batches larger than the largest bucket run eagerly.
//! `NARSIL_CUDA_GRAPH_BUCKETS` (comma-separated rows; empty or `0`: no
//! graphs) replaces them.

/// Environment variable naming the buckets.
pub const BUCKETS_ENV: &str = "NARSIL_CUDA_GRAPH_BUCKETS";

/// The default buckets (rows).
pub const DEFAULT_BUCKETS: [usize; 7] = [128, 256, 512, 1024, 2048, 4096, 8192];

/// A lane's buckets, ascending and distinct.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Buckets(Vec<usize>);

impl Default for Buckets {
    fn default() -> Self {
        Self(DEFAULT_BUCKETS.to_vec())
    }
}

impl Buckets {
    /// Buckets of these row counts (sorted, deduplicated, zeros dropped).
    pub fn new(mut rows: Vec<usize>) -> Self {
        rows.retain(|&r| r > 0);
        rows.sort_unstable();
        rows.dedup();
        Self(rows)
    }

    /// Parses `NARSIL_CUDA_GRAPH_BUCKETS`'s value: comma-separated row
    /// counts; empty or `0` for none.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.is_empty() {
            return Ok(Self(Vec::new()));
        }
        text.split(',')
            .map(|part| {
                part.trim().parse::<usize>().map_err(|_| {
                    format!(
                        "{BUCKETS_ENV}: {part:?} is not a row count (comma-separated rows, e.g. 128,1024)"
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Self::new)
    }

    /// The buckets the environment asks for, else the default.
    pub fn from_env() -> Result<Self, String> {
        std::env::var(BUCKETS_ENV).map_or_else(|_| Ok(Self::default()), |text| Self::parse(&text))
    }

    /// The row counts.
    pub fn rows(&self) -> &[usize] {
        &self.0
    }

    /// The bucket a batch of `rows` rows runs in: the smallest holding
    /// them, or `None` (run eagerly) past the largest.
    pub fn choose(&self, rows: usize) -> Option<usize> {
        self.0.iter().copied().find(|&bucket| bucket >= rows)
    }
}

/// How a batch of `rows` rows runs in a graph of `bucket` rows: the real
/// rows are `0..rows` of the bucket's inputs and outputs, the rest padding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Padded {
    /// Real rows.
    pub rows: usize,
    /// The bucket's rows.
    pub bucket: usize,
}

impl Padded {
    /// Rows of padding.
    pub fn padding(&self) -> usize {
        self.bucket - self.rows
    }

    /// Copies `rows * width` real values into the first rows of a
    /// `bucket * width` input (the padding rows keep what they hold).
    pub fn fill<T: Copy>(&self, input: &mut [T], real: &[T], width: usize) {
        assert_eq!(real.len(), self.rows * width, "the real rows");
        assert_eq!(input.len(), self.bucket * width, "the bucket's rows");
        input[..real.len()].copy_from_slice(real);
    }

    /// The real rows' scores out of a bucket's: `outputs` outputs, each
    /// `bucket` scores (output after output, as the network returns them),
    /// become `outputs` runs of `rows` scores.
    pub fn slice_scores(&self, bucket_scores: &[f32], outputs: usize) -> Vec<f32> {
        assert_eq!(bucket_scores.len(), outputs * self.bucket, "a bucket's scores");
        (0..outputs)
            .flat_map(|o| bucket_scores[o * self.bucket..o * self.bucket + self.rows].iter().copied())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_runs_in_the_smallest_bucket_that_holds_it() {
        let buckets = Buckets::default();
        assert_eq!(buckets.choose(1), Some(128));
        assert_eq!(buckets.choose(128), Some(128));
        assert_eq!(buckets.choose(129), Some(256));
        assert_eq!(buckets.choose(1600), Some(2048));
        assert_eq!(buckets.choose(8192), Some(8192));
        assert_eq!(buckets.choose(8193), None, "past the largest: eager");
    }

    #[test]
    fn buckets_parse_sorted_and_deduplicated() {
        assert_eq!(Buckets::parse("1024, 128,128,0").unwrap().rows(), [128, 1024]);
        assert!(Buckets::parse("").unwrap().rows().is_empty());
        assert_eq!(Buckets::parse("0").unwrap().choose(1), None);
        let error = Buckets::parse("128,lots").unwrap_err();
        assert!(error.contains("lots") && error.contains(BUCKETS_ENV), "{error}");
    }

    #[test]
    fn padding_keeps_the_padding_rows_and_slices_each_outputs_real_scores() {
        let padded = Padded { rows: 2, bucket: 4 };
        assert_eq!(padded.padding(), 2);
        let mut input = vec![9.0f32; 4 * 3];
        padded.fill(&mut input, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 3);
        assert_eq!(input, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0]);
        // Two outputs of 4 scores each: the first 2 of each.
        let scores = padded.slice_scores(&[0.1, 0.2, -1.0, -1.0, 0.3, 0.4, -1.0, -1.0], 2);
        assert_eq!(scores, [0.1, 0.2, 0.3, 0.4]);
    }
}
