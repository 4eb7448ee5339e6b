//! A step's progress on stderr, for `narsil tables map`'s long steps
//! (counting and sorting the vocabulary, merging, hashing): the lines the
//! library's build ([`narsil_embedding::id_map::build::Progress`]) reports,
//! printed.

use std::io::Write;
use std::time::{Duration, Instant};

/// How often progress is printed.
const PROGRESS_EVERY: Duration = Duration::from_millis(500);

/// A step's progress on stderr: a line rewritten at most every
/// [`PROGRESS_EVERY`], then its last word.
pub(super) struct Progress {
    label: String,
    started: Instant,
    printed: Instant,
    ticks: u32,
}

impl Progress {
    pub(super) fn new(label: String) -> Self {
        let now = Instant::now();
        Self { label, started: now, printed: now, ticks: 0 }
    }

    /// Prints `what()` if the last print is old enough (looked at every
    /// 4096 calls: the clock is not read per id).
    pub(super) fn tick(&mut self, what: impl FnOnce() -> String) {
        self.ticks = self.ticks.wrapping_add(1);
        if self.ticks.is_multiple_of(4096) && self.printed.elapsed() >= PROGRESS_EVERY {
            eprint!("\r{}: {}", self.label, what());
            let _ = std::io::stderr().flush();
            self.printed = Instant::now();
        }
    }

    pub(super) fn done(self, what: String) {
        eprintln!("\r{}: {what} in {:.1} s", self.label, self.started.elapsed().as_secs_f64());
    }
}

/// The build's steps, one [`Progress`] at a time, on stderr.
#[derive(Default)]
pub(super) struct Stderr(Option<Progress>);

impl narsil_embedding::id_map::build::Progress for Stderr {
    fn start(&mut self, label: String) {
        self.0 = Some(Progress::new(label));
    }

    fn tick(&mut self, what: &dyn Fn() -> String) {
        if let Some(progress) = &mut self.0 {
            progress.tick(what);
        }
    }

    fn done(&mut self, what: String) {
        if let Some(progress) = self.0.take() {
            progress.done(what);
        }
    }

    fn note(&mut self, line: String) {
        eprintln!("{line}");
    }
}
