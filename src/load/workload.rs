//! Builds the load generator's requests: random valid samples for the
//! schema the server reports, ids drawn per `--id-distribution` ([`super::ids`]);
//! with `--candidates`, the ranking workload ([`super::ranking`]), grouped
//! or flat.

use rand::{Rng, SeedableRng};

use super::ids::{IdDistributions, IdSampler, RandomBag};
use super::ranking::{Ranking, RankingForm};
use super::LoadArgs;
use crate::proto::{ModelInfoResponse, PredictRequest};

/// `args.distinct_requests` requests of `args.samples_per_request` samples each, with
/// dense values in [0, 1) and ids drawn per `args.id_distribution`; with
/// `args.candidates` above 0, ranking requests of one user and that many
/// candidates each ([`Ranking`]), in the run's form ([`super::ranking::form`]).
pub fn build_pool(info: &ModelInfoResponse, args: &LoadArgs) -> anyhow::Result<Vec<PredictRequest>> {
    let form = super::ranking::form(args, info)?.unwrap_or(RankingForm::Flat);
    build_pool_in(info, args, form)
}

/// The flat twins of a ranking run's requests: the pool [`build_pool`]
/// builds, every request in the flat form, from the same draws.
pub fn build_flat_twins(info: &ModelInfoResponse, args: &LoadArgs) -> anyhow::Result<Vec<PredictRequest>> {
    anyhow::ensure!(args.candidates > 0, "flat twins are ranking requests: they need --candidates");
    build_pool_in(info, args, RankingForm::Flat)
}

fn build_pool_in(
    info: &ModelInfoResponse,
    args: &LoadArgs,
    form: RankingForm,
) -> anyhow::Result<Vec<PredictRequest>> {
    let rows = args.rows_per_request();
    if info.max_batch_size != 0 && rows > info.max_batch_size as usize {
        let flag = if args.candidates > 0 { "--candidates" } else { "--samples-per-request" };
        anyhow::bail!(
            "{flag} {rows} exceeds the server's limit of {} samples per request",
            info.max_batch_size
        );
    }
    // A raw integer input has no table (`num_rows` 0): its values come from
    // [`super::raw`], not from a table's ids.
    if let Some(empty) = info.sparse_features.iter().find(|f| f.num_rows == 0 && !f.raw_input) {
        anyhow::bail!("the server reports sparse feature `{}` with an empty table", empty.name);
    }
    let ids = id_samplers(info, &args.id_distributions())?;
    if args.candidates > 0 {
        let ranking = Ranking::new(info, args, ids)?;
        let pool = ranking.pool_in(form, args.distinct_requests.max(1), args.seed);
        return Ok(pool.into_iter().map(|(_, request)| request).collect());
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    Ok((0..args.distinct_requests.max(1))
        .map(|i| {
            let shape = (args.samples_per_request, args.ids_per_feature);
            random_request(info, shape, &ids, &args.raw_times(), &mut rng, i)
        })
        .collect())
}

/// Writes every id of `requests` to `path`, one `FEATURE ID` line each
/// (`narsil load --id-log`): as sent, so a grouped request's request-level
/// ids once (they are the features `info` declares request-level), then its
/// candidates'. Raw integer inputs are not ids of any table: their values
/// are skipped.
pub fn write_id_log(
    path: &std::path::Path,
    info: &ModelInfoResponse,
    requests: &[PredictRequest],
) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::io::Write;
    let file = std::fs::File::create(path).with_context(|| format!("--id-log {}", path.display()))?;
    let mut out = std::io::BufWriter::new(file);
    let all: Vec<&str> = info.sparse_features.iter().map(|f| f.name.as_str()).collect();
    let of = |request_level: bool| -> Vec<&str> {
        let features = info.sparse_features.iter().filter(|f| f.request_level == request_level);
        features.map(|f| f.name.as_str()).collect()
    };
    let (user, candidate) = (of(true), of(false));
    let raw: std::collections::HashSet<&str> =
        info.sparse_features.iter().filter(|f| f.raw_input).map(|f| f.name.as_str()).collect();
    let mut write = |names: &[&str], bags: usize, lengths: &[u32], ids: &[i64]| -> std::io::Result<()> {
        let mut ids = ids.iter();
        for bag in 0..bags * names.len() {
            let len = lengths.get(bag).map_or(1, |&len| len as usize);
            let name = names[bag % names.len()];
            for &id in ids.by_ref().take(len) {
                if !raw.contains(name) {
                    writeln!(out, "{name} {id}")?;
                }
            }
        }
        Ok(())
    };
    for request in requests {
        let rows = request.batch_size as usize;
        match &request.request {
            None => write(&all, rows, &request.sparse_lengths, &request.sparse_ids)?,
            Some(block) => {
                if !user.is_empty() {
                    write(&user, 1, &block.sparse_lengths, &block.sparse_ids)?;
                }
                if !candidate.is_empty() {
                    write(&candidate, rows, &request.sparse_lengths, &request.sparse_ids)?;
                }
            }
        }
    }
    out.flush().with_context(|| format!("--id-log {}", path.display()))?;
    Ok(())
}

/// One id sampler per sparse feature of `info`.
pub fn id_samplers(
    info: &ModelInfoResponse,
    distributions: &IdDistributions,
) -> anyhow::Result<Vec<IdSampler>> {
    // A raw input's sampler is never drawn from: one row stands in.
    let rows: Vec<u64> =
        info.sparse_features.iter().map(|f| if f.raw_input { 1 } else { f.num_rows }).collect();
    distributions.samplers(&rows)
}

/// One request of `batch_size` random samples, feature `f`'s ids from
/// `ids[f]`. With `ids_per_feature` above 1, bag sizes are uniform in
/// `[0, 2 * ids_per_feature - 1]`. Raw inputs that carry times per `times`.
pub fn random_request(
    info: &ModelInfoResponse,
    (batch_size, ids_per_feature): (usize, u32),
    ids: &[IdSampler],
    times: &super::raw::RawTimes,
    rng: &mut impl Rng,
    index: usize,
) -> PredictRequest {
    let dense = (0..batch_size * info.num_dense as usize).map(|_| rng.random::<f32>()).collect();
    let mut sparse_lengths = Vec::new();
    let mut sparse_ids = Vec::with_capacity(batch_size * info.sparse_features.len());
    let mut sparse_weights = Vec::new();
    let has_raw = info.sparse_features.iter().any(|f| f.raw_input);
    for _ in 0..batch_size {
        if has_raw {
            let columns = (&mut sparse_lengths, &mut sparse_ids, &mut sparse_weights);
            push_raw_sample(info, ids_per_feature, (ids, times), rng, columns);
            continue;
        }
        for (feature, sampler) in info.sparse_features.iter().zip(ids) {
            let bag = RandomBag { sampler, weighted: feature.weighted, ids_per_feature };
            bag.push(rng, &mut sparse_lengths, &mut sparse_ids, &mut sparse_weights);
        }
    }
    PredictRequest {
        batch_size: batch_size as u32,
        dense,
        // One id per bag is the wire default: send no lengths at all.
        sparse_lengths: if ids_per_feature == 1 && !has_raw { Vec::new() } else { sparse_lengths },
        sparse_ids,
        request_id: format!("load-{index}"),
        model: info.name.clone(),
        model_version: String::new(),
        sparse_weights,
        request: None,
    }
}

/// One sample of a model with raw integer inputs ([`super::raw`]): one
/// history length per sequence (`ids_per_feature` as for a bag), its
/// channels aligned, its raw channels that carry `times` increasing
/// timestamps, a raw input outside a sequence one value (its query time
/// after the sample's history when it carries times), the other features' bags as
/// [`RandomBag`] draws them.
fn push_raw_sample(
    info: &ModelInfoResponse,
    ids_per_feature: u32,
    (ids, times): (&[IdSampler], &super::raw::RawTimes),
    rng: &mut impl Rng,
    (lengths, values, weights): (&mut Vec<u32>, &mut Vec<i64>, &mut Vec<f32>),
) {
    use super::raw;
    let per = ids_per_feature;
    let history: Vec<u32> =
        info.sequences.iter().map(|_| if per <= 1 { per } else { rng.random_range(0..2 * per) }).collect();
    let start = raw::start_time(rng);
    let mut last_time = None;
    // Per feature: its bag (and weights), or None for a query time, filled
    // once the sample's history is drawn.
    let mut bags: Vec<Option<(Vec<i64>, Vec<f32>)>> = Vec::with_capacity(ids.len());
    for (feature, sampler) in info.sparse_features.iter().zip(ids) {
        let sequence =
            info.sequences.iter().position(|s| !feature.sequence.is_empty() && s.name == feature.sequence);
        let bag = match (sequence, feature.raw_input, times.is_time(&feature.name)) {
            (Some(_), true, true) => {
                let history = raw::history_times(rng, start, history[sequence.unwrap()] as usize);
                last_time = history.last().copied().max(last_time);
                Some((history.into_iter().map(|t| times.sent(t)).collect(), Vec::new()))
            }
            (Some(s), true, false) => Some(((0..history[s]).map(|_| raw::small(rng)).collect(), Vec::new())),
            (None, true, true) => None,
            (None, true, false) => Some((vec![raw::small(rng)], Vec::new())),
            (Some(s), false, _) => {
                let bag: Vec<i64> = (0..history[s]).map(|_| sampler.sample(rng)).collect();
                let w = if feature.weighted {
                    bag.iter().map(|_| rng.random::<f32>()).collect()
                } else {
                    Vec::new()
                };
                Some((bag, w))
            }
            (None, false, _) => {
                let (mut l, mut b, mut w) = (Vec::new(), Vec::new(), Vec::new());
                RandomBag { sampler, weighted: feature.weighted, ids_per_feature: per }
                    .push(rng, &mut l, &mut b, &mut w);
                Some((b, w))
            }
        };
        bags.push(bag);
    }
    for bag in bags {
        let (bag, bag_weights) =
            bag.unwrap_or_else(|| (vec![times.sent(raw::query_time(rng, last_time))], Vec::new()));
        lengths.push(bag.len() as u32);
        values.extend(bag);
        weights.extend(bag_weights);
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::proto::SparseFeature;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        load: LoadArgs,
    }

    /// The pool builder as it was before `--candidates` (a verbatim copy,
    /// `id_distribution` then a plain `IdDistributions`): today's requests
    /// must stay byte-identical to it.
    fn old_build_pool(
        info: &ModelInfoResponse,
        samples_per_request: usize,
        ids_per_feature: u32,
        id_distribution: &IdDistributions,
        distinct_requests: usize,
        seed: u64,
    ) -> Vec<PredictRequest> {
        let ids = id_samplers(info, id_distribution).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..distinct_requests.max(1))
            .map(|i| old_random_request(info, samples_per_request, ids_per_feature, &ids, &mut rng, i))
            .collect()
    }

    fn old_random_request(
        info: &ModelInfoResponse,
        batch_size: usize,
        ids_per_feature: u32,
        ids: &[IdSampler],
        rng: &mut impl Rng,
        index: usize,
    ) -> PredictRequest {
        let dense = (0..batch_size * info.num_dense as usize).map(|_| rng.random::<f32>()).collect();
        let mut sparse_lengths = Vec::new();
        let mut sparse_ids = Vec::with_capacity(batch_size * info.sparse_features.len());
        let mut sparse_weights = Vec::new();
        for _ in 0..batch_size {
            for (feature, sampler) in info.sparse_features.iter().zip(ids) {
                let len = if ids_per_feature <= 1 {
                    ids_per_feature
                } else {
                    rng.random_range(0..2 * ids_per_feature)
                };
                sparse_lengths.push(len);
                for _ in 0..len {
                    sparse_ids.push(sampler.sample(rng));
                    if feature.weighted {
                        sparse_weights.push(rng.random::<f32>());
                    }
                }
            }
        }
        PredictRequest {
            batch_size: batch_size as u32,
            dense,
            sparse_lengths: if ids_per_feature == 1 { Vec::new() } else { sparse_lengths },
            sparse_ids,
            request_id: format!("load-{index}"),
            model: info.name.clone(),
            model_version: String::new(),
            sparse_weights,
            request: None,
        }
    }

    fn encoded(pool: &[PredictRequest]) -> Vec<Vec<u8>> {
        pool.iter().map(prost::Message::encode_to_vec).collect()
    }

    #[test]
    fn without_candidates_todays_requests_are_byte_identical_to_the_old_builders() {
        let info = ModelInfoResponse {
            name: "dlrm".into(),
            num_dense: 13,
            sparse_features: (0..26)
                .map(|i| SparseFeature {
                    name: format!("cat_{i}"),
                    num_rows: 1_000 + i,
                    weighted: i == 5,
                    request_level: false,
                    raw_ids: false,
                    sequence: String::new(),
                    raw_input: false,
                })
                .collect(),
            ..Default::default()
        };
        let cases: [&[&str]; 4] = [
            &[],
            &["--candidates", "0", "--seed", "11", "--samples-per-request", "7"],
            &["--ids-per-feature", "3", "--id-distribution", "zipf:1.05", "--distinct-requests", "5"],
            &["--ids-per-feature", "0", "--user-bag-ids", "3", "--request-features", "2", "--users", "9"],
        ];
        for flags in cases {
            let args = Cli::parse_from(["load"].iter().chain(flags)).load;
            let distribution = args.id_distribution.clone().unwrap_or("uniform".parse().unwrap());
            let old = old_build_pool(
                &info,
                args.samples_per_request,
                args.ids_per_feature,
                &distribution,
                args.distinct_requests,
                args.seed,
            );
            let new = build_pool(&info, &args).unwrap();
            assert_eq!(new.len(), old.len(), "{flags:?}");
            assert_eq!(encoded(&new), encoded(&old), "{flags:?}: requests changed");
        }
    }

    #[test]
    fn the_id_log_of_a_grouped_run_lists_the_users_ids_once_per_request() {
        let mut info = ModelInfoResponse {
            name: "dlrm".into(),
            num_dense: 2,
            dense_request_level: true,
            sparse_features: (0..4)
                .map(|i| SparseFeature {
                    name: format!("f{i}"),
                    num_rows: 50,
                    weighted: false,
                    request_level: false,
                    raw_ids: false,
                    sequence: String::new(),
                    raw_input: false,
                })
                .collect(),
            ..Default::default()
        };
        // f1 and f3 are the user's: 5 ids each; f0 and f2 one per candidate.
        info.sparse_features[1].request_level = true;
        info.sparse_features[3].request_level = true;
        let dir = tempfile::tempdir().unwrap();
        let log = |form: &str| -> Vec<String> {
            let flags = ["load", "--candidates", "6", "--user-bag-ids", "5", "--ranking-form", form];
            let args = Cli::parse_from(flags.iter().chain(&["--distinct-requests", "2"])).load;
            let pool = build_pool(&info, &args).unwrap();
            assert_eq!(pool[0].request.is_some(), form == "grouped");
            let path = dir.path().join(form);
            write_id_log(&path, &info, &pool).unwrap();
            std::fs::read_to_string(path).unwrap().lines().map(str::to_string).collect()
        };
        let (grouped, flat) = (log("grouped"), log("flat"));
        let count = |lines: &[String], feature: &str| lines.iter().filter(|l| l.starts_with(feature)).count();
        for (feature, grouped_ids, flat_ids) in
            [("f0 ", 12, 12), ("f1 ", 10, 60), ("f2 ", 12, 12), ("f3 ", 10, 60)]
        {
            assert_eq!(count(&grouped, feature), grouped_ids, "{feature}grouped");
            assert_eq!(count(&flat, feature), flat_ids, "{feature}flat");
        }
        // The same ids, the user's repeated on every row when flat.
        let mut expanded: Vec<&String> =
            grouped.iter().filter(|l| l.starts_with("f0") || l.starts_with("f2")).collect();
        for request in grouped.chunks(12 + 10) {
            let user: Vec<&String> =
                request.iter().filter(|l| l.starts_with("f1") || l.starts_with("f3")).collect();
            assert_eq!(user.len(), 10, "the user's bags first, once");
            for _ in 0..6 {
                expanded.extend(&user);
            }
        }
        let mut flat_sorted: Vec<&String> = flat.iter().collect();
        expanded.sort();
        flat_sorted.sort();
        assert_eq!(expanded, flat_sorted);
    }

    #[test]
    fn candidates_are_checked_against_the_servers_row_limit() {
        let info = ModelInfoResponse {
            num_dense: 2,
            max_batch_size: 256,
            sparse_features: vec![SparseFeature {
                name: "a".into(),
                num_rows: 10,
                weighted: false,
                request_level: false,
                raw_ids: false,
                sequence: String::new(),
                raw_input: false,
            }],
            ..Default::default()
        };
        let args = Cli::parse_from(["load", "--candidates", "500"]).load;
        let error = build_pool(&info, &args).unwrap_err().to_string();
        assert!(error.contains("--candidates 500") && error.contains("256"), "{error}");
        let args = Cli::parse_from(["load", "--candidates", "200", "--distinct-requests", "3"]).load;
        let pool = build_pool(&info, &args).unwrap();
        assert_eq!(pool.iter().map(|r| r.batch_size).collect::<Vec<_>>(), [200, 200, 200]);
    }

    #[test]
    fn without_candidates_a_gr_model_gets_aligned_histories_and_query_times_after_them() {
        let info = crate::load::ranking::tests::gr_info();
        let args = Cli::parse_from(["load", "--ids-per-feature", "4", "--samples-per-request", "20"]).load;
        let pool = build_pool(&info, &args).unwrap();
        let request = &pool[0];
        let mut values = request.sparse_ids.iter().copied();
        for sample in request.sparse_lengths.chunks(7) {
            let bags: Vec<Vec<i64>> =
                sample.iter().map(|&len| values.by_ref().take(len as usize).collect()).collect();
            assert_eq!((sample[2], sample[3]), (1, 1), "one raw value outside a sequence");
            assert!(sample[4] == sample[5] && sample[5] == sample[6], "the history's channels aligned");
            let (times, masks) = (&bags[5], &bags[6]);
            assert!(times.windows(2).all(|w| w[1] > w[0]) && times.iter().all(|&t| t > 1_600_000_000));
            assert!(masks.iter().chain(&bags[2]).all(|m| (0..256).contains(m)));
            assert!(bags[3][0] > times.last().copied().unwrap_or(0), "the query time follows the history");
        }
        // The id log skips raw values: they are no table's ids.
        let dir = tempfile::tempdir().unwrap();
        write_id_log(&dir.path().join("log"), &info, &pool).unwrap();
        let log = std::fs::read_to_string(dir.path().join("log")).unwrap();
        let features: std::collections::BTreeSet<&str> =
            log.lines().map(|l| l.split(' ').next().unwrap()).collect();
        assert_eq!(features.into_iter().collect::<Vec<_>>(), ["item_candidate_id", "item_id", "user_id"]);
    }
}
