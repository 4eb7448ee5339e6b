"""The DIN export's requests (models/export_din.py): seeded draws of users,
candidates and histories of given kinds, flat golden requests and ranking
requests, the cut Narsil applies to a history longer than its max_len, and
the golden files' JSON forms (crates/narsil-core/src/golden.rs for flat
requests; models/export_dlrm.py's golden_ranking.json for ranking ones)."""

import argparse
from typing import List, Tuple

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from din_model import HISTORY
from export_common import embedding_flags, key_major


class Draw:
    """Seeded draws of samples: user bags (0 to 4 ids), a candidate (one
    item and its category), a history of a given kind (items and their
    categories), dense features N(0, 1)."""

    def __init__(self, args: argparse.Namespace, seed: int) -> None:
        self.args = args
        self.g = torch.Generator().manual_seed(seed)
        # Each item's category, fixed: a history's and a candidate's cat ids follow their items.
        self.category = torch.randint(0, args.cat_rows, (args.item_rows,), generator=self.g)

    def int(self, low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=self.g))

    def user(self) -> List[torch.Tensor]:
        return [torch.randint(0, self.args.user_rows, (self.int(0, 5),), generator=self.g)
                for _ in range(self.args.num_user)]

    def candidate(self) -> List[torch.Tensor]:
        item = torch.randint(0, self.args.item_rows, (1,), generator=self.g)
        return [item, self.category[item]]

    def history(self, kind: str) -> List[torch.Tensor]:
        """A history's items and their categories (`items`' kinds)."""
        items = self.items(kind)
        return [items, self.category[items]]

    def items(self, kind: str) -> torch.Tensor:
        """A history's items. `kind`: zero, one, random (2 to max_len - 1),
        max (max_len), repeated (max_len // 2 positions over 3 distinct
        items), long (max_len + 1 to 2 max_len: cut when served)."""
        max_len = self.args.max_len
        length = {"zero": 0, "one": 1, "max": max_len, "repeated": max(2, max_len // 2)}.get(kind)
        if kind == "random":
            length = self.int(2, max(3, max_len))
        elif kind == "long":
            length = self.int(max_len + 1, 2 * max_len + 1)
        if kind == "repeated":
            pool = torch.randint(0, self.args.item_rows, (3,), generator=self.g)
            items = pool[torch.randint(0, 3, (length,), generator=self.g)]
        else:
            items = torch.randint(0, self.args.item_rows, (length,), generator=self.g)
        return items

    def dense(self) -> torch.Tensor:
        return torch.randn(self.args.num_dense, generator=self.g)


def sequence_flags(p: argparse.ArgumentParser, num_user: int, user_help: str, dim: int) -> None:
    """The flags a sequence model's draws read (`--num-user` user features,
    `--item-rows`, `--user-rows`, `--max-len`) and its tables' width
    (`--embedding-dim` `dim`, `--embedding-init`)."""
    p.add_argument("--num-user", type=int, default=num_user, help=user_help)
    p.add_argument("--item-rows", type=int, default=2000)
    p.add_argument("--user-rows", type=int, default=500, help="rows of each user feature's table")
    embedding_flags(p, dim, 0.5)
    p.add_argument("--max-len", type=int, default=64, help="the history's positions kept at most (the last)")


def sample_major(samples: List[dict]) -> dict:
    """Samples (each: `dense`, `bags` in wire order) as a sample-major
    request: `dense` [B, num_dense], `lengths` [B, F] int32, `ids`."""
    bags = [bag for s in samples for bag in s["bags"]]
    return {
        "batch_size": len(samples),
        "dense": torch.stack([s["dense"] for s in samples]),
        "lengths": torch.tensor([[len(b) for b in s["bags"]] for s in samples], dtype=torch.int32),
        "ids": torch.cat(bags).long() if bags else torch.zeros(0, dtype=torch.int64),
    }


def cut_history(channels: List[torch.Tensor], max_len: int) -> Tuple[List[torch.Tensor], int]:
    """A history's channels as Narsil serves them, cut to their last
    `max_len` positions; and how many positions were cut."""
    dropped = max(0, len(channels[0]) - max_len)
    return [channel[dropped:] for channel in channels], dropped


def cut(bags: List[torch.Tensor], max_len: int, channels: int = len(HISTORY)) -> Tuple[List[torch.Tensor], int]:
    """A sample's bags (wire order: the history's `channels` last) as
    Narsil serves them; and how many positions were cut."""
    history, dropped = cut_history(bags[len(bags) - channels:], max_len)
    return bags[:len(bags) - channels] + history, dropped


GOLDEN_KINDS = [
    (1, ["zero"]), (1, ["one"]), (1, ["max"]), (1, ["random"]), (1, ["repeated"]), (2, ["zero", "max"]),
    (5, ["random", "repeated", "one"]), (16, ["zero"]), (50, ["zero", "one", "random", "max", "repeated"]),
    (33, ["random"]), (8, ["max", "repeated"]), (3, ["long", "random"]), (1, ["long"]), (12, ["one", "max"]),
]
RANKING_KINDS = [(1, "zero"), (1, "max"), (3, "one"), (40, "random"), (130, "repeated"), (7, "zero"),
                 (64, "max"), (20, "long")]


def golden_requests(draw: Draw) -> List[dict]:
    """Flat requests: every sample carries its user, candidate and history
    (kinds cycling as GOLDEN_KINDS says)."""
    requests = []
    for batch_size, kinds in GOLDEN_KINDS:
        samples = []
        for s in range(batch_size):
            samples.append({"dense": draw.dense(),
                            "bags": draw.user() + draw.candidate() + draw.history(kinds[s % len(kinds)])})
        requests.append(samples)
    return requests


def served_golden_requests(draw: Draw, max_len: int, channels: int = len(HISTORY)) -> List[tuple]:
    """The flat golden requests (`golden_requests`), each as (its samples as
    served: histories of `channels` channels cut to `max_len`; the positions
    cut; its samples as sent)."""
    flat = []
    for samples in golden_requests(draw):
        served = [cut(s["bags"], max_len, channels) for s in samples]
        flat.append(([dict(s, bags=bags) for s, (bags, _) in zip(samples, served)],
                     sum(dropped for _, dropped in served), samples))
    return flat


def ranking_requests(draw: Draw) -> List[dict]:
    """Ranking requests: a user block (its pooled features, history, dense
    features) and candidates."""
    return [{"dense": draw.dense(), "user": draw.user(), "history": draw.history(kind),
             "candidates": [draw.candidate() for _ in range(candidates)]}
            for candidates, kind in RANKING_KINDS]


def tiled(request: dict, max_len: int) -> Tuple[List[dict], int]:
    """A ranking request as the flat samples it stands for (the block tiled
    onto each candidate, its history cut as served)."""
    history, dropped = cut_history(request["history"], max_len)
    return [{"dense": request["dense"], "bags": request["user"] + c + history} for c in request["candidates"]], dropped


def features(request: dict, keys: List[str]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, KeyedJaggedTensor]:
    """A sample-major request as model.pt takes it (dense, key-major
    lengths and ids) and as the reference does (their KeyedJaggedTensor)."""
    dense, lengths, ids = key_major(request)
    return dense, lengths, ids, KeyedJaggedTensor(keys=keys, values=ids, lengths=lengths)


def request_json(request: dict, scores: torch.Tensor, dropped: int) -> dict:
    """A flat golden request (crates/narsil-core/src/golden.rs) as sent,
    with the scores of its samples as served (`dropped` positions cut)."""
    entry = {"batch_size": request["batch_size"], "dense": request["dense"].reshape(-1).tolist(),
             "lengths": request["lengths"].reshape(-1).tolist(), "ids": request["ids"].tolist(),
             "outputs": {"default": scores.tolist()}, "scores_int8": scores.tolist()}
    if dropped:
        entry["truncated_positions"] = dropped
    return entry


def ranking_json(request: dict, scores: torch.Tensor, dropped: int) -> dict:
    """narsil.v1's grouped form (models/export_dlrm.py's golden_ranking.json):
    the block's bags in schema order (the user features, then the
    history's channels as sent, uncut), the candidates' own bags row after
    row."""
    block = request["user"] + request["history"]
    candidate_bags = [bag for c in request["candidates"] for bag in c]
    entry = {
        "user": {"dense": request["dense"].tolist(), "lengths": [len(b) for b in block],
                 "ids": torch.cat(block).tolist()},
        "candidates": len(request["candidates"]),
        "dense": [],
        "lengths": [len(b) for b in candidate_bags],
        "ids": torch.cat(candidate_bags).tolist(),
        "scores_int8": scores.tolist(),
        "outputs": {"default": scores.tolist()},
    }
    if dropped:
        entry["truncated_positions"] = dropped
    return entry



class Scored:
    """The reference's scores of an export's golden requests, kept as the
    golden files (`golden`, `ranking_golden`) and the split form's checks
    (`flat`: (samples as served, scores); `ranking`: (request, scores))
    take them."""

    def __init__(self) -> None:
        self.golden: List[dict] = []
        self.flat: List[tuple] = []
        self.ranking_golden: List[dict] = []
        self.ranking: List[tuple] = []
        self.scores: List[torch.Tensor] = []

    def add_flat(self, served: List[dict], sent: List[dict], dropped: int, scores: torch.Tensor) -> dict:
        """A flat request's scores (its samples as served and as sent,
        `dropped` positions cut); returns its golden entry."""
        self.golden.append(request_json(sample_major(sent), scores, dropped))
        self.flat.append((served, scores))
        self.scores.append(scores)
        return self.golden[-1]

    def add_ranking(self, request: dict, dropped: int, scores: torch.Tensor) -> None:
        """A ranking request's scores (`dropped` history positions cut)."""
        self.ranking_golden.append(ranking_json(request, scores, dropped))
        self.ranking.append((request, scores))
        self.scores.append(scores)

    def files(self, schema: dict, request_level: List[str]) -> dict:
        """golden.json (`schema` and the flat requests) and
        golden_ranking.json (the ranking requests), by file name."""
        return {"golden.json": {"schema": schema, "requests": self.golden},
                "golden_ranking.json": {"request_level": request_level, "requests": self.ranking_golden}}

    def spread(self) -> str:
        """How many scores, their range and standard deviation, for the
        log."""
        spread = torch.cat(self.scores)
        return (f"{spread.numel()} scores, {float(spread.min()):.3f} to {float(spread.max()):.3f}, "
                f"std {float(spread.std()):.3f}")
