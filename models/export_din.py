#!/usr/bin/env python3
"""Exports a DIN-style ranker with a behaviour sequence (models/din_model.py),
built from TorchRec modules with seeded random weights and quantized
TorchRec's way (`quantize_inference_model`: INT8 row-wise
`QuantEmbeddingCollection` for the item and category tables the history and
the candidate share, `QuantEmbeddingBagCollection` for the user's pooled
features). TorchRec's eager quantized forward over a KeyedJaggedTensor is the
reference for every score written.

Sparse features, in wire order: user_0..user_{U-1} (pooled, multi-hot),
cand_item, cand_cat (the candidate: one id each), hist_item, hist_cat (the
sequence `history`, aligned channels, oldest first, at most --max-len
positions, the last kept). Request-level (sent once by a ranking request):
the user features, the history and the dense features.

Writes into --out:

  model.pt             TorchScript, Narsil's interface (FX-traced with
                       TorchRec's tracer, scripted): forward(dense f32[B, num_dense],
                       lengths i32[F*B], ids i64[N]) -> f32[B], key-major over
                       every feature (a history is one bag), and
                       narsil_schema() (with `sequences` and `request_level`)
  golden.json          flat requests (sample-major, as on the wire; histories
                       of 0, 1, random, max_len and more positions, repeated
                       ids) with the reference's scores (`outputs.default`, and
                       `scores_int8`); a history longer than max_len is scored
                       cut to its last max_len positions, as Narsil serves it
                       (`truncated_positions`)
  golden_ranking.json  ranking requests (the user's block: user features,
                       history, dense; rows: the candidates' cand_item and
                       cand_cat) scored by the reference over the flat batch
                       with the block tiled onto each candidate
  split/               (--split) Narsil's split form: schema.json (pooling
                       `none` for the history's channels, `sequences`),
                       tables/*.bin (FBGEMM's INT8 row-wise rows, item and cat
                       shared by the candidate's pooled features and the
                       history), dense.pt (forward(dense, pooled, seq0_values,
                       seq0_offsets, seq0_row_unit)), golden.json and
                       golden_ranking.json; checked by emulating Narsil's stage
                       (rows dequantized as FBGEMM does, bags pooled, each
                       unit's positions laid out once) on flat, grouped and
                       fused batches against the reference
  manifest.json        export format, shape, seed, files
"""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import List

import torch

import fbgemm_gpu  # noqa: F401  (registers FBGEMM's operators)
from torchrec.fx import symbolic_trace as torchrec_symbolic_trace
from torchrec.inference.modules import quantize_inference_model
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection

from din_model import CANDIDATE, HISTORY, Din, DinDenseNetwork, DinPredictor, build, sequence_json
from din_requests import (Draw, cut, features, golden_requests, ranking_json, ranking_requests, request_json,
                          sample_major, tiled)
from sequence_split import din_layout, write_split
from working_sets import din_working_set
from export_dlrm import WithSchema, int_list

# Raised when what is written changes: scripts/lib.sh re-exports older ones.
EXPORT_FORMAT = 2
# model.pt's scores against the reference.
BOUND = 1e-6


def log(msg: str) -> None:
    print(f"[export_din {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def package(quantized: Din, keys: List[str], schema_json: str) -> torch.jit.ScriptModule:
    """TorchRec's inference export: FX-trace with TorchRec's tracer (its
    jagged tensors and FBGEMM lookups stay leaves), then script; wrapped with
    narsil_schema()."""
    traced = torchrec_symbolic_trace(DinPredictor(quantized, keys))
    return torch.jit.script(WithSchema(torch.jit.script(traced), schema_json))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "generated" / "test-din")
    p.add_argument("--name", default="din", help="model name reported by ModelInfo")
    p.add_argument("--version", default="1")
    p.add_argument("--num-dense", type=int, default=8)
    p.add_argument("--num-user", type=int, default=3, help="pooled user features (user_0, ...), one table each")
    p.add_argument("--item-rows", type=int, default=2000)
    p.add_argument("--cat-rows", type=int, default=50)
    p.add_argument("--user-rows", type=int, default=500, help="rows of each user feature's table")
    p.add_argument("--embedding-dim", type=int, default=32, help="every table's dimension D")
    p.add_argument("--embedding-init", type=float, default=0.5, help="embedding weights uniform in [-x, x]")
    p.add_argument("--max-len", type=int, default=64, help="the history's positions kept at most (the last)")
    p.add_argument("--bottom-arch", type=int_list, default=[64, 32], help="the dense features' MLP")
    p.add_argument("--attention-arch", type=int_list, default=[64, 16],
                   help="the attention MLP's layers over [c, p, c - p, c * p] (8D wide), before its one unit")
    p.add_argument("--over-arch", type=int_list, default=[128, 64], help="the top MLP's layers, before the logit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite an existing export")
    p.add_argument("--split", action="store_true", help="also write the split form into OUT/split")
    p.add_argument("--pt2", action="store_true",
                   help="with --split, also compile the dense network with AOTInductor into OUT/split/dense.pt2 "
                        "(FP32; needs a C++ compiler, about 20 s)")
    p.add_argument("--dense-attention", choices=["factored", "exact"], default="factored",
                   help="the split dense network's attention: factored (the history's part of the first layer "
                        "once per position, not per candidate; scores within about 5e-7 of the reference's) or "
                        "exact (the first layer per candidate over [c, p, c - p, c * p], as the model computes it)")
    args = p.parse_args()
    if args.num_user < 1 or args.max_len < 1:
        p.error("--num-user and --max-len must be at least 1")
    out: Path = args.out
    if args.pt2 and not args.split:
        p.error("--pt2 compiles the split form's dense network: it needs --split")
    split_missing = (args.split and not (out / "split" / "schema.json").exists()) or (
        args.pt2 and not (out / "split" / "dense.pt2").exists())
    if (out / "manifest.json").exists() and not args.force and not split_missing:
        log(f"{out} already holds an export; pass --force to overwrite")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    started = time.time()

    user = [f"user_{i}" for i in range(args.num_user)]
    keys = user + CANDIDATE + HISTORY
    request_level = user + HISTORY + ["dense"]
    rows = {**{f: args.user_rows for f in user}, "cand_item": args.item_rows, "cand_cat": args.cat_rows,
            "hist_item": args.item_rows, "hist_cat": args.cat_rows}
    log(f"building DIN: item {args.item_rows:,} x {args.embedding_dim}, cat {args.cat_rows:,}, {args.num_user} user "
        f"tables of {args.user_rows:,}; history of at most {args.max_len}; bottom {args.bottom_arch}, attention "
        f"{args.attention_arch}, over {args.over_arch}")
    din = build(args, user)
    quantized = quantize_inference_model(din)
    for collection, kind in ((quantized.sequence_collection, QuantEmbeddingCollection),
                             (quantized.pooled_collection, QuantEmbeddingBagCollection)):
        if not isinstance(collection, kind):
            raise SystemExit(f"quantize_inference_model made a {type(collection).__name__}, not a {kind.__name__}")

    draw = Draw(args, args.seed + 1)
    flat = []  # (the samples as served, positions cut, the samples as sent)
    for samples in golden_requests(draw):
        served = [cut(s["bags"], args.max_len) for s in samples]
        flat.append(([dict(s, bags=bags) for s, (bags, _) in zip(samples, served)],
                     sum(dropped for _, dropped in served), samples))
    ranking = ranking_requests(draw)

    schema_json = json.dumps({
        "name": args.name, "version": args.version, "num_dense": args.num_dense,
        "sparse": [{"name": k, "num_rows": rows[k]} for k in keys],
        "request_level": request_level,
        # model.pt runs `Din` (the exact attention).
        "sequences": [dict(sequence_json(args.max_len),
                           working_set=din_working_set(args.embedding_dim, args.attention_arch, False))],
    })
    log("packaging: INT8 tables (quantize_inference_model), FX-traced with TorchRec's tracer, scripted")
    with torch.inference_mode():  # one eager forward first, as TorchRec's packaging runs one before tracing
        dense, lengths, ids, kjt = features(sample_major(flat[8][0]), keys)
        quantized(dense, kjt)
    package(quantized, keys, schema_json).save(str(out / "model.pt"))
    loaded = torch.jit.load(str(out / "model.pt"))

    log("scoring the golden requests with TorchRec's eager quantized forward; model.pt checked against it")
    golden, flat_scored, single_worst, spread = [], [], 0.0, []
    with torch.inference_mode():
        for served, dropped, sent in flat:
            dense, lengths, ids, kjt = features(sample_major(served), keys)
            scores = quantized(dense, kjt)
            single_worst = max(single_worst, (loaded(dense, lengths, ids) - scores).abs().max().item())
            golden.append(request_json(sample_major(sent), scores, dropped))
            if len(served) <= 16:
                # QuantEmbeddingCollection's rows of the history as served
                # (sample after sample, oldest first): what Narsil's stage
                # must reproduce bit for bit (crates/narsil-embedding/tests/
                # fbgemm_parity.rs).
                nobag = quantized.sequence_collection(kjt)
                golden[-1]["sequence_values"] = {f: nobag[f].values().reshape(-1).tolist() for f in HISTORY}
            flat_scored.append((served, scores))
            spread.append(scores)
        ranking_golden, ranking_scored = [], []
        for request in ranking:
            samples, dropped = tiled(request, args.max_len)
            dense, lengths, ids, kjt = features(sample_major(samples), keys)
            scores = quantized(dense, kjt)
            single_worst = max(single_worst, (loaded(dense, lengths, ids) - scores).abs().max().item())
            ranking_golden.append(ranking_json(request, scores, dropped))
            ranking_scored.append((request, scores))
            spread.append(scores)
    if not single_worst <= BOUND:
        raise SystemExit(f"model.pt differs from TorchRec's eager quantized forward by {single_worst}")
    spread = torch.cat(spread)
    log(f"model.pt's scores within {single_worst:.1e} of the eager quantized forward's ({spread.numel()} scores, "
        f"{float(spread.min()):.3f} to {float(spread.max()):.3f}, std {float(spread.std()):.3f})")
    schema = json.loads(schema_json)
    (out / "golden.json").write_text(json.dumps({"schema": schema, "requests": golden}))
    ranking_file = {"request_level": request_level, "requests": ranking_golden}
    (out / "golden_ranking.json").write_text(json.dumps(ranking_file))

    summary = {"model_pt_max_diff": single_worst}
    if args.split:
        log("writing the split form and checking it through an emulation of Narsil's stage")
        network = DinDenseNetwork(quantized, len(user), args.embedding_dim,
                                  factored=args.dense_attention == "factored").eval()
        working_set = din_working_set(args.embedding_dim, args.attention_arch, args.dense_attention == "factored")
        worst = write_split(out / "split", quantized, network, din_layout(args.max_len, working_set), args, keys,
                            user, request_level, flat_scored, ranking_scored, log)
        (out / "split" / "golden.json").write_text(json.dumps({"schema": schema, "requests": golden}))
        (out / "split" / "golden_ranking.json").write_text(json.dumps(ranking_file))
        log("split dense.pt's scores against the eager quantized forward's: "
            + ", ".join(f"{kind} within {diff:.1e}" for kind, diff in worst.items()))
        summary["split_max_diff"] = worst
    manifest = {
        "export_format": EXPORT_FORMAT, "kind": "din", "name": args.name, "version": args.version, "seed": args.seed,
        "num_dense": args.num_dense, "num_user": args.num_user, "item_rows": args.item_rows,
        "cat_rows": args.cat_rows, "user_rows": args.user_rows, "embedding_dim": args.embedding_dim,
        "max_len": args.max_len, "bottom_arch": args.bottom_arch, "attention_arch": args.attention_arch,
        "over_arch": args.over_arch, "dense_attention": args.dense_attention, "torch": torch.__version__,
        "checks": summary,
        "files": ["model.pt", "golden.json", "golden_ranking.json"] + (["split/"] if args.split else []),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"wrote {out} in {time.time() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
