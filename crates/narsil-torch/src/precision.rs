//! The precision of the dense arithmetic (dense arch, interaction, over
//! arch) and whether this CPU can run bf16 at speed (and, for compiled
//! packages, the CPU's flags).
//!
//! bf16 casts the model's floating-point parameters to bf16 at load and asks
//! the INT8 embedding lookups for bf16 output; oneDNN then runs the GEMMs
//! with bf16 inputs and FP32 accumulation. Scores are FP32 either way.

use std::fmt;

/// `--dense-precision`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DensePrecision {
    /// FP32 everywhere (the exported model as it is).
    #[default]
    Fp32,
    /// bf16 dense arithmetic with FP32 accumulation.
    Bf16,
}

impl DensePrecision {
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            Self::Fp32 => "fp32",
            Self::Bf16 => "bf16",
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

/// Every flag of this CPU, as `/proc/cpuinfo` names them (`avx2`,
/// `avx512f`, `amx_tile`, ...); empty where it cannot be read.
pub fn cpu_flags() -> Vec<String> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    flags_of(&cpuinfo).into_iter().map(str::to_owned).collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logs_name_the_precision_as_the_flag_does() {
        assert_eq!(DensePrecision::Fp32.to_string(), "fp32");
        assert_eq!(DensePrecision::Bf16.to_string(), "bf16");
    }

    #[test]
    fn bf16_instructions_are_read_from_the_cpu_flags() {
        let amx = "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n";
        assert_eq!(bf16_flags(amx), ["amx_bf16", "avx512_bf16"]);
        let zen3 = "flags\t\t: fpu avx2 fma\n";
        assert!(bf16_flags(zen3).is_empty());
        assert!(bf16_flags("").is_empty());
    }
}
