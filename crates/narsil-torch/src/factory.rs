//! The libtorch [`BackendFactory`]: registers FBGEMM, loads the model once,
//! and gives each lane thread inference mode, its intra-op thread count and
//! its own staging buffers.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use narsil_core::{BackendError, BackendFactory, ModelBackend, ModelSchema};

use crate::device::parse_device;
use crate::fbgemm::{default_fbgemm_dir, load_fbgemm_ops};
use crate::lane::{enter_inference_mode, TorchLane};
use crate::model::TorchModel;
use crate::precision::{cpu_bf16_instructions, DensePrecision};

/// bf16 on a CPU without bf16 instructions would be emulated, slower than
/// FP32: refused rather than served slowly, unless the config asks for
/// emulation ([`TorchConfig::bf16_emulated`]).
pub(crate) fn require_cpu_bf16(config: &TorchConfig) -> Result<(), BackendError> {
    let found = cpu_bf16_instructions();
    if config.bf16_emulated {
        tracing::warn!(instructions = %found.join(", "), "bf16 dense arithmetic emulated where the CPU lacks it");
        return Ok(());
    }
    if found.is_empty() {
        return Err(BackendError::setup(
            "--dense-precision bf16 needs a CPU with AVX512-BF16 or AMX-BF16 instructions, and this one has \
             neither (bf16 would be emulated, slower than FP32); serve with --dense-precision fp32",
        ));
    }
    tracing::info!(instructions = %found.join(", "), "CPU bf16 instructions");
    Ok(())
}

/// How to load and run a TorchScript model.
#[derive(Debug, Clone)]
pub struct TorchConfig {
    /// The TorchScript file (`model_default.pt` from `models/export_dlrm.py`,
    /// or a TorchRec-signature module).
    pub model: PathBuf,
    /// A TorchRec-signature model's schema (`model.json`); `None` for the
    /// one beside the model.
    pub model_config: Option<PathBuf>,
    /// `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// libtorch intra-op threads per lane.
    pub intra_op_threads: usize,
    /// Directory holding fbgemm_gpu's shared libraries; `None` for the one
    /// next to the linked libtorch.
    pub fbgemm_dir: Option<PathBuf>,
    /// Row counts each lane runs before reporting ready. The profiling
    /// executor specialises the graph over its first calls, so each shape
    /// class served should be warmed.
    pub warmup_rows: Vec<usize>,
    /// Precision of the dense arithmetic.
    pub dense_precision: DensePrecision,
    /// Where a split model's tables live (memory or mapped).
    pub table_store: narsil_embedding::TableStore,
    /// Runs bf16 dense arithmetic even on a CPU without bf16 instructions
    /// (libtorch emulates it, slower than FP32; the numerics are the same:
    /// bf16 operands, FP32 accumulation). For checking bf16 numerics on any
    /// CPU; no serving flag sets it.
    pub bf16_emulated: bool,
    /// A split model's dense network form (`--dense-form`).
    pub dense_form: crate::dense_network::DenseForm,
}

impl TorchConfig {
    /// CPU, one intra-op thread, FBGEMM next to libtorch, warm-up at 1, 100
    /// and 1,600 rows.
    pub fn new(model: impl Into<PathBuf>) -> Self {
        Self {
            model: model.into(),
            model_config: None,
            device: "cpu".into(),
            intra_op_threads: 1,
            fbgemm_dir: None,
            warmup_rows: vec![1, 100, 1600],
            dense_precision: DensePrecision::Fp32,
            table_store: narsil_embedding::TableStore::Memory,
            bf16_emulated: false,
            dense_form: crate::dense_network::DenseForm::Auto,
        }
    }
}

/// Loads a TorchScript DLRM once and creates lanes that share it.
pub struct TorchFactory {
    model: Arc<TorchModel>,
    config: TorchConfig,
}

impl TorchFactory {
    /// Registers FBGEMM's operators, then loads the model.
    pub fn load(config: TorchConfig) -> Result<Self, BackendError> {
        let started = Instant::now();
        if config.intra_op_threads == 0 {
            return Err(BackendError::setup("intra-op threads must be at least 1"));
        }
        let fbgemm_dir = config.fbgemm_dir.clone().unwrap_or_else(default_fbgemm_dir);
        let libs = load_fbgemm_ops(&fbgemm_dir)?;
        tracing::debug!(dir = %fbgemm_dir.display(), libraries = libs.len(), "FBGEMM operators registered");
        // After the libraries: opening libtorch.so is what registers CUDA.
        let device = parse_device(&config.device)?;
        if config.dense_precision == DensePrecision::Bf16 && device == tch::Device::Cpu {
            require_cpu_bf16(&config)?;
        }
        tch::set_num_threads(config.intra_op_threads as i32);
        let model = TorchModel::load(
            &config.model,
            config.model_config.as_deref(),
            device,
            &config.device,
            config.dense_precision,
        )?;
        let model = Arc::new(model);
        if model.dict_signature() {
            probe(&model, &config)?;
        }
        tracing::info!(
            model = %config.model.display(),
            device = %config.device,
            dense_precision = %config.dense_precision,
            features = model.schema().num_sparse(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "TorchScript model loaded"
        );
        Ok(Self { model, config })
    }
}

impl BackendFactory for TorchFactory {
    fn schema(&self) -> &ModelSchema {
        self.model.schema()
    }

    fn create_lane(&self, _lane: usize) -> Result<Box<dyn ModelBackend>, BackendError> {
        enter_inference_mode();
        Ok(Box::new(TorchLane::new(Arc::clone(&self.model), self.config.intra_op_threads)))
    }

    fn mlp_flops_per_sample(&self) -> Option<f64> {
        self.model.mlp_flops_per_sample()
    }

    fn warmup_rows(&self) -> Vec<usize> {
        self.config.warmup_rows.clone()
    }
}

/// One small forward with the schema's shape: a module that does not take
/// what its config describes (feature counts, output names) fails here, at
/// start-up, rather than on a client's request.
fn probe(model: &Arc<TorchModel>, config: &TorchConfig) -> Result<(), BackendError> {
    let batch = narsil_core::backend::warmup_batch(model.schema(), 2);
    // The lane checks every output's score count itself (WrongScoreCount).
    TorchLane::new(Arc::clone(model), config.intra_op_threads).forward(&batch).map(drop).map_err(|e| {
        // A layer bf16 cannot reach (an op without a bf16 kernel, a dtype
        // the model fixes itself) names the precision, not the schema.
        if config.dense_precision == DensePrecision::Bf16 && narsil_core::error_chain(&e).contains("BFloat16") {
            return BackendError::load(
                &config.model,
                "the model cannot run with --dense-precision bf16 (a 2-row forward failed on a bf16 tensor); \
                 serve it with --dense-precision fp32",
            )
            .caused_by(e);
        }
        let schema = model.schema();
        let source = model.schema_source().map_or("its narsil_schema()".into(), |p| p.display().to_string());
        BackendError::load(
            &config.model,
            format!(
                "{source} does not match the model: a 2-row forward with dense_features {}, {} sparse_features \
                 ({} weighted) and outputs {:?} failed",
                schema.num_dense,
                schema.num_sparse(),
                schema.num_sparse() - schema.num_unweighted(),
                schema.outputs
            ),
        )
        .caused_by(e)
    })
}
