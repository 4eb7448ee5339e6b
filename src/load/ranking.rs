//! The ranking workload (`narsil load --candidates N`): each request is one
//! user and N candidate rows, as a real ranking call is.
//!
//! * Users are drawn Zipf (`--user-zipf`) from a population of `--users`,
//!   so they recur across requests, as real users do.
//! * A user's **request-level** features are a function of the user id
//!   alone (the user's generator is seeded from the id, not from `--seed`):
//!   every dense feature, and the first `--request-features` sparse features
//!   of the model's schema, each a multi-hot bag of `--user-bag-ids` ids
//!   drawn per `--id-distribution` from that feature's table. The same user
//!   carries the same features in every request, and in every run.
//! * The other sparse features are the **candidates'** own: per row, bags of
//!   `--ids-per-feature` ids (1 by default: one-hot), drawn per
//!   `--id-distribution` from the request's generator (`--seed`).
//!
//! Requests are sent **flat**: the user's dense values and bags repeated on
//! every candidate row, in the request types every protocol accepts today.
//! What that costs (bytes on the wire, lookups, the bottom MLP per row) is
//! what a grouped request form would save.

use rand::{Rng, SeedableRng};
use rand_distr::Distribution;

use super::ids::{IdSampler, RandomBag};
use super::LoadArgs;
use crate::proto::{ModelInfoResponse, PredictRequest};

/// `--user-bag-ids`: how many ids each request-level bag holds: `N`
/// (exactly N) or `MIN-MAX` (uniform in MIN..=MAX, drawn per user and
/// feature).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BagLength {
    /// Fewest ids.
    pub min: u32,
    /// Most ids.
    pub max: u32,
}

impl std::str::FromStr for BagLength {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let invalid = || format!("`{text}` is not a bag length: use `N` or `MIN-MAX` (MIN <= MAX)");
        let number = |s: &str| s.trim().parse::<u32>().map_err(|_| invalid());
        let (min, max) = match text.split_once('-') {
            None => (number(text)?, number(text)?),
            Some((min, max)) => (number(min)?, number(max)?),
        };
        if min > max {
            return Err(invalid());
        }
        Ok(Self { min, max })
    }
}

impl std::fmt::Display for BagLength {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{}-{}", self.min, self.max)
        }
    }
}

/// One user's request-level features.
#[derive(Debug, Clone, PartialEq)]
pub struct UserFeatures {
    /// Every dense feature, `num_dense` values.
    pub dense: Vec<f32>,
    /// Per request-level sparse feature (the first K of the schema), its ids.
    pub bags: Vec<Vec<i64>>,
    /// Per request-level sparse feature, its ids' weights (empty for an
    /// unweighted feature).
    pub weights: Vec<Vec<f32>>,
}

/// Mixed into a user id before it seeds the user's generator, so user `s`
/// and `--seed s` draw different streams.
const USER_SALT: u64 = 0x7573_6572_6665_6174; // "userfeat"

/// The ranking workload for one model.
#[derive(Debug)]
pub struct Ranking {
    info: ModelInfoResponse,
    candidates: usize,
    request_features: usize,
    bag_length: BagLength,
    candidate_ids_per_feature: u32,
    ids: Vec<IdSampler>,
    users: u64,
    user_zipf: rand_distr::Zipf<f64>,
}

/// `--request-features` as given, or half the model's sparse features
/// (rounded down).
pub fn request_features(args: &LoadArgs, num_sparse: usize) -> usize {
    args.request_features.unwrap_or(num_sparse / 2)
}

impl Ranking {
    /// The workload `args` describes (`args.candidates` above 0) for the
    /// model `info`, ids drawn by `ids` (one sampler per sparse feature).
    pub fn new(info: &ModelInfoResponse, args: &LoadArgs, ids: Vec<IdSampler>) -> anyhow::Result<Self> {
        let num_sparse = info.sparse_features.len();
        let request_features = request_features(args, num_sparse);
        anyhow::ensure!(args.candidates > 0, "the ranking workload needs --candidates above 0");
        anyhow::ensure!(
            request_features <= num_sparse,
            "--request-features {request_features} exceeds the model's {num_sparse} sparse features"
        );
        anyhow::ensure!(args.users > 0, "--users must be at least 1");
        anyhow::ensure!(ids.len() == num_sparse, "one id sampler per sparse feature");
        let user_zipf = rand_distr::Zipf::new(args.users as f64, args.user_zipf)
            .map_err(|e| anyhow::anyhow!("--user-zipf {} over {} users: {e}", args.user_zipf, args.users))?;
        Ok(Self {
            info: info.clone(),
            candidates: args.candidates,
            request_features,
            bag_length: args.user_bag_ids,
            candidate_ids_per_feature: args.ids_per_feature,
            ids,
            users: args.users,
            user_zipf,
        })
    }

    /// Request-level sparse features: the first this many of the schema.
    pub fn request_features(&self) -> usize {
        self.request_features
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
        for (feature, sampler) in self.info.sparse_features.iter().zip(&self.ids).take(self.request_features)
        {
            let len = rng.random_range(self.bag_length.min..=self.bag_length.max);
            let bag: Vec<i64> = (0..len).map(|_| sampler.sample(&mut rng)).collect();
            let bag_weights =
                if feature.weighted { bag.iter().map(|_| rng.random::<f32>()).collect() } else { Vec::new() };
            bags.push(bag);
            weights.push(bag_weights);
        }
        UserFeatures { dense, bags, weights }
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
        for _ in 0..rows {
            dense.extend_from_slice(&user.dense);
            for (f, (feature, sampler)) in self.info.sparse_features.iter().zip(&self.ids).enumerate() {
                if f < self.request_features {
                    sparse_lengths.push(user.bags[f].len() as u32);
                    sparse_ids.extend_from_slice(&user.bags[f]);
                    sparse_weights.extend_from_slice(&user.weights[f]);
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
        }
    }

    /// `count` flat requests, each with the user it is for; users drawn
    /// and candidates built from one generator seeded by `seed`.
    pub fn pool(&self, count: usize, seed: u64) -> Vec<(u64, PredictRequest)> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..count)
            .map(|index| {
                let user = self.draw_user(&mut rng);
                let request = self.flat_request(&self.user(user), &mut rng, index);
                (user, request)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
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
                })
                .collect(),
            ..Default::default()
        }
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
}
