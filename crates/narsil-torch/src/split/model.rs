//! A split model as loaded once and shared by its lanes, the CPU ones
//! (`split`) and the device ones (`device_lane`): its embedding stage, its
//! dense network, and where and how the network runs.

use narsil_core::ModelSchema;
use narsil_embedding::EmbeddingStage;
use tch::Device;

use crate::buckets::Buckets;
use crate::precision::DensePrecision;
use crate::split::dense_cut::DenseCut;
use crate::split::dense_network::DenseNetwork;
use crate::tensor_stage::TensorTables;

/// A loaded split model: its embedding stage and its dense network.
pub(crate) struct SplitModel {
    pub(crate) schema: ModelSchema,
    pub(crate) stage: EmbeddingStage,
    pub(crate) dense_network: DenseNetwork,
    /// The dense network cut for ranking requests, where the schema names
    /// one and the CPU lanes run it ([`DenseCut::load`]).
    pub(crate) dense_cut: Option<DenseCut>,
    /// The dense network's parameters and inputs: FP32, or bf16 (the
    /// pooled block and the dense features cast as they enter it; FP32
    /// accumulation in oneDNN's GEMMs; scores returned in FP32).
    pub(crate) precision: DensePrecision,
    /// Where the dense network runs.
    pub(crate) device: Device,
    /// Lanes are device lanes (`DeviceLane`): any device but the CPU, or the
    /// CPU when the config asks (`TorchConfig::device_path_on_cpu`).
    pub(crate) device_path: bool,
    /// The tables in device memory, when they are there.
    pub(crate) device_tables: Option<TensorTables>,
    /// Device lanes' batch-size buckets.
    pub(crate) buckets: Buckets,
    /// The dense network's FLOPs per sample, as the schema states them.
    pub(crate) dense_flops_per_sample: Option<f64>,
}
