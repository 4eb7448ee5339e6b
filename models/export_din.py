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

import json
import sys
from pathlib import Path
from typing import List

import torch

import fbgemm_gpu  # noqa: F401  (registers FBGEMM's operators)
from torchrec.fx import symbolic_trace as torchrec_symbolic_trace
from torchrec.inference.modules import quantize_inference_model
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection

from din_model import CANDIDATE, HISTORY, Din, DinDenseNetwork, DinPredictor, build, sequence_json
from din_requests import (Draw, Scored, features, ranking_requests, sample_major, sequence_flags,
                          served_golden_requests, tiled)
from export_common import WithSchema, begin_export, int_list, logger, parser, write_json_files, write_manifest
from sequence_split import din_layout, write_split
from working_sets import din_working_set

# Raised when what is written changes: scripts/lib.sh re-exports older ones.
EXPORT_FORMAT = 5
# model.pt's scores against the reference.
BOUND = 1e-6


log = logger("export_din")


def package(quantized: Din, keys: List[str], schema_json: str) -> torch.jit.ScriptModule:
    """TorchRec's inference export: FX-trace with TorchRec's tracer (its
    jagged tensors and FBGEMM lookups stay leaves), then script; wrapped with
    narsil_schema()."""
    traced = torchrec_symbolic_trace(DinPredictor(quantized, keys))
    return torch.jit.script(WithSchema(torch.jit.script(traced), schema_json))


def main() -> int:
    p = parser(__doc__, "test-din", name="din")
    p.add_argument("--num-dense", type=int, default=8)
    sequence_flags(p, 3, "pooled user features (user_0, ...), one table each", dim=32)
    p.add_argument("--cat-rows", type=int, default=50)
    p.add_argument("--bottom-arch", type=int_list, default=[64, 32], help="the dense features' MLP")
    p.add_argument("--attention-arch", type=int_list, default=[64, 16],
                   help="the attention MLP's layers over [c, p, c - p, c * p] (8D wide), before its one unit")
    p.add_argument("--over-arch", type=int_list, default=[128, 64], help="the top MLP's layers, before the logit")
    p.add_argument("--split", action="store_true", help="also write the split form into OUT/split")
    p.add_argument("--pt2", action="store_true",
                   help="with --split, also compile the dense network with AOTInductor into OUT/split/dense.pt2 "
                        "(FP32) and, on a CPU with bf16 instructions, dense_bf16.pt2 (needs a C++ compiler, about "
                        "20 s each)")
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
    started = begin_export(args, log, args.split and "split/schema.json", args.pt2 and "split/dense.pt2")
    if started is None:
        return 0

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
    flat = served_golden_requests(draw, args.max_len)
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
    scored, single_worst = Scored(), 0.0
    with torch.inference_mode():
        for served, dropped, sent in flat:
            dense, lengths, ids, kjt = features(sample_major(served), keys)
            scores = quantized(dense, kjt)
            single_worst = max(single_worst, (loaded(dense, lengths, ids) - scores).abs().max().item())
            entry = scored.add_flat(served, sent, dropped, scores)
            if len(served) <= 16:
                # QuantEmbeddingCollection's rows of the history as served
                # (sample after sample, oldest first): what Narsil's stage
                # must reproduce bit for bit (crates/narsil-embedding/tests/
                # fbgemm_parity.rs).
                nobag = quantized.sequence_collection(kjt)
                entry["sequence_values"] = {f: nobag[f].values().reshape(-1).tolist() for f in HISTORY}
        for request in ranking:
            samples, dropped = tiled(request, args.max_len)
            dense, lengths, ids, kjt = features(sample_major(samples), keys)
            scores = quantized(dense, kjt)
            single_worst = max(single_worst, (loaded(dense, lengths, ids) - scores).abs().max().item())
            scored.add_ranking(request, dropped, scores)
    if not single_worst <= BOUND:
        raise SystemExit(f"model.pt differs from TorchRec's eager quantized forward by {single_worst}")
    log(f"model.pt's scores within {single_worst:.1e} of the eager quantized forward's ({scored.spread()})")
    goldens = scored.files(json.loads(schema_json), request_level)
    write_json_files(out, goldens)

    summary = {"model_pt_max_diff": single_worst}
    if args.split:
        log("writing the split form and checking it through an emulation of Narsil's stage")
        network = DinDenseNetwork(quantized, len(user), args.embedding_dim,
                                  factored=args.dense_attention == "factored").eval()
        working_set = din_working_set(args.embedding_dim, args.attention_arch, args.dense_attention == "factored")
        worst = write_split(out / "split", quantized, network, din_layout(args.max_len, working_set), args, keys,
                            user, request_level, scored.flat, scored.ranking, log)
        write_json_files(out / "split", goldens)
        log("split dense.pt's scores against the eager quantized forward's: "
            + ", ".join(f"{kind} within {diff:.1e}" for kind, diff in worst.items()))
        summary["split_max_diff"] = worst
    fields = {"kind": "din", "name": args.name, "version": args.version, "seed": args.seed,
              "num_dense": args.num_dense, "num_user": args.num_user, "item_rows": args.item_rows,
              "cat_rows": args.cat_rows, "user_rows": args.user_rows, "embedding_dim": args.embedding_dim,
              "max_len": args.max_len, "bottom_arch": args.bottom_arch, "attention_arch": args.attention_arch,
              "over_arch": args.over_arch, "dense_attention": args.dense_attention}
    files = ["model.pt", "golden.json", "golden_ranking.json"] + (["split/"] if args.split else [])
    write_manifest(out, EXPORT_FORMAT, fields, files, started, log, checks=summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
