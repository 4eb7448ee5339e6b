//! Builds the load generator's requests: random valid samples for the
//! schema the server reports, ids drawn per `--id-distribution` ([`super::ids`]).

use rand::{Rng, SeedableRng};

use super::ids::{IdDistributions, IdSampler};
use super::LoadArgs;
use crate::proto::{ModelInfoResponse, PredictRequest};

/// `args.distinct_requests` requests of `args.samples_per_request` samples each, with
/// dense values in [0, 1) and ids drawn per `args.id_distribution`.
pub fn build_pool(info: &ModelInfoResponse, args: &LoadArgs) -> anyhow::Result<Vec<PredictRequest>> {
    if info.max_batch_size != 0 && args.samples_per_request > info.max_batch_size as usize {
        anyhow::bail!(
            "--samples-per-request {} exceeds the server's limit of {} samples per request",
            args.samples_per_request,
            info.max_batch_size
        );
    }
    if info.sparse_features.iter().any(|f| f.num_rows == 0) {
        anyhow::bail!("the server reports a sparse feature with an empty table");
    }
    let ids = id_samplers(info, &args.id_distribution)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    Ok((0..args.distinct_requests.max(1))
        .map(|i| random_request(info, args.samples_per_request, args.ids_per_feature, &ids, &mut rng, i))
        .collect())
}

/// Writes every id of `requests` to `path`, one `FEATURE ID` line each
/// (`narsil load --id-log`).
pub fn write_id_log(
    path: &std::path::Path,
    info: &ModelInfoResponse,
    requests: &[PredictRequest],
) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::io::Write;
    let file = std::fs::File::create(path).with_context(|| format!("--id-log {}", path.display()))?;
    let mut out = std::io::BufWriter::new(file);
    let features = info.sparse_features.len();
    for request in requests {
        let mut ids = request.sparse_ids.iter();
        for bag in 0..request.batch_size as usize * features {
            let len = request.sparse_lengths.get(bag).map_or(1, |&len| len as usize);
            let name = &info.sparse_features[bag % features].name;
            for &id in ids.by_ref().take(len) {
                writeln!(out, "{name} {id}")?;
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
    let rows: Vec<u64> = info.sparse_features.iter().map(|f| f.num_rows).collect();
    distributions.samplers(&rows)
}

/// One request of `batch_size` random samples, feature `f`'s ids from
/// `ids[f]`. With `ids_per_feature` above 1, bag sizes are uniform in
/// `[0, 2 * ids_per_feature - 1]`.
pub fn random_request(
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
            let len =
                if ids_per_feature <= 1 { ids_per_feature } else { rng.random_range(0..2 * ids_per_feature) };
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
        // One id per bag is the wire default: send no lengths at all.
        sparse_lengths: if ids_per_feature == 1 { Vec::new() } else { sparse_lengths },
        sparse_ids,
        request_id: format!("load-{index}"),
        model: info.name.clone(),
        model_version: String::new(),
        sparse_weights,
    }
}
