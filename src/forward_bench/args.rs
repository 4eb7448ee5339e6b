//! `narsil bench-forward`'s flags, and the one check of them before
//! anything is built.

use crate::flags::backend::BackendArgs;
use crate::load::ids::IdDistributions;

/// `narsil bench-forward` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct ForwardBenchArgs {
    /// The model and where it runs.
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Fused batch sizes (rows per forward) to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "100,400,1600,3200")]
    pub rows: Vec<usize>,
    /// Samples per request the fused batch is assembled from (as served).
    #[arg(long, default_value_t = 100)]
    pub request_samples: usize,
    /// Ids per bag: 1 is one-hot; above 1, bag sizes are uniform in [0, 2n-1].
    #[arg(long, default_value_t = 1)]
    pub ids_per_feature: u32,
    /// Measuring time per batch size, seconds.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Untimed forwards per batch size before measuring.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Ids sent: `uniform` or `zipf:ALPHA`, for every feature or one per
    /// feature (as `narsil load --id-distribution`).
    #[arg(long, default_value = "uniform")]
    pub id_distribution: IdDistributions,
    /// Distinct random requests the batches are fused from (as `narsil load`
    /// sends: its default is also 64). Fewer would keep the embedding rows
    /// touched warm in cache and flatter the backend.
    #[arg(long, default_value_t = 64)]
    pub distinct_requests: usize,
    /// Seconds per precision for this core's peaks (0 skips them).
    #[arg(long, default_value_t = 1.0)]
    pub peak_seconds: f64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

impl ForwardBenchArgs {
    /// Refuses sizes, counts and durations no run can use.
    pub fn check(&self) -> anyhow::Result<()> {
        if self.rows.is_empty() || self.rows.contains(&0) {
            anyhow::bail!("--rows needs positive batch sizes");
        }
        if self.request_samples == 0 || !(self.seconds.is_finite() && self.seconds > 0.0) {
            anyhow::bail!("--request-samples and --seconds must be positive");
        }
        if !(self.peak_seconds.is_finite() && self.peak_seconds >= 0.0) {
            anyhow::bail!("--peak-seconds must be a non-negative number");
        }
        Ok(())
    }
}
