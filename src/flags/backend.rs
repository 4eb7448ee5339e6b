//! The backend flags of `narsil serve` and `narsil bench-forward`: which
//! model, which backend, where it runs. Checked here, with the flags named;
//! loading is [`crate::lifecycle::loader`]'s.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use narsil_core::mock::MockConfig;
use narsil_core::BackendFactory;
use narsil_embedding::StoreFlags;

use crate::lifecycle::loader::LoadOptions;
pub use crate::lifecycle::loader::{BackendKind, DenseForm, DensePrecision, TableStore};

/// Which model to load, where to run it, and the mock's settings.
#[derive(Debug, Clone, clap::Args)]
pub struct BackendArgs {
    /// Model backend. Default: from `--model` (`burn` for a `.safetensors`
    /// file, `torch` for any other), `mock` without one.
    #[arg(long = "backend", env = "NARSIL_BACKEND", value_enum)]
    pub backend: Option<BackendKind>,
    /// Model file: TorchScript for torch (`model_default.pt` from
    /// models/export_dlrm.py, or a module with TorchRec's inference
    /// signature and a model.json beside it); FP32 safetensors
    /// (`weights_fp32.safetensors`) for burn, which without one serves a
    /// seeded random DLRM of the default shape. A directory is a split model
    /// (tables apart from the dense network, `export_*.py --split`), for
    /// torch, or for burn when its schema names `dense_weights`.
    #[arg(long, env = "NARSIL_MODEL")]
    pub model: Option<PathBuf>,
    /// Schema of a TorchRec-signature model (torch), when it is not the
    /// model.json beside the model file (models/README.md).
    #[arg(long, env = "NARSIL_MODEL_CONFIG")]
    pub model_config: Option<PathBuf>,
    /// Device for forward passes: `cpu`, `cuda` or `cuda:N`.
    #[arg(long, env = "NARSIL_DEVICE", default_value = "cpu")]
    pub device: String,
    /// Threads each forward may use inside the backend (torch; burn lanes
    /// are single-threaded: add lanes instead).
    #[arg(long, env = "NARSIL_INTRA_OP_THREADS", default_value_t = 1)]
    pub intra_op_threads: usize,
    /// torch, split models on `--device cuda`: the most bytes of tables held
    /// in the device's memory (lookups and pooling then run there); a model
    /// whose tables need more is refused, naming both. 0 keeps the tables on
    /// the host (the CPU stage pools, the pooled block is copied over).
    /// Unset: the tables go to the device when they fit in its memory.
    #[arg(long, env = "NARSIL_DEVICE_TABLE_BYTES")]
    pub device_table_bytes: Option<u64>,
    /// torch: directory of fbgemm_gpu's shared libraries (default: the
    /// fbgemm_gpu package next to the libtorch Narsil was built with).
    #[arg(long, env = "NARSIL_FBGEMM_DIR")]
    pub fbgemm_dir: Option<PathBuf>,
    /// torch: precision of the dense arithmetic. int8: a split model's
    /// INT8 dense network (dense_int8.pt2, written by `models/export_dlrm.py
    /// --split --int8` or, for a DLRM_DCN, `models/export_torchrec.py --split
    /// --pt2 --int8`, with its quality against FP32 in int8_quality.json),
    /// on CPUs with the instructions it was compiled for (AVX512-VNNI,
    /// AVX-VNNI or AMX-INT8; AVX2 for a package quantized there, with 7-bit
    /// activations); refused elsewhere and for models without that package.
    #[arg(long, env = "NARSIL_DENSE_PRECISION", value_enum, default_value_t = DensePrecision::Fp32)]
    pub dense_precision: DensePrecision,
    /// torch, split models: the dense network's form. `auto` runs the
    /// AOTInductor package the schema names for the precision (`dense.pt2`,
    /// `dense_bf16.pt2`) where this CPU has the instructions it was compiled
    /// for, unless the export timed `dense.pt` faster on this kind of CPU
    /// (the schema's `dense_form_timings`), else `dense.pt`; `torchscript`
    /// runs `dense.pt`; `pt2` requires the package.
    #[arg(long, env = "NARSIL_DENSE_FORM", value_enum, default_value_t = DenseForm::Auto)]
    pub dense_form: DenseForm,
    /// Split models (a `--model` directory): where their tables live.
    /// `memory` reads them into the process; `mmap` maps their files, so the
    /// page cache holds the hot rows and tables larger than RAM are served;
    /// `disk` reads each batch's rows from their files with direct I/O
    /// (never the page cache) into a row cache of --table-cache-bytes, for
    /// tables larger than the memory the server may use, all of a batch's
    /// reads in flight at once on an io_uring (`disk:io_uring` insists;
    /// `disk:threads` reads on a pool of threads; `disk` uses io_uring where
    /// the kernel allows it and threads elsewhere);
    /// `redis://HOST:PORT[,HOST:PORT...]` reads rows from the Redis Cluster
    /// at these seeds, where `narsil tables load` put them.
    #[arg(long, env = "NARSIL_TABLE_STORE", default_value = "memory")]
    pub table_store: TableStore,
    /// `disk` and `redis` table stores: the row cache's memory in bytes
    /// (each row rounded up to 8 bytes plus a 16-byte tag), shared by every
    /// lane, table and model version; 0 reads every row from the disk or the
    /// cluster.
    #[arg(long, env = "NARSIL_TABLE_CACHE_BYTES", default_value_t = narsil_embedding::stores::redis::DEFAULT_CACHE_BYTES)]
    pub table_cache_bytes: u64,
    /// `redis` table store: the longest one batch's fetch (every table,
    /// retries included) may take, milliseconds; a batch whose callers all
    /// set deadlines gives up at the latest of them if that comes first.
    #[arg(long, env = "NARSIL_TABLE_FETCH_TIMEOUT_MS", default_value_t = narsil_embedding::stores::redis::DEFAULT_FETCH_TIMEOUT.as_millis() as u64)]
    pub table_fetch_timeout_ms: u64,
    /// `redis` table store: what a row the cluster does not hold becomes.
    /// `error` fails the batch (UNAVAILABLE: no score computed from a
    /// missing row); `zero` pools it as zeros and counts it in
    /// `narsil_table_missing_rows_total`.
    #[arg(long, env = "NARSIL_MISSING_ROWS", default_value = "error")]
    pub missing_rows: narsil_embedding::MissingRows,
    /// Mock backend: fixed latency of one forward, milliseconds.
    #[arg(long, env = "NARSIL_MOCK_LATENCY_MS", default_value_t = 5.0)]
    pub mock_latency_ms: f64,
    /// Mock backend: extra latency per row, microseconds.
    #[arg(long, env = "NARSIL_MOCK_LATENCY_PER_ROW_US", default_value_t = 0.0)]
    pub mock_latency_per_row_us: f64,
    /// Mock backend: rows of each of its 26 tables (valid ids).
    #[arg(long, env = "NARSIL_MOCK_TABLE_ROWS", default_value_t = 100_000)]
    pub mock_table_rows: u64,
}

impl BackendArgs {
    /// Checks the rules between these flags that hold for any model file
    /// (a repository's versions each bring their own).
    pub fn validate_options(&self) -> anyhow::Result<()> {
        for (name, value) in [
            ("mock-latency-ms", self.mock_latency_ms),
            ("mock-latency-per-row-us", self.mock_latency_per_row_us),
        ] {
            if !value.is_finite() || value < 0.0 {
                anyhow::bail!("--{name} must be a non-negative number, got {value}");
            }
        }
        if self.intra_op_threads == 0 {
            anyhow::bail!("--intra-op-threads must be at least 1");
        }
        if self.table_fetch_timeout_ms == 0 {
            anyhow::bail!("--table-fetch-timeout-ms must be at least 1");
        }
        if self.device != "cpu" && self.device != "cuda" && !self.device.starts_with("cuda:") {
            anyhow::bail!("--device must be `cpu`, `cuda` or `cuda:N`, got `{}`", self.device);
        }
        Ok(())
    }

    /// Checks the rules between these flags.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.validate_options()?;
        if self.dense_precision == DensePrecision::Bf16 && self.kind() != BackendKind::Torch {
            anyhow::bail!(
                "--dense-precision bf16 is supported by --backend torch only (burn-flex runs bf16 matmuls through FP32); \
                 remove it or use --backend torch"
            );
        }
        if self.dense_precision == DensePrecision::Int8 && self.kind() != BackendKind::Torch {
            anyhow::bail!(
                "--dense-precision int8 is supported by --backend torch only (a split model's dense_int8.pt2); \
                 remove it or use --backend torch"
            );
        }
        match self.kind() {
            BackendKind::Mock | BackendKind::Burn if self.model_config.is_some() => {
                anyhow::bail!("--model-config is for --backend torch (TorchRec-signature models); remove it")
            }
            BackendKind::Mock if self.model.is_some() => {
                anyhow::bail!("--model is not used by --backend mock; remove it")
            }
            BackendKind::Mock if self.device != "cpu" => {
                anyhow::bail!("--backend mock runs on the CPU only; remove --device")
            }
            BackendKind::Torch if self.model.is_none() => anyhow::bail!(
                "--backend torch needs --model (a TorchScript file from models/export_dlrm.py; \
                 scripts/serve.sh exports and serves the default one)"
            ),
            _ => Ok(()),
        }
    }

    /// The backend asked for, or the one `--model` implies.
    pub fn kind(&self) -> BackendKind {
        match (self.backend, &self.model) {
            (Some(kind), _) => kind,
            (None, None) => BackendKind::Mock,
            (None, Some(model)) => BackendKind::for_file(model),
        }
    }

    /// How every model is loaded (the flags other than the model's own).
    pub fn load_options(&self) -> LoadOptions {
        LoadOptions {
            device: self.device.clone(),
            intra_op_threads: self.intra_op_threads,
            device_table_bytes: self.device_table_bytes,
            fbgemm_dir: self.fbgemm_dir.clone(),
            dense_precision: self.dense_precision,
            dense_form: self.dense_form,
            table_store: self.table_store.with_flags(&StoreFlags {
                cache_bytes: self.table_cache_bytes,
                fetch_timeout: Duration::from_millis(self.table_fetch_timeout_ms),
                missing_rows: self.missing_rows,
            }),
            mock: MockConfig {
                latency: Duration::from_secs_f64(self.mock_latency_ms / 1e3),
                per_row: Duration::from_secs_f64(self.mock_latency_per_row_us / 1e6),
            },
            mock_table_rows: self.mock_table_rows,
        }
    }

    /// Loads (or, for the mock, configures) the backend these flags ask for.
    pub fn build(&self) -> anyhow::Result<Arc<dyn BackendFactory>> {
        self.validate()?;
        self.load_options().load(self.kind(), self.model.as_deref(), self.model_config.as_deref())
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        backend: BackendArgs,
    }

    fn error(args: &[&str]) -> String {
        let mut argv = vec!["narsil"];
        argv.extend_from_slice(args);
        Cli::parse_from(argv).backend.validate().unwrap_err().to_string()
    }

    #[test]
    fn flag_rules_name_the_flag() {
        assert!(error(&["--backend", "torch"]).contains("--model"));
        assert!(error(&["--backend", "mock", "--model", "m.pt"]).contains("--model"));
        assert!(error(&["--backend", "mock", "--device", "cuda:0"]).contains("--device"));
        assert!(error(&["--device", "gpu"]).contains("--device"));
        assert!(error(&["--intra-op-threads", "0"]).contains("--intra-op-threads"));
        assert!(error(&["--mock-latency-ms=-1"]).contains("--mock-latency-ms"));
        assert!(error(&["--backend", "burn", "--dense-precision", "bf16"]).contains("--dense-precision"));
    }

    #[test]
    fn store_flags_reach_the_store_that_takes_them() {
        let store = |args: &[&str]| {
            let mut argv = vec!["narsil"];
            argv.extend_from_slice(args);
            Cli::parse_from(argv).backend.load_options().table_store.to_string()
        };
        let flags = ["--table-cache-bytes", "0", "--table-fetch-timeout-ms", "40", "--missing-rows", "zero"];
        assert_eq!(
            store(&[&["--table-store", "redis://h:1"][..], &flags].concat()),
            "redis://h:1 (cache 0 MiB, fetch timeout 40ms, missing rows: zero)"
        );
        assert_eq!(store(&[&["--table-store", "mmap"][..], &flags].concat()), "mmap");
        assert_eq!(store(&[]), "memory");
    }

    #[test]
    fn burn_without_a_model_is_a_valid_no_setup_default() {
        Cli::parse_from(["narsil", "--backend", "burn"]).backend.validate().unwrap();
    }
}
