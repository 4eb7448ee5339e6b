//! Latency and throughput accounting for `narsil load`: each caller's
//! [`Recorder`], and the phase's [`Report`] (its text: `text.rs`).

mod text;

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

use super::ranking::RankingForm;
use super::LoadArgs;
use crate::proto::{ModelInfoResponse, PredictResponse};

/// Outcomes of one caller (merged at the end of a phase).
#[derive(Debug)]
pub struct Recorder {
    ok_latency_us: Histogram<u64>,
    /// Per OK call: latency minus the server-reported forward time, i.e.
    /// what the call spent outside the model (narsil.v1 only; TorchRec's
    /// protocol reports no timings).
    outside_forward_us: Histogram<u64>,
    by_code: BTreeMap<String, u64>,
    fused_rows_sum: u64,
    /// Sum over OK calls of 1 / (requests in the call's forward): the number
    /// of forwards these calls took part in.
    forwards_seen: f64,
    /// Sum over OK calls of fused rows / requests in that forward.
    forward_rows_share: f64,
    /// Sum over OK calls of forward time (us) / requests in that forward.
    forward_us_share: f64,
    queue_us_sum: u64,
    compute_us_sum: u64,
    /// Open loop: scheduled requests not sent because too many were in flight.
    pub client_overflow: u64,
    /// --compare-flat: OK answers compared with their flat twin's scores.
    vs_flat_compared: u64,
    /// The largest |answer's score - flat twin's score| over them.
    vs_flat_max_abs_diff: f64,
    /// Of them, answers whose scores could not be compared: another count
    /// of scores than the twin's, or NaN where the twin's is a number (or
    /// the reverse).
    vs_flat_mismatches: u64,
}

impl Default for Recorder {
    fn default() -> Self {
        Self {
            ok_latency_us: Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid bounds"),
            outside_forward_us: Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid bounds"),
            by_code: BTreeMap::new(),
            fused_rows_sum: 0,
            forwards_seen: 0.0,
            forward_rows_share: 0.0,
            forward_us_share: 0.0,
            queue_us_sum: 0,
            compute_us_sum: 0,
            client_overflow: 0,
            vs_flat_compared: 0,
            vs_flat_max_abs_diff: 0.0,
            vs_flat_mismatches: 0,
        }
    }
}

impl Recorder {
    /// Records one answered call.
    pub fn record(&mut self, latency: Duration, result: Result<PredictResponse, tonic::Status>) {
        let code = match result {
            Ok(response) => {
                let latency_us = latency.as_micros() as u64;
                self.ok_latency_us.saturating_record(latency_us.max(1));
                if response.compute_time_us > 0 {
                    self.outside_forward_us
                        .saturating_record(latency_us.saturating_sub(response.compute_time_us).max(1));
                }
                self.fused_rows_sum += u64::from(response.fused_rows);
                let share = 1.0 / f64::from(response.fused_requests.max(1));
                self.forwards_seen += share;
                self.forward_rows_share += f64::from(response.fused_rows) * share;
                self.forward_us_share += response.compute_time_us as f64 * share;
                self.queue_us_sum += response.queue_time_us;
                self.compute_us_sum += response.compute_time_us;
                "OK".to_string()
            }
            Err(status) => format!("{:?}", status.code()),
        };
        *self.by_code.entry(code).or_default() += 1;
    }

    /// Compares an OK answer's `scores` with its flat twin's (`flat`).
    pub fn compare_with_flat(&mut self, scores: &[f32], flat: &[f32]) {
        self.vs_flat_compared += 1;
        if scores.len() != flat.len() {
            self.vs_flat_mismatches += 1;
            return;
        }
        let mut max = 0.0f64;
        for (&a, &b) in scores.iter().zip(flat) {
            if a.is_nan() || b.is_nan() {
                if a.is_nan() != b.is_nan() {
                    self.vs_flat_mismatches += 1;
                    return;
                }
                continue;
            }
            max = max.max((f64::from(a) - f64::from(b)).abs());
        }
        self.vs_flat_max_abs_diff = self.vs_flat_max_abs_diff.max(max);
    }

    /// Adds another recorder's outcomes to this one.
    pub fn merge(&mut self, other: Recorder) {
        self.ok_latency_us.add(&other.ok_latency_us).expect("same bounds");
        self.outside_forward_us.add(&other.outside_forward_us).expect("same bounds");
        for (code, n) in other.by_code {
            *self.by_code.entry(code).or_default() += n;
        }
        self.fused_rows_sum += other.fused_rows_sum;
        self.forwards_seen += other.forwards_seen;
        self.forward_rows_share += other.forward_rows_share;
        self.forward_us_share += other.forward_us_share;
        self.queue_us_sum += other.queue_us_sum;
        self.compute_us_sum += other.compute_us_sum;
        self.client_overflow += other.client_overflow;
        self.vs_flat_compared += other.vs_flat_compared;
        self.vs_flat_max_abs_diff = self.vs_flat_max_abs_diff.max(other.vs_flat_max_abs_diff);
        self.vs_flat_mismatches += other.vs_flat_mismatches;
    }
}

/// The result of a load run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// `closed` or `open`.
    pub mode: String,
    /// Closed loop callers.
    pub concurrency: usize,
    /// Open loop target rate.
    pub rate: Option<f64>,
    /// Samples (rows) per request: --candidates when set.
    pub batch_size: usize,
    /// Ranking workload: candidate rows per request (one user each); 0 for
    /// independent samples.
    pub candidates_per_request: usize,
    /// Ranking workload: request-level (user) sparse features; 0 for
    /// independent samples.
    pub request_features: usize,
    /// Ranking workload: how the requests were sent, `grouped` (the user's
    /// features once per request) or `flat` (on every row); null for
    /// independent samples.
    pub ranking_form: Option<String>,
    /// Mean protobuf-encoded size of the prebuilt requests, bytes: what a
    /// request takes on the wire, before gRPC and HTTP/2 framing.
    pub request_bytes_mean: f64,
    /// How ids were drawn (`--id-distribution`).
    pub id_distribution: String,
    /// Backend the server reported.
    pub backend: String,
    /// Measured phase length, seconds.
    pub elapsed_s: f64,
    /// Calls answered, any status.
    pub requests: u64,
    /// Calls answered OK.
    pub ok: u64,
    /// Answered calls per status code.
    pub by_code: BTreeMap<String, u64>,
    /// Open loop requests not sent (client in-flight cap).
    pub client_overflow: u64,
    /// OK calls per second.
    pub req_per_s: f64,
    /// OK samples per second (candidates per second with --candidates).
    pub samples_per_s: f64,
    /// Ranking workload: OK candidates per second (`samples_per_s`); 0 for
    /// independent samples.
    pub candidates_per_s: f64,
    /// Latency of OK calls, milliseconds.
    pub p50_ms: f64,
    /// 90th percentile, ms.
    pub p90_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// Maximum, ms.
    pub max_ms: f64,
    /// Mean, ms.
    pub mean_ms: f64,
    /// Mean rows of the fused forward each OK call was part of (weighted by
    /// calls: a forward of 16 requests counts 16 times).
    pub mean_fused_rows: f64,
    /// Mean rows per forward (weighted by forwards): the batch size to
    /// compare with `narsil bench-forward`.
    pub mean_forward_rows: f64,
    /// Mean forward time, ms, weighted by forwards.
    pub mean_forward_ms: f64,
    /// Seconds of forward per second of the run: with one lane, the share of
    /// time the backend was busy (forwards holding warm-up or other
    /// clients' requests only are not seen).
    pub forward_busy: f64,
    /// Mean server-side queue time, ms.
    pub mean_queue_ms: f64,
    /// Mean server-side forward time, ms.
    pub mean_compute_ms: f64,
    /// Per call, latency minus the server-reported forward time (what the
    /// engine, gRPC, the kernel and this client added), median, ms; 0 when
    /// the protocol reports no timings.
    pub outside_forward_p50_ms: f64,
    /// The same, 99th percentile, ms.
    pub outside_forward_p99_ms: f64,
    /// --compare-flat: requests sent flat before the run for their scores
    /// (each prebuilt request's flat twin, up to the flag's count).
    pub flat_reference_requests: usize,
    /// --compare-flat: OK answers of the measured run compared with their
    /// flat twin's scores.
    pub compared_vs_flat: u64,
    /// --compare-flat: the largest |grouped score - flat score| over every
    /// candidate of those answers; null without --compare-flat (or when no
    /// answer could be compared).
    pub max_abs_diff_vs_flat: Option<f64>,
    /// --compare-flat: answers whose scores could not be compared with the
    /// twin's (another count of scores, or NaN on one side only).
    pub vs_flat_mismatches: u64,
    /// Sparse features of the model (for the text report).
    #[serde(skip)]
    sparse_features: usize,
    /// Grouped: whether the dense features travel once (the model's dense
    /// features are request-level) or on every row (for the text report).
    #[serde(skip)]
    dense_once: bool,
}

impl Report {
    /// Summarises a measured phase.
    pub fn new(
        args: &LoadArgs,
        info: &ModelInfoResponse,
        form: Option<RankingForm>,
        r: Recorder,
        elapsed: Duration,
        request_bytes_mean: f64,
    ) -> Self {
        let ok = r.by_code.get("OK").copied().unwrap_or(0);
        let secs = elapsed.as_secs_f64().max(1e-9);
        let h = &r.ok_latency_us;
        let ms = |us: u64| us as f64 / 1e3;
        let per_ok = |sum: u64| if ok == 0 { 0.0 } else { sum as f64 / ok as f64 };
        Self {
            mode: if args.rate.is_some() { "open" } else { "closed" }.into(),
            concurrency: args.concurrency,
            rate: args.rate,
            batch_size: args.rows_per_request(),
            candidates_per_request: args.candidates,
            request_features: if args.candidates > 0 {
                super::ranking::request_features(args, info)
            } else {
                0
            },
            ranking_form: form.map(|form| form.name().to_string()),
            request_bytes_mean,
            id_distribution: args.id_distributions().to_string(),
            backend: info.backend.clone(),
            elapsed_s: secs,
            requests: r.by_code.values().sum(),
            ok,
            by_code: r.by_code.clone(),
            client_overflow: r.client_overflow,
            req_per_s: ok as f64 / secs,
            samples_per_s: (ok as f64 * args.rows_per_request() as f64) / secs,
            candidates_per_s: (ok as f64 * args.candidates as f64) / secs,
            p50_ms: ms(h.value_at_quantile(0.50)),
            p90_ms: ms(h.value_at_quantile(0.90)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            max_ms: ms(h.max()),
            mean_ms: h.mean() / 1e3,
            mean_fused_rows: per_ok(r.fused_rows_sum),
            mean_forward_rows: if r.forwards_seen > 0.0 {
                r.forward_rows_share / r.forwards_seen
            } else {
                0.0
            },
            mean_forward_ms: if r.forwards_seen > 0.0 {
                r.forward_us_share / r.forwards_seen / 1e3
            } else {
                0.0
            },
            forward_busy: r.forward_us_share / 1e6 / secs,
            mean_queue_ms: per_ok(r.queue_us_sum) / 1e3,
            mean_compute_ms: per_ok(r.compute_us_sum) / 1e3,
            outside_forward_p50_ms: ms(r.outside_forward_us.value_at_quantile(0.50)),
            outside_forward_p99_ms: ms(r.outside_forward_us.value_at_quantile(0.99)),
            flat_reference_requests: 0,
            compared_vs_flat: r.vs_flat_compared,
            max_abs_diff_vs_flat: (r.vs_flat_compared > r.vs_flat_mismatches)
                .then_some(r.vs_flat_max_abs_diff),
            vs_flat_mismatches: r.vs_flat_mismatches,
            sparse_features: info.sparse_features.len(),
            dense_once: info.dense_request_level,
        }
    }

    /// How many measured requests failed, of how many, by status code
    /// (`3 of 40 requests failed: DeadlineExceeded=2 Unavailable=1`); none
    /// when every answered request was OK.
    pub fn failures(&self) -> Option<String> {
        let failed = self.requests - self.ok;
        if failed == 0 {
            return None;
        }
        let codes: Vec<String> =
            self.by_code.iter().filter(|(code, _)| *code != "OK").map(|(c, n)| format!("{c}={n}")).collect();
        Some(format!("{failed} of {} requests failed: {}", self.requests, codes.join(" ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(fused_rows: u32, fused_requests: u32) -> Result<PredictResponse, tonic::Status> {
        let compute_time_us = u64::from(fused_rows) * 10;
        Ok(PredictResponse { fused_rows, fused_requests, compute_time_us, ..Default::default() })
    }

    #[test]
    fn rows_per_forward_weights_each_forward_once() {
        let mut r = Recorder::default();
        // Two calls shared one forward of 200 rows; one call ran alone with 100.
        r.record(Duration::from_millis(1), ok(200, 2));
        r.record(Duration::from_millis(1), ok(200, 2));
        r.record(Duration::from_millis(1), ok(100, 1));
        r.record(Duration::from_millis(1), Err(tonic::Status::resource_exhausted("full")));
        assert_eq!(r.by_code["OK"], 3);
        assert!((r.forwards_seen - 2.0).abs() < 1e-9);
        assert!((r.forward_rows_share / r.forwards_seen - 150.0).abs() < 1e-9);
        assert_eq!(r.fused_rows_sum, 500, "call-weighted sum");
        // Forwards of 2 ms and 1 ms: 3 ms of forward in all.
        assert!((r.forward_us_share - 3000.0).abs() < 1e-6);
        // 1 ms calls whose forwards took 2, 2 and 1 ms: nothing outside
        // (clamped), nothing outside, nothing outside.
        assert_eq!(r.outside_forward_us.len(), 3);
    }

    #[test]
    fn time_outside_the_forward_is_latency_minus_the_reported_forward() {
        let mut r = Recorder::default();
        for _ in 0..10 {
            r.record(Duration::from_micros(5_300), ok(100, 1)); // forward 1,000 us
        }
        let outside = r.outside_forward_us.value_at_quantile(0.5);
        assert!((4_290..=4_310).contains(&outside), "{outside}");
    }

    #[test]
    fn a_ranking_report_gives_candidates_per_second_and_bytes_per_request() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            load: LoadArgs,
        }
        let info = ModelInfoResponse {
            backend: "mock".into(),
            num_dense: 13,
            sparse_features: (0..26)
                .map(|i| crate::proto::SparseFeature {
                    name: format!("cat_{i}"),
                    num_rows: 10,
                    weighted: false,
                    request_level: false,
                    raw_ids: false,
                    sequence: String::new(),
                    raw_input: false,
                })
                .collect(),
            ..Default::default()
        };
        let report_for = |info: &ModelInfoResponse, flags: &[&str]| {
            let args = <Cli as clap::Parser>::parse_from(["load"].iter().chain(flags)).load;
            let mut r = Recorder::default();
            for _ in 0..4 {
                r.record(Duration::from_millis(2), ok(500, 1));
            }
            let form = super::super::ranking::form(&args, info).unwrap();
            Report::new(&args, info, form, r, Duration::from_secs(2), 123_456.0)
        };
        let report = |flags: &[&str]| report_for(&info, flags);
        let ranking = report(&["--candidates", "500"]);
        assert_eq!(
            (ranking.batch_size, ranking.candidates_per_request, ranking.request_features),
            (500, 500, 13)
        );
        assert!((ranking.samples_per_s - 1_000.0).abs() < 1e-9, "4 requests of 500 in 2 s");
        assert_eq!(ranking.id_distribution, "zipf:1.05", "the ranking workload's default ids");
        let text = ranking.text();
        assert!(text.contains("1 user x 500 candidates (13 of 26 sparse features"), "{text}");
        assert!(text.contains("2.0 req/s, 1000 candidates/s"), "{text}");
        assert!(text.contains("123456 bytes/request"), "{text}");
        let json = serde_json::to_value(&ranking).unwrap();
        assert_eq!(json["candidates_per_request"], 500);
        assert_eq!(json["request_bytes_mean"], 123_456.0);
        assert_eq!(json["samples_per_s"], 1_000.0);
        assert_eq!(json["candidates_per_s"], 1_000.0);
        assert!(json.get("sparse_features").is_none());
        // A model that declares nothing request-level gets flat requests,
        // and the report says so.
        assert_eq!(json["ranking_form"], "flat");
        assert!(text.contains("request-level, sent flat)"), "{text}");
        assert_eq!(json["max_abs_diff_vs_flat"], serde_json::Value::Null);
        assert!(!text.contains("vs flat "), "{text}");
        // One that declares cat_0..cat_12 and its dense features: grouped.
        let mut declared = info.clone();
        declared.dense_request_level = true;
        for feature in &mut declared.sparse_features[..13] {
            feature.request_level = true;
        }
        let grouped = report_for(&declared, &["--candidates", "500"]);
        assert_eq!(serde_json::to_value(&grouped).unwrap()["ranking_form"], "grouped");
        assert!(grouped.text().contains("request-level, sent grouped)"), "{}", grouped.text());
        declared.dense_request_level = false;
        let text = report_for(&declared, &["--candidates", "500"]).text();
        assert!(text.contains("sent grouped, the dense features on every row)"), "{text}");
        let text = report_for(&declared, &["--candidates", "500", "--ranking-form", "flat"]).text();
        assert!(text.contains("sent flat)"), "{text}");
        let samples = report(&[]);
        assert_eq!(
            (samples.batch_size, samples.candidates_per_request, samples.request_features),
            (100, 0, 0)
        );
        assert_eq!(samples.id_distribution, "uniform");
        assert!(samples.text().contains("100 samples/request"));
        assert!(samples.text().contains("samples/s"));
        let json = serde_json::to_value(&samples).unwrap();
        assert_eq!(
            (&json["ranking_form"], &json["candidates_per_s"]),
            (&serde_json::Value::Null, &0.0.into())
        );
    }

    #[test]
    fn grouped_answers_are_compared_with_their_flat_twins_scores() {
        let mut a = Recorder::default();
        a.compare_with_flat(&[0.5, 0.25, 0.125], &[0.5, 0.25, 0.125]);
        a.compare_with_flat(&[0.5, 0.2501], &[0.5, 0.25]);
        let mut b = Recorder::default();
        b.compare_with_flat(&[0.7, 0.1], &[0.7, 0.1004]);
        b.compare_with_flat(&[0.7], &[0.7, 0.1]); // one score short
        b.compare_with_flat(&[f32::NAN, 0.1], &[0.3, 0.1]);
        b.compare_with_flat(&[f32::NAN], &[f32::NAN]);
        a.merge(b);
        assert_eq!((a.vs_flat_compared, a.vs_flat_mismatches), (6, 2));
        assert!((a.vs_flat_max_abs_diff - 0.0004).abs() < 1e-6, "{}", a.vs_flat_max_abs_diff);
        a.record(Duration::from_millis(1), ok(2, 1));
        let info = ModelInfoResponse { backend: "mock".into(), ..Default::default() };
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            load: LoadArgs,
        }
        let args = <Cli as clap::Parser>::parse_from(["load", "--candidates", "2"]).load;
        let form = Some(RankingForm::Grouped);
        let mut report = Report::new(&args, &info, form, a, Duration::from_secs(1), 10.0);
        report.flat_reference_requests = 3;
        let diff = report.max_abs_diff_vs_flat.unwrap();
        assert!((diff - 0.0004).abs() < 1e-6, "{diff}");
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(
            (json["compared_vs_flat"].as_u64(), json["vs_flat_mismatches"].as_u64()),
            (Some(6), Some(2))
        );
        assert_eq!(json["flat_reference_requests"], 3);
        let text = report.text();
        assert!(
            text.contains("vs flat     max |grouped - flat| 4.00") && text.contains("over 6 answers"),
            "{text}"
        );
        assert!(text.contains("(3 requests' flat twins), 2 answers NOT comparable"), "{text}");
        // Nothing comparable: no difference to report.
        let mut none = Recorder::default();
        none.compare_with_flat(&[1.0], &[]);
        let report = Report::new(&args, &info, form, none, Duration::from_secs(1), 10.0);
        assert_eq!(report.max_abs_diff_vs_flat, None);
        assert!(report.text().contains("nothing compared over 1 answers"), "{}", report.text());
    }

    #[test]
    fn failed_requests_are_counted_by_status_code_and_none_failed_is_no_failure() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            load: LoadArgs,
        }
        let args = <Cli as clap::Parser>::parse_from(["load"]).load;
        let info = ModelInfoResponse { backend: "mock".into(), ..Default::default() };
        let report_of =
            |recorder: Recorder| Report::new(&args, &info, None, recorder, Duration::from_secs(1), 10.0);
        let mut all_ok = Recorder::default();
        all_ok.record(Duration::from_millis(1), ok(4, 1));
        assert_eq!(report_of(all_ok).failures(), None);
        let mut mixed = Recorder::default();
        for _ in 0..37 {
            mixed.record(Duration::from_millis(1), ok(4, 1));
        }
        mixed.record(Duration::from_millis(1), Err(tonic::Status::deadline_exceeded("late")));
        mixed.record(Duration::from_millis(1), Err(tonic::Status::deadline_exceeded("late")));
        mixed.record(Duration::from_millis(1), Err(tonic::Status::unavailable("gone")));
        assert_eq!(
            report_of(mixed).failures().as_deref(),
            Some("3 of 40 requests failed: DeadlineExceeded=2 Unavailable=1")
        );
    }
}
