//! The ranking workload (`narsil load --candidates N`): each request is one
//! user and N candidate rows, as a real ranking call is.
//!
//! * Users are drawn Zipf (`--user-zipf`) from a population of `--users`,
//!   so they recur across requests, as real users do.
//! * A user's **request-level** features are a function of the user id
//!   alone (the user's generator is seeded from the id, not from `--seed`):
//!   every dense feature, and the request-level sparse features, each a
//!   multi-hot bag of `--user-bag-ids` ids drawn per `--id-distribution`
//!   from that feature's table. The request-level sparse features are those
//!   the model declares (`ModelInfo.sparse_features[].request_level`) when it
//!   declares any request-level feature, else the first `--request-features`
//!   of the schema. The same user carries the same features in every
//!   request, and in every run.
//! * A model's request-level **sequences** (the user's history: one id per
//!   position, channels aligned) are `--history-len` ids each (by default
//!   uniform from half the sequence's `max_len` to its `max_len`), drawn
//!   per `--id-distribution` from each channel's table, one length per
//!   sequence for all its channels.
//! * A model's **raw integer inputs** (`raw_input`) get GR-like values
//!   ([`super::raw`]): a history's `time` channels increasing timestamps
//!   from the user's generator, its other raw channels action bitmasks, a
//!   row's raw `time` feature the request's query time after the user's
//!   last timestamp (one draw a request, the same on every row), other raw
//!   features small values, one a row.
//! * The other sparse features are the **candidates'** own: per row, bags of
//!   `--ids-per-feature` ids (1 by default: one-hot), drawn per
//!   `--id-distribution` from the request's generator (`--seed`).
//!
//! Requests are sent in one of two forms (`--ranking-form`), built from the
//! same draws, so a grouped request and its flat twin score the same:
//!
//! * **grouped** (narsil.v1 only; its default there when the model declares
//!   request-level features): the request-level sparse features once, in
//!   `PredictRequest.request`, the dense features once in `request.dense`
//!   when the model's dense features are request-level
//!   (`ModelInfo.dense_request_level`), the candidate rows carrying only the
//!   candidate features;
//! * **flat**: the user's dense values and bags repeated on every candidate
//!   row, the request every protocol accepts.

use rand::{Rng, SeedableRng};
use rand_distr::Distribution;

pub use super::bag_length::BagLength;
use super::ids::{IdSampler, RandomBag};
use super::{raw, LoadArgs, Protocol};
use crate::proto::{ModelInfoResponse, PredictRequest, RequestFeatures};

/// `--ranking-form`: how a ranking request travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RankingForm {
    /// The request-level features once, in `PredictRequest.request`; the
    /// candidate rows carry only the candidate features (narsil.v1).
    Grouped,
    /// The user's features repeated on every candidate row (every protocol).
    Flat,
}

impl RankingForm {
    /// Its name, as the flag and the report spell it.
    pub fn name(self) -> &'static str {
        match self {
            RankingForm::Grouped => "grouped",
            RankingForm::Flat => "flat",
        }
    }
}

impl std::fmt::Display for RankingForm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether the model declares any request-level feature (sparse, or its
/// dense features): then the grouped form is the one it takes, and its
/// declaration says which features are the user's.
pub fn declares_request_level(info: &ModelInfoResponse) -> bool {
    info.dense_request_level || info.sparse_features.iter().any(|f| f.request_level)
}

/// The form of this run's ranking requests: `--ranking-form` as given, or
/// by default grouped over narsil.v1 to a model that declares request-level
/// features, flat otherwise. `None` without `--candidates`.
pub fn form(args: &LoadArgs, info: &ModelInfoResponse) -> anyhow::Result<Option<RankingForm>> {
    if args.candidates == 0 {
        anyhow::ensure!(
            args.ranking_form.is_none(),
            "--ranking-form applies to the ranking workload: it needs --candidates N"
        );
        anyhow::ensure!(
            args.compare_flat.is_none(),
            "--compare-flat applies to the ranking workload: it needs --candidates N and --ranking-form grouped"
        );
        return Ok(None);
    }
    let form = match (args.ranking_form, args.protocol) {
        (Some(RankingForm::Grouped), Protocol::Torchrec) => anyhow::bail!(
            "--ranking-form grouped: TorchRec's inference protocol has no request-level block, it takes \
             flat requests only; use --ranking-form flat (the default over --protocol torchrec)"
        ),
        (Some(RankingForm::Grouped), Protocol::Kserve) => anyhow::bail!(
            "--ranking-form grouped: narsil load sends KServe v2 ranking requests flat only; use \
             --ranking-form flat (the default over --protocol kserve), or --protocol narsil"
        ),
        (Some(RankingForm::Grouped), Protocol::Narsil) if !declares_request_level(info) => anyhow::bail!(
            "--ranking-form grouped: model `{}` declares no request-level feature (ModelInfo: no sparse \
             feature with request_level, dense_request_level false), so the server takes no grouped \
             request for it; serve a model that declares them, or use --ranking-form flat",
            info.name
        ),
        (Some(form), _) => form,
        (None, Protocol::Narsil) if declares_request_level(info) => RankingForm::Grouped,
        (None, _) => RankingForm::Flat,
    };
    anyhow::ensure!(
        args.compare_flat.is_none() || form == RankingForm::Grouped,
        "--compare-flat compares grouped answers with their flat twins' scores: it needs the grouped form \
         (this run sends flat; pass --ranking-form grouped over --protocol narsil)"
    );
    Ok(Some(form))
}

/// Which sparse features are request-level (the user's), one flag per
/// feature of the schema: those the model declares when it declares any
/// request-level feature (`--request-features`, if given, must count them),
/// else the first `--request-features` (default: half of them, rounded
/// down).
pub fn request_level(args: &LoadArgs, info: &ModelInfoResponse) -> anyhow::Result<Vec<bool>> {
    let num_sparse = info.sparse_features.len();
    if declares_request_level(info) {
        let declared: Vec<bool> = info.sparse_features.iter().map(|f| f.request_level).collect();
        let count = declared.iter().filter(|&&r| r).count();
        if let Some(k) = args.request_features {
            anyhow::ensure!(
                k == count,
                "--request-features {k}: model `{}` declares {count} request-level sparse features ({}); \
                 leave the flag out, or give {count}",
                info.name,
                declared_names(info)
            );
        }
        return Ok(declared);
    }
    let k = args.request_features.unwrap_or(num_sparse / 2);
    anyhow::ensure!(
        k <= num_sparse,
        "--request-features {k} exceeds the model's {num_sparse} sparse features"
    );
    Ok((0..num_sparse).map(|f| f < k).collect())
}

fn declared_names(info: &ModelInfoResponse) -> String {
    let names: Vec<&str> =
        info.sparse_features.iter().filter(|f| f.request_level).map(|f| f.name.as_str()).collect();
    if names.is_empty() {
        "none".to_string()
    } else {
        names.join(", ")
    }
}

/// One user's request-level features.
#[derive(Debug, Clone, PartialEq)]
pub struct UserFeatures {
    /// Every dense feature, `num_dense` values.
    pub dense: Vec<f32>,
    /// Per request-level sparse feature (in schema order), its ids.
    pub bags: Vec<Vec<i64>>,
    /// Per request-level sparse feature, its ids' weights (empty for an
    /// unweighted feature).
    pub weights: Vec<Vec<f32>>,
    /// The last timestamp of the user's history (its raw `time` channels),
    /// `None` without one: the requests' query times follow it.
    pub last_time: Option<i64>,
}

/// Mixed into a user id before it seeds the user's generator, so user `s`
/// and `--seed s` draw different streams.
const USER_SALT: u64 = 0x7573_6572_6665_6174; // "userfeat"

/// The ranking workload for one model.
#[derive(Debug)]
pub struct Ranking {
    info: ModelInfoResponse,
    candidates: usize,
    /// Per sparse feature of the schema: whether it is request-level.
    request_level: Vec<bool>,
    bag_length: BagLength,
    /// Per declared sequence (ModelInfo's order), its histories' lengths.
    history: Vec<BagLength>,
    candidate_ids_per_feature: u32,
    ids: Vec<IdSampler>,
    users: u64,
    user_zipf: rand_distr::Zipf<f64>,
    /// Which raw inputs carry times, in what unit.
    times: raw::RawTimes,
}

/// How many sparse features are request-level ([`request_level`]); 0 when
/// the flags do not fit the model.
pub fn request_features(args: &LoadArgs, info: &ModelInfoResponse) -> usize {
    request_level(args, info).map_or(0, |mask| mask.iter().filter(|&&r| r).count())
}

impl Ranking {
    /// The workload `args` describes (`args.candidates` above 0) for the
    /// model `info`, ids drawn by `ids` (one sampler per sparse feature).
    pub fn new(info: &ModelInfoResponse, args: &LoadArgs, ids: Vec<IdSampler>) -> anyhow::Result<Self> {
        let num_sparse = info.sparse_features.len();
        anyhow::ensure!(args.candidates > 0, "the ranking workload needs --candidates above 0");
        let request_level = request_level(args, info)?;
        anyhow::ensure!(args.users > 0, "--users must be at least 1");
        anyhow::ensure!(ids.len() == num_sparse, "one id sampler per sparse feature");
        let user_zipf = rand_distr::Zipf::new(args.users as f64, args.user_zipf)
            .map_err(|e| anyhow::anyhow!("--user-zipf {} over {} users: {e}", args.user_zipf, args.users))?;
        let history = info
            .sequences
            .iter()
            .map(|s| {
                let max = s.max_len.max(1);
                args.history_len.unwrap_or(BagLength { min: max.div_ceil(2), max })
            })
            .collect();
        Ok(Self {
            info: info.clone(),
            candidates: args.candidates,
            request_level,
            bag_length: args.user_bag_ids,
            history,
            candidate_ids_per_feature: args.ids_per_feature,
            ids,
            users: args.users,
            user_zipf,
            times: args.raw_times(),
        })
    }

    /// How many sparse features are request-level.
    pub fn request_features(&self) -> usize {
        self.request_level.iter().filter(|&&r| r).count()
    }

    /// Per sparse feature of the schema: whether it is request-level.
    pub fn request_level(&self) -> &[bool] {
        &self.request_level
    }

    /// One user id (below `--users`; 0 the most frequent).
    pub fn draw_user(&self, rng: &mut impl Rng) -> u64 {
        // Zipf draws ranks 1..=users, as floats.
        (self.user_zipf.sample(rng) as u64).clamp(1, self.users) - 1
    }

    /// User `user`'s request-level features: the same for every call (a
    /// function of the id, whatever the run's seed).
    pub fn user(&self, user: u64) -> UserFeatures {
        let mut rng = rand::rngs::StdRng::seed_from_u64(user ^ USER_SALT);
        let dense = (0..self.info.num_dense).map(|_| rng.random::<f32>()).collect();
        let (mut bags, mut weights) = (Vec::new(), Vec::new());
        // Each sequence's length, drawn once for all its (aligned) channels.
        let lengths: Vec<u32> = self.history.iter().map(|h| rng.random_range(h.min..=h.max)).collect();
        let features = self.info.sparse_features.iter().zip(&self.ids).zip(&self.request_level);
        let (mut start, mut last_time) = (None, None);
        for ((feature, sampler), _) in features.filter(|(_, request_level)| **request_level) {
            let sequence = self.info.sequences.iter().position(|s| s.name == feature.sequence);
            let in_sequence = sequence.is_some() && !feature.sequence.is_empty();
            let len = match sequence {
                Some(s) if in_sequence => lengths[s],
                // A raw input outside a sequence is one value.
                _ if feature.raw_input => 1,
                _ => rng.random_range(self.bag_length.min..=self.bag_length.max),
            };
            let bag: Vec<i64> = match (feature.raw_input, self.times.is_time(&feature.name)) {
                (false, _) => (0..len).map(|_| sampler.sample(&mut rng)).collect(),
                (true, true) if in_sequence => {
                    let start = *start.get_or_insert_with(|| raw::start_time(&mut rng));
                    let times = raw::history_times(&mut rng, start, len as usize);
                    last_time = times.last().copied().max(last_time);
                    times.into_iter().map(|t| self.times.sent(t)).collect()
                }
                (true, true) => vec![self.times.sent(raw::query_time(&mut rng, last_time))],
                (true, false) => (0..len).map(|_| raw::small(&mut rng)).collect(),
            };
            let bag_weights =
                if feature.weighted { bag.iter().map(|_| rng.random::<f32>()).collect() } else { Vec::new() };
            bags.push(bag);
            weights.push(bag_weights);
        }
        UserFeatures { dense, bags, weights, last_time }
    }

    /// One flat request: `user`'s features repeated on each of the
    /// candidate rows, the candidates' own features drawn from `rng`.
    pub fn flat_request(&self, user: &UserFeatures, rng: &mut impl Rng, index: usize) -> PredictRequest {
        let rows = self.candidates;
        let num_sparse = self.info.sparse_features.len();
        let mut dense = Vec::with_capacity(rows * user.dense.len());
        let mut sparse_lengths = Vec::with_capacity(rows * num_sparse);
        let mut sparse_ids = Vec::new();
        let mut sparse_weights = Vec::new();
        let per = self.candidate_ids_per_feature;
        let query_time = self.query_time(user, rng);
        for _ in 0..rows {
            dense.extend_from_slice(&user.dense);
            let mut user_bag = 0;
            for (f, (feature, sampler)) in self.info.sparse_features.iter().zip(&self.ids).enumerate() {
                if self.request_level[f] {
                    sparse_lengths.push(user.bags[user_bag].len() as u32);
                    sparse_ids.extend_from_slice(&user.bags[user_bag]);
                    sparse_weights.extend_from_slice(&user.weights[user_bag]);
                    user_bag += 1;
                    continue;
                }
                if feature.raw_input {
                    sparse_lengths.push(1);
                    sparse_ids.push(
                        query_time
                            .filter(|_| self.times.is_time(&feature.name))
                            .unwrap_or_else(|| raw::small(rng)),
                    );
                    continue;
                }
                let bag = RandomBag { sampler, weighted: feature.weighted, ids_per_feature: per };
                bag.push(rng, &mut sparse_lengths, &mut sparse_ids, &mut sparse_weights);
            }
        }
        PredictRequest {
            batch_size: rows as u32,
            dense,
            sparse_lengths,
            sparse_ids,
            request_id: format!("load-{index}"),
            model: self.info.name.clone(),
            model_version: String::new(),
            sparse_weights,
            request: None,
        }
    }

    /// One grouped request: `user`'s sparse features once in `request`
    /// (its dense features too when the model's dense features are
    /// request-level, else on every row), the candidate rows carrying only
    /// the candidate features. Draws from `rng` exactly what
    /// [`Self::flat_request`] draws, so the two forms of one draw are twins.
    pub fn grouped_request(&self, user: &UserFeatures, rng: &mut impl Rng, index: usize) -> PredictRequest {
        let rows = self.candidates;
        let candidate_features = self.request_level.iter().filter(|&&r| !r).count();
        let dense_once = self.info.dense_request_level;
        let dense = if dense_once { Vec::new() } else { user.dense.repeat(rows) };
        let mut sparse_lengths = Vec::with_capacity(rows * candidate_features);
        let mut sparse_ids = Vec::new();
        let mut sparse_weights = Vec::new();
        let per = self.candidate_ids_per_feature;
        let query_time = self.query_time(user, rng);
        for _ in 0..rows {
            for (f, (feature, sampler)) in self.info.sparse_features.iter().zip(&self.ids).enumerate() {
                if !self.request_level[f] && feature.raw_input {
                    sparse_lengths.push(1);
                    sparse_ids.push(
                        query_time
                            .filter(|_| self.times.is_time(&feature.name))
                            .unwrap_or_else(|| raw::small(rng)),
                    );
                } else if !self.request_level[f] {
                    let bag = RandomBag { sampler, weighted: feature.weighted, ids_per_feature: per };
                    bag.push(rng, &mut sparse_lengths, &mut sparse_ids, &mut sparse_weights);
                }
            }
        }
        let request = RequestFeatures {
            dense: if dense_once { user.dense.clone() } else { Vec::new() },
            sparse_lengths: user.bags.iter().map(|bag| bag.len() as u32).collect(),
            sparse_ids: user.bags.concat(),
            sparse_weights: user.weights.concat(),
        };
        PredictRequest {
            batch_size: rows as u32,
            dense,
            // One id per candidate bag is the wire default: send no lengths.
            sparse_lengths: if per == 1 { Vec::new() } else { sparse_lengths },
            sparse_ids,
            request_id: format!("load-{index}"),
            model: self.info.name.clone(),
            model_version: String::new(),
            sparse_weights,
            request: Some(request),
        }
    }

    /// A request's query time for `user` ([`raw::query_time`]), drawn from
    /// `rng` only when the candidate rows carry a raw `time` feature (so
    /// other models' requests draw what they always drew).
    fn query_time(&self, user: &UserFeatures, rng: &mut impl Rng) -> Option<i64> {
        let features = self.info.sparse_features.iter().zip(&self.request_level);
        let row_time = features.into_iter().any(|(f, &r)| !r && f.raw_input && self.times.is_time(&f.name));
        row_time.then(|| self.times.sent(raw::query_time(rng, user.last_time)))
    }

    /// `count` flat requests, each with the user it is for; users drawn
    /// and candidates built from one generator seeded by `seed`.
    pub fn pool(&self, count: usize, seed: u64) -> Vec<(u64, PredictRequest)> {
        self.pool_in(RankingForm::Flat, count, seed)
    }

    /// `count` requests in `form`, each with the user it is for: the same
    /// draws in either form, so `pool_in(Grouped, n, s)[i]` and
    /// `pool_in(Flat, n, s)[i]` are one request's two forms.
    pub fn pool_in(&self, form: RankingForm, count: usize, seed: u64) -> Vec<(u64, PredictRequest)> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..count)
            .map(|index| {
                let user = self.draw_user(&mut rng);
                let features = self.user(user);
                let request = match form {
                    RankingForm::Flat => self.flat_request(&features, &mut rng, index),
                    RankingForm::Grouped => self.grouped_request(&features, &mut rng, index),
                };
                (user, request)
            })
            .collect()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use clap::Parser;

    use super::*;
    use crate::proto::SparseFeature;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        load: LoadArgs,
    }

    fn args(flags: &[&str]) -> LoadArgs {
        Cli::parse_from(["load"].iter().chain(flags)).load
    }

    /// The default DLRM's shape, tables of `rows` rows (feature 3 weighted
    /// when `weighted`).
    fn dlrm(rows: u64, weighted: bool) -> ModelInfoResponse {
        ModelInfoResponse {
            name: "dlrm".into(),
            num_dense: 13,
            sparse_features: (0..26)
                .map(|i| SparseFeature {
                    name: format!("cat_{i}"),
                    num_rows: rows + i as u64,
                    weighted: weighted && i == 3,
                    request_level: false,
                    raw_ids: false,
                    sequence: String::new(),
                    raw_input: false,
                })
                .collect(),
            ..Default::default()
        }
    }

    /// `info`, declaring the features of `request_level` request-level, and
    /// its dense features when `dense`.
    fn declared(mut info: ModelInfoResponse, request_level: &[usize], dense: bool) -> ModelInfoResponse {
        for &f in request_level {
            info.sparse_features[f].request_level = true;
        }
        info.dense_request_level = dense;
        info
    }

    /// A grouped request as the flat request it stands for: its
    /// request-level block copied onto every row, each feature where the
    /// schema puts it.
    fn expand(info: &ModelInfoResponse, grouped: &PredictRequest) -> PredictRequest {
        let block = grouped.request.as_ref().expect("a grouped request has a request-level block");
        let rows = grouped.batch_size as usize;
        let num_dense = info.num_dense as usize;
        // The request-level bags, in schema order: (ids, weights).
        let mut user = Vec::new();
        let (mut ids, mut weights) = (block.sparse_ids.iter(), block.sparse_weights.iter());
        let user_features = info.sparse_features.iter().filter(|f| f.request_level);
        for (k, feature) in user_features.enumerate() {
            let len = block.sparse_lengths.get(k).map_or(1, |&len| len as usize);
            let bag: Vec<i64> = ids.by_ref().take(len).copied().collect();
            let bag_weights: Vec<f32> =
                if feature.weighted { weights.by_ref().take(len).copied().collect() } else { Vec::new() };
            user.push((bag, bag_weights));
        }
        assert!(ids.next().is_none() && weights.next().is_none(), "the block holds nothing more");
        let mut flat = PredictRequest { request: None, ..grouped.clone() };
        (flat.dense, flat.sparse_lengths, flat.sparse_ids, flat.sparse_weights) = Default::default();
        let (mut ids, mut weights) = (grouped.sparse_ids.iter(), grouped.sparse_weights.iter());
        let mut candidate_bag = 0;
        for row in 0..rows {
            if info.dense_request_level {
                assert!(grouped.dense.is_empty(), "request-level dense features are sent once");
                flat.dense.extend_from_slice(&block.dense);
            } else {
                assert!(block.dense.is_empty());
                flat.dense.extend_from_slice(&grouped.dense[row * num_dense..(row + 1) * num_dense]);
            }
            let mut user_bag = user.iter();
            for feature in &info.sparse_features {
                if feature.request_level {
                    let (bag, bag_weights) = user_bag.next().unwrap();
                    flat.sparse_lengths.push(bag.len() as u32);
                    flat.sparse_ids.extend_from_slice(bag);
                    flat.sparse_weights.extend_from_slice(bag_weights);
                    continue;
                }
                let len = grouped.sparse_lengths.get(candidate_bag).map_or(1, |&len| len as usize);
                candidate_bag += 1;
                flat.sparse_lengths.push(len as u32);
                flat.sparse_ids.extend(ids.by_ref().take(len));
                if feature.weighted {
                    flat.sparse_weights.extend(weights.by_ref().take(len));
                }
            }
        }
        assert!(ids.next().is_none() && weights.next().is_none(), "the rows hold nothing more");
        flat
    }

    fn ranking(info: &ModelInfoResponse, flags: &[&str]) -> Ranking {
        let args = args(flags);
        let ids = super::super::workload::id_samplers(info, &args.id_distributions()).unwrap();
        Ranking::new(info, &args, ids).unwrap()
    }

    /// Row `row`'s bags of `request`, feature by feature.
    fn row_bags(request: &PredictRequest, num_sparse: usize) -> Vec<Vec<Vec<i64>>> {
        let mut ids = request.sparse_ids.iter().copied();
        request
            .sparse_lengths
            .chunks(num_sparse)
            .map(|row| row.iter().map(|&len| ids.by_ref().take(len as usize).collect()).collect())
            .collect()
    }

    #[test]
    fn the_same_user_always_gets_the_same_request_level_features() {
        let info = dlrm(100_000, true);
        let a = ranking(&info, &["--candidates", "3", "--seed", "1"]);
        let b = ranking(&info, &["--candidates", "7", "--seed", "2"]);
        for user in [0, 1, 17, 99_999] {
            assert_eq!(a.user(user), a.user(user), "user {user}: twice in one run");
            assert_eq!(a.user(user), b.user(user), "user {user}: in a run with another seed");
        }
        assert_ne!(a.user(0), a.user(1), "two users, two feature sets");
        // Through the pool: every request of one user carries the same
        // request-level block on its first row.
        let pool = a.pool(400, 5);
        let mut seen: BTreeMap<u64, (Vec<f32>, Vec<Vec<i64>>)> = BTreeMap::new();
        let mut repeats = 0;
        for (user, request) in &pool {
            let block = (request.dense[..13].to_vec(), row_bags(request, 26)[0][..13].to_vec());
            if let Some(first) = seen.insert(*user, block.clone()) {
                assert_eq!(first, block, "user {user}'s features changed between requests");
                repeats += 1;
            }
        }
        assert!(repeats > 0, "some user came back in 400 requests");
    }

    #[test]
    fn every_candidate_row_of_a_flat_request_carries_the_users_features_exactly() {
        let info = dlrm(100_000, true);
        let workload = ranking(&info, &["--candidates", "50"]);
        assert_eq!(workload.request_features(), 13, "default: half of 26 sparse features");
        for (user, request) in workload.pool(8, 3) {
            let features = workload.user(user);
            assert_eq!(request.batch_size, 50);
            assert_eq!(request.dense.len(), 50 * 13);
            assert_eq!(request.sparse_lengths.len(), 50 * 26);
            let rows = row_bags(&request, 26);
            assert_eq!(rows.len(), 50);
            let mut weights = request.sparse_weights.iter().copied();
            for (row, bags) in rows.iter().enumerate() {
                assert_eq!(request.dense[row * 13..(row + 1) * 13], features.dense[..], "row {row}'s dense");
                assert_eq!(bags[..13], features.bags[..], "row {row}'s request-level bags");
                for bag in &bags[13..] {
                    assert_eq!(bag.len(), 1, "row {row}: candidate features are one-hot");
                }
                // Feature 3 (request-level) is the only weighted one.
                let row_weights: Vec<f32> = weights.by_ref().take(features.weights[3].len()).collect();
                assert_eq!(row_weights, features.weights[3], "row {row}'s request-level weights");
            }
            assert_eq!(weights.next(), None, "no weights beyond the weighted feature's");
            let candidates: BTreeSet<i64> = rows.iter().map(|bags| bags[20][0]).collect();
            assert!(candidates.len() > 1, "candidates differ from row to row");
        }
    }

    #[test]
    fn users_recur_across_requests_under_the_default_zipf() {
        let info = dlrm(1_000, false);
        let workload = ranking(&info, &["--candidates", "2"]);
        let pool = workload.pool(1_000, 7);
        let users: BTreeSet<u64> = pool.iter().map(|(user, _)| *user).collect();
        // Uniform over 100,000 users would give ~995 distinct users in 1,000
        // requests; Zipf 1.05 gives far fewer.
        assert!(users.len() < 800, "{} distinct users in 1,000 requests", users.len());
        assert!(users.iter().all(|&u| u < 100_000), "users are below --users");
        // And the recurring users' requests are recognisably the same user's.
        let blocks: BTreeSet<Vec<Vec<i64>>> =
            pool.iter().map(|(_, r)| row_bags(r, 26)[0][..13].to_vec()).collect();
        assert_eq!(blocks.len(), users.len(), "one request-level block per distinct user");
    }

    #[test]
    fn a_users_history_has_one_length_for_all_its_channels_within_the_sequences_maximum() {
        // cat_0 and cat_1 the channels of a request-level history of at most 10.
        let mut info = declared(dlrm(1_000, false), &[0, 1, 2], false);
        info.sequences = vec![crate::proto::SequenceFeature {
            name: "history".into(),
            features: vec!["cat_0".into(), "cat_1".into()],
            max_len: 10,
            keep: "last".into(),
            request_rows: false,
        }];
        info.sparse_features[0].sequence = "history".into();
        info.sparse_features[1].sequence = "history".into();
        let mut lengths = BTreeSet::new();
        let workload = ranking(&info, &["--candidates", "2", "--user-bag-ids", "3"]);
        for user in 0..200 {
            let features = workload.user(user);
            assert_eq!(features.bags[0].len(), features.bags[1].len(), "user {user}: channels aligned");
            assert_eq!(features.bags[2].len(), 3, "a pooled bag keeps --user-bag-ids");
            lengths.insert(features.bags[0].len());
        }
        assert_eq!(lengths, (5..=10).collect(), "half the maximum to the maximum by default");
        let fixed = ranking(&info, &["--candidates", "2", "--history-len", "7"]);
        assert!((0..20).all(|user| fixed.user(user).bags[1].len() == 7));
    }

    #[test]
    fn request_level_bags_have_the_stated_length() {
        let info = dlrm(100_000, false);
        let fixed = ranking(&info, &["--candidates", "4"]);
        for user in 0..50 {
            let features = fixed.user(user);
            assert_eq!(features.bags.len(), 13);
            assert!(features.bags.iter().all(|bag| bag.len() == 20), "user {user}: 20 ids each by default");
        }
        let ranged =
            ranking(&info, &["--candidates", "4", "--user-bag-ids", "5-8", "--request-features", "3"]);
        let mut lengths = BTreeSet::new();
        for user in 0..200 {
            let features = ranged.user(user);
            assert_eq!(features.bags.len(), 3, "--request-features 3");
            lengths.extend(features.bags.iter().map(Vec::len));
        }
        assert_eq!(lengths, BTreeSet::from([5, 6, 7, 8]));
        for (_, request) in ranged.pool(4, 1) {
            let rows = row_bags(&request, 26);
            assert!(rows.iter().all(|bags| bags[3..].iter().all(|bag| bag.len() == 1)));
        }
        assert_eq!("20".parse(), Ok(BagLength { min: 20, max: 20 }));
        assert_eq!("5-8".parse::<BagLength>().unwrap().to_string(), "5-8");
        for bad in ["", "x", "8-5", "-3", "1-"] {
            assert!(bad.parse::<BagLength>().unwrap_err().contains("MIN-MAX"), "{bad}");
        }
    }

    #[test]
    fn ranking_ids_stay_within_each_tables_rows() {
        // Small tables of different sizes, multi-hot candidates too.
        let info = dlrm(30, true);
        for distribution in ["zipf:1.05", "uniform"] {
            let workload = ranking(
                &info,
                &["--candidates", "20", "--id-distribution", distribution, "--ids-per-feature", "3"],
            );
            for (_, request) in workload.pool(16, 2) {
                for bags in row_bags(&request, 26) {
                    for (feature, bag) in bags.iter().enumerate() {
                        let rows = info.sparse_features[feature].num_rows as i64;
                        assert!(
                            bag.iter().all(|&id| (0..rows).contains(&id)),
                            "{distribution} feature {feature}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_grouped_request_expanded_equals_its_flat_twin_from_the_same_seed() {
        let cases: [(ModelInfoResponse, &[&str]); 4] = [
            // The workload: cat_0..cat_12 and the dense features
            // request-level, feature 3 weighted (a weighted user bag).
            (declared(dlrm(100_000, true), &(0..13).collect::<Vec<_>>(), true), &["--candidates", "50"]),
            // Request-level features scattered over the schema, dense
            // features per row, multi-hot weighted candidates.
            (
                declared(dlrm(1_000, true), &[1, 4, 7, 25], false),
                &["--candidates", "9", "--ids-per-feature", "3", "--user-bag-ids", "0-6"],
            ),
            // Only the dense features request-level.
            (declared(dlrm(500, false), &[], true), &["--candidates", "4", "--id-distribution", "uniform"]),
            // A weighted candidate feature, one-hot.
            (declared(dlrm(500, true), &[0, 1, 2], true), &["--candidates", "7", "--request-features", "3"]),
        ];
        for (info, flags) in cases {
            let workload = ranking(&info, flags);
            for seed in [1, 9] {
                let grouped = workload.pool_in(RankingForm::Grouped, 12, seed);
                let flat = workload.pool_in(RankingForm::Flat, 12, seed);
                assert_eq!(grouped.len(), flat.len());
                for ((user, grouped), (twin_user, flat)) in grouped.iter().zip(&flat) {
                    assert_eq!(user, twin_user, "{flags:?}: one user per twin");
                    assert!(flat.request.is_none(), "flat requests carry no block");
                    let block = grouped.request.as_ref().unwrap();
                    assert_eq!(block.sparse_lengths.len(), workload.request_features(), "{flags:?}");
                    // Multi-hot candidates send their lengths, one-hot ones none.
                    let lengths_per_row = if flags.contains(&"--ids-per-feature") {
                        26 - workload.request_features()
                    } else {
                        0
                    };
                    assert_eq!(grouped.sparse_lengths.len(), grouped.batch_size as usize * lengths_per_row);
                    assert_eq!(&expand(&info, grouped), flat, "{flags:?} seed {seed}: grouped != flat");
                }
            }
        }
        // And the flat pool is the one `pool` has always built.
        let info = declared(dlrm(100_000, true), &(0..13).collect::<Vec<_>>(), true);
        let workload = ranking(&info, &["--candidates", "20"]);
        assert_eq!(workload.pool(5, 3), workload.pool_in(RankingForm::Flat, 5, 3));
    }

    #[test]
    fn declaring_the_first_features_request_level_changes_no_flat_request() {
        // The default DLRM's export declares cat_0..cat_12: the flat requests
        // are those of a model that declares nothing (the first 13 of 26).
        let plain = dlrm(100_000, true);
        let with = declared(plain.clone(), &(0..13).collect::<Vec<_>>(), true);
        let flags = ["--candidates", "30"];
        let encode = |pool: Vec<(u64, PredictRequest)>| -> Vec<Vec<u8>> {
            pool.iter().map(|(_, r)| prost::Message::encode_to_vec(r)).collect()
        };
        assert_eq!(encode(ranking(&plain, &flags).pool(6, 4)), encode(ranking(&with, &flags).pool(6, 4)));
    }

    #[test]
    fn the_grouped_form_of_the_default_workload_is_over_ten_times_smaller() {
        let info = declared(dlrm(100_000, false), &(0..13).collect::<Vec<_>>(), true);
        let workload = ranking(&info, &["--candidates", "500"]);
        let bytes = |form| -> usize {
            let pool = workload.pool_in(form, 8, 1);
            pool.iter().map(|(_, r)| prost::Message::encoded_len(r)).sum()
        };
        let (grouped, flat) = (bytes(RankingForm::Grouped), bytes(RankingForm::Flat));
        assert!(flat > 10 * grouped, "flat {flat} bytes, grouped {grouped}");
        // One-hot candidates: their lengths are left to the wire's default.
        let (_, request) = &workload.pool_in(RankingForm::Grouped, 1, 1)[0];
        assert!(request.sparse_lengths.is_empty());
        assert_eq!(request.sparse_ids.len(), 500 * 13);
        assert!(request.dense.is_empty());
        assert_eq!(request.request.as_ref().unwrap().dense.len(), 13);
        assert_eq!(request.request.as_ref().unwrap().sparse_lengths, [20; 13]);
    }

    #[test]
    fn the_form_defaults_to_grouped_where_it_can_and_is_refused_by_name_where_it_cannot() {
        let plain = dlrm(100, false);
        let with = declared(plain.clone(), &[0, 1], true);
        let form = |info: &ModelInfoResponse, flags: &[&str]| form(&args(flags), info);
        let c = ["--candidates", "5"];
        let flags = |more: &[&'static str]| -> Vec<&'static str> { c.iter().chain(more).copied().collect() };
        assert_eq!(form(&with, &c).unwrap(), Some(RankingForm::Grouped), "narsil.v1, declared: grouped");
        assert_eq!(form(&plain, &c).unwrap(), Some(RankingForm::Flat), "nothing declared: flat");
        assert_eq!(form(&with, &flags(&["--protocol", "torchrec"])).unwrap(), Some(RankingForm::Flat));
        assert_eq!(form(&with, &flags(&["--protocol", "kserve"])).unwrap(), Some(RankingForm::Flat));
        assert_eq!(form(&with, &flags(&["--ranking-form", "flat"])).unwrap(), Some(RankingForm::Flat));
        assert_eq!(form(&with, &[]).unwrap(), None, "no ranking workload");
        let refused = |info: &ModelInfoResponse, more: &[&'static str]| -> String {
            form(info, &flags(more)).unwrap_err().to_string()
        };
        for (info, more, says) in [
            (&with, &["--ranking-form", "grouped", "--protocol", "torchrec"][..], "TorchRec"),
            (&with, &["--ranking-form", "grouped", "--protocol", "kserve"][..], "KServe"),
            (&plain, &["--ranking-form", "grouped"][..], "declares no request-level feature"),
            (&plain, &["--compare-flat"][..], "--compare-flat"),
            (&with, &["--compare-flat", "--ranking-form", "flat"][..], "--compare-flat"),
        ] {
            let error = refused(info, more);
            assert!(error.contains(says) && error.contains("--"), "{more:?}: {error}");
            if more.contains(&"grouped") {
                assert!(error.contains("--ranking-form"), "{more:?}: {error}");
            }
        }
        assert!(form(&with, &["--ranking-form", "grouped"])
            .unwrap_err()
            .to_string()
            .contains("--candidates"));
        let compare = args(&flags(&["--compare-flat"]));
        assert_eq!(compare.compare_flat, Some(200), "--compare-flat alone: 200 requests");
        assert_eq!(args(&flags(&["--compare-flat", "7"])).compare_flat, Some(7));
        assert_eq!(form(&with, &flags(&["--compare-flat"])).unwrap(), Some(RankingForm::Grouped));
    }

    #[test]
    fn a_model_that_declares_request_level_features_decides_which_are_the_users() {
        let info = declared(dlrm(100, false), &[2, 5, 9], false);
        let workload = ranking(&info, &["--candidates", "3"]);
        assert_eq!(workload.request_features(), 3);
        let mask: Vec<usize> = (0..26).filter(|&f| workload.request_level()[f]).collect();
        assert_eq!(mask, [2, 5, 9]);
        let args = args(&["--candidates", "3", "--request-features", "4"]);
        let ids = super::super::workload::id_samplers(&info, &args.id_distributions()).unwrap();
        let error = Ranking::new(&info, &args, ids).unwrap_err().to_string();
        assert!(error.contains("--request-features 4") && error.contains("cat_2, cat_5, cat_9"), "{error}");
    }

    #[test]
    fn bad_ranking_flags_are_refused_by_name() {
        let info = dlrm(100, false);
        let error = |flags: &[&str]| {
            let args = args(flags);
            let ids = super::super::workload::id_samplers(&info, &args.id_distributions()).unwrap();
            Ranking::new(&info, &args, ids).unwrap_err().to_string()
        };
        assert!(error(&["--candidates", "5", "--request-features", "27"]).contains("--request-features"));
        assert!(error(&["--candidates", "5", "--users", "0"]).contains("--users"));
    }

    /// A GR-like model (generative-recommenders' streaming features): a
    /// request-level user id and history `uih` of item ids, raw timestamps
    /// and raw action bitmasks; per candidate an item id, a raw rating and
    /// a raw query time.
    pub(crate) fn gr_info() -> ModelInfoResponse {
        let feature = |name: &str, num_rows: u64, request_level: bool, sequence: &str| SparseFeature {
            name: name.into(),
            num_rows,
            weighted: false,
            request_level,
            raw_ids: false,
            sequence: sequence.into(),
            raw_input: num_rows == 0,
        };
        ModelInfoResponse {
            name: "gr".into(),
            num_dense: 0,
            sparse_features: vec![
                feature("user_id", 1_000, true, ""),
                feature("item_candidate_id", 5_000, false, ""),
                feature("item_candidate_rating", 0, false, ""),
                feature("item_query_time", 0, false, ""),
                feature("item_id", 5_000, true, "uih"),
                feature("action_timestamp", 0, true, "uih"),
                feature("item_weights", 0, true, "uih"),
            ],
            sequences: vec![crate::proto::SequenceFeature {
                name: "uih".into(),
                features: vec!["item_id".into(), "action_timestamp".into(), "item_weights".into()],
                max_len: 64,
                keep: "last".into(),
                request_rows: true,
            }],
            ..Default::default()
        }
    }

    #[test]
    fn timestamps_increase_within_a_history_and_bitmasks_are_in_range() {
        let workload = ranking(&gr_info(), &["--candidates", "16"]);
        for user in 0..50 {
            let features = workload.user(user);
            // Request-level bags: user_id, item_id, action_timestamp, item_weights.
            let [user_id, items, times, masks] = &features.bags[..] else { panic!("four user bags") };
            assert!(!user_id.is_empty(), "a pooled user bag (--user-bag-ids)");
            assert!((32..=64).contains(&items.len()), "history length {}", items.len());
            assert_eq!((times.len(), masks.len()), (items.len(), items.len()), "channels aligned");
            assert!(times.windows(2).all(|w| w[1] > w[0]), "user {user}: oldest first, increasing");
            assert!(times[0] >= raw::EPOCH_BASE && times[0] < raw::EPOCH_BASE + 400 * 86_400);
            assert!(masks.iter().all(|m| (0..256).contains(m)), "user {user}: {masks:?}");
            assert_eq!(features.last_time, times.last().copied());
            assert_eq!(workload.user(user), features, "a recurring user has the same history");
        }
        assert_ne!(workload.user(0).bags[2][0], workload.user(1).bags[2][0], "each user its own start");
    }

    #[test]
    fn the_query_time_follows_the_history_the_same_for_every_candidate() {
        let info = gr_info();
        let workload = ranking(&info, &["--candidates", "16"]);
        let mut query_times_of_user_0 = BTreeSet::new();
        for (user, request) in workload.pool_in(RankingForm::Grouped, 40, 7) {
            let last = workload.user(user).last_time.unwrap();
            assert!(request.sparse_lengths.is_empty(), "one value per candidate bag");
            // Per row: item_candidate_id, item_candidate_rating, item_query_time.
            let rows: Vec<&[i64]> = request.sparse_ids.chunks(3).collect();
            assert_eq!(rows.len(), 16);
            let query = rows[0][2];
            assert!(query > last && query <= last + 3_600, "query {query} after the history's {last}");
            assert!(rows.iter().all(|row| row[2] == query), "one query time a request");
            assert!(rows.iter().all(|row| (0..256).contains(&row[1])), "ratings in [0, 256)");
            if user == 0 {
                query_times_of_user_0.insert(query);
            }
        }
        assert!(query_times_of_user_0.len() > 1, "a recurring user asks again later, another query time");
    }

    #[test]
    fn grouped_and_flat_twins_carry_the_same_raw_values() {
        let info = gr_info();
        for flags in [&["--candidates", "16"][..], &["--candidates", "5", "--ids-per-feature", "2"]] {
            let workload = ranking(&info, flags);
            let grouped = workload.pool_in(RankingForm::Grouped, 10, 3);
            let flat = workload.pool_in(RankingForm::Flat, 10, 3);
            for ((_, grouped), (_, flat)) in grouped.iter().zip(&flat) {
                assert_eq!(&expand(&info, grouped), flat, "{flags:?}: grouped != flat");
                // Every raw input outside the sequence is one value a row.
                let per_row = flat.sparse_lengths.chunks(7).map(|row| (row[2], row[3])).collect::<Vec<_>>();
                assert!(per_row.iter().all(|&lengths| lengths == (1, 1)), "{per_row:?}");
            }
        }
    }
}
