#!/usr/bin/env python3
"""Exports an HSTU generative ranker (models/hstu_model.py), built from
TorchRec modules with seeded random weights and quantized TorchRec's way
(`quantize_inference_model`: INT8 row-wise `QuantEmbeddingCollection` for the
item, action and age tables, `QuantEmbeddingBagCollection` for the user's
contextual features). The model's eager forward over the quantized
collections is the reference for every score written: flat samples each as
its own sequence, ranking requests as one sequence with their candidates
appended (as the model serves itself).

Sparse features, in wire order: user_0..user_{U-1} (pooled contextual
features), cand_item (the candidate: one id), hist_item, hist_action,
hist_age (the sequence `history`, aligned channels, oldest first, at most
--max-len positions, the last kept; hist_age is the action's age bucket,
`floor(ln(max(seconds, 1)) / 0.301)`). Request-level: the user features and
the history. No dense features.

Writes into --out:

  golden.json          flat requests (histories of 0, 1, random, max_len and
                       more positions, repeated ids) with the reference's
                       scores; a history longer than max_len is scored cut
                       to its last max_len positions, as Narsil serves it
  golden_ranking.json  ranking requests (the user's block: user features and
                       history; rows: the candidates), scored by the
                       reference in one forward per request
  split/               Narsil's split form (models/sequence_split.py):
                       schema.json, tables/*.bin, dense.pt (scripted
                       hstu_model.HstuDenseNetwork), with --pt2 dense.pt2
                       (and dense_bf16.pt2 on a CPU with bf16),
                       golden files; checked through an emulation of
                       Narsil's stage on flat, grouped and fused batches
  manifest.json        export format, shape, seed, checks, files
"""

import argparse
import sys
from pathlib import Path
from typing import List

import torch

import fbgemm_gpu  # noqa: F401  (registers FBGEMM's operators)
from torchrec.inference.modules import quantize_inference_model

from din_requests import (Draw, Scored, cut_history, features, ranking_requests, sample_major, sequence_flags,
                          served_golden_requests, tiled)
from export_common import begin_export, int_list, logger, parser, write_json_files, write_manifest
from hstu_model import CANDIDATE, HISTORY, HstuDenseNetwork, age_bucket, build, sequence_json
from working_sets import hstu_working_set
from sequence_split import Layout, write_split

# Raised when what is written changes: scripts/lib.sh re-exports older ones.
EXPORT_FORMAT = 4
# The split form's scores against the reference (FP32): the reference runs
# the whole padded sequence's attention, the split form each history once
# and each candidate alone (sums in another order).
BOUND = 1e-5
# dense.pt with bf16 weights and inputs against the reference (FP32): two
# STU layers' LayerNorms and pointwise attention in bf16 (measured: see the
# manifest's checks).
BF16_BOUND = 1e-1
# A candidate scored with others of its request against alone (the
# reference, FP32).
INVARIANCE_BOUND = 1e-6


log = logger("export_hstu")


class HstuDraw(Draw):
    """Seeded draws: user bags (0 to 4 ids), a candidate (one item), a
    history of a given kind (items, actions, and age buckets of actions
    spread over the last 30 days, oldest first)."""

    def __init__(self, args: argparse.Namespace, seed: int) -> None:
        self.args = args
        self.g = torch.Generator().manual_seed(seed)

    def candidate(self) -> List[torch.Tensor]:
        return [torch.randint(0, self.args.item_rows, (1,), generator=self.g)]

    def history(self, kind: str) -> List[torch.Tensor]:
        items = self.items(kind)
        length = len(items)
        actions = torch.randint(0, self.args.action_rows, (length,), generator=self.g)
        seconds = torch.sort(torch.rand(length, generator=self.g) * 30 * 86400, descending=True).values
        ages = age_bucket(seconds).clamp(max=self.args.age_rows - 1)
        return [items, actions, ages]


def one_forward(quantized, request: dict, keys: List[str], max_len: int) -> torch.Tensor:
    """The reference's scores of a ranking request: its candidates appended
    to its (cut) history in one forward."""
    history, _ = cut_history(request["history"], max_len)
    empty = [torch.zeros(0, dtype=torch.int64)]
    samples = [{"dense": request["dense"],
                "bags": (request["user"] if i == 0 else empty * len(request["user"])) + c
                + (history if i == 0 else empty * len(HISTORY))}
               for i, c in enumerate(request["candidates"])]
    *_, kjt = features(sample_major(samples), keys)
    return quantized.rank(kjt, len(samples))


def main() -> int:
    p = parser(__doc__, "test-hstu", name="hstu")
    sequence_flags(p, 2, "contextual user features (user_0, ...), one table each", dim=16)
    p.add_argument("--action-rows", type=int, default=8)
    p.add_argument("--age-rows", type=int, default=64, help="age buckets (ln(30 days) / 0.301 is about 49)")
    p.add_argument("--model-dim", type=int, default=32, help="the STU layers' token width")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16, help="width of each head's u, v, q and k")
    p.add_argument("--head-arch", type=int_list, default=[32], help="the head's MLP layers, before the logit")
    p.add_argument("--attention-block", type=int, default=32,
                   help="the split dense network's attention block: a unit's tokens are cut into blocks of this many "
                        "(only its last block padded)")
    p.add_argument("--pt2", action="store_true",
                   help="also compile the dense network with AOTInductor into OUT/split/dense.pt2 (FP32) "
                        "and, on a CPU with bf16 instructions, dense_bf16.pt2")
    args = p.parse_args()
    args.num_dense = 0
    if args.num_user < 1 or args.max_len < 1 or args.attention_block < 1:
        p.error("--num-user, --max-len and --attention-block must be at least 1")
    out: Path = args.out
    started = begin_export(args, log, "split/schema.json", args.pt2 and "split/dense.pt2")
    if started is None:
        return 0

    user = [f"user_{i}" for i in range(args.num_user)]
    keys = user + CANDIDATE + HISTORY
    request_level = user + HISTORY
    rows = {**{f: args.user_rows for f in user}, "cand_item": args.item_rows, "hist_item": args.item_rows,
            "hist_action": args.action_rows, "hist_age": args.age_rows}
    log(f"building HSTU: item {args.item_rows:,} x {args.embedding_dim}, {args.num_user} contextual features; "
        f"{args.layers} STU layers of width {args.model_dim}, {args.heads} heads of {args.head_dim}; history of "
        f"at most {args.max_len}")
    quantized = quantize_inference_model(build(args, user))

    draw = HstuDraw(args, args.seed + 1)
    flat = served_golden_requests(draw, args.max_len, len(HISTORY))
    ranking = ranking_requests(draw)

    log("scoring the golden requests with the eager quantized forward (flat: a sequence per sample; ranking: "
        "one sequence per request, its candidates appended)")
    scored, invariance = Scored(), 0.0
    with torch.inference_mode():
        for served, dropped, sent in flat:
            _, _, _, kjt = features(sample_major(served), keys)
            scored.add_flat(served, sent, dropped, quantized(torch.zeros(len(served), 0), kjt))
        for request in ranking:
            scores = one_forward(quantized, request, keys, args.max_len)
            samples, dropped = tiled(request, args.max_len)
            _, _, _, kjt = features(sample_major(samples), keys)
            invariance = max(invariance, (quantized(torch.zeros(len(samples), 0), kjt) - scores).abs().max().item())
            scored.add_ranking(request, dropped, scores)
    if not invariance <= INVARIANCE_BOUND:
        raise SystemExit(f"a candidate scored with its request's others differs from alone by {invariance}")
    log(f"reference: {scored.spread()}; a candidate with its request's others within {invariance:.1e} of alone")
    schema = {"name": args.name, "version": args.version, "num_dense": 0,
              "sparse": [{"name": k, "num_rows": rows[k]} for k in keys],
              "request_level": request_level, "sequences": [sequence_json(args.max_len)]}
    goldens = scored.files(schema, request_level)
    write_json_files(out, goldens)

    log("writing the split form and checking it through an emulation of Narsil's stage")
    network = HstuDenseNetwork(quantized.network, args.attention_block).eval()
    working_set = hstu_working_set(args.attention_block, args.heads, args.head_dim, args.num_user, args.model_dim)
    layout = Layout(HISTORY, CANDIDATE, dict(sequence_json(args.max_len), working_set=working_set), BOUND,
                    BF16_BOUND)
    worst = write_split(out / "split", quantized, network, layout, args, keys, user, request_level, scored.flat,
                        scored.ranking, log)
    write_json_files(out / "split", goldens)
    log("split dense.pt's scores against the eager quantized forward's: "
        + ", ".join(f"{kind} within {diff:.1e}" for kind, diff in worst.items()))
    fields = {"kind": "hstu", "name": args.name, "version": args.version, "seed": args.seed,
              "num_user": args.num_user, "item_rows": args.item_rows, "action_rows": args.action_rows,
              "age_rows": args.age_rows, "user_rows": args.user_rows, "embedding_dim": args.embedding_dim,
              "model_dim": args.model_dim, "layers": args.layers, "heads": args.heads, "head_dim": args.head_dim,
              "max_len": args.max_len, "head_arch": args.head_arch, "attention_block": args.attention_block}
    write_manifest(out, EXPORT_FORMAT, fields, ["golden.json", "golden_ranking.json", "split/"], started, log,
                   checks={"invariance": invariance, "split_max_diff": worst})
    return 0


if __name__ == "__main__":
    sys.exit(main())
