"""MLPerf Inference DLRM-v2's shape and traffic, as facts restated (numpy
only, so both the exporter, models/export_torchrec.py --shape
mlperf-dlrm-v2, and the LoadGen harness, benchmarks/loadgen/, import it).

The numbers below are MLPerf's (mlcommons/inference,
recommendation/dlrm_v2/pytorch: the model's table sizes and layer sizes in
python/main.py, the query-size quantiles in tools/dist_quantile.txt; the
multi-hot sizes are MLCommons training's recommendation_v2 ones, which the
inference benchmark's multi-hot Criteo was materialised with). Nothing of
their code is used here.

A query (one LoadGen sample) is one user's request of 100-700 pairs, drawn
from the quantile list by inverse transform sampling (270 pairs on average).
A pair has 13 dense features and 26 sparse features of MLPerf's multi-hot
sizes (214 ids a pair). As in MLPerf's multi-hot generator, a bag's first id
is the one-hot Criteo id (drawn here Zipf-like, Criteo's ids being skewed)
and the other ids of the bag are a fixed list of uniform ids that the first
id always brings (MLPerf keeps a seeded table of them per first id; here a
seeded hash of (feature, first id, position), so a 40M-row table needs no
table of companions).
"""

from typing import List, Sequence

import numpy as np

# Rows of each of the 26 tables (MLPerf's num_embeddings_per_feature).
MLPERF_ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
               11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]
# Ids per bag of each feature (MLPerf's multi-hot sizes): 214 a pair.
MULTI_HOT_SIZES = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
# Pairs per query: MLPerf's quantile list (the inverse of the query-size CDF in steps of 0.05).
QUERY_SIZE_QUANTILES = [100, 100, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 300, 300, 400, 500,
                        600, 700]
NUM_DENSE = 13
EMBEDDING_DIM = 128
DENSE_ARCH = [512, 256, 128]
OVER_ARCH = [1024, 1024, 512, 256, 1]
DCN_LAYERS = 3
DCN_RANK = 512
# Default cap on a table's rows: 7.1M rows in all (1.0 GB of INT8 rows, 3.6 GB FP32 while exporting).
DEFAULT_MAX_ROWS = 1_000_000

assert sum(MULTI_HOT_SIZES) == 214 and len(MULTI_HOT_SIZES) == len(MLPERF_ROWS) == 26


def capped_rows(max_rows: int) -> List[int]:
    """MLPerf's table sizes, each capped at `max_rows`."""
    return [min(rows, max_rows) for rows in MLPERF_ROWS]


def query_sizes(count: int, seed: int) -> np.ndarray:
    """`count` query sizes (pairs), each a uniformly chosen entry of the
    quantile list (inverse transform sampling, as MLPerf draws them)."""
    rng = np.random.default_rng(seed)
    return np.asarray(QUERY_SIZE_QUANTILES)[rng.integers(0, len(QUERY_SIZE_QUANTILES), count)]


def zipf_ids(rng: np.random.Generator, rows: int, count: int, exponent: float) -> np.ndarray:
    """`count` ids in [0, rows), rank r drawn with probability ~ 1/r^exponent
    (inverse CDF of the continuous bounded power law), ranks scattered over
    the table by a fixed odd multiplier so the hot rows are not the first."""
    u = rng.random(count)
    if abs(exponent - 1.0) < 1e-9:
        ranks = np.exp(u * np.log(rows + 1.0)) - 1.0
    else:
        a = 1.0 - exponent
        ranks = (1.0 + u * ((rows + 1.0) ** a - 1.0)) ** (1.0 / a) - 1.0
    ranks = np.minimum(ranks.astype(np.int64), rows - 1)
    return (ranks * 2654435761) % rows


def companion_ids(feature: int, first: np.ndarray, extra: int, rows: int) -> np.ndarray:
    """The `extra` ids a bag whose first id is `first` always carries after
    it: uniform in [0, rows), a seeded hash of (feature, first id, position)
    ([len(first), extra])."""
    if extra == 0:
        return np.zeros((len(first), 0), dtype=np.int64)
    x = (first.astype(np.uint64)[:, None] * np.uint64(0x9E3779B97F4A7C15)
         + np.arange(1, extra + 1, dtype=np.uint64)[None, :] * np.uint64(0xBF58476D1CE4E5B9)
         + np.full(1, feature + 1, dtype=np.uint64) * np.uint64(0x94D049BB133111EB))
    x ^= x >> np.uint64(31)
    x *= np.uint64(0xD6E8FEB86659FD93)
    x ^= x >> np.uint64(29)
    return (x % np.uint64(rows)).astype(np.int64)


def pairs(rng: np.random.Generator, count: int, rows: Sequence[int], exponent: float):
    """`count` pairs: dense f32[count, 13] (log-normal-ish, as Criteo's
    log-transformed counts) and ids i64[count, 214], sample-major (each
    pair's bags feature after feature, MULTI_HOT_SIZES ids each)."""
    dense = np.log1p(rng.exponential(3.0, (count, NUM_DENSE))).astype(np.float32)
    bags = []
    for feature, (size, n) in enumerate(zip(MULTI_HOT_SIZES, rows)):
        first = zipf_ids(rng, n, count, exponent)
        bags.append(first[:, None])
        bags.append(companion_ids(feature, first, size - 1, n))
    return dense, np.concatenate(bags, axis=1)


def queries(count: int, rows: Sequence[int], exponent: float, seed: int):
    """`count` queries: a list of (dense f32[P, 13], ids i64[P, 214]), P
    from the quantile list."""
    rng = np.random.default_rng(seed + 1)
    return [pairs(rng, int(p), rows, exponent) for p in query_sizes(count, seed)]
