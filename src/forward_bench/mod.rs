//! `narsil bench-forward`: a backend alone, in process, on one lane thread,
//! at fixed fused batch sizes. No gRPC, no queue: the "raw forward" samples/s
//! that serving efficiency is measured against (served samples/s divided by
//! raw samples/s at the same mean fused rows).
//!
//! It also measures one core's peak in every precision ([`roofline`]: the
//! multiply-add instructions' own peak, the best of large libtorch GEMMs on
//! one thread, AMX's published rate) and reports each size's samples/s as
//! a fraction of the limit: that peak in the forward's precision times the
//! cores the forward uses (its intra-op threads, at most the cores here),
//! over the dense network's FLOPs per sample. No forward can exceed 1.0.
//! A forward on a GPU has no fraction (n/a, and the report says why).
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

use crate::flags::backend::{BackendArgs, BackendKind, DensePrecision};
use narsil_embedding::{DistinctIds, IdCount};
use roofline::{forward_limit, Limit, Roofline, AMX_PUBLISHED};

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
    /// samples/s over the limit in the forward's precision (the peak of
    /// the cores it uses over the dense FLOPs per sample); `None` where
    /// there is no limit (`no_limit_because` says why).
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
    /// distance from the peak of the cores it uses.
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
    /// One core's peaks (`--peak-seconds 0`, or a forward off the CPU:
    /// none).
    pub roofline: Option<Roofline>,
    /// The dense network's FLOPs per sample, as its export counted them.
    pub dense_flops_per_sample: Option<f64>,
    /// One core's peak in the forward's precision times `limit_cores`, over
    /// the dense FLOPs per sample: samples/s if nothing but the dense
    /// arithmetic ran, at the peak.
    pub limit_samples_per_s: Option<f64>,
    /// The cores the limit counts: the forward's intra-op threads (1 for
    /// burn and the mock), at most the cores this process may run on.
    pub limit_cores: Option<usize>,
    /// Why there is no limit (and no fraction of it), when there is none.
    pub no_limit_because: Option<String>,
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
    match write_report(&mut std::io::stdout().lock(), &report, args.json) {
        // A closed pipe (`| head`) is not an error worth a panic.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}

fn write_report(out: &mut impl Write, report: &ForwardReport, json: bool) -> std::io::Result<()> {
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
        print_roofline(out, roofline)?;
    }
    let flops = report
        .dense_flops_per_sample
        .map_or(String::new(), |flops| format!("dense network {:.2} MFLOP/sample; ", flops / 1e6));
    match (report.limit_samples_per_s, report.limit_cores, &report.no_limit_because) {
        (Some(limit), Some(cores), _) => writeln!(
            out,
            "{flops}limit at {cores} core(s) x one core's {} peak: {limit:.0} samples/s",
            report.dense_precision,
        )?,
        (_, _, why) => {
            writeln!(out, "{flops}fraction of the limit n/a: {}", why.as_deref().unwrap_or("no limit"))?
        }
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
        let fraction = |f: Option<f64>| f.map_or("n/a".into(), |f| format!("{f:.2}"));
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
    // This CPU's peaks bound a forward on this CPU only.
    let on_cpu = args.backend.device == "cpu";
    let roofline =
        (args.peak_seconds > 0.0 && on_cpu).then(|| Roofline::measure(args.peak_seconds, libtorch_gemm));
    let dense_flops_per_sample = factory.dense_flops_per_sample().filter(|flops| *flops > 0.0);
    let limit = forward_limit(
        &args.backend.device,
        args.backend.dense_precision,
        roofline.as_ref().and_then(|r| r.limit_gops(args.backend.dense_precision)),
        dense_flops_per_sample,
        arithmetic_threads(&args.backend),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    let limit_samples_per_s = limit.as_ref().ok().map(|l| l.samples_per_s);
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
                    rest_fraction_of_limit: limit
                        .as_ref()
                        .ok()
                        .map(|l| l.fraction(staged.rest_samples_per_s)),
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
            fraction_of_limit: limit.as_ref().ok().map(|l| l.fraction(samples_per_s)),
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
        limit_cores: limit.as_ref().ok().map(|l: &Limit| l.cores),
        no_limit_because: limit.err(),
        results,
    })
}

/// The threads a forward's arithmetic runs on: torch's intra-op threads
/// (`bench-forward` never raises them); burn lanes and the mock use one.
fn arithmetic_threads(backend: &BackendArgs) -> usize {
    match backend.kind() {
        BackendKind::Torch => backend.intra_op_threads.max(1),
        _ => 1,
    }
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

/// One GEMM's GFLOP/s through libtorch on one intra-op thread of the
/// calling (lane) thread: one core's rate. `None` without libtorch, and for
/// INT8 (no aten op tch exposes).
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

/// The roofline as a few lines: each precision's instruction peak (every
/// form timed), best GEMM, AMX's published rate (labelled as such) and
/// limit, per core.
fn print_roofline(out: &mut impl Write, roofline: &Roofline) -> std::io::Result<()> {
    let clock = roofline.clock_ghz.map_or("not measured".into(), |ghz| format!("{ghz:.2} GHz"));
    writeln!(out, "one core's peaks (clock while busy: {clock}):")?;
    for peak in &roofline.peaks {
        writeln!(out, "  {}", roofline_line(peak))?;
    }
    Ok(())
}

/// One precision's line of [`print_roofline`].
fn roofline_line(peak: &roofline::PrecisionPeak) -> String {
    let vector = peak.vector.as_ref().map_or("no multiply-add instruction".into(), |v| {
        let per_cycle = peak.vector_ops_per_cycle.map_or(String::new(), |c| format!(", {c:.0}/cycle"));
        let others: Vec<String> = v
            .timed
            .iter()
            .filter(|t| t.instruction != v.instruction || t.gops != v.gops)
            .map(|t| format!("{} {:.0}", t.instruction, t.gops))
            .collect();
        let others =
            if others.is_empty() { String::new() } else { format!(" (also timed: {})", others.join(", ")) };
        format!("{} {:.0} GOP/s{per_cycle}{others}", v.instruction, v.gops)
    });
    let gemm = peak.best_gemm.as_ref().map_or("-".into(), |g| {
        format!("{:.0} GFLOP/s ({}x{}x{}, 1 thread)", g.gflops, g.shape[0], g.shape[1], g.shape[2])
    });
    let amx =
        peak.amx_published_gops.map_or(String::new(), |g| format!("; AMX {g:.0} GOP/s ({AMX_PUBLISHED})"));
    let limit = match (peak.limit_gops, peak.amx_published_gops) {
        (None, _) => "none".into(),
        (Some(g), Some(amx)) if g == amx => format!("{g:.0} GOP/s (AMX's rate, {AMX_PUBLISHED})"),
        (Some(g), _) => format!("{g:.0} GOP/s"),
    };
    format!("{:<5} {vector}; best libtorch GEMM {gemm}{amx}; limit {limit}", peak.precision)
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
        assert_eq!(big.fraction_of_limit, None, "no peak measured");
        assert!(report.no_limit_because.unwrap().contains("no dense FLOPs"), "the mock states none");
    }

    /// The mock, stating `flops` dense FLOPs per sample as an export does.
    struct WithFlops {
        mock: std::sync::Arc<dyn BackendFactory>,
        flops: f64,
    }

    impl BackendFactory for WithFlops {
        fn schema(&self) -> &narsil_core::ModelSchema {
            self.mock.schema()
        }
        fn create_lane(&self, lane: usize) -> Result<Box<dyn ModelBackend>, narsil_core::BackendError> {
            self.mock.create_lane(lane)
        }
        fn dense_flops_per_sample(&self) -> Option<f64> {
            Some(self.flops)
        }
    }

    fn mock_args(extra: &[&str]) -> ForwardBenchArgs {
        let mut argv = vec![
            "bench",
            "--backend",
            "mock",
            "--mock-latency-ms",
            "0",
            "--mock-latency-per-row-us",
            "10",
            "--rows",
            "100",
            "--seconds",
            "0.03",
            "--warmup",
            "1",
        ];
        argv.extend_from_slice(extra);
        Cli::parse_from(argv).args
    }

    #[test]
    fn a_measured_peak_gives_each_size_its_fraction_of_the_limit() {
        let args = mock_args(&["--peak-seconds", "0.02", "--dense-precision", "fp32"]);
        // 1 kFLOP/sample: a GOP/s is 10^6 samples/s, so that the fraction
        // stays below 1 even with a peak measured slowly (in parallel with
        // other tests on few cores).
        let factory = WithFlops { mock: args.backend.build().unwrap(), flops: 1e3 };
        let report = measure(&args, &factory, Instant::now()).unwrap();
        let roofline = report.roofline.as_ref().expect("measured");
        assert_eq!(roofline.peaks.len(), 3);
        let no_fp32_peak = roofline.limit_gops(DensePrecision::Fp32).is_none();
        if no_fp32_peak {
            // No FMA and no libtorch: nothing to hold a forward against.
            assert!(report.no_limit_because.unwrap().contains("fp32 peak"));
            return;
        }
        // The mock runs on one thread: one core's peak, over 1 kFLOP.
        let core = roofline.limit_gops(DensePrecision::Fp32).unwrap();
        assert_eq!(report.limit_cores, Some(1));
        let limit = report.limit_samples_per_s.expect("a limit");
        assert!((limit - core * 1e6).abs() <= limit * 1e-12, "{limit} vs {core} GOP/s");
        let result = &report.results[0];
        let fraction = result.fraction_of_limit.expect("a fraction");
        assert!((fraction - result.samples_per_s / limit).abs() <= fraction * 1e-12);
        // 10 us per row is 100,000 samples/s at most: below any core's peak
        // of 0.1 GOP/s or more over 1 kFLOP.
        assert!(fraction > 0.0 && fraction < 1.0, "{fraction}");
        let mut text = Vec::new();
        write_report(&mut text, &report, false).unwrap();
        let text = String::from_utf8(text).unwrap();
        assert!(text.contains("limit at 1 core(s) x one core's fp32 peak"), "{text}");
        assert!(text.contains(&format!("{fraction:.2}")), "{text}");
    }

    #[test]
    fn a_forward_on_a_gpu_has_no_fraction_of_a_cpu_peak_and_says_why() {
        // The mock runs here; the flags say the forward runs on a GPU.
        let factory = WithFlops { mock: mock_args(&[]).backend.build().unwrap(), flops: 1e6 };
        let args = mock_args(&["--peak-seconds", "0.02", "--device", "cuda"]);
        let report = measure(&args, &factory, Instant::now()).unwrap();
        assert!(report.roofline.is_none(), "this CPU's peaks are not measured for a GPU forward");
        assert_eq!((report.limit_samples_per_s, report.limit_cores), (None, None));
        assert!(report.results.iter().all(|r| r.fraction_of_limit.is_none()));
        let why = report.no_limit_because.clone().unwrap();
        assert!(why.contains("cuda"), "{why}");
        let mut text = Vec::new();
        write_report(&mut text, &report, false).unwrap();
        let text = String::from_utf8(text).unwrap();
        assert!(text.contains(&format!("fraction of the limit n/a: {why}")), "{text}");
    }

    #[test]
    fn an_amx_rate_is_printed_as_published_not_measured() {
        use roofline::{GemmRate, PrecisionPeak};
        use vector_peak::{InstructionRate, VectorPeak};
        let rate = |instruction, gops| InstructionRate { instruction, gops };
        let peak = PrecisionPeak {
            precision: "bf16".into(),
            vector: Some(VectorPeak {
                instruction: "vdpbf16ps zmm",
                ops_per_instruction: 64,
                gops: 200.0,
                timed: vec![rate("vdpbf16ps zmm", 200.0), rate("vdpbf16ps ymm", 150.0)],
            }),
            vector_ops_per_cycle: Some(64.0),
            best_gemm: Some(GemmRate { shape: [2048, 2048, 2048], gflops: 900.0 }),
            amx_published_gops: Some(3200.0),
            limit_gops: Some(3200.0),
        };
        let line = roofline_line(&peak);
        assert!(line.contains("AMX 3200 GOP/s (published, not measured)"), "{line}");
        assert!(line.contains("limit 3200 GOP/s (AMX's rate, published, not measured)"), "{line}");
        assert!(
            line.contains("vdpbf16ps zmm 200 GOP/s") && line.contains("also timed: vdpbf16ps ymm 150"),
            "{line}"
        );
        let measured = PrecisionPeak { amx_published_gops: None, limit_gops: Some(900.0), ..peak };
        let line = roofline_line(&measured);
        assert!(!line.contains("AMX") && line.ends_with("limit 900 GOP/s"), "{line}");
    }
}
