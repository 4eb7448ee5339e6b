//! Loading a model file into a backend: which backend a file needs, and the
//! settings every model is loaded with (device, threads, precision, the
//! mock's latency). The command line makes these from its flags
//! (`flags::backend`); the repository watcher loads every version with them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::ValueEnum;
use narsil_core::mock::{MockConfig, MockFactory};
use narsil_core::{BackendFactory, ModelSchema};
pub use narsil_embedding::TableStore;

/// Which model backend serves requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// Fixed-latency mock with deterministic scores (measures the engine).
    Mock,
    /// TorchScript DLRM through libtorch (Cargo feature `torch`).
    Torch,
    /// Pure-Rust DLRM through Burn (Cargo feature `burn`).
    Burn,
}

impl BackendKind {
    /// The flag value naming this backend.
    pub fn name(self) -> &'static str {
        match self {
            Self::Mock => "mock",
            Self::Torch => "torch",
            Self::Burn => "burn",
        }
    }

    /// The backend a model file needs: `burn` for `.safetensors`, `torch`
    /// for any other; a split model's `schema.json` goes to `torch` when
    /// this binary has it, else to `burn` (which serves split models whose
    /// schema names `dense_weights`).
    pub fn for_file(model: &Path) -> Self {
        match model.extension() {
            Some(e) if e == "safetensors" => Self::Burn,
            _ if !cfg!(feature = "torch") && is_split(model) => Self::Burn,
            _ => Self::Torch,
        }
    }
}

/// The arithmetic of the dense arch, interaction and over arch (embedding
/// tables keep their own type, INT8 in the default model; scores are FP32
/// either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DensePrecision {
    /// FP32.
    Fp32,
    /// bf16 inputs with FP32 accumulation (torch; needs AVX512-BF16 or AMX on CPU).
    Bf16,
    /// INT8 GEMMs (torch, split models with dense_int8.pt2 from `models/export_dlrm.py --split --int8`; needs
    /// the instructions it was compiled for: AVX512-VNNI, AVX-VNNI, AMX-INT8, or AVX2).
    Int8,
}

/// A split model's dense network form (torch).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DenseForm {
    /// The AOTInductor package the schema names for the precision where
    /// this CPU has the instructions it was compiled for; TorchScript
    /// (`dense.pt`) otherwise.
    Auto,
    /// The TorchScript dense network.
    Torchscript,
    /// The AOTInductor package, required.
    Pt2,
}

/// How every model is loaded, whatever its file.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Device for forward passes: `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// Threads each forward may use inside the backend (torch).
    pub intra_op_threads: usize,
    /// torch split models on CUDA: the most bytes of tables held in the
    /// device's memory (`--device-table-bytes`; `None`: as many as fit).
    pub device_table_bytes: Option<u64>,
    /// torch: directory of fbgemm_gpu's shared libraries (default: next to
    /// the libtorch Narsil was built with).
    pub fbgemm_dir: Option<PathBuf>,
    /// torch: precision of the dense arithmetic.
    pub dense_precision: DensePrecision,
    /// torch split models: the dense network's form.
    pub dense_form: DenseForm,
    /// Split models: where their tables live (`--table-store`, with the
    /// store flags applied).
    pub table_store: TableStore,
    /// The mock backend's latency.
    pub mock: MockConfig,
    /// The mock backend's rows per table (valid ids).
    pub mock_table_rows: u64,
}

impl LoadOptions {
    /// Loads `model` (none: the mock, or Burn's seeded random DLRM) into
    /// `kind`; `model_config` is a TorchRec-signature model's schema when it
    /// is not the `model.json` beside the file.
    pub fn load(
        &self,
        kind: BackendKind,
        model: Option<&Path>,
        model_config: Option<&Path>,
    ) -> anyhow::Result<Arc<dyn BackendFactory>> {
        if self.dense_precision == DensePrecision::Bf16 && kind != BackendKind::Torch {
            anyhow::bail!(
                "bf16 dense precision is supported by torch models only (burn-flex runs bf16 matmuls \
                 through FP32); this model needs {}",
                kind.name()
            );
        }
        if self.dense_precision == DensePrecision::Int8 && kind != BackendKind::Torch {
            anyhow::bail!(
                "int8 dense precision is a torch split model's dense_int8.pt2 (models/export_dlrm.py --split --int8); \
                 this model needs {}",
                kind.name()
            );
        }
        match kind {
            BackendKind::Mock => {
                let schema = ModelSchema::dlrm("mock", "cpu", self.mock_table_rows);
                Ok(Arc::new(MockFactory::new(schema, self.mock)))
            }
            BackendKind::Torch => {
                let model = model.ok_or_else(|| anyhow::anyhow!("a torch model needs a TorchScript file"))?;
                self.load_torch(model, model_config)
            }
            BackendKind::Burn => self.load_burn(model),
        }
    }

    /// Loads a model file with the backend it needs ([`BackendKind::for_file`]).
    pub fn load_file(&self, model: &Path) -> anyhow::Result<Arc<dyn BackendFactory>> {
        self.load(BackendKind::for_file(model), Some(model), None)
    }

    #[cfg(feature = "burn")]
    fn load_burn(&self, model: Option<&Path>) -> anyhow::Result<Arc<dyn BackendFactory>> {
        if self.device != "cpu" {
            anyhow::bail!("--backend burn runs on the CPU in this build; remove --device");
        }
        let factory = match model {
            Some(path) if is_split(path) => {
                narsil_burn::BurnFactory::load_split(split_dir(path), self.table_store.clone())?
            }
            Some(path) => narsil_burn::BurnFactory::load(path)?,
            None => {
                tracing::info!(
                    "no --model: generating a seeded random DLRM (26 x 100,000 x 64, seed 0) for --backend burn"
                );
                narsil_burn::BurnFactory::random(&narsil_burn::DlrmShape::default(), 0)?
            }
        };
        Ok(Arc::new(factory))
    }

    #[cfg(not(feature = "burn"))]
    fn load_burn(&self, _model: Option<&Path>) -> anyhow::Result<Arc<dyn BackendFactory>> {
        Err(not_compiled(BackendKind::Burn))
    }

    #[cfg(feature = "torch")]
    fn load_torch(
        &self,
        model: &Path,
        model_config: Option<&Path>,
    ) -> anyhow::Result<Arc<dyn BackendFactory>> {
        let mut config = narsil_torch::TorchConfig::new(model.to_path_buf());
        config.device = self.device.clone();
        config.model_config = model_config.map(Path::to_path_buf);
        config.intra_op_threads = self.intra_op_threads;
        config.device_table_bytes = self.device_table_bytes;
        config.device_path_on_cpu =
            std::env::var(narsil_torch::DEVICE_PATH_ON_CPU_ENV).is_ok_and(|value| value == "1");
        config.fbgemm_dir = self.fbgemm_dir.clone();
        config.table_store = self.table_store.clone();
        config.dense_precision = match self.dense_precision {
            DensePrecision::Fp32 => narsil_torch::DensePrecision::Fp32,
            DensePrecision::Bf16 => narsil_torch::DensePrecision::Bf16,
            DensePrecision::Int8 => narsil_torch::DensePrecision::Int8,
        };
        config.dense_form = match self.dense_form {
            DenseForm::Auto => narsil_torch::DenseForm::Auto,
            DenseForm::Torchscript => narsil_torch::DenseForm::TorchScript,
            DenseForm::Pt2 => narsil_torch::DenseForm::Pt2,
        };
        // A directory, or a repository version's schema.json, is a split
        // model (tables apart from the dense network).
        if is_split(model) {
            config.model = split_dir(model).to_path_buf();
            return Ok(Arc::new(narsil_torch::SplitFactory::load(config)?));
        }
        if let Some(hint) = faster_form_hint(model) {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| tracing::info!("{hint}"));
        }
        Ok(Arc::new(narsil_torch::TorchFactory::load(config)?))
    }

    #[cfg(not(feature = "torch"))]
    fn load_torch(&self, _model: &Path, _config: Option<&Path>) -> anyhow::Result<Arc<dyn BackendFactory>> {
        Err(not_compiled(BackendKind::Torch))
    }
}

/// For a single-file TorchScript model, how to serve its faster form: the
/// split model (tables in Narsil's stage, the dense network as an
/// AOTInductor package: 1.5-1.8x the single file's throughput on AVX-512
/// CPUs, REPORTS.md), where it sits beside the model or can be made from
/// it; `None` when neither is known.
#[cfg(any(feature = "torch", test))]
fn faster_form_hint(model: &Path) -> Option<String> {
    let dir = model.parent()?;
    let split = dir.join("split");
    if split.join(super::repository::SPLIT_SCHEMA).is_file() {
        return Some(format!(
            "{} has a split form beside it, usually faster (a .pt2 dense network where one was compiled): \
             serve it with --model {}",
            model.display(),
            split.display()
        ));
    }
    let config = std::fs::read_to_string(dir.join("model.json")).ok()?;
    if declares_sequences(&config) {
        return Some(format!(
            "{} is a single-file TorchRec model with sequence features: each request's history is copied into \
             every candidate row and looked up again per row; its split form looks each history up once per \
             request: make it once with `.venv/bin/python models/extract_split.py {}` and serve --model {}",
            model.display(),
            dir.display(),
            dir.join("extracted").display()
        ));
    }
    Some(format!(
        "{} is a single-file TorchRec model; its split form (an AOTInductor dense network) is usually \
         faster: make it once with `.venv/bin/python models/extract_split.py {} --pt2` and serve \
         --model {}",
        model.display(),
        dir.display(),
        dir.join("extracted").display()
    ))
}

/// Whether a `model.json`'s text declares sequence features (a non-empty
/// `sequences`).
#[cfg(any(feature = "torch", test))]
fn declares_sequences(config: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(config)
        .ok()
        .and_then(|v| v.get("sequences").and_then(|s| s.as_array()).map(|s| !s.is_empty()))
        .unwrap_or(false)
}

/// Whether `model` is a split model: its directory, or its `schema.json`
/// (a model repository's version).
fn is_split(model: &Path) -> bool {
    model.is_dir() || model.file_name().is_some_and(|name| name == super::repository::SPLIT_SCHEMA)
}

/// A split model's directory, given it or its `schema.json`.
#[cfg(any(feature = "torch", feature = "burn"))]
fn split_dir(model: &Path) -> &Path {
    if model.is_dir() {
        model
    } else {
        model.parent().unwrap_or(Path::new("."))
    }
}

#[cfg(not(all(feature = "torch", feature = "burn")))]
fn not_compiled(kind: BackendKind) -> anyhow::Error {
    anyhow::anyhow!(
        "--backend {0} is not compiled into this binary; rebuild with `cargo build --release --features {0}` \
         (scripts/serve.sh does this for torch)",
        kind.name()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_single_file_model_is_told_its_faster_split_form_beside_it_or_how_to_make_it() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("model.pt");
        assert_eq!(faster_form_hint(&model), None, "nothing known about this file");
        std::fs::write(dir.path().join("model.json"), "{}").unwrap();
        let make = faster_form_hint(&model).unwrap();
        assert!(make.contains("models/extract_split.py") && make.contains("--pt2"), "{make}");
        let sequences = r#"{"sequences": [{"name": "history", "features": ["hist_item"], "max_len": 8}]}"#;
        std::fs::write(dir.path().join("model.json"), sequences).unwrap();
        let make = faster_form_hint(&model).unwrap();
        assert!(make.contains("sequence features") && make.contains("once per request"), "{make}");
        assert!(make.contains("models/extract_split.py") && !make.contains("--pt2"), "{make}");
        std::fs::create_dir(dir.path().join("split")).unwrap();
        std::fs::write(dir.path().join("split/schema.json"), "{}").unwrap();
        let beside = faster_form_hint(&model).unwrap();
        assert!(beside.contains(&format!("--model {}", dir.path().join("split").display())), "{beside}");
    }

    #[test]
    fn the_file_names_its_backend() {
        assert_eq!(BackendKind::for_file(Path::new("m/1/model.safetensors")), BackendKind::Burn);
        assert_eq!(BackendKind::for_file(Path::new("m/1/model.pt")), BackendKind::Torch);
        let split = if cfg!(feature = "torch") { BackendKind::Torch } else { BackendKind::Burn };
        let repo = tempfile::tempdir().unwrap();
        std::fs::write(repo.path().join("schema.json"), "{}").unwrap();
        assert_eq!(BackendKind::for_file(&repo.path().join("schema.json")), split);
    }
}
