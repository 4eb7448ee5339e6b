//! The served model's input schema: what a valid request looks like.

/// One sparse (categorical) feature and its embedding table size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SparseFeature {
    /// Feature name, e.g. `cat_0`.
    pub name: String,
    /// Rows in the feature's table; valid ids are `[0, num_rows)`, unless
    /// `raw_ids`.
    pub num_rows: u64,
    /// Each id carries a weight (TorchRec's id-score-list features).
    pub weighted: bool,
    /// Its ids are raw 64-bit values (any `i64`), which the model maps to
    /// rows itself (a split model's table with an id map or declared
    /// modulo, a TorchRec managed-collision model): never range-checked
    /// nor changed by `--id-policy`.
    pub raw_ids: bool,
    /// A raw integer input (`"pooling": "raw"`): its int64 values reach
    /// the dense network exactly as sent, never looked up (no table: its
    /// `num_rows` is 0), never range-checked nor changed by `--id-policy`.
    /// In a sequence it is a channel aligned with the others; outside one,
    /// exactly one value per sample (or per request block where it is
    /// request-level).
    pub raw_input: bool,
}

impl SparseFeature {
    /// An unweighted feature.
    pub fn new(name: impl Into<String>, num_rows: u64) -> Self {
        Self { name: name.into(), num_rows, weighted: false, raw_ids: false, raw_input: false }
    }

    /// A raw integer input ([`SparseFeature::raw_input`]).
    pub fn raw(name: impl Into<String>) -> Self {
        Self { raw_input: true, ..Self::new(name, 0) }
    }

    /// Whether its values are taken as sent, never held against a
    /// table's rows: raw ids, or a raw input.
    pub fn is_unchecked(&self) -> bool {
        self.raw_ids || self.raw_input
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
    /// Its request-level inputs (none: flat requests only).
    pub request_level: RequestLevel,
    /// Its sequence features (sparse features whose bags are sequences of
    /// positions, looked up unpooled), in the order the model takes them.
    pub sequences: Vec<SequenceFeature>,
}

impl ModelSchema {
    /// Charges each sequence what a split model's AOTInductor package
    /// allocates for it: its `package_working_set` where it declares one
    /// (a server running the package calls this; [`crate::working_set`]).
    pub fn charge_package_working_sets(&mut self) {
        for sequence in &mut self.sequences {
            if let Some(package) = sequence.package_working_set {
                sequence.working_set = Some(package);
            }
        }
    }

    /// Number of sparse features.
    pub fn num_sparse(&self) -> usize {
        self.sparse.len()
    }

    /// Number of unweighted sparse features (the weighted ones follow them).
    pub fn num_unweighted(&self) -> usize {
        self.sparse.iter().take_while(|f| !f.weighted).count()
    }

    /// Whether any sparse feature takes raw ids.
    pub fn takes_raw_ids(&self) -> bool {
        self.sparse.iter().any(|f| f.raw_ids)
    }

    /// Whether any feature's values must reach the model as full int64
    /// (raw ids, raw inputs): a TorchRec-signature model then gets its ids
    /// as int64, not int32.
    pub fn takes_int64_ids(&self) -> bool {
        self.sparse.iter().any(SparseFeature::is_unchecked)
    }

    /// The raw inputs outside any sequence, in schema order: one value per
    /// row each, the dense network's `raw i64[R, K]`.
    pub fn row_raw_inputs(&self) -> Vec<usize> {
        (0..self.sparse.len())
            .filter(|&f| self.sparse[f].raw_input && self.sequence_of(f).is_none())
            .collect()
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
            request_level: RequestLevel::default(),
            sequences: Vec::new(),
        }
    }

    /// Serves it with `level` as its request-level inputs, in place of
    /// what the model declares (`--request-level`): the one schema the
    /// engine validates requests against, whose request blocks tell a
    /// backend's stage which features arrive once per request. Refused,
    /// the schema left as it was, when `level` names some of a sequence's
    /// channels and not the others ([`sent_once`]).
    pub fn set_request_level(&mut self, level: RequestLevel) -> Result<(), String> {
        for sequence in &self.sequences {
            sent_once(&sequence.name, &sequence.features, &level, self)?;
        }
        self.request_level = level;
        Ok(())
    }

    /// The sequence whose first channel is sparse feature `f`, if any.
    pub fn first_channel_of(&self, f: usize) -> Option<&SequenceFeature> {
        self.sequences.iter().find(|s| s.features[0] == f)
    }

    /// The sequence sparse feature `f` is a channel of, if any.
    pub fn sequence_of(&self, f: usize) -> Option<&SequenceFeature> {
        self.sequences.iter().find(|s| s.features.contains(&f))
    }
}

/// Which inputs of a model are request-level.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestLevel {
    /// Schema indices of the request-level sparse features, ascending.
    pub features: Vec<usize>,
    /// Whether the dense features (all of them) are request-level.
    pub dense: bool,
}

impl RequestLevel {
    /// Whether the model has any request-level input (else requests are
    /// flat only).
    pub fn is_declared(&self) -> bool {
        !self.features.is_empty() || self.dense
    }

    /// Whether sparse feature `f` is request-level.
    pub fn contains(&self, f: usize) -> bool {
        self.features.binary_search(&f).is_ok()
    }

    /// The declaration named by `names` (sparse feature names of `schema`,
    /// and `dense` for the dense features), as given to `--request-level`;
    /// `none` (or nothing) declares none.
    pub fn parse<'a>(names: impl IntoIterator<Item = &'a str>, schema: &ModelSchema) -> Result<Self, String> {
        let mut level = Self::default();
        for name in names.into_iter().map(str::trim).filter(|n| !n.is_empty() && *n != "none") {
            match schema.sparse.iter().position(|f| f.name == name) {
                Some(f) => level.features.push(f),
                None if name == "dense" => level.dense = true,
                None => {
                    let known: Vec<&str> = schema.sparse.iter().map(|f| f.name.as_str()).collect();
                    return Err(format!(
                        "{name:?} is not a feature of the model (its sparse features: {}; `dense` names the dense features)",
                        known.join(", ")
                    ));
                }
            }
        }
        level.features.sort_unstable();
        level.features.dedup();
        Ok(level)
    }

    /// The sparse features that are not request-level (a grouped
    /// request's candidate features), in schema order.
    pub fn candidate_features(&self, schema: &ModelSchema) -> Vec<usize> {
        (0..schema.num_sparse()).filter(|&f| !self.contains(f)).collect()
    }

    /// The request-level sparse features' names, comma-separated (for
    /// messages).
    pub fn sparse_names(&self, schema: &ModelSchema) -> String {
        self.features.iter().map(|&f| schema.sparse[f].name.as_str()).collect::<Vec<_>>().join(", ")
    }

    /// The names it declares, as [`RequestLevel::parse`] reads them.
    pub fn names(&self, schema: &ModelSchema) -> Vec<String> {
        let mut names: Vec<String> = self.features.iter().map(|&f| schema.sparse[f].name.clone()).collect();
        if self.dense {
            names.push("dense".into());
        }
        names
    }
}

/// Which end of a longer sequence is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeepEnd {
    /// The last `max_len` positions (the most recent: ids are sent oldest
    /// first).
    #[default]
    Last,
    /// The first `max_len` positions.
    First,
}

impl KeepEnd {
    /// The name schemas use (`last`, `first`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Last => "last",
            Self::First => "first",
        }
    }

    /// The end named `name`.
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "last" => Ok(Self::Last),
            "first" => Ok(Self::First),
            other => Err(format!("keep {other:?}: expected \"last\" or \"first\"")),
        }
    }
}

/// One declared sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceFeature {
    /// Its name (the dense network's inputs follow the declaration order).
    pub name: String,
    /// Schema indices of its channels (sparse features), in the order
    /// their embeddings are concatenated per position.
    pub features: Vec<usize>,
    /// Positions kept at most.
    pub max_len: usize,
    /// Which end of a longer sequence is kept.
    pub keep: KeepEnd,
    /// FP32 values per position the serving stage writes for the dense
    /// network (its channels' dims), what a position costs in memory; 0
    /// where the model looks its sequences up itself (a single-file model).
    pub width: usize,
    /// What its dense network allocates per request for it, as declared
    /// ([`crate::working_set`]); `None`: not declared
    /// ([`SequenceFeature::working_set`] estimates it).
    pub working_set: Option<crate::working_set::WorkingSet>,
    /// What a split model's AOTInductor packages allocate per request for
    /// it, where they attend otherwise than its TorchScript network
    /// (`"package_working_set"`); a server running a package charges it
    /// ([`ModelSchema::charge_package_working_sets`]).
    pub package_working_set: Option<crate::working_set::WorkingSet>,
    /// Its raw channels ([`SparseFeature::raw_input`]): the int64 values
    /// per position the stage hands the dense network as they were sent
    /// (`seq{i}_raw i64[P, K]`).
    pub raw_channels: usize,
    /// Whether its dense network also takes, per unit, the rows of the
    /// whole request the unit came from (`seq{i}_unit_rows i64[U]`;
    /// `"request_rows": true`) and, where the model has raw inputs outside
    /// sequences, that request's last row's values of them
    /// (`seq{i}_unit_raw i64[U, K]`).
    pub request_rows: bool,
}

/// Whether `level` sends sequence `name`, whose channels are the sparse
/// features `channels` of `schema`, once per request: true when all its
/// channels are request-level, false when none are. A sequence's channels
/// are aligned positions of one history, so they travel together; a level
/// naming some of them only is refused, naming the sequence, the channels
/// it names and those it leaves out.
pub fn sent_once(
    name: &str,
    channels: &[usize],
    level: &crate::RequestLevel,
    schema: &ModelSchema,
) -> Result<bool, String> {
    let (named, left): (Vec<usize>, Vec<usize>) = channels.iter().partition(|&&f| level.contains(f));
    if left.is_empty() || named.is_empty() {
        return Ok(left.is_empty());
    }
    let names = |features: &[usize]| {
        features.iter().map(|&f| schema.sparse[f].name.as_str()).collect::<Vec<_>>().join(", ")
    };
    Err(format!(
        "sequence {name:?} (channels {}) is request-level in {} but not in {}: its channels are one \
         history's aligned positions, sent together once per request or on every row; name all of them \
         request-level, or none",
        names(channels),
        names(&named),
        names(&left)
    ))
}
