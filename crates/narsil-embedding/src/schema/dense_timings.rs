//! The dense network's forms (TorchScript, the `.pt2` package) as timed at
//! export ([`DenseFormTimings`]), which `--dense-form auto` reads to serve
//! the faster on the exporting CPU, and the INT8 package timed against
//! FP32's faster form ([`DenseFormTimings::int8_vs_fp32`]), which the server
//! states when it serves INT8 (a warning where INT8 was the slower).

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
    /// The INT8 package (`dense_int8.pt2`, its one form), where it was timed.
    #[serde(default)]
    pub int8: Option<PackageTimes>,
}

/// The INT8 package's forward times (µs) at [`DenseFormTimings::rows`].
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct PackageTimes {
    /// The `.pt2` package's.
    pub pt2_us: Vec<u64>,
}

impl DenseFormTimings {
    /// INT8's samples/s over FP32's faster form's (each timed row count
    /// weighing the same, per sample), where the export timed both on
    /// `this_cpu` (the same `vendor family F model M`): below 1, INT8
    /// serves fewer samples than FP32 would on this kind of CPU (a small
    /// network on AVX2: its quantize and dequantize passes cost more than
    /// its INT8 GEMMs save). None where either was not timed here.
    pub fn int8_vs_fp32(&self, this_cpu: &str) -> Option<f64> {
        if self.cpu != this_cpu {
            return None;
        }
        let fp32 = self.fp32.as_ref()?;
        let fp32_us: Vec<u64> =
            fp32.torchscript_us.iter().zip(&fp32.pt2_us).map(|(&t, &p)| t.min(p)).collect();
        let fp32 = per_sample_us(&fp32_us, &self.rows)?;
        let int8 = per_sample_us(&self.int8.as_ref()?.pt2_us, &self.rows)?;
        (int8 > 0.0).then(|| fp32 / int8)
    }
}

/// `times` per sample, summed over `rows`; None where they do not cover
/// every size.
fn per_sample_us(times: &[u64], rows: &[u64]) -> Option<f64> {
    (times.len() == rows.len() && rows.iter().all(|&r| r > 0))
        .then(|| times.iter().zip(rows).map(|(&t, &r)| t as f64 / r as f64).sum())
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
        match (per_sample_us(&self.torchscript_us, rows), per_sample_us(&self.pt2_us, rows)) {
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
        assert!(timings.int8.is_none());
        let without = text.replace("\"dense_form_timings\"", "\"unused\"");
        assert!(serde_json::from_str::<SplitSchema>(&without).unwrap().dense_form_timings.is_none());
    }

    #[test]
    fn int8_is_compared_with_fp32s_faster_form_only_where_both_were_timed_on_this_kind_of_cpu() {
        let here = "AuthenticAMD family 23 model 49";
        let timings = |cpu: &str, int8_us: Option<Vec<u64>>| DenseFormTimings {
            cpu: cpu.into(),
            rows: vec![100, 1600],
            // FP32's faster form: the package at 100 rows (1 µs a sample), TorchScript at 1,600 (1 µs).
            fp32: Some(FormTimes { torchscript_us: vec![200, 1600], pt2_us: vec![100, 3200] }),
            bf16: None,
            int8: int8_us.map(|pt2_us| PackageTimes { pt2_us }),
        };
        // INT8 4 µs a sample over both sizes against FP32's 2: half FP32's samples/s.
        let slower = timings(here, Some(vec![200, 3200]));
        assert_eq!(slower.int8_vs_fp32(here), Some(0.5));
        let faster = timings(here, Some(vec![50, 800]));
        assert_eq!(faster.int8_vs_fp32(here), Some(2.0));
        // Timed on another kind of CPU, not timed, or not covering the rows: says nothing.
        assert_eq!(timings("GenuineIntel family 6 model 207", Some(vec![50, 800])).int8_vs_fp32(here), None);
        assert_eq!(timings(here, None).int8_vs_fp32(here), None);
        assert_eq!(timings(here, Some(vec![50])).int8_vs_fp32(here), None);
        let no_fp32 = DenseFormTimings { fp32: None, ..faster };
        assert_eq!(no_fp32.int8_vs_fp32(here), None);
    }

    #[test]
    fn a_schema_reads_the_int8_packages_timings() {
        let text = r#"{"format": "narsil-split-1", "name": "m", "version": "1", "num_dense": 1,
            "tables": [], "features": [], "outputs": ["s"], "dense_network": "dense.pt",
            "dense_form_timings": {"cpu": "c", "rows": [100], "fp32": {"torchscript_us": [300], "pt2_us": [200]},
                "int8": {"pt2_us": [400]}}}"#;
        let timings = serde_json::from_str::<SplitSchema>(text).unwrap().dense_form_timings.unwrap();
        assert_eq!(timings.int8, Some(PackageTimes { pt2_us: vec![400] }));
        assert_eq!(timings.int8_vs_fp32("c"), Some(0.5));
    }
}
