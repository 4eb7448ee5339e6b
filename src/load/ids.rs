//! Which ids the load generator sends. Real recommendation traffic is
//! skewed: a few ids (popular items, active users) take most lookups,
//! roughly Zipf-distributed. `--id-distribution` chooses, per feature:
//!
//! * `uniform`: every id of the table equally likely;
//! * `zipf:ALPHA`: the id of popularity rank `r` (0 the hottest) with
//!   probability proportional to `1 / (r + 1)^ALPHA` (ALPHA > 0; 1.05 is a
//!   common fit for item popularity).
//!
//! Ranks are scattered over the table, so hot ids are not `0..k` (which a
//! cache or a page cache would flatter): rank `r` of feature `f` is id
//! `(r * P + B_f) mod rows`, where `P` is the first of a fixed list of large
//! primes that does not divide `rows` (so the map is a bijection) and `B_f`
//! an offset drawn from `f`. Which ids are hot is a property of the traffic,
//! not of a run: `--seed` changes the draws, never the popularity order, so
//! a warm-up with one seed warms the rows a run with another seed reads.

use rand::Rng;
use rand_distr::Distribution;

/// How one feature's ids are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum IdDistribution {
    /// Every id equally likely.
    Uniform,
    /// Zipf with this exponent over popularity ranks.
    Zipf(f64),
}

impl std::fmt::Display for IdDistribution {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Uniform => write!(f, "uniform"),
            Self::Zipf(alpha) => write!(f, "zipf:{alpha}"),
        }
    }
}

impl std::str::FromStr for IdDistribution {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let invalid =
            || format!("`{text}` is not an id distribution: use `uniform` or `zipf:ALPHA` (ALPHA > 0)");
        match text.trim().split_once(':') {
            None if text.trim() == "uniform" => Ok(Self::Uniform),
            Some(("zipf", alpha)) => match alpha.trim().parse::<f64>() {
                Ok(alpha) if alpha.is_finite() && alpha > 0.0 => Ok(Self::Zipf(alpha)),
                _ => Err(invalid()),
            },
            _ => Err(invalid()),
        }
    }
}

/// `--id-distribution`: one distribution for every feature, or one per
/// feature (comma-separated, in the model's feature order).
#[derive(Debug, Clone, PartialEq)]
pub struct IdDistributions(pub Vec<IdDistribution>);

impl std::str::FromStr for IdDistributions {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        text.split(',').map(str::parse).collect::<Result<Vec<_>, _>>().map(Self)
    }
}

impl std::fmt::Display for IdDistributions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        write!(f, "{}", names.join(","))
    }
}

impl IdDistributions {
    /// One sampler per feature, for tables of `rows[f]` rows.
    pub fn samplers(&self, rows: &[u64]) -> anyhow::Result<Vec<IdSampler>> {
        let each: Vec<IdDistribution> = match self.0.len() {
            1 => vec![self.0[0]; rows.len()],
            n if n == rows.len() => self.0.clone(),
            n => anyhow::bail!(
                "--id-distribution names {n} distributions; give one for every feature or one per feature ({})",
                rows.len()
            ),
        };
        each.into_iter()
            .zip(rows)
            .enumerate()
            .map(|(feature, (distribution, &rows))| IdSampler::new(distribution, rows, feature))
            .collect()
    }
}

/// Large primes: the first that does not divide a table's rows scatters its
/// ranks.
const STRIDES: [u64; 4] = [2_654_435_761, 2_246_822_519, 3_266_489_917, 668_265_263];

/// Draws one feature's ids.
#[derive(Debug, Clone)]
pub struct IdSampler {
    rows: u64,
    stride: u64,
    offset: u64,
    zipf: Option<rand_distr::Zipf<f64>>,
}

impl IdSampler {
    /// Ids of a table of `rows` rows (at least 1) for feature `feature`.
    pub fn new(distribution: IdDistribution, rows: u64, feature: usize) -> anyhow::Result<Self> {
        anyhow::ensure!(rows > 0, "a table with no rows has no ids to draw");
        let stride = STRIDES
            .into_iter()
            .find(|p| !rows.is_multiple_of(*p))
            .expect("rows is not divisible by four primes");
        let offset = splitmix(splitmix(feature as u64)) % rows;
        let zipf = match distribution {
            IdDistribution::Uniform => None,
            IdDistribution::Zipf(alpha) => Some(
                rand_distr::Zipf::new(rows as f64, alpha)
                    .map_err(|e| anyhow::anyhow!("zipf:{alpha} over {rows} rows: {e}"))?,
            ),
        };
        Ok(Self { rows, stride, offset, zipf })
    }

    /// The id of popularity rank `rank` (below `rows`).
    pub fn id_of_rank(&self, rank: u64) -> u64 {
        ((u128::from(rank) * u128::from(self.stride) + u128::from(self.offset)) % u128::from(self.rows))
            as u64
    }

    /// One id.
    pub fn sample(&self, rng: &mut impl Rng) -> i64 {
        let rank = match &self.zipf {
            // Zipf draws ranks 1..=rows, as floats.
            Some(zipf) => (zipf.sample(rng) as u64).clamp(1, self.rows) - 1,
            None => rng.random_range(0..self.rows),
        };
        self.id_of_rank(rank) as i64
    }
}

/// SplitMix64's finaliser: a seed mixed into well-spread bits.
fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// One random bag of a feature: `ids_per_feature` ids (0 or 1: exactly
/// that many; more: uniform in `[0, 2 * ids_per_feature - 1]`) from
/// `sampler`, each with a random weight where the feature is weighted.
pub struct RandomBag<'a> {
    /// Where its ids come from.
    pub sampler: &'a IdSampler,
    /// Whether each id comes with a weight.
    pub weighted: bool,
    /// The mean ids per bag (see above).
    pub ids_per_feature: u32,
}

impl RandomBag<'_> {
    /// Draws the bag from `rng` (its length, then each id and its weight)
    /// onto a request's columns.
    pub fn push(
        &self,
        rng: &mut impl Rng,
        lengths: &mut Vec<u32>,
        ids: &mut Vec<i64>,
        weights: &mut Vec<f32>,
    ) {
        let per = self.ids_per_feature;
        let len = if per <= 1 { per } else { rng.random_range(0..2 * per) };
        lengths.push(len);
        for _ in 0..len {
            ids.push(self.sampler.sample(rng));
            if self.weighted {
                weights.push(rng.random::<f32>());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, HashMap};

    use rand::SeedableRng;

    use super::*;

    #[test]
    fn distributions_parse_and_bad_ones_say_what_is_accepted() {
        assert_eq!("uniform".parse(), Ok(IdDistribution::Uniform));
        assert_eq!("zipf:1.05".parse(), Ok(IdDistribution::Zipf(1.05)));
        let both: IdDistributions = "zipf:1.2,uniform".parse().unwrap();
        assert_eq!(both.0, [IdDistribution::Zipf(1.2), IdDistribution::Uniform]);
        assert_eq!(both.to_string(), "zipf:1.2,uniform");
        for bad in ["", "zipf", "zipf:0", "zipf:-1", "zipf:x", "normal"] {
            assert!(bad.parse::<IdDistribution>().unwrap_err().contains("zipf:ALPHA"), "{bad}");
        }
        let two: IdDistributions = "uniform,uniform".parse().unwrap();
        let error = two.samplers(&[10, 10, 10]).unwrap_err().to_string();
        assert!(error.contains("one per feature (3)"), "{error}");
    }

    #[test]
    fn ranks_are_scattered_over_the_whole_table_one_to_one() {
        for rows in [1u64, 7, 1000, 2_654_435_761 * 2] {
            let sampler = IdSampler::new(IdDistribution::Uniform, rows, 3).unwrap();
            let ids: BTreeSet<u64> = (0..rows.min(1000)).map(|r| sampler.id_of_rank(r)).collect();
            assert_eq!(ids.len() as u64, rows.min(1000), "rows {rows}: ranks map to distinct ids");
            assert!(ids.iter().all(|&id| id < rows));
        }
        let sampler = IdSampler::new(IdDistribution::Zipf(1.05), 100_000, 0).unwrap();
        let hottest: Vec<u64> = (0..10).map(|r| sampler.id_of_rank(r)).collect();
        assert!(hottest.iter().filter(|&&id| id < 10).count() <= 1, "hot ids are not 0..k: {hottest:?}");
        let other = IdSampler::new(IdDistribution::Zipf(1.05), 100_000, 1).unwrap();
        assert_ne!(sampler.id_of_rank(0), other.id_of_rank(0), "each feature has its own hot ids");
    }

    #[test]
    fn another_seed_draws_other_ids_of_the_same_popularity_order() {
        let samplers = |seed| {
            let pool = "zipf:1.05".parse::<IdDistributions>().unwrap().samplers(&[100_000, 5_000]).unwrap();
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let draws: Vec<i64> = (0..1000).map(|_| pool[0].sample(&mut rng)).collect();
            (pool.iter().map(|s| s.id_of_rank(0)).collect::<Vec<_>>(), draws)
        };
        let ((hot_1, draws_1), (hot_2, draws_2)) = (samplers(1), samplers(2));
        assert_eq!(hot_1, hot_2, "a warm-up with seed 1 warms the rows a run with seed 2 reads");
        assert_ne!(draws_1, draws_2);
    }

    #[test]
    fn zipf_traffic_is_skewed_toward_the_hottest_ranks_and_uniform_is_not() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let draws = 50_000;
        let mut share_of_top_100 = |distribution| {
            let sampler = IdSampler::new(distribution, 100_000, 0).unwrap();
            let top: BTreeSet<i64> = (0..100).map(|r| sampler.id_of_rank(r) as i64).collect();
            let mut counts: HashMap<i64, usize> = HashMap::new();
            for _ in 0..draws {
                *counts.entry(sampler.sample(&mut rng)).or_default() += 1;
            }
            let hottest = counts.iter().max_by_key(|(_, &n)| n).map(|(&id, _)| id).unwrap();
            let in_top: usize = counts.iter().filter(|(id, _)| top.contains(id)).map(|(_, n)| n).sum();
            (in_top as f64 / draws as f64, hottest == sampler.id_of_rank(0) as i64)
        };
        let (zipf_share, zipf_hottest_is_rank_0) = share_of_top_100(IdDistribution::Zipf(1.05));
        // Zipf 1.05 over 100k ids: the top 100 ranks carry about half the lookups.
        assert!(zipf_share > 0.35 && zipf_share < 0.6, "{zipf_share}");
        assert!(zipf_hottest_is_rank_0);
        let (uniform_share, _) = share_of_top_100(IdDistribution::Uniform);
        assert!(uniform_share < 0.01, "{uniform_share}");
    }
}
