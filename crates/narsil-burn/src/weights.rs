//! The DLRM's FP32 weights: loaded from the safetensors file that
//! `models/export_dlrm.py` writes (names in models/README.md), or generated
//! from a seed. The shape is read from the tensors, never assumed.

use std::collections::BTreeMap;
use std::path::Path;

use narsil_core::schema::DEFAULT_OUTPUT;
use narsil_core::{BackendError, ModelSchema, SparseFeature};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use safetensors::{Dtype, SafeTensors};

/// One fully connected layer, PyTorch layout: `weight` is `[out, in]`.
#[derive(Debug, Clone)]
pub struct LinearWeights {
    pub inputs: usize,
    pub outputs: usize,
    /// `[outputs x inputs]`, row-major.
    pub weight: Vec<f32>,
    /// `[outputs]`.
    pub bias: Vec<f32>,
}

/// Every weight of a DLRM.
#[derive(Debug, Clone)]
pub struct DlrmWeights {
    /// Served schema: dense count, features and their table rows.
    pub schema: ModelSchema,
    /// Embedding dimension.
    pub dim: usize,
    /// One table per sparse feature, `[rows x dim]` row-major.
    pub tables: Vec<Vec<f32>>,
    /// Dense arch layers (ReLU after each).
    pub dense: Vec<LinearWeights>,
    /// Over arch layers (ReLU after each but the last).
    pub over: Vec<LinearWeights>,
}

/// The sizes of a DLRM, for generated models.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DlrmShape {
    pub num_dense: usize,
    pub num_sparse: usize,
    pub num_rows: usize,
    pub dim: usize,
    pub dense_arch: Vec<usize>,
    pub over_arch: Vec<usize>,
}

impl Default for DlrmShape {
    /// The benchmark DLRM: 13 dense, 26 x 100,000 x 64, dense 512-256-64,
    /// over 512-512-256-1.
    fn default() -> Self {
        Self {
            num_dense: 13,
            num_sparse: 26,
            num_rows: 100_000,
            dim: 64,
            dense_arch: vec![512, 256, 64],
            over_arch: vec![512, 512, 256, 1],
        }
    }
}

impl DlrmShape {
    /// Width of the over arch's input: the dense embedding plus the upper
    /// triangle (without diagonal) of the (1 + num_sparse)^2 dot products.
    pub fn interaction_width(num_sparse: usize, dim: usize) -> usize {
        dim + (num_sparse + 1) * num_sparse / 2
    }
}

impl DlrmWeights {
    /// A deterministic random DLRM: embeddings uniform in [-0.1, 0.1], linear
    /// layers uniform in +-1/sqrt(fan_in) (PyTorch's default range).
    pub fn random(shape: &DlrmShape, seed: u64) -> Result<Self, BackendError> {
        if shape.dense_arch.last() != Some(&shape.dim) || shape.over_arch.last().is_none_or(|&k| k == 0) {
            return Err(BackendError::setup(
                "the dense arch must end with the embedding dim and the over arch with one unit per output",
            ));
        }
        let mut rng = SmallRng::seed_from_u64(seed);
        let tables = (0..shape.num_sparse)
            .map(|_| (0..shape.num_rows * shape.dim).map(|_| rng.random_range(-0.1f32..0.1)).collect())
            .collect();
        let mut layers = |inputs: usize, sizes: &[usize]| -> Vec<LinearWeights> {
            let mut inputs = inputs;
            sizes
                .iter()
                .map(|&outputs| {
                    let bound = 1.0 / (inputs as f32).sqrt();
                    let layer = LinearWeights {
                        inputs,
                        outputs,
                        weight: (0..inputs * outputs).map(|_| rng.random_range(-bound..bound)).collect(),
                        bias: (0..outputs).map(|_| rng.random_range(-bound..bound)).collect(),
                    };
                    inputs = outputs;
                    layer
                })
                .collect()
        };
        let dense = layers(shape.num_dense, &shape.dense_arch);
        let over = layers(DlrmShape::interaction_width(shape.num_sparse, shape.dim), &shape.over_arch);
        let schema = ModelSchema {
            request_level: Default::default(),
            sequences: Vec::new(),
            name: "dlrm-random".into(),
            version: format!("seed-{seed}"),
            backend: "burn".into(),
            device: "cpu".into(),
            num_dense: shape.num_dense,
            sparse: (0..shape.num_sparse)
                .map(|i| SparseFeature::new(format!("cat_{i}"), shape.num_rows as u64))
                .collect(),
            outputs: output_names(shape.over_arch[shape.over_arch.len() - 1]),
        };
        Ok(Self { schema, dim: shape.dim, tables, dense, over })
    }

    /// Loads `weights_fp32.safetensors`. Errors name the missing or
    /// mis-shaped tensor.
    pub fn load(path: &Path) -> Result<Self, BackendError> {
        let bytes = map(path)?;
        let tensors = Tensors::read(path, &bytes)?;
        let (_, metadata) = SafeTensors::read_metadata(&bytes)
            .map_err(|e| BackendError::load(path, "unreadable header").caused_by(e))?;
        let file = &tensors.file;
        let at = |what: String| BackendError::load(path, what);

        // Sparse features: embedding.cat_0, embedding.cat_1, ... in index order.
        let mut feature_names: BTreeMap<usize, String> = BTreeMap::new();
        for name in file.names() {
            if let Some(feature) = name.strip_prefix("embedding.") {
                let index = feature.rsplit('_').next().and_then(|i| i.parse().ok()).ok_or_else(|| {
                    at(format!("embedding tensor `{name}` is not named embedding.<feature>_<index>"))
                })?;
                feature_names.insert(index, feature.to_string());
            }
        }
        if feature_names.is_empty() {
            return Err(at("no `embedding.*` tensors".into()));
        }
        if let Some((i, _)) = feature_names.keys().enumerate().find(|(i, index)| i != *index) {
            return Err(at(format!("embedding tensors must be numbered 0..n; index {i} is missing")));
        }
        let mut tables = Vec::new();
        let mut sparse = Vec::new();
        let mut dim = None;
        for feature in feature_names.values() {
            let name = format!("embedding.{feature}");
            let (shape, data) = tensors.tensor(&name, 2)?;
            if *dim.get_or_insert(shape[1]) != shape[1] || shape[0] == 0 {
                return Err(at(format!(
                    "tensor `{name}` has shape {shape:?}; every table needs [rows > 0, dim]"
                )));
            }
            sparse.push(SparseFeature::new(feature.clone(), shape[0] as u64));
            tables.push(data);
        }
        let dim = dim.expect("at least one table");
        let (dense, over) = tensors.dense_and_over(sparse.len(), dim)?;
        let tasks = over.last().expect("non-empty").outputs;

        let described: Option<serde_json::Value> = metadata
            .metadata()
            .as_ref()
            .and_then(|m| m.get("narsil_schema"))
            .and_then(|s| serde_json::from_str(s).ok());
        let text = |key: &str, default: &str| {
            described.as_ref().and_then(|d| d.get(key)?.as_str().map(String::from)).unwrap_or(default.into())
        };
        let schema = ModelSchema {
            request_level: Default::default(),
            sequences: Vec::new(),
            name: text("name", "dlrm"),
            version: text("version", "1"),
            backend: "burn".into(),
            device: "cpu".into(),
            num_dense: dense[0].inputs,
            sparse,
            outputs: match described.as_ref().and_then(|d| d.get("outputs")) {
                None => output_names(tasks),
                Some(names) => {
                    let names: Vec<String> = serde_json::from_value(names.clone())
                        .map_err(|_| at("narsil_schema's `outputs` is not a list of names".into()))?;
                    if names.len() != tasks {
                        return Err(at(format!(
                            "narsil_schema's `outputs` names {} outputs, but the over arch ends with {tasks} units",
                            names.len()
                        )));
                    }
                    names
                }
            },
        };
        Ok(Self { schema, dim, tables, dense, over })
    }
}

/// A DLRM's dense arch and over arch alone (a split model's
/// `dense.safetensors`: `dense.{i}.*` and `over.{i}.*`, no tables), checked
/// against `num_dense` inputs, `num_sparse` pooled vectors of `dim` values
/// and `outputs` outputs.
pub fn load_dense_network(
    path: &Path,
    num_dense: usize,
    num_sparse: usize,
    dim: usize,
    outputs: usize,
) -> Result<(Vec<LinearWeights>, Vec<LinearWeights>), BackendError> {
    let bytes = map(path)?;
    let (dense, over) = Tensors::read(path, &bytes)?.dense_and_over(num_sparse, dim)?;
    let tasks = over.last().expect("non-empty").outputs;
    if dense[0].inputs != num_dense || tasks != outputs {
        return Err(BackendError::load(
            path,
            format!(
                "the dense network takes {} dense features and gives {tasks} outputs; the schema has {num_dense} and {outputs}",
                dense[0].inputs
            ),
        ));
    }
    Ok((dense, over))
}

/// A safetensors file mapped read-only: the tensors are copied out once,
/// and the file's pages stay in the page cache instead of doubling the heap.
fn map(path: &Path) -> Result<memmap2::Mmap, BackendError> {
    let cannot_read = |e: std::io::Error| {
        BackendError::load(path, "cannot read; export one with models/export_dlrm.py").caused_by(e)
    };
    let handle = std::fs::File::open(path).map_err(cannot_read)?;
    // SAFETY: the mapping is read-only and dropped once the tensors are
    // copied out; a weights file must not be rewritten while a server loads it.
    unsafe { memmap2::Mmap::map(&handle) }.map_err(cannot_read)
}

/// A safetensors file's FP32 tensors, with errors naming the file.
struct Tensors<'a> {
    file: SafeTensors<'a>,
    path: &'a Path,
}

impl<'a> Tensors<'a> {
    fn read(path: &'a Path, bytes: &'a [u8]) -> Result<Self, BackendError> {
        let file = SafeTensors::deserialize(bytes)
            .map_err(|e| BackendError::load(path, "not a safetensors file (TorchScript models, TorchRec-signature ones included, need --backend torch)").caused_by(e))?;
        Ok(Self { file, path })
    }

    fn at(&self, what: String) -> BackendError {
        BackendError::load(self.path, what)
    }

    /// Tensor `name` of `dims` dimensions: its shape and values.
    fn tensor(&self, name: &str, dims: usize) -> Result<(Vec<usize>, Vec<f32>), BackendError> {
        let view = self.file.tensor(name).map_err(|_| self.at(format!("missing tensor `{name}`")))?;
        if view.dtype() != Dtype::F32 {
            return Err(self.at(format!("tensor `{name}` is {:?}, expected F32", view.dtype())));
        }
        if view.shape().len() != dims {
            return Err(
                self.at(format!("tensor `{name}` has shape {:?}, expected {dims} dims", view.shape()))
            );
        }
        let data =
            view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        Ok((view.shape().to_vec(), data))
    }

    /// Layers `prefix.0`, `prefix.1`, ... (at least one), each taking the
    /// previous one's outputs (the first `inputs`, if given).
    fn layers(&self, prefix: &str, mut inputs: Option<usize>) -> Result<Vec<LinearWeights>, BackendError> {
        let mut layers = Vec::new();
        while self.file.tensor(&format!("{prefix}.{}.weight", layers.len())).is_ok() {
            let i = layers.len();
            let (w_shape, weight) = self.tensor(&format!("{prefix}.{i}.weight"), 2)?;
            let (b_shape, bias) = self.tensor(&format!("{prefix}.{i}.bias"), 1)?;
            let (outputs, layer_inputs) = (w_shape[0], w_shape[1]);
            if inputs.is_some_and(|n| n != layer_inputs) || b_shape[0] != outputs {
                return Err(self.at(format!(
                    "tensor `{prefix}.{i}.weight` has shape {w_shape:?} (bias {b_shape:?}); \
                     expected [out, {}] and bias [out]",
                    inputs.map_or("in".to_string(), |n| n.to_string())
                )));
            }
            layers.push(LinearWeights { inputs: layer_inputs, outputs, weight, bias });
            inputs = Some(outputs);
        }
        if layers.is_empty() {
            return Err(self.at(format!("missing tensor `{prefix}.0.weight`")));
        }
        Ok(layers)
    }

    /// The dense arch (ending with `dim` outputs) and the over arch (taking
    /// the interaction of `num_sparse` pooled vectors).
    fn dense_and_over(
        &self,
        num_sparse: usize,
        dim: usize,
    ) -> Result<(Vec<LinearWeights>, Vec<LinearWeights>), BackendError> {
        let dense = self.layers("dense", None)?;
        let last = dense.last().expect("non-empty").outputs;
        if last != dim {
            return Err(
                self.at(format!("the dense arch ends with {last} outputs, not the embedding dim {dim}"))
            );
        }
        let over = self.layers("over", Some(DlrmShape::interaction_width(num_sparse, dim)))?;
        Ok((dense, over))
    }
}

/// Output names of a `tasks`-unit over arch without names of its own:
/// `default` for one (TorchRec's single output), `task_0..` for more.
fn output_names(tasks: usize) -> Vec<String> {
    if tasks == 1 {
        vec![DEFAULT_OUTPUT.into()]
    } else {
        (0..tasks).map(|i| format!("task_{i}")).collect()
    }
}
