//! The dense network's forms (TorchScript, the `.pt2` package) as timed at
//! export ([`DenseFormTimings`]), which `--dense-form auto` reads to serve
//! the faster on the exporting CPU.

use serde::Deserialize;

/// The dense network's forms (TorchScript, the `.pt2` package) timed at
/// export, one thread, per precision (`models/split_model.py`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct DenseFormTimings {
    /// The exporting CPU, `vendor family F model M` from /proc/cpuinfo
    /// (the model name alone says "AMD EPYC" for Zen 3, 4 and 5 alike).
    pub cpu: String,
    /// The rows of each timed forward.
    pub rows: Vec<u64>,
    /// FP32's forms, where both were timed.
    #[serde(default)]
    pub fp32: Option<FormTimes>,
    /// bf16's forms, where both were timed.
    #[serde(default)]
    pub bf16: Option<FormTimes>,
}

/// One precision's forward times (µs) at [`DenseFormTimings::rows`].
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct FormTimes {
    /// The TorchScript network's.
    pub torchscript_us: Vec<u64>,
    /// The `.pt2` package's.
    pub pt2_us: Vec<u64>,
}

impl FormTimes {
    /// Whether the TorchScript network costs less per sample than the
    /// package, summed over the timed `rows` (each size weighs the same);
    /// false where the times do not cover every size.
    pub fn torchscript_faster(&self, rows: &[u64]) -> bool {
        let per_sample = |times: &[u64]| -> Option<f64> {
            (times.len() == rows.len() && rows.iter().all(|&r| r > 0))
                .then(|| times.iter().zip(rows).map(|(&t, &r)| t as f64 / r as f64).sum())
        };
        match (per_sample(&self.torchscript_us), per_sample(&self.pt2_us)) {
            (Some(torchscript), Some(pt2)) => torchscript < pt2,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::SplitSchema;

    #[test]
    fn the_form_faster_per_sample_over_the_timed_rows_is_chosen() {
        let times = |torchscript_us: Vec<u64>, pt2_us: Vec<u64>| FormTimes { torchscript_us, pt2_us };
        let rows = [100, 1600];
        // TorchScript slower at 100 rows, faster at 1,600: 2.0 + 1.0 < 1.0 + 2.5 µs a sample.
        assert!(times(vec![200, 1600], vec![100, 4000]).torchscript_faster(&rows));
        assert!(!times(vec![200, 4000], vec![100, 1600]).torchscript_faster(&rows));
        // Equal: the package stays (today's default).
        assert!(!times(vec![100, 1600], vec![100, 1600]).torchscript_faster(&rows));
        // Times that do not cover the rows say nothing.
        assert!(!times(vec![1], vec![100, 1600]).torchscript_faster(&rows));
        assert!(!times(vec![1, 1], vec![100, 1600]).torchscript_faster(&[0, 1600]));
    }

    #[test]
    fn a_schema_reads_its_form_timings_and_one_without_them_has_none() {
        let text = r#"{"format": "narsil-split-1", "name": "m", "version": "1", "num_dense": 1,
            "tables": [], "features": [], "outputs": ["s"], "dense_network": "dense.pt",
            "dense_form_timings": {"cpu": "AuthenticAMD family 26 model 2", "rows": [100, 1600],
                "fp32": {"torchscript_us": [190, 2900], "pt2_us": [210, 1500]}}}"#;
        let schema: SplitSchema = serde_json::from_str(text).unwrap();
        let timings = schema.dense_form_timings.unwrap();
        assert_eq!(timings.cpu, "AuthenticAMD family 26 model 2");
        assert!(!timings.fp32.unwrap().torchscript_faster(&timings.rows));
        assert!(timings.bf16.is_none());
        let without = text.replace("\"dense_form_timings\"", "\"unused\"");
        assert!(serde_json::from_str::<SplitSchema>(&without).unwrap().dense_form_timings.is_none());
    }
}
