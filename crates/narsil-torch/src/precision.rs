//! The precision of the dense arithmetic (dense arch, interaction, over
//! arch) and whether this CPU can run bf16 or INT8 at speed (and, for
//! compiled packages, the CPU's flags).
//!
//! bf16 casts the model's floating-point parameters to bf16 at load and asks
//! the INT8 embedding lookups for bf16 output; oneDNN then runs the GEMMs
//! with bf16 inputs and FP32 accumulation. INT8 is a split model's
//! `dense_int8.pt2` package only (`models/export_dlrm.py --split --int8`):
//! its GEMMs take uint8 activations and INT8 weights (VNNI or AMX-INT8 dot
//! products; on AVX2, activations in 7 bits so that `vpmaddubsw`'s 16-bit
//! pair sums cannot saturate), and its inputs stay FP32, quantized inside
//! the graph. Which instructions a package needs is in its own metadata. Scores are FP32
//! in every precision.

use std::fmt;

use narsil_core::BackendError;

/// `--dense-precision`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DensePrecision {
    /// FP32 everywhere (the exported model as it is).
    #[default]
    Fp32,
    /// bf16 dense arithmetic with FP32 accumulation.
    Bf16,
    /// INT8 GEMMs (a split model's `dense_int8.pt2`), FP32 inputs and scores.
    Int8,
}

impl DensePrecision {
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            Self::Fp32 => "fp32",
            Self::Bf16 => "bf16",
            Self::Int8 => "int8",
        }
    }
}

impl fmt::Display for DensePrecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The CPU's bf16 instructions, as `/proc/cpuinfo` names them (`amx_bf16`,
/// `avx512_bf16`); empty when it has none. Without them oneDNN emulates bf16
/// GEMMs, which is slower than FP32.
pub fn cpu_bf16_instructions() -> Vec<&'static str> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    bf16_flags(&cpuinfo)
}

/// The CPU's instructions for INT8 GEMMs, as `/proc/cpuinfo` names them:
/// its dot products (`amx_int8`, `avx512_vnni`, `avx_vnni`), else `avx2`;
/// empty when it has none of them.
pub fn cpu_int8_instructions() -> Vec<&'static str> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    int8_flags(&cpuinfo)
}

/// Every flag of this CPU, as `/proc/cpuinfo` names them (`avx2`,
/// `avx512f`, `amx_tile`, ...); empty where it cannot be read.
pub fn cpu_flags() -> Vec<String> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    flags_of(&cpuinfo).into_iter().map(str::to_owned).collect()
}

/// This CPU as `vendor family F model M` (the first processor's
/// `vendor_id`, `cpu family` and `model` in /proc/cpuinfo): the identity
/// export-time timings are recorded under (`models/split_model.py`'s
/// `cpu_identity` writes the same).
pub fn cpu_identity() -> String {
    identity_of(&std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default())
}

fn identity_of(cpuinfo: &str) -> String {
    let field = |key: &str| {
        cpuinfo
            .lines()
            .take_while(|line| !line.trim().is_empty())
            .filter_map(|line| line.split_once(':'))
            .find(|(k, _)| k.trim() == key)
            .map_or("?", |(_, value)| value.trim())
    };
    format!("{} family {} model {}", field("vendor_id"), field("cpu family"), field("model"))
}

fn flags_of(cpuinfo: &str) -> Vec<&str> {
    cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, f)| f.split_whitespace().collect())
        .unwrap_or_default()
}

fn bf16_flags(cpuinfo: &str) -> Vec<&'static str> {
    let flags = flags_of(cpuinfo);
    ["amx_bf16", "avx512_bf16"].into_iter().filter(|want| flags.contains(want)).collect()
}

fn int8_flags(cpuinfo: &str) -> Vec<&'static str> {
    let flags = flags_of(cpuinfo);
    let dot: Vec<_> =
        ["amx_int8", "avx512_vnni", "avx_vnni"].into_iter().filter(|want| flags.contains(want)).collect();
    if dot.is_empty() && flags.contains(&"avx2") {
        return vec!["avx2"];
    }
    dot
}

/// INT8 dense arithmetic needs AVX2 at least (x86's oneDNN INT8 GEMMs);
/// without it, it is refused, naming the flags. Whether this CPU can run a
/// given package (one quantized for VNNI's 8-bit activations cannot run on
/// AVX2 alone) is the package's own metadata, checked at its load.
pub(crate) fn require_cpu_int8() -> Result<(), BackendError> {
    let found = cpu_int8_instructions();
    if found.is_empty() {
        return Err(BackendError::setup(
            "--dense-precision int8 needs an x86 CPU with AVX2 or INT8 dot-product instructions (/proc/cpuinfo \
             flags avx2, avx512_vnni, avx_vnni, amx_int8), and this one has none; serve with --dense-precision fp32",
        ));
    }
    tracing::info!(instructions = %found.join(", "), "CPU INT8 instructions");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logs_name_the_precision_as_the_flag_does() {
        assert_eq!(DensePrecision::Fp32.to_string(), "fp32");
        assert_eq!(DensePrecision::Bf16.to_string(), "bf16");
        assert_eq!(DensePrecision::Int8.to_string(), "int8");
    }

    #[test]
    fn int8_instructions_are_read_from_the_cpu_flags() {
        let spr = "flags\t\t: fpu avx512f avx512_vnni amx_int8 amx_tile\n";
        assert_eq!(int8_flags(spr), ["amx_int8", "avx512_vnni"]);
        assert_eq!(int8_flags("flags\t\t: fpu avx2 avx_vnni\n"), ["avx_vnni"]);
        // Without dot products, AVX2 (7-bit activations).
        assert_eq!(int8_flags("flags\t\t: fpu avx2 fma avx512f\n"), ["avx2"]);
        assert!(int8_flags("flags\t\t: fpu sse4_2 avx\n").is_empty());
        assert!(int8_flags("").is_empty());
    }

    #[test]
    fn bf16_instructions_are_read_from_the_cpu_flags() {
        let amx = "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n";
        assert_eq!(bf16_flags(amx), ["amx_bf16", "avx512_bf16"]);
        let zen3 = "flags\t\t: fpu avx2 fma\n";
        assert!(bf16_flags(zen3).is_empty());
        assert!(bf16_flags("").is_empty());
    }

    #[test]
    fn a_cpu_is_identified_by_vendor_family_and_model_not_its_marketing_name() {
        let cpuinfo = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n\
                       model name\t: AMD EPYC\nflags\t\t: fpu avx2\n\nprocessor\t: 1\nmodel\t\t: 9\n";
        assert_eq!(identity_of(cpuinfo), "AuthenticAMD family 26 model 2");
        assert_eq!(identity_of(""), "? family ? model ?");
    }
}
