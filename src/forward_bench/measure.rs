//! The timing itself, on the lane thread: fused batches of each size built
//! from random requests, forwards timed (and, with a stage, its two parts
//! timed apart), held against the limit; the result is a [`ForwardReport`].

use std::time::{Duration, Instant};

use narsil_core::request::{IdPolicy, RequestLimits};
use narsil_core::{assemble, BackendFactory, BatchStage, KeyedBatch, ModelBackend, RequestSamples};
use narsil_embedding::{DistinctIds, IdCount};
use rand::SeedableRng;

use super::args::ForwardBenchArgs;
use super::report::{ForwardReport, ForwardResult, StagedTimes};
use super::roofline::{self, forward_limit, Limit, Roofline};
use crate::flags::backend::{BackendArgs, BackendKind, DensePrecision};
use crate::load::workload::{id_samplers, random_request};
use crate::protocols::convert::{model_info, request_samples};

/// Batches prepared per size (each from different pool requests).
const BATCHES_PER_SIZE: usize = 16;

/// A `/proc/self/status` field in MiB (Linux only).
fn proc_status_mib(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

pub(super) fn measure(
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
    let limits = RequestLimits::new(usize::MAX, IdPolicy::Reject);
    let ids = id_samplers(&info, &args.id_distribution)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let times = crate::load::raw::RawTimes::default();
    let mut random = |samples: usize, index: usize| -> anyhow::Result<RequestSamples> {
        let mut request = request_samples(random_request(
            &info,
            (samples, args.ids_per_feature),
            &ids,
            &times,
            &mut rng,
            index,
        ));
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
    use narsil_torch::gemm_peak::gemm_peak_gflops;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forward_bench::report::write_report;
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
}
