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
//!
//! This file is the entry ([`run`]); the others hold one job each:
//!
//! * `args`: the flags and their check.
//! * `measure`: the timing on the lane thread, into a [`ForwardReport`].
//! * `report`: what a run found, and how it is printed (table or JSON).
//! * `roofline` and `vector_peak`: one core's peaks and the limit.

mod args;
mod measure;
mod report;
mod roofline;
mod vector_peak;

use std::time::Instant;

pub use args::ForwardBenchArgs;
pub use report::{ForwardReport, ForwardResult, StagedTimes};

/// Runs the benchmark and prints its report.
pub fn run(args: ForwardBenchArgs) -> anyhow::Result<()> {
    args.check()?;
    let started = Instant::now();
    let factory = args.backend.build()?;
    // A lane thread, as in the server: per-thread settings apply to it.
    let report = std::thread::scope(|scope| {
        scope
            .spawn(|| measure::measure(&args, factory.as_ref(), started))
            .join()
            .map_err(|_| anyhow::anyhow!("the benchmark lane panicked"))?
    })?;
    match report::write_report(&mut std::io::stdout().lock(), &report, args.json) {
        // A closed pipe (`| head`) is not an error worth a panic.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => Ok(other?),
    }
}
