"""DLRMv3-shaped queries for a generative ranker with GR's streaming
feature set (generative-recommenders' `streaming-100b` config, MLPerf
DLRMv3's model): one query is one user's contexts, history and candidates,
under GR's KJT names, drawn the way GR's streaming synthetic data is
shaped (dlrm_v3/streaming_synthetic_data.py, read, not copied), scaled by
the caller:

* each user keeps a few interest categories (4) with its own preference
  weights; a history position or candidate picks a category by them and an
  item uniformly within the category's block of ids (items are laid out by
  category, `item_category_id = item_id // items_per_category`, as GR's
  generator lays them out);
* every item has one rating for all users, 5 to 1 with the generator's
  probabilities (0.2, 0.25, 0.25, 0.2, 0.1); a history position's action
  bitmask marks the actions its rating implies (GR's action weights 1, 2,
  4, 8, 16: one per star);
* queries come **in time order**: query i is asked at `start + i * gap`
  seconds, each history's actions lie before its query (increasing), and a
  query's candidates share its query time;
* history lengths and candidate counts are uniform in the caller's
  ranges.

Used by the LoadGen harness (benchmarks/loadgen, `--model-key dlrm-v3`);
numpy only.
"""

from typing import Dict, List, Sequence, Tuple

import numpy as np

CATEGORIES_PER_USER = 4
RATINGS = np.array([5, 4, 3, 2, 1])
RATING_P = np.array([0.2, 0.25, 0.25, 0.2, 0.1])
ACTION_WEIGHTS = [1, 2, 4, 8, 16]
START_S = 1_700_000_000
QUERY_GAP_S = 30
HISTORY_SPAN_S = 90 * 86400


def _bitmask(rating: np.ndarray) -> np.ndarray:
    """One action bit per star (1-star: the first action only)."""
    return (np.left_shift(1, rating) - 1).astype(np.int64)


def queries(count: int, rows: Dict[str, int], history: Tuple[int, int], candidates: Tuple[int, int],
            seed: int) -> List[dict]:
    """`count` queries, each `{"uih": {feature: ids}, "candidates":
    {feature: ids}}` in GR's streaming names; `rows` the served tables'
    rows (`user_id`, `item_id`, `item_category_id`)."""
    rng = np.random.default_rng(seed)
    items, categories = rows["item_id"], max(1, min(rows["item_category_id"], rows["item_id"]))
    per_category = items // categories
    item_rating = np.random.default_rng(seed + 1).choice(RATINGS, size=items, p=RATING_P)
    out = []
    for i in range(count):
        query_time = START_S + i * QUERY_GAP_S
        interests = rng.choice(categories, size=min(CATEGORIES_PER_USER, categories), replace=False)
        preference = rng.dirichlet(np.ones(len(interests)))

        def draw(n: int) -> np.ndarray:
            cats = rng.choice(interests, size=n, p=preference)
            return np.minimum(cats * per_category + rng.integers(0, per_category, size=n), items - 1)

        length = int(rng.integers(history[0], history[1] + 1))
        count_c = int(rng.integers(candidates[0], candidates[1] + 1))
        seen = draw(length)
        times = np.sort(query_time - rng.integers(1, HISTORY_SPAN_S, size=length))
        shown = draw(count_c)
        rating = item_rating[seen]
        out.append({
            "uih": {
                "user_id": [int(rng.integers(0, rows["user_id"]))],
                "item_id": seen.tolist(),
                "item_rating": rating.tolist(),
                "action_timestamp": times.tolist(),
                "item_weights": _bitmask(rating).tolist(),
                "dummy_watch_time": [0] * length,
                "item_category_id": np.minimum(seen // per_category, categories - 1).tolist(),
            },
            "candidates": {
                "item_candidate_id": shown.tolist(),
                "item_candidate_rating": item_rating[shown].tolist(),
                "item_query_time": [query_time] * count_c,
                "item_action_weights": [0] * count_c,
                "item_dummy_watchtime": [1] * count_c,
                "item_candidate_category_id": np.minimum(shown // per_category, categories - 1).tolist(),
            },
        })
    return out


def grouped_request(pb, query: dict, features: Sequence[Tuple[str, bool]], model: str = ""):
    """`query` as one grouped narsil.v1 PredictRequest: the request-level
    features (contexts and history; `features` is ModelInfo's `(name,
    request_level)` list, in its order) once in the request block, one row
    per candidate with its candidate features."""
    uih, cands = query["uih"], query["candidates"]
    rows = len(next(iter(cands.values())))
    request = pb.PredictRequest(batch_size=rows, model=model)
    block = [name for name, level in features if level]
    per_row = [name for name, level in features if not level]
    missing = [n for n in block if n not in uih] + [n for n in per_row if n not in cands]
    if missing:
        raise SystemExit(f"the served model asks for {missing}: not features of GR's streaming set")
    request.request.sparse_lengths.extend(len(uih[n]) for n in block)
    for n in block:
        request.request.sparse_ids.extend(uih[n])
    request.sparse_lengths.extend([1] * (rows * len(per_row)))
    request.sparse_ids.extend(np.array([cands[n] for n in per_row], dtype=np.int64).T.ravel().tolist())
    return request
