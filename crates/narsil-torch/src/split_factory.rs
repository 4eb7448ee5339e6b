//! Loading a split model ([`crate::split`]) once and creating the lanes
//! that share it: on the CPU, the split lane (the embedding stage, then the
//! dense network); on CUDA (`--device cuda[:N]`), [`crate::device_lane`]'s
//! lanes (the dense network on the device, CUDA graphs per batch-size
//! bucket, the tables in device memory when they fit the budget, or on the
//! host with the CPU stage's pooled block copied through pinned buffers).
//! Above both `split` and `device_lane`, which never name it.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use narsil_core::{BackendError, BackendFactory, KeyedBatch, ModelBackend, ModelSchema};
use narsil_embedding::{EmbeddingStage, SplitSchema};
use tch::Device;

use crate::buckets::Buckets;
use crate::device::split_model_device;
use crate::device_lane::DeviceLane;
use crate::factory::{require_cpu_bf16, TorchConfig, DEVICE_TABLE_BYTES_ENV};
use crate::lane::enter_inference_mode;
use crate::precision::DensePrecision;
use crate::split::dense_cut::DenseCut;
use crate::split::dense_network::DenseNetwork;
use crate::split::lane::SplitLane;
use crate::split::model::SplitModel;
use crate::tensor_stage::{device_bytes, TablesNotOnDevice, TensorTables};
use crate::DenseForm;

/// Loads a split model once and creates lanes that share it.
pub struct SplitFactory {
    model: Arc<SplitModel>,
    config: TorchConfig,
}

fn load_error(dir: &Path, error: impl std::fmt::Display) -> BackendError {
    BackendError::load(dir, error.to_string())
}

impl SplitFactory {
    /// Reads the schema and every table of the split model in directory
    /// `config.model`, and loads its dense network.
    pub fn load(config: TorchConfig) -> Result<Self, BackendError> {
        let started = Instant::now();
        let dir = config.model.clone();
        if config.intra_op_threads == 0 {
            return Err(BackendError::setup("intra-op threads must be at least 1"));
        }
        if config.model_config.is_some() {
            return Err(BackendError::load(
                &dir,
                "a split model states its schema in schema.json; remove --model-config",
            ));
        }
        let device = split_model_device(&config.device)?;
        if config.dense_precision == DensePrecision::Bf16 && device == Device::Cpu {
            require_cpu_bf16(&config)?;
        }
        let device_path = device != Device::Cpu || config.device_path_on_cpu;
        let split = SplitSchema::read(&dir).map_err(|e| load_error(&dir, e))?;
        let buckets = match (&config.graph_buckets, device) {
            (Some(buckets), _) => buckets.clone(),
            // The device path on the CPU pads to the buckets the environment
            // names, if any (how `gpu_check.sh`'s dry run exercises them).
            (None, Device::Cpu)
                if config.device_path_on_cpu && std::env::var_os(crate::buckets::BUCKETS_ENV).is_some() =>
            {
                Buckets::from_env().map_err(BackendError::setup)?
            }
            (None, Device::Cpu) => Buckets::new(Vec::new()),
            (None, _) => Buckets::from_env().map_err(BackendError::setup)?,
        };
        let (stores, opened) = config.table_store.open(&dir, &split).map_err(|e| load_error(&dir, e))?;
        let device_tables = if device_path && split.takes_unpooled_inputs() {
            tracing::info!(
                ?device,
                "the model has sequence features or raw inputs: its tables stay on the host (the CPU stage looks \
                 sequences up, lays raw inputs out and pools; its values are copied to the device) and its dense \
                 network runs eagerly"
            );
            None
        } else if device_path {
            device_tables(&dir, &split, &stores, device, config.device_table_budget()?)?
        } else {
            None
        };
        let mut stage = EmbeddingStage::over_stores(&dir, &split, stores).map_err(|e| load_error(&dir, e))?;
        if device_tables.is_none() {
            stage.lay_out_mapped_tables();
        } else {
            stage.refuse_pushes(format!(
                "the model's tables are on the device ({device:?}): they were copied there when it loaded, and rows pushed since would not reach them; to serve new ids, publish a new model version whose tables and id maps hold them (or serve this one with its tables on the host)"
            ));
        }
        let mut schema = split.model_schema("torch", &config.device);
        tch::set_num_threads(config.intra_op_threads as i32);
        // A package's model instances: one per forward that can run at once
        // (lanes, and the load-time probe).
        let runners = std::thread::available_parallelism().map_or(2, |n| n.get()).max(2);
        let dense_network =
            DenseNetwork::load(&dir, &split, config.dense_form, config.dense_precision, runners, device)?;
        let network = dir.join(dense_network.file(&split, config.dense_precision));
        if dense_network.form() == DenseForm::Pt2 {
            schema.charge_package_working_sets();
        }
        let dense_cut = match device_path {
            // Device lanes run the whole network (CUDA graphs per bucket).
            true => None,
            false => DenseCut::load(&dir, &split, dense_network.form(), config.dense_precision, runners)?,
        };
        tracing::info!(
            model = %dir.display(),
            tables_read = opened.read,
            tables_shared = opened.shared,
            store = %config.table_store,
            dense_precision = %config.dense_precision,
            dense_form = %dense_network.form(),
            table_mib = opened.bytes >> 20,
            ?device,
            tables_on_device_mib = device_tables.as_ref().map(|t| t.bytes() >> 20),
            graph_buckets = ?buckets.rows(),
            features = schema.num_sparse(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "split model loaded"
        );
        let model = SplitModel {
            schema,
            stage,
            dense_network,
            dense_cut,
            precision: config.dense_precision,
            device,
            device_path,
            device_tables,
            buckets,
            dense_flops_per_sample: split.dense_flops_per_sample.map(|flops| flops as f64),
        };
        let factory = Self { model: Arc::new(model), config };
        // A dense network that does not take this schema's shape fails now,
        // not on a client's request.
        let batch = narsil_core::backend::warmup_batch(factory.schema(), 2);
        let probe = {
            // Without gradients, as the lanes run (factory.rs's `probe`).
            let _no_grad = tch::no_grad_guard();
            if factory.model.device_path {
                // Eager: no graphs are captured for the probe.
                DeviceLane::new(Arc::clone(&factory.model), factory.config.intra_op_threads, false)
                    .and_then(|mut lane| lane.forward(&batch))
            } else {
                SplitLane::new(Arc::clone(&factory.model), factory.config.intra_op_threads).forward(&batch)
            }
        };
        probe.map_err(|e| {
            BackendError::load(
                &network,
                "the dense network does not take this schema's dense and pooled inputs",
            )
            .caused_by(e)
        })?;
        Ok(factory)
    }

    /// The dense network's form it serves (what `--dense-form auto`
    /// chose).
    pub fn dense_form(&self) -> DenseForm {
        self.model.dense_network.form()
    }

    /// Whether its CPU lanes run ranking requests' dense arch once per
    /// request ([`crate::split::dense_cut`]).
    pub fn runs_dense_cut(&self) -> bool {
        self.model.dense_cut.is_some()
    }

    /// Whether its CPU lanes run `batch`'s user arithmetic once per request
    /// (the user-once top, [`crate::split::dense_cut`]).
    pub fn runs_user_once(&self, batch: &KeyedBatch) -> bool {
        self.model.dense_cut.as_ref().is_some_and(|cut| cut.runs_user_once(batch))
    }

    /// The lane the engine would create, on the calling thread (tests).
    pub fn lane(&self) -> Result<Box<dyn ModelBackend>, BackendError> {
        self.create_lane(0)
    }
}

/// Where the tables of a split model served on a device live: on the device
/// if every table is in this process and they fit the budget (`None`: any
/// that can be allocated on CUDA; none on the CPU device path), else on
/// the host. An explicit budget they exceed is an error naming both.
fn device_tables(
    dir: &Path,
    split: &SplitSchema,
    stores: &[Arc<dyn narsil_embedding::RowStore>],
    device: Device,
    budget: Option<u64>,
) -> Result<Option<TensorTables>, BackendError> {
    let budget = match (budget, device) {
        (Some(0), _) | (None, Device::Cpu) => return Ok(None),
        (Some(budget), _) => budget,
        (None, _) => u64::MAX,
    };
    let started = Instant::now();
    match TensorTables::upload(split, stores, device, budget) {
        Ok(tables) => {
            tracing::info!(
                ?device,
                mib = tables.bytes() >> 20,
                groups = tables.groups(),
                elapsed_ms = started.elapsed().as_millis() as u64,
                "tables uploaded to the device: lookups, dequantisation and pooling run there"
            );
            Ok(Some(tables))
        }
        Err(error @ TablesNotOnDevice::OverBudget { .. }) => Err(BackendError::load(dir, error.to_string())),
        Err(error) if budget != u64::MAX => Err(BackendError::load(
            dir,
            format!("{DEVICE_TABLE_BYTES_ENV} asks for the tables on the device, but {error}"),
        )),
        Err(error) => {
            tracing::warn!(
                ?device,
                table_mib = device_bytes(split) >> 20,
                reason = %error,
                "tables stay on the host (the CPU stage pools them; the pooled block is copied to the device)"
            );
            Ok(None)
        }
    }
}

impl BackendFactory for SplitFactory {
    fn schema(&self) -> &ModelSchema {
        &self.model.schema
    }

    fn create_lane(&self, _lane: usize) -> Result<Box<dyn ModelBackend>, BackendError> {
        enter_inference_mode();
        if self.model.device_path {
            return Ok(Box::new(DeviceLane::new(
                Arc::clone(&self.model),
                self.config.intra_op_threads,
                true,
            )?));
        }
        Ok(Box::new(SplitLane::new(Arc::clone(&self.model), self.config.intra_op_threads)))
    }

    fn warmup_rows(&self) -> Vec<usize> {
        self.config.warmup_rows.clone()
    }

    /// Both its lanes (host and device path) pool request-level bags once
    /// per unit.
    fn takes_request_level(&self) -> bool {
        true
    }

    fn dense_flops_per_sample(&self) -> Option<f64> {
        self.model.dense_flops_per_sample
    }

    fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        self.model.stage.metrics().register(registry);
    }

    fn watch_dependencies(&self, watcher: narsil_core::DependencyWatcher) {
        self.model.stage.watch_store(watcher);
    }

    fn push_ids(&self, push: &narsil_core::IdPush<'_>) -> Result<narsil_core::IdsPushed, String> {
        self.model.stage.push_ids(push)
    }

    fn id_map_tables(&self) -> Vec<narsil_core::IdMapTable> {
        self.model.stage.id_map_tables()
    }
}
