//! A split model's dense network in the form the lane runs: the TorchScript
//! module (`dense.pt`, frozen, FP32 or bf16) or the AOTInductor package
//! the schema names for the precision (`dense.pt2`, FP32;
//! `dense_bf16.pt2`, bf16; `dense_int8.pt2`, INT8). Both take `forward(dense, pooled)`
//! on CPU tensors the lane borrows and return the scores: one seam, so a
//! device other than the CPU is one more form, not a change to the lane.
//!
//! `--dense-form` chooses: `auto` (the default) runs the package when the
//! schema names one for the precision and this CPU has the instructions it
//! was compiled for, `dense.pt` otherwise, and says at load which form it
//! runs and why (the exporter keeps the Inductor settings that measured
//! fastest on its CPU: 1.7-2.1x TorchScript's samples/s in FP32 and
//! 1.07-1.25x in bf16 on an AVX-512 Zen 5 core, a tie on an AVX2 Zen 3,
//! REPORTS.md "AOTInductor dense networks"); `torchscript` always runs
//! `dense.pt`; `pt2` requires the package (an error names what is missing).
//!
//! `--dense-precision int8` has one form, the schema's `dense_package_int8`
//! (`models/export_dlrm.py --split --int8`: PT2E static quantization
//! compiled with Inductor's x86 path, INT8 GEMMs on prepacked oneDNN
//! weights). Its inputs stay FP32 (the graph quantizes them itself) and its
//! scores are FP32. It is never replaced by another form: a model without
//! the package, a CPU without the instructions it was compiled for (VNNI or
//! AMX-INT8; AVX2 where it was quantized there), `--dense-form torchscript`
//! or a device other than the CPU is refused, naming what is missing.
//! Where its export timed it against FP32 on this kind of CPU, the load
//! says how they compared, and warns where INT8 was the slower.
//!
//! On CUDA (`--device cuda[:N]`) the TorchScript network is loaded onto the
//! device (bf16: floating-point parameters only are cast, as on the CPU).
//! `auto` serves TorchScript there (a CUDA `.pt2` has not been checked on a
//! GPU machine yet: one segfaulted in the process that compiled it);
//! `pt2` loads the package only where its metadata says it was compiled for
//! CUDA (`AOTI_DEVICE_KEY`), and otherwise refuses, naming the file.

use std::fmt;
use std::path::Path;

use narsil_core::BackendError;
use narsil_embedding::{DenseFormTimings, SplitSchema};
use tch::{Device, Tensor};

use crate::aoti_package::AotiPackage;

/// The metadata key under which AOTInductor records the device a package
/// was compiled for (`cpu`, `cuda`).
pub const AOTI_DEVICE_KEY: &str = "AOTI_DEVICE_KEY";
use crate::precision::{cpu_flags, cpu_identity, DensePrecision};
use crate::script_module::{LibtorchError, ScriptModule};

/// `--dense-form`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DenseForm {
    /// The package where it can run, else TorchScript.
    #[default]
    Auto,
    /// TorchScript (`dense.pt`).
    TorchScript,
    /// The AOTInductor package (`dense.pt2`), required.
    Pt2,
}

impl DenseForm {
    /// The flag value.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::TorchScript => "torchscript",
            Self::Pt2 => "pt2",
        }
    }
}

impl fmt::Display for DenseForm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A loaded dense network.
pub enum DenseNetwork {
    /// A frozen TorchScript module.
    TorchScript(ScriptModule),
    /// An AOTInductor package.
    Package(AotiPackage),
}

impl DenseNetwork {
    /// Loads the dense network of the split model in `dir` in `form`.
    /// `runners`: forwards a package can run at once.
    pub fn load(
        dir: &Path,
        split: &SplitSchema,
        form: DenseForm,
        precision: DensePrecision,
        runners: usize,
        device: Device,
    ) -> Result<Self, BackendError> {
        if precision == DensePrecision::Int8 {
            return Self::load_int8(dir, split, form, runners, device);
        }
        if device != Device::Cpu {
            return Self::load_on_device(dir, split, form, precision, runners, device);
        }
        if let Some(package) = Self::package_to_run(dir, split, form, precision)? {
            let path = dir.join(package);
            let flags = cpu_flags();
            let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            match AotiPackage::load(&path, runners, &flags) {
                Ok(package) => {
                    tracing::info!(file = %path.display(), "dense network: AOTInductor package");
                    return Ok(Self::Package(package));
                }
                Err(e) if form == DenseForm::Pt2 => {
                    return Err(
                        BackendError::load(&path, "not an AOTInductor package this CPU can run").caused_by(e)
                    );
                }
                Err(e) => tracing::warn!(
                    file = %path.display(),
                    reason = %e,
                    "the AOTInductor package cannot run here: serving the TorchScript dense network"
                ),
            }
        }
        let network = dir.join(&split.dense_network);
        let loaded = load_script(&network, Device::Cpu, precision).map_err(|e| {
            BackendError::load(&network, "not a TorchScript dense network libtorch can load").caused_by(e)
        })?;
        tracing::info!(file = %network.display(), "dense network: TorchScript");
        Ok(Self::TorchScript(loaded.module))
    }

    /// [`Self::load`] in INT8: the INT8 package, or an error naming why not.
    fn load_int8(
        dir: &Path,
        split: &SplitSchema,
        form: DenseForm,
        runners: usize,
        device: Device,
    ) -> Result<Self, BackendError> {
        if device != Device::Cpu {
            return Err(BackendError::setup(format!(
                "--dense-precision int8 runs on the CPU only (dense_int8.pt2 is compiled for x86 INT8 \
                 instructions), not on {device:?}; serve with --dense-precision fp32 or bf16"
            )));
        }
        if form == DenseForm::TorchScript {
            return Err(BackendError::setup(
                "--dense-precision int8 has no TorchScript form (its INT8 network is the AOTInductor package \
                 dense_int8.pt2): serve with --dense-form auto or pt2",
            ));
        }
        crate::precision::require_cpu_int8()?;
        let Some(package) = split.dense_package_int8.as_deref() else {
            return Err(BackendError::load(
                dir.join("schema.json"),
                "--dense-precision int8, but the schema names no dense_package_int8: make it with \
                 models/export_dlrm.py --split --int8 (a DLRM_DCN: models/export_torchrec.py --split --pt2 \
                 --int8) on an x86 CPU with AVX2, AVX512-VNNI, AVX-VNNI or AMX-INT8, or serve with --dense-precision \
                 fp32",
            ));
        };
        let path = dir.join(package);
        let flags = cpu_flags();
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let package = AotiPackage::load(&path, runners, &flags).map_err(|e| {
            BackendError::load(&path, "not an INT8 AOTInductor package this CPU can run").caused_by(e)
        })?;
        let timings = split.dense_form_timings.as_ref();
        match timings.and_then(|timings| timings.int8_vs_fp32(&cpu_identity())) {
            Some(ratio) if ratio < 1.0 => tracing::warn!(
                file = %path.display(),
                cpu = timings.map_or("?", |timings| timings.cpu.as_str()),
                "dense network: INT8 AOTInductor package, which its export timed at {ratio:.2}x FP32's \
                 samples/s on this kind of CPU (the schema's dense_form_timings): --dense-precision fp32 \
                 serves more here"
            ),
            Some(ratio) => tracing::info!(
                file = %path.display(),
                "dense network: INT8 AOTInductor package ({ratio:.2}x FP32's samples/s as its export timed it \
                 on this kind of CPU)"
            ),
            None => tracing::info!(file = %path.display(), "dense network: INT8 AOTInductor package"),
        }
        Ok(Self::Package(package))
    }

    /// [`Self::load`] on a device other than the CPU.
    fn load_on_device(
        dir: &Path,
        split: &SplitSchema,
        form: DenseForm,
        precision: DensePrecision,
        runners: usize,
        device: Device,
    ) -> Result<Self, BackendError> {
        if form == DenseForm::Pt2 {
            let Some(package) = Self::package_to_run(dir, split, form, precision)? else {
                unreachable!("package_to_run refuses pt2 without a package")
            };
            let path = dir.join(package);
            let compiled_for = AotiPackage::metadata(&path, AOTI_DEVICE_KEY)
                .map_err(|e| BackendError::load(&path, "not an AOTInductor package").caused_by(e))?;
            if compiled_for.as_deref() != Some("cuda") {
                return Err(BackendError::load(
                    &path,
                    format!(
                        "--dense-form pt2 on {device:?}, but this package was compiled for {} ({AOTI_DEVICE_KEY}); \
                         compile one for CUDA on a GPU machine, or serve --dense-form torchscript (dense.pt runs on CUDA)",
                        compiled_for.as_deref().unwrap_or("an unnamed device")
                    ),
                ));
            }
            let package = AotiPackage::load_compiled_for_cuda(&path, runners).map_err(|e| {
                BackendError::load(&path, "a CUDA AOTInductor package libtorch cannot load").caused_by(e)
            })?;
            tracing::info!(file = %path.display(), ?device, "dense network: AOTInductor package for CUDA");
            return Ok(Self::Package(package));
        }
        let network = dir.join(&split.dense_network);
        let loaded = load_script(&network, device, precision).map_err(|e| {
            BackendError::load(
                &network,
                format!("not a TorchScript dense network libtorch can load on {device:?}"),
            )
            .caused_by(e)
        })?;
        tracing::info!(file = %network.display(), ?device, "dense network: TorchScript");
        Ok(Self::TorchScript(loaded.module))
    }

    /// The package file to try, if any: the schema's package for
    /// `precision` (`dense_package` for FP32, `dense_package_bf16` for bf16,
    /// `dense_package_int8` for INT8).
    fn package_to_run<'a>(
        dir: &Path,
        split: &'a SplitSchema,
        form: DenseForm,
        precision: DensePrecision,
    ) -> Result<Option<&'a Path>, BackendError> {
        let (package, field) = Self::package_for(split, precision);
        match (form, package) {
            (DenseForm::TorchScript, _) => Ok(None),
            (DenseForm::Pt2, None) => Err(BackendError::load(
                dir.join("schema.json"),
                format!(
                    "--dense-form pt2 with --dense-precision {precision}, but the schema names no {field} \
                     (export the model again with models/export_dlrm.py --split or models/export_torchrec.py \
                     --split --pt2, which compile dense.pt2, and dense_bf16.pt2 on a CPU with bf16 instructions)"
                ),
            )),
            (DenseForm::Auto, None) => {
                tracing::info!(%precision, "the schema names no {field}: serving the TorchScript dense network");
                Ok(None)
            }
            (DenseForm::Auto, Some(_))
                if auto_serves_torchscript(split.dense_form_timings.as_ref(), precision, &cpu_identity()) =>
            {
                tracing::info!(
                    %precision,
                    cpu = split.dense_form_timings.as_ref().map_or("?", |timings| timings.cpu.as_str()),
                    "--dense-form auto: the export timed the TorchScript dense network faster than {field} \
                     on this CPU: serving TorchScript"
                );
                Ok(None)
            }
            (_, package) => Ok(package),
        }
    }

    /// The schema's package for `precision`, and the field that names it.
    fn package_for(split: &SplitSchema, precision: DensePrecision) -> (Option<&Path>, &'static str) {
        match precision {
            DensePrecision::Fp32 => (split.dense_package.as_deref(), "dense_package"),
            DensePrecision::Bf16 => (split.dense_package_bf16.as_deref(), "dense_package_bf16"),
            DensePrecision::Int8 => (split.dense_package_int8.as_deref(), "dense_package_int8"),
        }
    }

    /// The file this network was loaded from.
    pub fn file<'a>(&self, split: &'a SplitSchema, precision: DensePrecision) -> &'a Path {
        match self {
            Self::Package(_) => Self::package_for(split, precision).0.unwrap_or(&split.dense_network),
            Self::TorchScript(_) => &split.dense_network,
        }
    }

    /// The form loaded (`TorchScript` or `Pt2`, never `Auto`).
    pub fn form(&self) -> DenseForm {
        match self {
            Self::TorchScript(_) => DenseForm::TorchScript,
            Self::Package(_) => DenseForm::Pt2,
        }
    }

    /// `forward(inputs...)`: the scores tensor.
    pub fn forward_tensors(&self, inputs: &[&Tensor]) -> Result<Tensor, LibtorchError> {
        match self {
            Self::TorchScript(module) => module.forward_tensors(inputs),
            Self::Package(package) => package.forward_tensors(inputs),
        }
    }
}

/// Whether `--dense-form auto` serves the TorchScript network instead of
/// the package in `precision`: only where the export timed both on a CPU
/// of this kind (`this_cpu`, [`cpu_identity`]) and TorchScript cost less
/// per sample (the form that wins differs by CPU: TorchScript 1.4x the
/// package on an Intel Xeon with AMX in FP32, the package 1.55x TorchScript
/// on a Zen 5). Elsewhere the package, as measured on most CPUs.
pub fn auto_serves_torchscript(
    timings: Option<&DenseFormTimings>,
    precision: DensePrecision,
    this_cpu: &str,
) -> bool {
    let Some(timings) = timings else { return false };
    let times = match precision {
        DensePrecision::Fp32 => timings.fp32.as_ref(),
        DensePrecision::Bf16 => timings.bf16.as_ref(),
        DensePrecision::Int8 => None,
    };
    timings.cpu == this_cpu && times.is_some_and(|times| times.torchscript_faster(&timings.rows))
}

/// Loads a TorchScript dense network. One that names FBGEMM's operators (a
/// network `models/extract_split.py` sliced out of a packaged TorchRec model
/// with sequence features keeps TorchRec's jagged-tensor ops, which are
/// FBGEMM's) is loaded again once they are registered: a split server
/// registers them only for such a network, since loading them opens
/// `libtorch.so` and its CUDA libraries.
fn load_script(
    network: &Path,
    device: Device,
    precision: DensePrecision,
) -> Result<crate::script_module::Loaded, LibtorchError> {
    match ScriptModule::load(network, device, precision) {
        Err(e) if e.0.contains("fbgemm::") => {
            let dir = crate::fbgemm::default_fbgemm_dir();
            crate::fbgemm::load_fbgemm_ops(&dir).map_err(|why| LibtorchError(format!("{e}; {why}")))?;
            tracing::info!(file = %network.display(), "dense network names FBGEMM's operators: registered them");
            ScriptModule::load(network, device, precision)
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use narsil_embedding::FormTimes;

    use super::*;

    fn timings(cpu: &str, fp32: Option<FormTimes>) -> DenseFormTimings {
        DenseFormTimings { cpu: cpu.into(), rows: vec![100, 1600], fp32, bf16: None, int8: None }
    }

    #[test]
    fn auto_serves_torchscript_only_where_the_export_timed_it_faster_on_this_kind_of_cpu() {
        let faster = || Some(FormTimes { torchscript_us: vec![150, 1500], pt2_us: vec![200, 2200] });
        let slower = || Some(FormTimes { torchscript_us: vec![200, 2200], pt2_us: vec![150, 1500] });
        let here = "GenuineIntel family 6 model 207";
        assert!(auto_serves_torchscript(Some(&timings(here, faster())), DensePrecision::Fp32, here));
        assert!(!auto_serves_torchscript(Some(&timings(here, slower())), DensePrecision::Fp32, here));
        // Timed on another kind of CPU: says nothing about this one.
        let there = "AuthenticAMD family 26 model 2";
        assert!(!auto_serves_torchscript(Some(&timings(there, faster())), DensePrecision::Fp32, here));
        // Not timed in this precision, or not at all.
        assert!(!auto_serves_torchscript(Some(&timings(here, faster())), DensePrecision::Bf16, here));
        assert!(!auto_serves_torchscript(Some(&timings(here, faster())), DensePrecision::Int8, here));
        assert!(!auto_serves_torchscript(None, DensePrecision::Fp32, here));
    }
}
