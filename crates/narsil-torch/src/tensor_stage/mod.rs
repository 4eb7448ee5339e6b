//! The embedding stage as tensor operations on any tch device: a split
//! model's tables uploaded once (at load) to the device, and per fused batch
//! lookup, INT8 row-wise dequantisation and pooling run there. On CUDA this
//! keeps the tables in GPU memory and sends only the batch's ids (~0.3 MB for
//! 1,600 rows of the default DLRM) instead of its pooled block (~10 MB); on
//! the CPU device it is the same code, which is how it is tested here against
//! the CPU stage ([`narsil_embedding::EmbeddingStage::pool`]).
//!
//! Layout and arithmetic follow `narsil-embedding`'s `pool.rs` (FBGEMM's
//! inference layout): an INT8 row is an fp16 scale, an fp16 bias (its first
//! four bytes), then `dim` uint8 values, padded to a multiple of 16 bytes; a
//! pooled value is `sum over the bag of (scale * w) * q + bias * w` in FP32.
//! Here each id's term is computed separately and the terms are summed by
//! `index_add_` (on CUDA: atomics, in no fixed order), so the result is the
//! CPU stage's up to FP32 rounding of the summation order: within
//! [`TOLERANCE`] (stated and tested). Mean pooling folds `1 / len` into each
//! id's multiplier (FBGEMM multiplies the sum; same value up to rounding).
//!
//! Tables of one row format are laid end to end in one device tensor (a
//! "group"), so a batch costs one gather, one dequantisation and one
//! `index_add_` per group (usually one), whatever the number of tables: a
//! GPU's forward is launch-bound, not bandwidth-bound. Ids are mapped to
//! rows of the group (`id + the table's first row`) and to their bag
//! (`row * features + feature`, the pooled block's `[rows, features * dim]`
//! layout) on the host ([`Lookup::fill`], plain Rust, range-checked: an
//! out-of-range index on a GPU is a device assert that ends the process's
//! CUDA context). No batch-wide dedup: gathering a duplicated row again is
//! one more row read, far cheaper on a GPU than a host-side dedup pass.

mod lookup;

use std::sync::Arc;

use narsil_core::BackendError;
use narsil_embedding::{PoolingMode, RowStore, SplitSchema, Storage};
use tch::{Device, Kind, Tensor};

use crate::lane::torch_error;
pub use lookup::{DeviceLookup, GroupLookup, Lookup};

/// How far the tensor stage's pooled values may be from the CPU stage's:
/// `|tensor - cpu| <= TOLERANCE * (1 + |cpu|)` (FP32 rounding of a
/// different summation order, and of a mean's `1 / len` folded per id).
pub const TOLERANCE: f32 = 1e-5;

/// One group's rows on the device.
struct Group {
    storage: Storage,
    /// INT8: uint8 `[rows, row_bytes]`; FP32: f32 `[rows, dim]`.
    rows: Tensor,
}

/// A feature's table, as a place in a group.
#[derive(Debug, Clone)]
pub struct FeatureTable {
    /// The feature's name (errors name it).
    pub name: String,
    /// Its table's group.
    pub group: usize,
    /// The table's first row in the group.
    pub base: i64,
    /// The table's rows.
    pub rows: u64,
    /// Sum or mean.
    pub mode: PoolingMode,
    /// Whether its ids come with weights.
    pub weighted: bool,
}

/// A split model's tables on a device.
pub struct TensorTables {
    groups: Vec<Group>,
    features: Vec<FeatureTable>,
    dim: usize,
    bytes: u64,
    device: Device,
}

// SAFETY: after `upload` the tables' tensors are only read (`index_select`
// from any lane; libtorch's kernels do not write their inputs, and reading
// one tensor from several threads at once is safe); nothing takes `&mut`
// to them, and they are freed once, with the value.
unsafe impl Sync for TensorTables {}

/// Why tables cannot be put on the device.
#[derive(Debug, thiserror::Error)]
pub enum TablesNotOnDevice {
    /// A table's rows are not in this process (disk, Redis).
    #[error("table {table:?} is in the {store} store, not in this process's memory")]
    NotLocal {
        /// The table.
        table: String,
        /// Its store.
        store: &'static str,
    },
    /// They do not fit the budget.
    #[error(
        "the {tables} tables take {bytes} bytes ({mib} MiB), more than the device table budget of {budget} bytes \
         (NARSIL_DEVICE_TABLE_BYTES); raise it, or set it to 0 to keep the tables on the host (the CPU stage pools \
         them and the pooled block is copied to the device)"
    )]
    OverBudget {
        /// Tables.
        tables: usize,
        /// Their bytes.
        bytes: u64,
        /// `bytes` in MiB.
        mib: u64,
        /// The budget.
        budget: u64,
    },
    /// libtorch failed (an allocation on the device, most likely).
    #[error("uploading table {table:?} ({bytes} bytes) to {device:?} failed: {source}")]
    Upload {
        /// The table.
        table: String,
        /// Its bytes.
        bytes: u64,
        /// The device.
        device: Device,
        /// Why.
        source: tch::TchError,
    },
}

/// Bytes the tables of `schema` take on a device.
pub fn device_bytes(schema: &SplitSchema) -> u64 {
    schema.tables.iter().map(|t| t.rows * t.storage.row_bytes(t.dim) as u64).sum()
}

impl TensorTables {
    /// Uploads every table of `schema` (table `i`'s rows in `stores[i]`,
    /// which must hold them in this process) to `device`, if their bytes fit
    /// `budget`. Tables in popularity order are put back in id order.
    pub fn upload(
        schema: &SplitSchema,
        stores: &[Arc<dyn RowStore>],
        device: Device,
        budget: u64,
    ) -> Result<Self, TablesNotOnDevice> {
        for (spec, store) in schema.tables.iter().zip(stores) {
            if store.local_rows().is_none() {
                return Err(TablesNotOnDevice::NotLocal { table: spec.name.clone(), store: store.kind() });
            }
        }
        let bytes = device_bytes(schema);
        if bytes > budget {
            return Err(TablesNotOnDevice::OverBudget {
                tables: schema.tables.len(),
                bytes,
                mib: bytes >> 20,
                budget,
            });
        }
        // Groups: one per row format, tables in schema order.
        let mut formats: Vec<(Storage, usize)> = Vec::new();
        let mut placed = Vec::new(); // per table: (group, base)
        let mut group_rows: Vec<i64> = Vec::new();
        for spec in &schema.tables {
            let format = (spec.storage, spec.row_bytes);
            let g = formats.iter().position(|f| *f == format).unwrap_or_else(|| {
                formats.push(format);
                group_rows.push(0);
                formats.len() - 1
            });
            placed.push((g, group_rows[g]));
            group_rows[g] += spec.rows as i64;
        }
        let dim = schema.pooled_dim();
        let mut groups = Vec::new();
        for (g, &(storage, row_bytes)) in formats.iter().enumerate() {
            let total = group_rows[g];
            let upload_error = |table: &str, source| TablesNotOnDevice::Upload {
                table: table.into(),
                bytes: total as u64 * row_bytes as u64,
                device,
                source,
            };
            let first = &schema.tables[placed.iter().position(|&(pg, _)| pg == g).unwrap_or(0)].name;
            let mut rows = Tensor::f_empty([total, row_bytes as i64], (Kind::Uint8, device))
                .map_err(|e| upload_error(first, e))?;
            for ((spec, store), &(pg, base)) in schema.tables.iter().zip(stores).zip(&placed) {
                if pg != g {
                    continue;
                }
                let local = store.local_rows().expect("checked above");
                let host = match store.slots() {
                    None => Tensor::f_from_slice(&local[..spec.rows as usize * row_bytes]),
                    Some(index) => {
                        let mut in_order = Vec::with_capacity(spec.rows as usize * row_bytes);
                        for id in 0..spec.rows as i64 {
                            let at = index.slot(id) as usize * row_bytes;
                            in_order.extend_from_slice(&local[at..at + row_bytes]);
                        }
                        Tensor::f_from_slice(&in_order)
                    }
                }
                .and_then(|t| t.f_reshape([spec.rows as i64, row_bytes as i64]))
                .map_err(|e| upload_error(&spec.name, e))?;
                rows.f_narrow(0, base, spec.rows as i64)
                    .and_then(|mut slot| slot.f_copy_(&host))
                    .map_err(|e| upload_error(&spec.name, e))?;
            }
            if storage == Storage::Fp32 {
                // `dim` little-endian FP32s a row, nothing else.
                rows = rows.f_view_dtype(Kind::Float).map_err(|e| upload_error(first, e))?;
            }
            groups.push(Group { storage, rows });
        }
        let features = schema
            .features
            .iter()
            .map(|f| {
                let t = schema.tables.iter().position(|t| t.name == f.table).expect("a checked schema");
                FeatureTable {
                    name: f.name.clone(),
                    group: placed[t].0,
                    base: placed[t].1,
                    rows: schema.tables[t].rows,
                    mode: f.pooling,
                    weighted: f.weighted,
                }
            })
            .collect();
        Ok(Self { groups, features, dim, bytes, device })
    }

    /// Bytes of table rows on the device.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The device they are on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Groups of tables (one per row format).
    pub fn groups(&self) -> usize {
        self.groups.len()
    }

    /// Each feature's table.
    pub fn features(&self) -> &[FeatureTable] {
        &self.features
    }

    /// Values in the pooled block per row.
    pub fn pooled_width(&self) -> usize {
        self.features.len() * self.dim
    }

    /// Pools a batch of `rows` rows whose lookups (per group, already on
    /// the device: [`Lookup`] uploaded) are `lookups`: a `[rows, width]`
    /// FP32 tensor on the device.
    ///
    /// With ranking requests, `broadcast` holds the batch's request-level
    /// units and the gather index ([`Lookup::gather`], on the device): the
    /// units' bags are pooled once, into bags past the rows', and gathered
    /// into their candidate rows.
    pub fn pool(
        &self,
        rows: usize,
        lookups: &[DeviceLookup],
        broadcast: Option<(usize, &Tensor)>,
    ) -> Result<Tensor, BackendError> {
        let features = self.features.len() as i64;
        let dim = self.dim as i64;
        let bag_rows = rows + broadcast.map_or(0, |(units, _)| units);
        let mut out = Tensor::f_zeros([bag_rows as i64 * features, dim], (Kind::Float, self.device))
            .map_err(torch_error)?;
        for (group, lookup) in self.groups.iter().zip(lookups) {
            if lookup.rows.numel() == 0 {
                continue;
            }
            let gathered = group.rows.f_index_select(0, &lookup.rows).map_err(torch_error)?;
            let values = match group.storage {
                Storage::Int8Rowwise => {
                    let scale_bias = gathered
                        .f_narrow(1, 0, 4)
                        .and_then(|t| t.f_contiguous())
                        .and_then(|t| t.f_view_dtype(Kind::Half))
                        .and_then(|t| t.f_to_kind(Kind::Float))
                        .map_err(torch_error)?;
                    let (mut scale, mut bias) = (
                        scale_bias.f_narrow(1, 0, 1).map_err(torch_error)?,
                        scale_bias.f_narrow(1, 1, 1).map_err(torch_error)?,
                    );
                    if let Some(multipliers) = &lookup.multipliers {
                        let m = multipliers.f_unsqueeze(1).map_err(torch_error)?;
                        scale = scale.f_mul(&m).map_err(torch_error)?;
                        bias = bias.f_mul(&m).map_err(torch_error)?;
                    }
                    let q = gathered
                        .f_narrow(1, 4, dim)
                        .and_then(|t| t.f_to_kind(Kind::Float))
                        .map_err(torch_error)?;
                    bias.f_addcmul(&q, &scale).map_err(torch_error)?
                }
                Storage::Fp32 => match &lookup.multipliers {
                    None => gathered,
                    Some(m) => m.f_unsqueeze(1).and_then(|m| gathered.f_mul(&m)).map_err(torch_error)?,
                },
            };
            out = out.f_index_add_(0, &lookup.bags, &values).map_err(torch_error)?;
        }
        if let Some((_, gather)) = broadcast {
            out = out.f_index_select(0, gather).map_err(torch_error)?;
        }
        out.f_view([rows as i64, features * dim]).map_err(torch_error)
    }
}
