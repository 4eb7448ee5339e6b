//! `narsil bench-forward`: a backend alone, in process, on one lane thread,
//! at fixed fused batch sizes. No gRPC, no queue: the "raw forward" samples/s
//! that serving efficiency is measured against (served samples/s divided by
//! raw samples/s at the same mean fused rows).
//!
//! With libtorch compiled in, it also measures this core's GEMM peak (FP32
//! and bf16, same libtorch, same intra-op threads) and reports each size's
//! samples/s as a fraction of the MLP-arithmetic limit: the GEMM peak in the
//! forward's precision divided by the model's MLP FLOPs per sample.
//!
//! For backends with a stage (split models) each size is timed again in its
//! two parts, the stage alone and the rest given its output (the dense
//! network alone): what `--stage-ahead` could hide at best.

use std::io::Write;
use std::time::{Duration, Instant};

use narsil_core::request::{IdPolicy, RequestLimits};
use narsil_core::{assemble, BackendFactory, BatchStage, KeyedBatch, ModelBackend, RequestSamples};
use rand::SeedableRng;
use serde::Serialize;

use crate::flags::backend::{BackendArgs, DensePrecision};
use narsil_embedding::{DistinctIds, IdCount};

use crate::load::ids::IdDistributions;
use crate::load::workload::{id_samplers, random_request};
use crate::protocols::convert::{model_info, request_samples};

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
    /// Seconds per precision for the GEMM peak (0 skips it).
    #[arg(long, default_value_t = 1.0)]
    pub peak_seconds: f64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Batches prepared per size (each from different pool requests).
const BATCHES_PER_SIZE: usize = 16;

/// One batch size's result.
#[derive(Debug, Clone, Serialize)]
pub struct ForwardResult {
    pub rows: usize,
    pub forwards: usize,
    pub samples_per_s: f64,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// samples/s over the MLP-arithmetic limit in the forward's precision.
    pub fraction_of_mlp_limit: Option<f64>,
    /// Mean ids per forward, over every sparse feature.
    pub ids_per_forward: f64,
    /// Ids per forward over distinct ids per table and forward: what
    /// fetching each distinct row once would save (1: nothing repeats).
    pub dedup_ratio: f64,
    /// Backends with a stage (split models): the forward timed again in
    /// its two parts, as lanes run them with `--stage-ahead`.
    pub staged: Option<StagedTimes>,
}

/// A forward's two parts, timed apart over the same batches.
#[derive(Debug, Clone, Serialize)]
pub struct StagedTimes {
    /// Mean time of the stage alone (a split model's dedup, fetch, pooling).
    pub stage_ms: f64,
    /// Mean time of the rest, given the stage's output (the dense network
    /// alone, its pooled input given).
    pub rest_ms: f64,
    /// Samples/s of the rest alone: the most a pipeline that hid the stage
    /// entirely could serve on this thread.
    pub rest_samples_per_s: f64,
}

/// This core's GEMM peak through libtorch, `[1600 x 512] x [512 x 512]`
/// linear layers, GFLOP/s.
#[derive(Debug, Clone, Serialize)]
pub struct GemmPeaks {
    pub fp32_gflops: f64,
    pub bf16_gflops: f64,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct ForwardReport {
    pub backend: String,
    pub model: Option<String>,
    pub device: String,
    pub intra_op_threads: usize,
    pub ids_per_feature: u32,
    pub id_distribution: String,
    pub dense_precision: String,
    pub load_ms: f64,
    /// Resident memory once the model is loaded and one lane created, MiB.
    pub rss_after_load_mib: Option<f64>,
    /// Peak resident memory of the whole run, MiB.
    pub peak_rss_mib: Option<f64>,
    pub gemm_peaks: Option<GemmPeaks>,
    pub mlp_flops_per_sample: Option<f64>,
    /// The GEMM peak in the forward's precision over the MLP FLOPs per
    /// sample: samples/s if nothing but the MLPs ran, at the peak.
    pub mlp_limit_samples_per_s: Option<f64>,
    pub results: Vec<ForwardResult>,
}

/// A `/proc/self/status` field in MiB (Linux only).
fn proc_status_mib(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// Runs the benchmark and prints its report.
pub fn run(args: ForwardBenchArgs) -> anyhow::Result<()> {
    if args.rows.is_empty() || args.rows.contains(&0) {
        anyhow::bail!("--rows needs positive batch sizes");
    }
    if args.request_samples == 0 || !(args.seconds.is_finite() && args.seconds > 0.0) {
        anyhow::bail!("--request-samples and --seconds must be positive");
    }
    if !(args.peak_seconds.is_finite() && args.peak_seconds >= 0.0) {
        anyhow::bail!("--peak-seconds must be a non-negative number");
    }
    let started = Instant::now();
    let factory = args.backend.build()?;
    // A lane thread, as in the server: per-thread settings apply to it.
    let report = std::thread::scope(|scope| {
        scope
            .spawn(|| measure(&args, factory.as_ref(), started))
            .join()
            .map_err(|_| anyhow::anyhow!("the benchmark lane panicked"))?
    })?;
    match print_report(&report, args.json) {
        // A closed pipe (`| head`) is not an error worth a panic.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}

fn print_report(report: &ForwardReport, json: bool) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    if json {
        writeln!(out, "{}", serde_json::to_string(report)?)?;
        return Ok(());
    }
    writeln!(
        out,
        "backend {} on {}, {} intra-op thread(s), {} id(s) per bag ({}); loaded in {:.0} ms; \
         RSS {:.0} MiB after load, peak {:.0} MiB",
        report.backend,
        report.device,
        report.intra_op_threads,
        report.ids_per_feature,
        report.id_distribution,
        report.load_ms,
        report.rss_after_load_mib.unwrap_or(f64::NAN),
        report.peak_rss_mib.unwrap_or(f64::NAN)
    )?;
    if let Some(peaks) = &report.gemm_peaks {
        writeln!(
            out,
            "GEMM peak (libtorch, 1600x512x512): FP32 {:.0} GFLOP/s, bf16 {:.0} GFLOP/s",
            peaks.fp32_gflops, peaks.bf16_gflops
        )?;
    }
    if let (Some(flops), Some(limit)) = (report.mlp_flops_per_sample, report.mlp_limit_samples_per_s) {
        writeln!(
            out,
            "dense precision {}: MLPs {:.2} MFLOP/sample, MLP-arithmetic limit {:.0} samples/s",
            report.dense_precision,
            flops / 1e6,
            limit
        )?;
    }
    writeln!(
        out,
        "{:>6} {:>9} {:>12} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>9} {:>9} {:>12}",
        "rows",
        "forwards",
        "samples/s",
        "mean ms",
        "p50 ms",
        "p99 ms",
        "of limit",
        "ids",
        "dedup",
        "stage ms",
        "rest ms",
        "rest smp/s"
    )?;
    for r in &report.results {
        let fraction = r.fraction_of_mlp_limit.map_or("-".into(), |f| format!("{f:.2}"));
        let staged = r.staged.as_ref().map_or(format!("{:>9} {:>9} {:>12}", "-", "-", "-"), |s| {
            format!("{:>9.3} {:>9.3} {:>12.0}", s.stage_ms, s.rest_ms, s.rest_samples_per_s)
        });
        writeln!(
            out,
            "{:>6} {:>9} {:>12.0} {:>9.3} {:>9.3} {:>9.3} {:>9} {:>9.0} {:>6.2}x {staged}",
            r.rows,
            r.forwards,
            r.samples_per_s,
            r.mean_ms,
            r.p50_ms,
            r.p99_ms,
            fraction,
            r.ids_per_forward,
            r.dedup_ratio
        )?;
    }
    Ok(())
}

fn measure(
    args: &ForwardBenchArgs,
    factory: &dyn BackendFactory,
    started: Instant,
) -> anyhow::Result<ForwardReport> {
    let schema = factory.schema().clone();
    let mut lane = factory.create_lane(0)?;
    let load_ms = started.elapsed().as_secs_f64() * 1e3;
    let rss_after_load_mib = proc_status_mib("VmRSS:");
    let gemm_peaks = gemm_peaks(args.peak_seconds);
    let mlp_flops_per_sample = factory.mlp_flops_per_sample();
    let mlp_limit_samples_per_s = match (&gemm_peaks, mlp_flops_per_sample) {
        (Some(peaks), Some(flops)) if flops > 0.0 => {
            let peak = match args.backend.dense_precision {
                DensePrecision::Fp32 => Some(peaks.fp32_gflops),
                DensePrecision::Bf16 => Some(peaks.bf16_gflops),
                // No INT8 GEMM peak is measured (issue 46, item 1): no limit.
                DensePrecision::Int8 => None,
            };
            peak.map(|peak| peak * 1e9 / flops)
        }
        _ => None,
    };
    let info = model_info(&schema, usize::MAX);
    let limits = RequestLimits { max_samples: usize::MAX, id_policy: IdPolicy::Reject };
    let ids = id_samplers(&info, &args.id_distribution)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut random = |samples: usize, index: usize| -> anyhow::Result<RequestSamples> {
        let mut request =
            request_samples(random_request(&info, samples, args.ids_per_feature, &ids, &mut rng, index));
        request.validate(&schema, limits)?;
        Ok(request)
    };
    let pool: Vec<RequestSamples> = (0..args.distinct_requests.max(1))
        .map(|i| random(args.request_samples, i))
        .collect::<anyhow::Result<_>>()?;
    let mut stage = lane.take_stage();
    let mut results = Vec::new();
    for &rows in &args.rows {
        // Whole requests from the pool, cycling, plus one smaller request for
        // a remainder; each batch starts further along the pool.
        let whole = rows / args.request_samples;
        let remainder = match rows % args.request_samples {
            0 => None,
            r => Some(random(r, pool.len())?),
        };
        let batches: Vec<_> = (0..BATCHES_PER_SIZE)
            .map(|k| {
                let requests =
                    (0..whole).map(|j| &pool[(k * whole + j) % pool.len()]).chain(remainder.as_ref());
                assemble(schema.num_dense, schema.num_sparse(), requests)
            })
            .collect();
        let mut distinct = DistinctIds::default();
        let mut ids = IdCount::default();
        for batch in &batches {
            for f in 0..batch.num_sparse {
                distinct.clear();
                distinct.add(batch.feature_ids(f));
                ids = ids + distinct.count();
            }
        }
        for batch in batches.iter().cycle().take(args.warmup) {
            lane.forward(batch)?;
        }
        let budget = Duration::from_secs_f64(args.seconds);
        let mut times = Vec::new();
        let begin = Instant::now();
        for batch in batches.iter().cycle() {
            let t = Instant::now();
            lane.forward(batch)?;
            times.push(t.elapsed());
            if begin.elapsed() >= budget {
                break;
            }
        }
        let total: Duration = times.iter().sum();
        let staged = match stage.as_mut() {
            Some(stage) => Some(time_staged(lane.as_mut(), stage.as_mut(), &batches, times.len(), rows)?),
            None => None,
        };
        times.sort();
        let pct = |p: f64| times[((times.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e3;
        let samples_per_s = (rows * times.len()) as f64 / total.as_secs_f64();
        results.push(ForwardResult {
            rows,
            forwards: times.len(),
            samples_per_s,
            fraction_of_mlp_limit: mlp_limit_samples_per_s.map(|limit| samples_per_s / limit),
            mean_ms: total.as_secs_f64() * 1e3 / times.len() as f64,
            p50_ms: pct(0.5),
            p99_ms: pct(0.99),
            ids_per_forward: ids.looked_up as f64 / batches.len() as f64,
            dedup_ratio: ids.ratio(),
            staged,
        });
    }
    Ok(ForwardReport {
        backend: schema.backend.clone(),
        model: args.backend.model.as_ref().map(|p| p.display().to_string()),
        device: schema.device.clone(),
        intra_op_threads: args.backend.intra_op_threads,
        ids_per_feature: args.ids_per_feature,
        id_distribution: args.id_distribution.to_string(),
        dense_precision: format!("{:?}", args.backend.dense_precision).to_lowercase(),
        load_ms,
        rss_after_load_mib,
        peak_rss_mib: proc_status_mib("VmHWM:"),
        gemm_peaks,
        mlp_flops_per_sample,
        mlp_limit_samples_per_s,
        results,
    })
}

/// Times `forwards` forwards over `batches` in their two parts: the stage,
/// then the rest given its output.
fn time_staged(
    lane: &mut dyn ModelBackend,
    stage: &mut dyn BatchStage,
    batches: &[KeyedBatch],
    forwards: usize,
    rows: usize,
) -> anyhow::Result<StagedTimes> {
    let (mut staging, mut rest) = (Duration::ZERO, Duration::ZERO);
    for batch in batches.iter().cycle().take(forwards) {
        let t = Instant::now();
        let staged = stage.stage(batch)?;
        let after_stage = Instant::now();
        lane.forward_staged(batch, staged)?;
        staging += after_stage - t;
        rest += after_stage.elapsed();
    }
    let per_forward = |total: Duration| total.as_secs_f64() * 1e3 / forwards as f64;
    Ok(StagedTimes {
        stage_ms: per_forward(staging),
        rest_ms: per_forward(rest),
        rest_samples_per_s: (rows * forwards) as f64 / rest.as_secs_f64(),
    })
}

/// The GEMM peaks on the calling (lane) thread; `None` without libtorch or
/// with `seconds` 0.
#[cfg(feature = "torch")]
fn gemm_peaks(seconds: f64) -> Option<GemmPeaks> {
    use narsil_torch::roofline::gemm_peak_gflops;
    use narsil_torch::DensePrecision;
    if seconds <= 0.0 {
        return None;
    }
    let duration = Duration::from_secs_f64(seconds);
    let shape = [1600, 512, 512];
    Some(GemmPeaks {
        fp32_gflops: gemm_peak_gflops(DensePrecision::Fp32, shape, duration),
        bf16_gflops: gemm_peak_gflops(DensePrecision::Bf16, shape, duration),
    })
}

#[cfg(not(feature = "torch"))]
fn gemm_peaks(_seconds: f64) -> Option<GemmPeaks> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ForwardBenchArgs,
    }

    #[test]
    fn measures_every_size_with_full_batches_on_the_mock() {
        let cli = Cli::parse_from([
            "bench",
            "--backend",
            "mock",
            "--mock-latency-ms",
            "0",
            "--mock-latency-per-row-us",
            "10",
            "--rows",
            "1,250",
            "--seconds",
            "0.05",
            "--warmup",
            "1",
            "--peak-seconds",
            "0",
            "--ids-per-feature",
            "2",
        ]);
        let factory = cli.args.backend.build().unwrap();
        let report = measure(&cli.args, factory.as_ref(), Instant::now()).unwrap();
        assert_eq!(report.backend, "mock");
        let rows: Vec<usize> = report.results.iter().map(|r| r.rows).collect();
        assert_eq!(rows, [1, 250]);
        let big = &report.results[1];
        assert!(big.forwards >= 1);
        // 10 us per row: a 250-row forward takes at least 2.5 ms.
        assert!(big.mean_ms >= 2.5, "{big:?}");
        assert!(big.samples_per_s <= 250.0 / 2.5e-3 * 1.001, "{big:?}");
        assert!(big.staged.is_none(), "the mock has no stage");
    }
}
