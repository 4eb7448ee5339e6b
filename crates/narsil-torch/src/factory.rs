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
    pub dense_form: crate::split::dense_network::DenseForm,
    /// A split model on a device: the byte budget for its tables in device
    /// memory (`None`: `NARSIL_DEVICE_TABLE_BYTES` if set). Neither: on CUDA, every table
    /// held in this process goes to the device if it can be allocated
    /// there (else the tables stay on the host); on the CPU device path,
    /// tables stay on the host. `Some(0)`: tables stay on the host (the
    /// CPU stage pools them; the pooled block is copied). `Some(n)`: tables
    /// go to the device, and a model whose tables take more than `n` bytes
    /// is refused, naming both.
    pub device_table_bytes: Option<u64>,
    /// Serves a split model through the device lane on the CPU device
    /// (staging buffers, the tensor stage, padded buckets, the double-buffer
    /// hand-off): the GPU path's logic, testable without a GPU. No serving
    /// flag sets it; `narsil serve` sets it under
    /// [`DEVICE_PATH_ON_CPU_ENV`]`=1` (`gpu_check.sh`'s dry run).
    pub device_path_on_cpu: bool,
    /// Batch-size buckets for CUDA graphs (and padded forwards on the CPU
    /// device path); `None`: `NARSIL_CUDA_GRAPH_BUCKETS` or the default on
    /// CUDA, none on the CPU.
    pub graph_buckets: Option<crate::buckets::Buckets>,
}

/// Environment variable that serves split models on `--device cpu` through
/// the device lane ([`TorchConfig::device_path_on_cpu`]): for checks of the
/// GPU path's logic on a CPU, never for serving.
pub const DEVICE_PATH_ON_CPU_ENV: &str = "NARSIL_DEVICE_PATH_ON_CPU";

/// Environment variable with the device table budget
/// ([`TorchConfig::device_table_bytes`]).
pub const DEVICE_TABLE_BYTES_ENV: &str = "NARSIL_DEVICE_TABLE_BYTES";

/// Parses a byte count: digits, optionally followed by `KiB`, `MiB` or
/// `GiB`.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, ""),
    };
    let shift = match unit.trim() {
        "" | "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        _ => return Err(format!("{text:?} is not a byte count (digits, optionally KiB, MiB or GiB)")),
    };
    let value: u64 = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a byte count (digits, optionally KiB, MiB or GiB)"))?;
    value.checked_mul(1 << shift).ok_or_else(|| format!("{text:?} is too many bytes"))
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
            dense_form: crate::split::dense_network::DenseForm::Auto,
            device_table_bytes: None,
            device_path_on_cpu: false,
            graph_buckets: None,
        }
    }

    /// The device table budget: [`TorchConfig::device_table_bytes`], else
    /// `NARSIL_DEVICE_TABLE_BYTES` (an error names the variable), else none.
    pub fn device_table_budget(&self) -> Result<Option<u64>, BackendError> {
        if self.device_table_bytes.is_some() {
            return Ok(self.device_table_bytes);
        }
        match std::env::var(DEVICE_TABLE_BYTES_ENV) {
            Err(_) => Ok(None),
            Ok(text) => parse_bytes(&text)
                .map(Some)
                .map_err(|e| BackendError::setup(format!("{DEVICE_TABLE_BYTES_ENV}: {e}"))),
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
        let on_cuda = config.device != "cpu";
        let libs = load_fbgemm_ops(&fbgemm_dir).map_err(|e| {
            if on_cuda {
                fbgemm_on_cuda(&config).caused_by(e)
            } else {
                e
            }
        })?;
        tracing::debug!(dir = %fbgemm_dir.display(), libraries = libs.len(), "FBGEMM operators registered");
        // After the libraries: opening libtorch.so is what registers CUDA.
        let device = parse_device(&config.device)?;
        if config.dense_precision == DensePrecision::Bf16 && device == tch::Device::Cpu {
            require_cpu_bf16(&config)?;
        }
        if config.dense_precision == DensePrecision::Int8 {
            return Err(BackendError::load(
                &config.model,
                "--dense-precision int8 serves a split model's INT8 dense network (dense_int8.pt2), and this is a \
                 single-file model; serve its split form made with models/export_dlrm.py --split --int8 (--model \
                 <OUT>/split), or this model with --dense-precision fp32 or bf16",
            ));
        }
        tch::set_num_threads(config.intra_op_threads as i32);
        let model = TorchModel::load(
            &config.model,
            config.model_config.as_deref(),
            device,
            &config.device,
            config.dense_precision,
        )
        .map_err(|e| if on_cuda { fbgemm_on_cuda(&config).caused_by(e) } else { e })?;
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

    fn dense_flops_per_sample(&self) -> Option<f64> {
        self.model.dense_flops_per_sample()
    }

    fn warmup_rows(&self) -> Vec<usize> {
        self.config.warmup_rows.clone()
    }
}

/// A single-file model on CUDA that could not be loaded there: its INT8
/// tables need fbgemm_gpu's CUDA operators.
fn fbgemm_on_cuda(config: &TorchConfig) -> BackendError {
    BackendError::load(
        &config.model,
        format!(
            "a single-file TorchScript model on --device {} runs its INT8 embedding tables through fbgemm_gpu's CUDA \
             operators, which need fbgemm_gpu built for CUDA (the GPU machines here have none); the split form \
             serves on CUDA: --model <its split directory> (models/export_dlrm.py --split, \
             models/export_torchrec.py --split, models/extract_split.py)",
            config.device
        ),
    )
}

/// One small forward with the schema's shape: a module that does not take
/// what its config describes (feature counts, output names) fails here, at
/// start-up, rather than on a client's request.
fn probe(model: &Arc<TorchModel>, config: &TorchConfig) -> Result<(), BackendError> {
    let batch = narsil_core::backend::warmup_batch(model.schema(), 2);
    // Without gradients, as every lane runs (in inference mode): a graph
    // TorchScript first profiled with them, for a model whose parameters
    // still ask for gradients (as trained models are saved), would save
    // tensors for backward in the lanes' forwards and fail there.
    let _no_grad = tch::no_grad_guard();
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
