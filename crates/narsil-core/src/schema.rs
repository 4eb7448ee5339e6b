//! The served model's input schema: what a valid request looks like.

/// One sparse (categorical) feature and its embedding table size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SparseFeature {
    /// Feature name, e.g. `cat_0`.
    pub name: String,
    /// Rows in the feature's table; valid ids are `[0, num_rows)`.
    pub num_rows: u64,
    /// Each id carries a weight (TorchRec's id-score-list features).
    pub weighted: bool,
}

impl SparseFeature {
    /// An unweighted feature.
    pub fn new(name: impl Into<String>, num_rows: u64) -> Self {
        Self { name: name.into(), num_rows, weighted: false }
    }
}

/// The output name of a single-output model (TorchRec's server reads its
/// scores under this key).
pub const DEFAULT_OUTPUT: &str = "default";

/// Everything a client needs to build valid requests, and everything the
/// engine needs to validate and reorder them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSchema {
    /// Model name.
    pub name: String,
    /// Model version string.
    pub version: String,
    /// Backend name: `torch`, `burn` or `mock`.
    pub backend: String,
    /// Device the forward runs on, e.g. `cpu`.
    pub device: String,
    /// Dense features per sample.
    pub num_dense: usize,
    /// Sparse features in wire order: the unweighted ones, then the
    /// weighted ones (each group in the order of the model's own
    /// `KeyedJaggedTensor` keys).
    pub sparse: Vec<SparseFeature>,
    /// The model's outputs, in the order a forward returns them: one score
    /// per sample each.
    pub outputs: Vec<String>,
}

impl ModelSchema {
    /// Number of sparse features.
    pub fn num_sparse(&self) -> usize {
        self.sparse.len()
    }

    /// Number of unweighted sparse features (the weighted ones follow them).
    pub fn num_unweighted(&self) -> usize {
        self.sparse.iter().take_while(|f| !f.weighted).count()
    }

    /// Number of outputs.
    pub fn num_outputs(&self) -> usize {
        self.outputs.len()
    }

    /// The benchmark DLRM's shape: 13 dense features, 26 sparse features
    /// `cat_0..cat_25` with `rows` ids each.
    pub fn dlrm(backend: &str, device: &str, rows: u64) -> Self {
        Self {
            name: "dlrm".into(),
            version: "1".into(),
            backend: backend.into(),
            device: device.into(),
            num_dense: 13,
            sparse: (0..26).map(|i| SparseFeature::new(format!("cat_{i}"), rows)).collect(),
            outputs: vec![DEFAULT_OUTPUT.into()],
        }
    }
}
