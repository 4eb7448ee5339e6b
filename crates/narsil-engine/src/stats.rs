//! What the engine records about its own work: counters, histograms and
//! gauges, readable in process ([`StatsSnapshot`]) and as Prometheus text
//! ([`Stats::encode`]), through `prometheus-client`.
//!
//! Per request: end-to-end time of answered requests, queue time (admission
//! to a lane, or its stage thread, taking the request's batch) and the
//! outcome. Per forward: compute time, fused rows and fused requests, and
//! whether it failed. Per batch whose every caller left first (abandoned):
//! that alone (no forward, rows or compute time), and whether its time went
//! into the forward rather than the queue (stalled). Per staged
//! batch (`--stage-ahead`): its wait at the hand-over to its lane. Gauges:
//! queued requests and rows, busy lanes.

use std::fmt::Write;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

/// How a request ended, as counted in `narsil_requests_total{outcome}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Answered with scores.
    Ok,
    /// Refused by admission (RESOURCE_EXHAUSTED).
    Rejected,
    /// Its deadline or queue timeout passed (DEADLINE_EXCEEDED).
    Deadline,
    /// Its caller went away before the answer.
    Cancelled,
    /// Failed validation (INVALID_ARGUMENT).
    Invalid,
    /// Its forward failed (INTERNAL).
    BackendError,
    /// Still loading or shutting down (UNAVAILABLE).
    Unavailable,
}

impl Outcome {
    /// Every outcome, in exposition order.
    pub const ALL: [Outcome; 7] = [
        Outcome::Ok,
        Outcome::Rejected,
        Outcome::Deadline,
        Outcome::Cancelled,
        Outcome::Invalid,
        Outcome::BackendError,
        Outcome::Unavailable,
    ];

    /// The label value.
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Rejected => "rejected",
            Outcome::Deadline => "deadline",
            Outcome::Cancelled => "cancelled",
            Outcome::Invalid => "invalid",
            Outcome::BackendError => "backend_error",
            Outcome::Unavailable => "unavailable",
        }
    }
}

impl EncodeLabelValue for Outcome {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(self.name())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: Outcome,
}

/// Live metrics, shared by the request path, the collector and the lanes.
#[derive(Debug)]
pub struct Stats {
    pub(crate) forwards: Counter,
    pub(crate) rows_computed: Counter,
    pub(crate) requests_computed: Counter,
    pub(crate) requests_abandoned: Counter,
    pub(crate) backend_errors: Counter,
    pub(crate) batches_abandoned: Counter,
    pub(crate) batches_stalled: Counter,
    pub(crate) batches_staged: Counter,
    pub(crate) probe_forwards: Counter,
    pub(crate) positions_truncated: Counter,
    pub(crate) busy_lanes: Gauge,
    pub(crate) backend_healthy: Gauge,
    pub(crate) queue_seconds: Histogram,
    pub(crate) stage_handover_seconds: Histogram,
    pub(crate) compute_seconds: Histogram,
    pub(crate) request_seconds: Histogram,
    pub(crate) batch_rows: Histogram,
    pub(crate) batch_requests: Histogram,
    outcomes: Family<OutcomeLabel, Counter>,
    /// The family's counters, indexed like [`Outcome::ALL`], so counting
    /// takes no lock.
    by_outcome: [Counter; Outcome::ALL.len()],
    queued_requests: Gauge,
    queued_rows: Gauge,
    queued_bytes: Gauge,
    /// What a sequence model's requests in flight hold for their working
    /// sets ([`crate::working_sets`]).
    pub(crate) working_set_bytes: Gauge,
    registry: Registry,
}

/// A copy of the counters at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StatsSnapshot {
    /// Forward passes run (warm-up excluded), failed ones included,
    /// abandoned batches not.
    pub forwards: u64,
    /// Rows those forwards computed.
    pub rows_computed: u64,
    /// Requests (or parts of split requests) those forwards computed.
    pub requests_computed: u64,
    /// Queued requests removed before their forward: cancelled or expired.
    pub requests_abandoned: u64,
    /// Forwards that failed or panicked (abandoned batches excluded).
    pub backend_errors: u64,
    /// Batches whose every caller stopped waiting before their forward
    /// could finish ([`narsil_core::BackendError::Abandoned`]): their
    /// requests got DEADLINE_EXCEEDED; not a failed forward.
    pub batches_abandoned: u64,
    /// Abandoned batches whose time went into their forward, not the queue
    /// (a table store too slow to deliver): each counts toward the
    /// backend's health as a failed forward does.
    pub batches_stalled: u64,
    /// Batches a stage thread staged ahead and handed to its lane
    /// (`--stage-ahead`), whatever their outcome.
    pub batches_staged: u64,
    /// Lanes running a forward right now.
    pub busy_lanes: usize,
    /// Requests admitted and not yet started.
    pub queued_requests: usize,
}

fn seconds_buckets() -> Histogram {
    // 50 µs to ~1.6 s.
    Histogram::new(exponential_buckets(50e-6, 2.0, 16))
}

impl Default for Stats {
    fn default() -> Self {
        Self::labelled(&[])
    }
}

impl Stats {
    /// Metrics whose every sample carries `labels` (the model and version
    /// an engine serves).
    pub fn labelled(labels: &[(&str, &str)]) -> Self {
        let labels: Vec<(std::borrow::Cow<'static, str>, std::borrow::Cow<'static, str>)> =
            labels.iter().map(|(k, v)| (k.to_string().into(), v.to_string().into())).collect();
        let outcomes = Family::<OutcomeLabel, Counter>::default();
        let by_outcome =
            Outcome::ALL.map(|outcome| outcomes.get_or_create(&OutcomeLabel { outcome }).clone());
        let stats = Stats {
            forwards: Counter::default(),
            rows_computed: Counter::default(),
            requests_computed: Counter::default(),
            requests_abandoned: Counter::default(),
            backend_errors: Counter::default(),
            batches_abandoned: Counter::default(),
            batches_stalled: Counter::default(),
            batches_staged: Counter::default(),
            probe_forwards: Counter::default(),
            positions_truncated: Counter::default(),
            busy_lanes: Gauge::default(),
            backend_healthy: {
                let healthy = Gauge::default();
                healthy.set(1);
                healthy
            },
            queue_seconds: seconds_buckets(),
            stage_handover_seconds: seconds_buckets(),
            compute_seconds: seconds_buckets(),
            request_seconds: seconds_buckets(),
            batch_rows: Histogram::new(exponential_buckets(1.0, 2.0, 15)),
            batch_requests: Histogram::new(exponential_buckets(1.0, 2.0, 10)),
            outcomes,
            by_outcome,
            queued_requests: Gauge::default(),
            queued_rows: Gauge::default(),
            queued_bytes: Gauge::default(),
            working_set_bytes: Gauge::default(),
            registry: Registry::with_prefix_and_labels("narsil", labels.into_iter()),
        };
        stats.register()
    }

    fn register(mut self) -> Self {
        let r = &mut self.registry;
        r.register("requests", "Requests by outcome", self.outcomes.clone());
        r.register_with_unit(
            "request",
            "End-to-end time of requests answered with scores",
            Unit::Seconds,
            self.request_seconds.clone(),
        );
        r.register_with_unit(
            "queue",
            "Time from admission until a lane (or its stage thread) took a request's batch",
            Unit::Seconds,
            self.queue_seconds.clone(),
        );
        r.register_with_unit(
            "stage_handover",
            "Time a batch staged ahead waited for its lane, from the end of its stage to the lane taking it",
            Unit::Seconds,
            self.stage_handover_seconds.clone(),
        );
        r.register_with_unit(
            "compute",
            "Duration of one forward",
            Unit::Seconds,
            self.compute_seconds.clone(),
        );
        r.register("batch_rows", "Rows fused into one forward", self.batch_rows.clone());
        r.register("batch_requests", "Requests fused into one forward", self.batch_requests.clone());
        r.register("forwards", "Forward passes run (abandoned batches excluded)", self.forwards.clone());
        r.register(
            "forward_errors",
            "Forwards that failed or panicked (abandoned batches excluded)",
            self.backend_errors.clone(),
        );
        r.register(
            "batches_abandoned",
            "Batches whose every caller's deadline passed before the forward could finish",
            self.batches_abandoned.clone(),
        );
        r.register(
            "batches_stalled",
            "Abandoned batches whose time went into the forward, not the queue; each counts toward unhealthy",
            self.batches_stalled.clone(),
        );
        r.register(
            "batches_staged",
            "Batches a stage thread staged ahead and handed to its lane",
            self.batches_staged.clone(),
        );
        r.register(
            "abandoned",
            "Queued requests dropped before a forward (cancelled or expired)",
            self.requests_abandoned.clone(),
        );
        r.register(
            "queue_depth",
            "Requests admitted and waiting for a forward",
            self.queued_requests.clone(),
        );
        r.register("queue_rows", "Rows admitted and waiting for a forward", self.queued_rows.clone());
        r.register(
            "queue_bytes",
            "Decoded request bytes admitted and waiting for a forward",
            self.queued_bytes.clone(),
        );
        r.register(
            "working_set_bytes",
            "Bytes the memory bound holds for the working sets of a sequence model's requests in flight",
            self.working_set_bytes.clone(),
        );
        r.register("busy_lanes", "Lanes running a forward", self.busy_lanes.clone());
        r.register(
            "backend_healthy",
            "1 while the backend serves, 0 after too many failed or stalled forwards in a row",
            self.backend_healthy.clone(),
        );
        r.register(
            "sequence_positions_truncated",
            "Sequence positions dropped from requests whose sequences were longer than the model's maximum",
            self.positions_truncated.clone(),
        );
        r.register(
            "probe_forwards",
            "One-row forwards run by idle lanes to see whether an unhealthy backend recovered",
            self.probe_forwards.clone(),
        );
        self
    }

    /// The registry the engine's metrics are in (for a backend's own).
    pub fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// Counts one request's outcome.
    pub fn record(&self, outcome: Outcome) {
        self.by_outcome[outcome as usize].inc();
    }

    /// Prometheus text exposition, with the queue gauges set to the given
    /// occupancy.
    pub fn encode(&self, queued_requests: usize, queued_rows: usize, queued_bytes: usize) -> String {
        self.queued_requests.set(queued_requests as i64);
        self.queued_rows.set(queued_rows as i64);
        self.queued_bytes.set(queued_bytes as i64);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)
            .expect("writing to a String cannot fail");
        text
    }

    pub(crate) fn snapshot(&self, queued_requests: usize) -> StatsSnapshot {
        StatsSnapshot {
            forwards: self.forwards.get(),
            rows_computed: self.rows_computed.get(),
            requests_computed: self.requests_computed.get(),
            requests_abandoned: self.requests_abandoned.get(),
            backend_errors: self.backend_errors.get(),
            batches_abandoned: self.batches_abandoned.get(),
            batches_stalled: self.batches_stalled.get(),
            batches_staged: self.batches_staged.get(),
            busy_lanes: self.busy_lanes.get().max(0) as usize,
            queued_requests,
        }
    }
}

/// Joins the OpenMetrics expositions of several registries (one per served
/// model version, and the server's own) into one: each metric family's
/// `# HELP`/`# TYPE`/`# UNIT` lines once, followed by the samples of every
/// exposition that has it, and one `# EOF`.
pub fn merge_expositions<'a>(texts: impl IntoIterator<Item = &'a str>) -> String {
    // Families in first-seen order: (metadata lines, sample lines).
    let mut families: Vec<(String, String, String)> = Vec::new();
    for text in texts {
        let mut current: Option<usize> = None;
        for line in text.lines() {
            if line == "# EOF" {
                continue;
            }
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap_or_default();
                let index = families.iter().position(|(n, ..)| n == name).unwrap_or_else(|| {
                    families.push((name.to_string(), String::new(), String::new()));
                    families.len() - 1
                });
                current = Some(index);
                if families[index].1.is_empty() {
                    families[index].1.push_str(line);
                    families[index].1.push('\n');
                }
                continue;
            }
            let Some(index) = current else { continue };
            let family = &mut families[index];
            if line.starts_with('#') {
                if !family.1.contains(line) {
                    family.1.push_str(line);
                    family.1.push('\n');
                }
            } else {
                family.2.push_str(line);
                family.2.push('\n');
            }
        }
    }
    let mut merged: String = families.into_iter().map(|(_, meta, samples)| meta + &samples).collect();
    merged.push_str("# EOF\n");
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merged_expositions_keep_each_family_once_with_every_version_s_samples() {
        let v1 = Stats::labelled(&[("model", "dlrm"), ("version", "1")]);
        let v2 = Stats::labelled(&[("model", "dlrm"), ("version", "2")]);
        v1.record(Outcome::Ok);
        v2.record(Outcome::Ok);
        v2.record(Outcome::Ok);
        let merged = merge_expositions([v1.encode(0, 0, 0).as_str(), v2.encode(0, 0, 0).as_str()]);
        assert_eq!(merged.matches("# TYPE narsil_requests counter").count(), 1, "{merged}");
        assert_eq!(merged.matches("# EOF").count(), 1);
        assert!(merged.ends_with("# EOF\n"));
        assert!(
            merged.contains(r#"narsil_requests_total{model="dlrm",version="1",outcome="ok"} 1"#),
            "{merged}"
        );
        assert!(
            merged.contains(r#"narsil_requests_total{model="dlrm",version="2",outcome="ok"} 2"#),
            "{merged}"
        );
        // Every family's samples follow its own metadata.
        let requests = merged.find("# TYPE narsil_requests counter").unwrap();
        let next_family = merged[requests..].find("# HELP narsil_request_seconds").unwrap() + requests;
        assert!(merged[requests..next_family].contains(r#"version="2",outcome="ok""#));
    }

    #[test]
    fn exposition_has_every_outcome_and_the_histograms() {
        let stats = Stats::default();
        stats.record(Outcome::Deadline);
        stats.batch_rows.observe(100.0);
        let text = stats.encode(3, 300, 4000);
        for outcome in Outcome::ALL {
            assert!(
                text.contains(&format!("narsil_requests_total{{outcome=\"{}\"}}", outcome.name())),
                "{text}"
            );
        }
        assert!(text.contains("narsil_requests_total{outcome=\"deadline\"} 1"), "{text}");
        assert!(text.contains("narsil_batch_rows_count 1"), "{text}");
        assert!(text.contains("narsil_queue_seconds_bucket"), "{text}");
        assert!(text.contains("narsil_stage_handover_seconds_count 0"), "{text}");
        assert!(text.contains("narsil_batches_abandoned_total 0"), "{text}");
        assert!(text.contains("narsil_batches_stalled_total 0"), "{text}");
        assert!(text.contains("narsil_batches_staged_total 0"), "{text}");
        assert!(text.contains("narsil_queue_depth 3"), "{text}");
        assert!(text.contains("narsil_queue_rows 300"), "{text}");
        assert!(text.contains("narsil_queue_bytes 4000"), "{text}");
        assert!(text.contains("narsil_working_set_bytes 0"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
