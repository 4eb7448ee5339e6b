//! Ranking requests: one user (and its context) scored against many
//! candidates. The features that are the same for every candidate — the
//! *request-level* ones, declared by the model ([`crate::RequestLevel`]) — arrive
//! once per request in a [`RequestBlock`] instead of on every row; the
//! candidate rows carry only the others.
//!
//! Once validated, a grouped request's rows hold an empty bag for every
//! request-level feature (and no dense values when the dense features are
//! request-level), and its block holds those features once, shared (an
//! `Arc`) by every part the request is split into. Fusing keeps the blocks
//! apart from the rows ([`crate::request_blocks`]): the embedding stage
//! pools each block once and broadcasts it to its request's rows; a
//! backend that takes only flat batches gets them expanded
//! ([`crate::KeyedBatch::into_flat`]).

use crate::ids::fit_ids;
use crate::invalid::{ids_match_lengths, widen_weights, InputField, InvalidInput, RequestLimits};
use crate::schema::ModelSchema;
use crate::sequence::{fit_sequences, BagLayout, SequenceFeature};

/// A ranking request's request-level features, sent once for all its
/// candidates.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RequestBlock {
    /// The dense features, `[num_dense]`, when they are request-level;
    /// empty otherwise.
    pub dense: Vec<f32>,
    /// Ids per request-level feature, in schema order. Empty as sent means
    /// one id each; validation fills it in.
    pub lengths: Vec<u32>,
    /// Their ids, feature after feature.
    pub ids: Vec<i64>,
    /// As sent: one weight per id of a weighted request-level feature.
    /// Validation widens it to one per id (1.0 for unweighted features'),
    /// or leaves it empty where no request-level feature is weighted.
    pub weights: Vec<f32>,
    /// Schema indices of the features `lengths` are for (set by
    /// validation: the model's [`crate::RequestLevel::features`]).
    pub features: Vec<usize>,
    /// A hash of its values (set by validation, on the request's own
    /// thread): blocks whose digests differ differ, so fusing compares
    /// only blocks with the same digest ([`crate::RequestBlocks::gather`]).
    pub digest: u64,
    /// The rows (candidates) of the whole request it came with, where a
    /// sequence of the model declares `request_rows` (0 otherwise). Set
    /// by validation, before the engine cuts the request into parts (the
    /// parts share the block, so each keeps the whole's count); part of
    /// the block's values, so two requests of one user share a unit only
    /// where their counts agree.
    pub request_rows: usize,
    /// Where [`RequestBlock::request_rows`] is set: the whole request's
    /// last row's raw inputs outside sequences, one value each in schema
    /// order ([`ModelSchema::row_raw_inputs`]; a request-level one's is
    /// the block's), so every part of a cut request hands the network its
    /// whole request's last row (a generative ranker's query time). Set by
    /// validation once the rows are checked; part of the block's values.
    pub last_row_raw: Vec<i64>,
}

impl RequestBlock {
    /// Memory its values take.
    pub fn decoded_bytes(&self) -> usize {
        use std::mem::size_of;
        self.dense.len() * size_of::<f32>()
            + self.lengths.len() * size_of::<u32>()
            + self.ids.len() * size_of::<i64>()
            + self.weights.len() * size_of::<f32>()
            + self.features.len() * size_of::<usize>()
            + self.last_row_raw.len() * size_of::<i64>()
    }

    /// Checks the block against the model's declaration and the server's
    /// bound on its ids, and fills in implicit lengths, widens weights and
    /// maps ids (`limits.id_policy`).
    /// Returns the sequence positions it cut ([`crate::sequence`]).
    fn validate(&mut self, schema: &ModelSchema, limits: RequestLimits) -> Result<usize, InvalidInput> {
        if self.ids.len() > limits.max_request_level_ids {
            return Err(InvalidInput::new(
                InputField::RequestIds,
                format!(
                    "has {} ids, more than the server's limit of {} request-level ids a request \
                     (--max-request-level-ids)",
                    self.ids.len(),
                    limits.max_request_level_ids
                ),
            ));
        }
        let policy = limits.id_policy;
        let level = &schema.request_level;
        let k = level.features.len();
        let expected_dense = if level.dense { schema.num_dense } else { 0 };
        if self.dense.len() != expected_dense {
            let why = if level.dense {
                format!(
                    "has {} values, expected the model's {expected_dense} dense features",
                    self.dense.len()
                )
            } else {
                format!(
                    "has {} values, but the model's dense features are per candidate: send them in dense",
                    self.dense.len()
                )
            };
            return Err(InvalidInput::new(InputField::RequestDense, why));
        }
        if let Some(pos) = self.dense.iter().position(|v| !v.is_finite()) {
            return Err(InvalidInput::new(
                InputField::RequestDense,
                format!("feature {pos} is {} (values must be finite)", self.dense[pos]),
            ));
        }
        if self.lengths.is_empty() {
            self.lengths = vec![1; k];
        } else if self.lengths.len() != k {
            return Err(InvalidInput::new(
                InputField::RequestLengths,
                format!(
                    "has {} entries, expected one per request-level feature ({k}: {}) or none for one id each",
                    self.lengths.len(),
                    level.sparse_names(schema)
                ),
            ));
        }
        let total: u64 = self.lengths.iter().map(|&l| u64::from(l)).sum();
        if total != self.ids.len() as u64 {
            return Err(InvalidInput::new(
                InputField::RequestIds,
                format!("has {} ids but the request-level lengths sum to {total}", self.ids.len()),
            ));
        }
        let truncated = self.fit_sequences(schema)?;
        self.check_raw_inputs(schema)?;
        let mut at = 0;
        for (&f, &len) in level.features.iter().zip(&self.lengths) {
            let feature = &schema.sparse[f];
            if let Err(k) = fit_ids(&mut self.ids[at..at + len as usize], feature, policy) {
                return Err(InvalidInput::new(
                    InputField::RequestIds,
                    format!(
                        "request feature {f} ({}) has id {} outside [0, {})",
                        feature.name,
                        self.ids[at + k],
                        feature.num_rows
                    ),
                ));
            }
            at += len as usize;
        }
        let weighted = |k: usize| schema.sparse[level.features[k]].weighted;
        if (0..k).any(weighted) {
            let whose = "the weighted request-level features'";
            widen_weights(&mut self.weights, &self.lengths, weighted, InputField::RequestWeights, whose)?;
        } else if !self.weights.is_empty() {
            return Err(InvalidInput::new(
                InputField::RequestWeights,
                format!(
                    "has {} weights, but no request-level feature is weighted: send none",
                    self.weights.len()
                ),
            ));
        }
        self.features.clone_from(&level.features);
        self.digest = self.hash_values();
        Ok(truncated)
    }

    /// A hash of its dense values, lengths, ids and weights, keyed by this
    /// process's secret key (SipHash-1-3, std's `RandomState`): a client
    /// cannot choose blocks whose digests collide, so fusing compares few
    /// blocks whole (an unkeyed mix can be made to collide for any seed:
    /// flipping an id's top bit and the next id's bit 4 cancels in
    /// FxHash's rotate-xor-multiply). A collision still only costs a
    /// comparison.
    pub(crate) fn hash_values(&self) -> u64 {
        use std::hash::{BuildHasher, Hash, Hasher};
        static KEY: std::sync::OnceLock<std::collections::hash_map::RandomState> = std::sync::OnceLock::new();
        let mut hasher = KEY.get_or_init(Default::default).build_hasher();
        let mut floats = |values: &[f32]| {
            hasher.write_usize(values.len());
            values.iter().for_each(|v| hasher.write_u32(v.to_bits()));
        };
        floats(&self.dense);
        floats(&self.weights);
        hasher.write_usize(self.request_rows);
        self.last_row_raw.hash(&mut hasher);
        self.lengths.hash(&mut hasher);
        self.ids.hash(&mut hasher);
        hasher.finish()
    }

    /// Checks its sequences' alignment and cuts those longer than their
    /// maximum; returns the positions dropped.
    fn fit_sequences(&mut self, schema: &ModelSchema) -> Result<usize, InvalidInput> {
        let sequences: Vec<&SequenceFeature> =
            schema.sequences.iter().filter(|s| s.is_request_level(schema)).collect();
        if sequences.is_empty() {
            return Ok(0);
        }
        let level = &schema.request_level.features;
        let bag = |_: usize, f: usize| {
            level
                .binary_search(&f)
                .expect("a request-level sequence's channels are all request-level (sequence::sent_once)")
        };
        let feature = |k: usize| level[k];
        let place = |_: usize| "the request block".to_string();
        let bags = BagLayout {
            samples: 1,
            bag: &bag,
            feature: &feature,
            field: InputField::RequestLengths,
            place: &place,
        };
        fit_sequences(&sequences, schema, &mut self.lengths, &mut self.ids, &bags)
    }

    /// Feature number `k`'s (of [`RequestBlock::features`]) ids, once
    /// validated.
    pub fn feature_ids(&self, k: usize) -> &[i64] {
        &self.ids[self.feature_range(k)]
    }

    /// Where feature number `k`'s ids (and weights) are, once validated.
    pub fn feature_range(&self, k: usize) -> std::ops::Range<usize> {
        let start: usize = self.lengths[..k].iter().map(|&l| l as usize).sum();
        start..start + self.lengths[k] as usize
    }
}

/// For a grouped request (one with `block`): checks the block and the
/// candidate rows' lengths (`[samples x candidate features]` as sent), then
/// widens the rows' lengths to every feature (an empty bag for each
/// request-level one), so the rest of validation, the reorder and the
/// fusion treat its rows like any other. Returns the dense values each row
/// carries.
pub(crate) fn widen_row_lengths(
    block: &mut RequestBlock,
    lengths: &mut Vec<u32>,
    ids_sent: usize,
    samples: usize,
    schema: &ModelSchema,
    limits: RequestLimits,
) -> Result<(usize, usize), InvalidInput> {
    let level = &schema.request_level;
    if !level.is_declared() {
        return Err(InvalidInput::new(
            InputField::Request,
            format!(
                "model {:?} declares no request-level feature: send every feature on every row (no request block)",
                schema.name
            ),
        ));
    }
    block.request_rows = if schema.sequences.iter().any(|s| s.request_rows) { samples } else { 0 };
    let truncated = block.validate(schema, limits)?;
    let num_sparse = schema.num_sparse();
    let candidate = level.candidate_features(schema);
    if lengths.is_empty() {
        ids_match_lengths(ids_sent, samples * candidate.len(), InputField::Ids)?;
        *lengths = vec![1; samples * candidate.len()];
    } else if lengths.len() != samples * candidate.len() {
        return Err(InvalidInput::new(
            InputField::Lengths,
            format!(
                "has {} entries, expected batch_size x candidate features = {samples} x {} = {} (the {} request-level \
                 features go once in request.sparse_lengths), or none for one id per bag",
                lengths.len(),
                candidate.len(),
                samples * candidate.len(),
                level.features.len()
            ),
        ));
    }
    let row_dense = if level.dense { 0 } else { schema.num_dense };
    if level.features.is_empty() {
        return Ok((row_dense, truncated));
    }
    let mut widened = vec![0u32; samples * num_sparse];
    for (row, sent) in widened.chunks_exact_mut(num_sparse).zip(lengths.chunks_exact(candidate.len().max(1)))
    {
        for (&f, &len) in candidate.iter().zip(sent) {
            row[f] = len;
        }
    }
    *lengths = widened;
    Ok((row_dense, truncated))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::invalid::IdPolicy;
    use crate::request::{RequestLimits, RequestSamples};
    use crate::schema::RequestLevel;

    /// 2 dense, 4 sparse features of 10 rows: `cat_0` and `cat_2` and the
    /// dense features request-level.
    fn schema() -> ModelSchema {
        let mut s = ModelSchema::dlrm("mock", "cpu", 10);
        s.num_dense = 2;
        s.sparse.truncate(4);
        s.request_level = RequestLevel::parse(["cat_0", "cat_2", "dense"], &s).unwrap();
        s
    }

    const LIMITS: RequestLimits = RequestLimits::new(8, IdPolicy::Reject);

    fn grouped() -> RequestSamples {
        // 2 candidates: cat_1 and cat_3 one id each; the user: cat_0 [1, 2], cat_2 [3].
        RequestSamples {
            num_samples: 2,
            lengths: vec![],
            ids: vec![4, 5, 6, 7],
            request: Some(Arc::new(RequestBlock {
                dense: vec![0.5, 0.25],
                lengths: vec![2, 1],
                ids: vec![1, 2, 3],
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    #[test]
    fn a_declaration_reads_feature_names_and_dense_and_refuses_unknown_names() {
        let s = schema();
        assert_eq!(s.request_level, RequestLevel { features: vec![0, 2], dense: true });
        assert_eq!(s.request_level.names(&s), ["cat_0", "cat_2", "dense"]);
        let e = RequestLevel::parse(["cat_9"], &s).unwrap_err();
        assert!(e.contains("\"cat_9\" is not a feature") && e.contains("cat_3"), "{e}");
        assert!(!RequestLevel::parse(["none"], &s).unwrap().is_declared());
    }

    #[test]
    fn a_grouped_requests_rows_get_empty_bags_for_the_request_level_features() {
        let mut r = grouped();
        r.validate(&schema(), LIMITS).unwrap();
        // Row-major over the 4 features: cat_0 and cat_2 empty on each row.
        assert_eq!(r.lengths, [0, 1, 0, 1, 0, 1, 0, 1]);
        let block = r.request.as_ref().unwrap();
        assert_eq!(
            (block.features.as_slice(), block.feature_ids(0), block.feature_ids(1)),
            (&[0, 2][..], &[1, 2][..], &[3][..])
        );
        assert!(r.dense.is_empty());
    }

    #[test]
    fn a_block_the_model_cannot_take_is_refused_naming_the_request_field() {
        let field = |r: RequestSamples, s: &ModelSchema| r.clone().validate(s, LIMITS).unwrap_err();
        let mut flat_only = schema();
        flat_only.request_level = RequestLevel::default();
        let e = field(grouped(), &flat_only);
        assert_eq!((e.field, e.field.name()), (InputField::Request, "request"));
        let mut r = grouped();
        Arc::make_mut(r.request.as_mut().unwrap()).dense.pop();
        assert_eq!(field(r, &schema()).field.name(), "request.dense");
        let mut r = grouped();
        Arc::make_mut(r.request.as_mut().unwrap()).lengths = vec![3];
        let e = field(r, &schema());
        assert!(e.field.name() == "request.sparse_lengths" && e.message.contains("cat_0, cat_2"), "{e}");
        let mut r = grouped();
        Arc::make_mut(r.request.as_mut().unwrap()).ids[2] = 10;
        let e = field(r, &schema());
        assert!(e.field.name() == "request.sparse_ids" && e.message.contains("(cat_2) has id 10"), "{e}");
        let mut r = grouped();
        r.lengths = vec![1; 8];
        let e = field(r, &schema());
        assert!(e.field == InputField::Lengths && e.message.contains("2 x 2 = 4"), "{e}");
        let mut r = grouped();
        r.dense = vec![0.0; 4];
        assert_eq!(field(r, &schema()).field, InputField::Dense);
        let mut r = grouped();
        r.num_samples = 0;
        assert_eq!(field(r, &schema()).field, InputField::SampleCount);
    }

    #[test]
    fn a_block_over_the_servers_bound_on_request_level_ids_is_refused_naming_it() {
        let mut r = grouped();
        let limits = RequestLimits { max_request_level_ids: 2, ..LIMITS };
        let e = r.clone().validate(&schema(), limits).unwrap_err();
        assert_eq!(e.field, InputField::RequestIds);
        assert!(e.message.contains("3 ids") && e.message.contains("--max-request-level-ids"), "{e}");
        r.validate(&schema(), RequestLimits { max_request_level_ids: 3, ..LIMITS }).unwrap();
    }

    #[test]
    fn implicit_lengths_need_one_id_per_bag_before_they_are_written() {
        let mut r = grouped();
        r.num_samples = 8;
        let e = r.validate(&schema(), LIMITS).unwrap_err();
        assert_eq!(e.field, InputField::Ids);
        assert_eq!(e.message, "has 4 ids but the lengths sum to 16");
        assert!(r.lengths.is_empty(), "nothing written for the 8 rows claimed");
        let mut flat =
            RequestSamples { num_samples: 8, dense: vec![0.0; 16], ids: vec![1; 3], ..Default::default() };
        let e = flat.validate(&schema(), LIMITS).unwrap_err();
        assert_eq!((e.field, e.message.as_str()), (InputField::Ids, "has 3 ids but the lengths sum to 32"));
        assert!(flat.lengths.is_empty());
    }

    #[test]
    fn fused_growth_counts_the_dense_broadcast_and_the_flat_copy() {
        let mut r = grouped();
        r.validate(&schema(), LIMITS).unwrap();
        // 2 rows: 2 dense values each; flat: the block's 3 ids and weights too.
        assert_eq!(r.fused_growth_bytes(false), 2 * 2 * 4);
        assert_eq!(r.fused_growth_bytes(true), 2 * (2 * 4 + 3 * 12));
        let flat = RequestSamples { num_samples: 2, ..Default::default() };
        assert_eq!(flat.fused_growth_bytes(true), 0);
        let mut huge = grouped();
        huge.num_samples = usize::MAX;
        assert_eq!(huge.fused_growth_bytes(true), usize::MAX, "saturates");
    }

    #[test]
    fn blocks_crafted_to_collide_under_an_unkeyed_mix_get_different_digests_on_every_thread_alike() {
        // Raw ids (a mapped table's) differing in one id's top bit and the
        // next id's bit 4: FxHash's rotate-xor-multiply gives both the same
        // hash whatever its seed.
        fn block(ids: Vec<i64>) -> RequestBlock {
            RequestBlock { lengths: vec![ids.len() as u32], ids, ..Default::default() }
        }
        let (a, b) = (block(vec![5, 9, 77]), block(vec![5 ^ i64::MIN, 9 ^ 16, 77]));
        assert_ne!(a.hash_values(), b.hash_values());
        // One key for the process: equal blocks get equal digests on any thread.
        let on_another_thread = std::thread::spawn(|| block(vec![5, 9, 77]).hash_values()).join().unwrap();
        assert_eq!(a.hash_values(), on_another_thread);
        assert_ne!(a.hash_values(), block(vec![5, 9, 78]).hash_values());
    }

    #[test]
    fn modulo_maps_the_blocks_ids_too() {
        let mut r = grouped();
        Arc::make_mut(r.request.as_mut().unwrap()).ids = vec![11, -1, 3];
        r.validate(&schema(), RequestLimits { id_policy: IdPolicy::Modulo, ..LIMITS }).unwrap();
        assert_eq!(r.request.unwrap().ids, [1, 9, 3]);
    }

    #[test]
    fn weights_of_weighted_request_level_features_are_widened_in_the_block() {
        // Weighted features come last: cat_2 (request-level) and cat_3.
        let mut s = schema();
        s.sparse[2].weighted = true;
        s.sparse[3].weighted = true;
        let mut r = grouped();
        r.weights = vec![2.0, 3.0];
        Arc::make_mut(r.request.as_mut().unwrap()).weights = vec![0.5];
        let mut ok = r.clone();
        ok.validate(&s, LIMITS).unwrap();
        assert_eq!(ok.weights, [1.0, 2.0, 1.0, 3.0], "the rows' own weights, one per row id");
        assert_eq!(ok.request.unwrap().weights, [1.0, 1.0, 0.5]);
        Arc::make_mut(r.request.as_mut().unwrap()).weights = vec![];
        assert_eq!(r.validate(&s, LIMITS).unwrap_err().field, InputField::RequestWeights);
    }
}
