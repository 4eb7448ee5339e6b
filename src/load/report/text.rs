//! The human-readable [`Report`]: the phase's load, throughput, latency,
//! batching, failures and the --compare-flat line, as `narsil load` prints
//! them.

use super::Report;

impl Report {
    /// The human-readable report.
    pub fn text(&self) -> String {
        let load = match self.rate {
            Some(rate) => format!("open loop at {rate} req/s"),
            None => format!("closed loop, concurrency {}", self.concurrency),
        };
        let codes: Vec<String> = self.by_code.iter().map(|(c, n)| format!("{c}={n}")).collect();
        // Only narsil.v1 answers carry the server's timings (fused rows are
        // at least 1 in every answer that does).
        let server = if self.mean_fused_rows > 0.0 {
            format!(
                "server      mean fused rows {:.1} (per forward {:.1}), queue {:.3} ms, forward {:.3} ms \
                 (per forward {:.3}), forward busy {:.2}\n\
                 outside the forward ms  p50 {:.3}  p99 {:.3}\n",
                self.mean_fused_rows,
                self.mean_forward_rows,
                self.mean_queue_ms,
                self.mean_compute_ms,
                self.mean_forward_ms,
                self.forward_busy,
                self.outside_forward_p50_ms,
                self.outside_forward_p99_ms,
            )
        } else {
            "server      no timings (this protocol's answers carry none)\n".to_string()
        };
        let (shape, rows) = if self.candidates_per_request > 0 {
            let form = match self.ranking_form.as_deref() {
                Some("grouped") if self.dense_once => "sent grouped".to_string(),
                Some("grouped") => "sent grouped, the dense features on every row".to_string(),
                Some(form) => format!("sent {form}"),
                None => "sent flat".to_string(),
            };
            let shape = format!(
                "ranking: 1 user x {} candidates ({} of {} sparse features and all dense request-level, {form})",
                self.candidates_per_request, self.request_features, self.sparse_features
            );
            (shape, "candidates")
        } else {
            (format!("{} samples/request", self.batch_size), "samples")
        };
        format!(
            "narsil load: {load}, {shape}, ids {}, backend {}\n\
             requests    {} in {:.2} s ({})\n\
             throughput  {:.1} req/s, {:.0} {rows}/s\n\
             wire        {:.0} bytes/request (protobuf, mean of the prebuilt requests)\n\
             latency ms  p50 {:.3}  p90 {:.3}  p99 {:.3}  max {:.3}  mean {:.3}\n\
             {server}{}{}",
            self.id_distribution,
            self.backend,
            self.requests,
            self.elapsed_s,
            codes.join(" "),
            self.req_per_s,
            self.samples_per_s,
            self.request_bytes_mean,
            self.p50_ms,
            self.p90_ms,
            self.p99_ms,
            self.max_ms,
            self.mean_ms,
            if self.client_overflow > 0 {
                format!("client      {} scheduled requests not sent (in-flight cap)\n", self.client_overflow)
            } else {
                String::new()
            },
            self.vs_flat_text(),
        )
    }

    /// The --compare-flat line, empty without it.
    fn vs_flat_text(&self) -> String {
        if self.flat_reference_requests == 0 && self.compared_vs_flat == 0 {
            return String::new();
        }
        let diff = match self.max_abs_diff_vs_flat {
            Some(diff) => format!("max |grouped - flat| {diff:.3e}"),
            None => "nothing compared".to_string(),
        };
        let mismatches = if self.vs_flat_mismatches > 0 {
            format!(", {} answers NOT comparable (score count or NaN differs)", self.vs_flat_mismatches)
        } else {
            String::new()
        };
        format!(
            "vs flat     {diff} over {} answers ({} requests' flat twins){mismatches}\n",
            self.compared_vs_flat, self.flat_reference_requests
        )
    }
}
