//! What a `narsil bench-forward` run found, and how it is printed: one JSON
//! object, or a table with one core's peaks above it.

use std::io::Write;

use serde::Serialize;

use super::roofline::{self, Roofline, AMX_PUBLISHED};

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

pub(super) fn write_report(out: &mut impl Write, report: &ForwardReport, json: bool) -> std::io::Result<()> {
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

    #[test]
    fn an_amx_rate_is_printed_as_published_not_measured() {
        use crate::forward_bench::vector_peak::{InstructionRate, VectorPeak};
        use roofline::{GemmRate, PrecisionPeak};
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
