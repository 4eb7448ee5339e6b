//! Running a phase of the load: issuing request numbers until the phase's
//! count or time is used up, sent by `--concurrency` callers (closed loop)
//! or on `--rate`'s schedule (open loop), every outcome recorded.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::client::{Client, Prebuilt};
use super::report::Recorder;
use super::LoadArgs;
use crate::proto::PredictResponse;

/// What a phase (warm-up or measured) sends: a count of requests, or
/// requests for a time.
#[derive(Debug, Clone, Copy)]
pub(super) struct Phase {
    pub(super) requests: Option<u64>,
    pub(super) duration: Option<Duration>,
}

/// Issues request numbers until the phase's count or time is used up.
struct Issuer {
    phase: Phase,
    issued: AtomicU64,
    start: Instant,
}

impl Issuer {
    fn next(&self) -> Option<u64> {
        if self.phase.duration.is_some_and(|d| self.start.elapsed() >= d) {
            return None;
        }
        let n = self.issued.fetch_add(1, Ordering::Relaxed);
        self.phase.requests.is_none_or(|limit| n < limit).then_some(n)
    }
}

/// Runs one phase, closed loop or open (`--rate`); its outcomes and length.
pub(super) async fn run_phase(
    args: &LoadArgs,
    clients: &[Client],
    pool: &Arc<Vec<Prebuilt>>,
    phase: Phase,
) -> (Recorder, Duration) {
    let issuer = Arc::new(Issuer { phase, issued: AtomicU64::new(0), start: Instant::now() });
    let recorder = match args.rate {
        None => closed_loop(args, clients, pool, &issuer).await,
        Some(rate) => open_loop(args, clients, pool, &issuer, rate).await,
    };
    (recorder, issuer.start.elapsed())
}

async fn closed_loop(
    args: &LoadArgs,
    clients: &[Client],
    pool: &Arc<Vec<Prebuilt>>,
    issuer: &Arc<Issuer>,
) -> Recorder {
    let callers: Vec<_> = (0..args.concurrency)
        .map(|caller| {
            let mut client = clients[caller % clients.len()].clone();
            let pool = Arc::clone(pool);
            let issuer = Arc::clone(issuer);
            let timeout_ms = args.timeout_ms;
            tokio::spawn(async move {
                let mut recorder = Recorder::default();
                while let Some(n) = issuer.next() {
                    let prebuilt = &pool[n as usize % pool.len()];
                    let start = Instant::now();
                    let result = client.call(&prebuilt.message, timeout_ms).await;
                    let latency = start.elapsed();
                    if let (Ok(response), Some(flat)) = (&result, &prebuilt.flat_scores) {
                        recorder.compare_with_flat(&response.scores, flat);
                    }
                    recorder.record(latency, result);
                }
                recorder
            })
        })
        .collect();
    let mut total = Recorder::default();
    for caller in callers {
        if let Ok(recorder) = caller.await {
            total.merge(recorder);
        }
    }
    total
}

async fn open_loop(
    args: &LoadArgs,
    clients: &[Client],
    pool: &Arc<Vec<Prebuilt>>,
    issuer: &Arc<Issuer>,
    rate: f64,
) -> Recorder {
    let interval = Duration::from_secs_f64(1.0 / rate);
    let in_flight = Arc::new(tokio::sync::Semaphore::new(args.max_in_flight));
    // Each call reports its latency and outcome; one recorder (one
    // histogram) collects them all.
    let (done_tx, mut done_rx) =
        tokio::sync::mpsc::unbounded_channel::<(Duration, usize, Result<PredictResponse, tonic::Status>)>();
    let mut overflow = 0u64;
    while let Some(n) = issuer.next() {
        let scheduled = issuer.start + interval.mul_f64(n as f64);
        tokio::time::sleep_until(scheduled.into()).await;
        let Ok(permit) = Arc::clone(&in_flight).try_acquire_owned() else {
            overflow += 1;
            continue;
        };
        let mut client = clients[n as usize % clients.len()].clone();
        let pool = Arc::clone(pool);
        let done = done_tx.clone();
        let timeout_ms = args.timeout_ms;
        tokio::spawn(async move {
            let index = n as usize % pool.len();
            let result = client.call(&pool[index].message, timeout_ms).await;
            let _ = done.send((scheduled.elapsed(), index, result));
            drop(permit);
        });
    }
    drop(done_tx);
    let mut total = Recorder::default();
    while let Some((latency, index, result)) = done_rx.recv().await {
        if let (Ok(response), Some(flat)) = (&result, &pool[index].flat_scores) {
            total.compare_with_flat(&response.scores, flat);
        }
        total.record(latency, result);
    }
    total.client_overflow = overflow;
    total
}
