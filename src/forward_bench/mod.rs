//! `narsil bench-forward`: a backend alone, in process, on one lane thread,
//! at fixed fused batch sizes. No gRPC, no queue: the "raw forward" samples/s
//! that serving efficiency is measured against (served samples/s divided by
//! raw samples/s at the same mean fused rows).
//!
//! It also measures this core's peak in every precision ([`roofline`]:
//! the multiply-add instructions' own peak, the best of large libtorch
//! GEMMs, AMX's published rate) and reports each size's samples/s as a
//! fraction of the limit: that peak in the forward's precision over the
//! dense network's FLOPs per sample. No forward can exceed 1.0.
//!
//! For backends with a stage (split models) each size is timed again in its
//! two parts, the stage alone and the rest given its output (the dense
//! network alone): what `--stage-ahead` could hide at best, the stage's
//! share of the forward, and the dense network's own fraction of the limit.

mod roofline;
mod vector_peak;

use std::io::Write;
use std::time::{Duration, Instant};

use narsil_core::request::{IdPolicy, RequestLimits};
use narsil_core::{assemble, BackendFactory, BatchStage, KeyedBatch, ModelBackend, RequestSamples};
use rand::SeedableRng;
use serde::Serialize;

use crate::flags::backend::{BackendArgs, DensePrecision};
use narsil_embedding::{DistinctIds, IdCount};
use roofline::Roofline;

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
    /// Seconds per precision for this core's peaks (0 skips them).
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
    /// samples/s over the limit in the forward's precision (this core's
    /// peak over the dense FLOPs per sample).
    pub fraction_of_limit: Option<f64>,
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
    /// The rest's samples/s over the limit: the dense network's own
    /// distance from this core's peak.
    pub rest_fraction_of_limit: Option<f64>,
    /// The stage's share of the two parts' time.
    pub stage_share: f64,
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
    /// This core's peaks (`--peak-seconds 0`: none).
    pub roofline: Option<Roofline>,
    /// The dense network's FLOPs per sample, as its export counted them.
    pub dense_flops_per_sample: Option<f64>,
    /// The peak in the forward's precision over the dense FLOPs per
    /// sample: samples/s if nothing but the dense arithmetic ran, at the
    /// peak.
    pub limit_samples_per_s: Option<f64>,
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
    if let Some(roofline) = &report.roofline {
        print_roofline(&mut out, roofline)?;
    }
    match (report.dense_flops_per_sample, report.limit_samples_per_s) {
        (Some(flops), Some(limit)) => writeln!(
            out,
            "dense network {:.2} MFLOP/sample; limit at the {} peak {:.0} samples/s",
            flops / 1e6,
            report.dense_precision,
            limit
        )?,
        (None, _) => writeln!(
            out,
            "the model states no dense FLOPs per sample (exports since the roofline do): no fraction of the limit"
        )?,
        (Some(flops), None) => writeln!(
            out,
            "dense network {:.2} MFLOP/sample; no {} peak measured: no fraction of the limit",
            flops / 1e6,
            report.dense_precision
        )?,
    }
    writeln!(
        out,
        "{:>6} {:>9} {:>12} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>9} {:>9} {:>12} {:>11} {:>13}",
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
        "rest smp/s",
        "stage share",
        "rest of limit"
    )?;
    for r in &report.results {
        let fraction = |f: Option<f64>| f.map_or("-".into(), |f| format!("{f:.2}"));
        let staged = r.staged.as_ref().map_or(
            format!("{:>9} {:>9} {:>12} {:>11} {:>13}", "-", "-", "-", "-", "-"),
            |s| {
                format!(
                    "{:>9.3} {:>9.3} {:>12.0} {:>10.0}% {:>13}",
                    s.stage_ms,
                    s.rest_ms,
                    s.rest_samples_per_s,
                    s.stage_share * 100.0,
                    fraction(s.rest_fraction_of_limit)
                )
            },
        );
        writeln!(
            out,
            "{:>6} {:>9} {:>12.0} {:>9.3} {:>9.3} {:>9.3} {:>9} {:>9.0} {:>6.2}x {staged}",
            r.rows,
            r.forwards,
            r.samples_per_s,
            r.mean_ms,
            r.p50_ms,
            r.p99_ms,
            fraction(r.fraction_of_limit),
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
    let roofline = (args.peak_seconds > 0.0).then(|| Roofline::measure(args.peak_seconds, libtorch_gemm));
    let dense_flops_per_sample = factory.dense_flops_per_sample().filter(|flops| *flops > 0.0);
    let limit_samples_per_s = roofline
        .as_ref()
        .and_then(|r| r.limit_gops(args.backend.dense_precision))
        .zip(dense_flops_per_sample)
        .map(|(gops, flops)| gops * 1e9 / flops);
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
            Some(stage) => Some(time_staged(lane.as_mut(), stage.as_mut(), &batches, times.len(), rows)?)
                .map(|staged| StagedTimes {
                    rest_fraction_of_limit: limit_samples_per_s
                        .map(|limit| staged.rest_samples_per_s / limit),
                    ..staged
                }),
            None => None,
        };
        times.sort();
        let pct = |p: f64| times[((times.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e3;
        let samples_per_s = (rows * times.len()) as f64 / total.as_secs_f64();
        results.push(ForwardResult {
            rows,
            forwards: times.len(),
            samples_per_s,
            fraction_of_limit: limit_samples_per_s.map(|limit| samples_per_s / limit),
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
        dense_precision: roofline::precision_name(args.backend.dense_precision).into(),
        load_ms,
        rss_after_load_mib,
        peak_rss_mib: proc_status_mib("VmHWM:"),
        roofline,
        dense_flops_per_sample,
        limit_samples_per_s,
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
        rest_fraction_of_limit: None,
        stage_share: staging.as_secs_f64() / (staging + rest).as_secs_f64(),
    })
}

/// One GEMM's GFLOP/s through libtorch on the calling (lane) thread;
/// `None` without libtorch, and for INT8 (no aten op tch exposes).
#[cfg(feature = "torch")]
fn libtorch_gemm(precision: DensePrecision, shape: [i64; 3], duration: Duration) -> Option<f64> {
    use narsil_torch::roofline::gemm_peak_gflops;
    use narsil_torch::DensePrecision as TorchPrecision;
    let precision = match precision {
        DensePrecision::Fp32 => TorchPrecision::Fp32,
        DensePrecision::Bf16 => TorchPrecision::Bf16,
        DensePrecision::Int8 => return None,
    };
    Some(gemm_peak_gflops(precision, shape, duration))
}

#[cfg(not(feature = "torch"))]
fn libtorch_gemm(_precision: DensePrecision, _shape: [i64; 3], _duration: Duration) -> Option<f64> {
    None
}

/// The roofline as a few lines: each precision's instruction peak, best
/// GEMM and limit.
fn print_roofline(out: &mut impl Write, roofline: &Roofline) -> std::io::Result<()> {
    let clock = roofline.clock_ghz.map_or("not measured".into(), |ghz| format!("{ghz:.2} GHz"));
    writeln!(out, "this core's peaks (clock while busy: {clock}):")?;
    for peak in &roofline.peaks {
        let vector = peak.vector.as_ref().map_or("no multiply-add instruction".into(), |v| {
            let per_cycle = peak.vector_ops_per_cycle.map_or(String::new(), |c| format!(", {c:.0}/cycle"));
            format!("{} {:.0} GOP/s{per_cycle}", v.instruction, v.gops)
        });
        let gemm = peak.best_gemm.as_ref().map_or("-".into(), |g| {
            format!("{:.0} GFLOP/s ({}x{}x{})", g.gflops, g.shape[0], g.shape[1], g.shape[2])
        });
        let amx = peak.amx_published_gops.map_or(String::new(), |g| format!("; AMX published {g:.0} GOP/s"));
        let limit = peak.limit_gops.map_or("none".into(), |g| format!("{g:.0} GOP/s"));
        writeln!(out, "  {:<5} {vector}; best libtorch GEMM {gemm}{amx}; limit {limit}", peak.precision)?;
    }
    Ok(())
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
