//! A split model's dense network in the form the lane runs: the TorchScript
//! module (`dense.pt`, frozen, FP32 or bf16) or the AOTInductor package
//! (`dense.pt2`, FP32) the schema names. Both take `forward(dense, pooled)`
//! on CPU tensors the lane borrows and return the scores: one seam, so a
//! device other than the CPU is one more form, not a change to the lane.
//!
//! `--dense-form` chooses: `torchscript` (the default: on an AVX2-only
//! Zen 3 core the package measured 0.74-1.0x its speed, REPORTS.md
//! "AOTInductor dense networks") always runs `dense.pt`; `auto` runs the
//! package when the schema names one, the precision is FP32 and this CPU
//! has the instructions it was compiled for, and says at load which form it
//! runs and why; `pt2` requires the package (an error names what is
//! missing).

use std::fmt;
use std::path::Path;

use narsil_core::BackendError;
use narsil_embedding::SplitSchema;
use tch::{Device, Tensor};

use crate::aoti_package::AotiPackage;
use crate::precision::{cpu_flags, DensePrecision};
use crate::script_module::{LibtorchError, ScriptModule};

/// `--dense-form`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DenseForm {
    /// The package where it can run, else TorchScript.
    Auto,
    /// TorchScript (`dense.pt`).
    #[default]
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
    ) -> Result<Self, BackendError> {
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
        let loaded = ScriptModule::load(&network, Device::Cpu, precision).map_err(|e| {
            BackendError::load(&network, "not a TorchScript dense network libtorch can load").caused_by(e)
        })?;
        tracing::info!(file = %network.display(), "dense network: TorchScript");
        Ok(Self::TorchScript(loaded.module))
    }

    /// The package file to try, if any.
    fn package_to_run<'a>(
        dir: &Path,
        split: &'a SplitSchema,
        form: DenseForm,
        precision: DensePrecision,
    ) -> Result<Option<&'a Path>, BackendError> {
        let package = split.dense_package.as_deref();
        match (form, package) {
            (DenseForm::TorchScript, _) => Ok(None),
            (DenseForm::Pt2, None) => Err(BackendError::load(
                dir.join("schema.json"),
                "--dense-form pt2, but the schema names no dense_package (export the model again with \
                 models/export_dlrm.py --split, which compiles dense.pt2)",
            )),
            (DenseForm::Pt2, Some(_)) if precision != DensePrecision::Fp32 => Err(BackendError::load(
                dir,
                format!("--dense-form pt2 runs FP32 packages only; --dense-precision {precision} needs --dense-form torchscript or auto"),
            )),
            (DenseForm::Auto, Some(_)) if precision != DensePrecision::Fp32 => {
                tracing::info!(%precision, "the AOTInductor package is FP32: serving the TorchScript dense network");
                Ok(None)
            }
            (_, package) => Ok(package),
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
