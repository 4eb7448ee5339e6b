#!/usr/bin/env python3
"""Exports a DIN ranker as a team writes it with plain TorchRec and packages
it for inference the TorchRec way: the model Narsil is handed as a single
file, with no code of Narsil's inside (what `models/extract_split.py` then
splits; `models/export_din.py` is Narsil's own DIN, written with its split
form in mind).

The model (`TeamDin`), seeded random weights:

  * one `EmbeddingCollection` (unpooled) with the tables `item` (features
    `hist_item`, `cand_item`) and `cat` (`hist_cat`, `cand_cat`): the
    history and the candidate share their tables;
  * an `EmbeddingBagCollection` (sum) for the user's pooled features;
  * the team's own dense code after the collections: a bottom MLP over the
    dense features; the candidate `c` (its one item and category row side
    by side, `JaggedTensor.values()`); the history padded to `--max-len`
    positions by `JaggedTensor.to_padded_dense`; DIN's target attention
    (an MLP over `[c, p, c - p, c * p]` per position, one weight, masked,
    no softmax) and the weighted sum of the positions; an MLP over
    `[bottom(dense), user, c, interest]` to one logit, a sigmoid;
  * `--kind bst`: a BST-like model instead (Behavior Sequence Transformer,
    Chen et al. 2019): the history and the candidate as one sequence of
    `--max-len + 1` tokens (the candidate last, learned position
    embeddings), one `nn.TransformerEncoderLayer` over it (padding masked),
    the candidate's output token and the masked mean of the history's
    through the same top MLP.

Packaged as `torchrec/inference` does it: a `PredictModule` (`forward(batch:
Dict[str, Tensor]) -> Dict[str, Tensor]`, `float_features`,
`id_list_features.{lengths,values}`), `quantize_inference_model` (INT8
row-wise `QuantEmbeddingCollection` and `QuantEmbeddingBagCollection`),
FX-traced with TorchRec's tracer, scripted. `model.json` declares the
features (user_0.., cand_item, cand_cat, hist_item, hist_cat), the history
as a sequence (`max_len`, the last kept) and the request-level features
(the user's, the history, the dense features).

Writes into --out: model.pt, model.json, golden.json (flat requests:
histories of 0, 1, random, max and more positions, each scored by model.pt
on its history cut as Narsil serves it), golden_ranking.json (ranking
requests: the block tiled onto each candidate and scored by model.pt),
manifest.json; with --extract, `extracted/`: the split form
models/extract_split.py makes from model.pt and model.json alone.
"""

import json
import math
import sys
from pathlib import Path
from typing import Dict, List

import torch
from torch import nn

import fbgemm_gpu  # noqa: F401  (registers FBGEMM's operators)
from torchrec.fx import symbolic_trace as torchrec_symbolic_trace
from torchrec.inference.modules import PredictModule, quantize_inference_model
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mlp import MLP
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from din_requests import Draw, Scored, ranking_requests, sample_major, sequence_flags, served_golden_requests, tiled
from export_common import begin_export, int_list, logger, parser, write_json_files, write_manifest
from extract_split import extract

# Raised when what is written changes: scripts/lib.sh re-exports older ones.
EXPORT_FORMAT = 2

HISTORY = ["hist_item", "hist_cat"]
CANDIDATE = ["cand_item", "cand_cat"]

log = logger("export_torchrec_din")


class TeamDin(nn.Module):
    """DIN over TorchRec's collections, as a team writes it (module docs)."""

    def __init__(self, ec: EmbeddingCollection, ebc: EmbeddingBagCollection, num_dense: int, dim: int,
                 num_user: int, max_len: int, bottom: List[int], attention: List[int], over: List[int]) -> None:
        super().__init__()
        self.ec = ec
        self.ebc = ebc
        self.max_len = max_len
        self.bottom = MLP(num_dense, bottom)
        self.attention = MLP(8 * dim, attention)
        self.attention_out = nn.Linear(attention[-1], 1)
        self.over = MLP(bottom[-1] + num_user * dim + 4 * dim, over)
        self.logit = nn.Linear(over[-1], 1)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        user = self.ebc(features).values()
        sequences = self.ec(features)
        candidate = torch.cat([sequences["cand_item"].values(), sequences["cand_cat"].values()], dim=1)
        item, cat = sequences["hist_item"], sequences["hist_cat"]
        history = torch.cat([item.to_padded_dense(self.max_len), cat.to_padded_dense(self.max_len)], dim=2)
        mask = torch.arange(self.max_len).unsqueeze(0) < item.lengths().unsqueeze(1)
        c = candidate.unsqueeze(1).expand_as(history)
        hidden = self.attention(torch.cat([c, history, c - history, c * history], dim=2))
        weights = self.attention_out(hidden).squeeze(2) * mask.float()
        interest = torch.bmm(weights.unsqueeze(1), history).squeeze(1)
        top = self.over(torch.cat([self.bottom(dense), user, candidate, interest], dim=1))
        return torch.sigmoid(self.logit(top)).reshape(-1)


class TeamBst(nn.Module):
    """A BST-like model over the same collections (module docs): one
    transformer layer over `[history ‖ candidate]`."""

    def __init__(self, ec: EmbeddingCollection, ebc: EmbeddingBagCollection, num_dense: int, dim: int,
                 num_user: int, max_len: int, bottom: List[int], over: List[int], heads: int) -> None:
        super().__init__()
        self.ec = ec
        self.ebc = ebc
        self.max_len = max_len
        self.bottom = MLP(num_dense, bottom)
        self.positions = nn.Parameter(torch.randn(max_len + 1, 2 * dim) * 0.1)
        self.encoder = nn.TransformerEncoderLayer(2 * dim, heads, dim_feedforward=4 * dim, dropout=0.0,
                                                  batch_first=True)
        self.over = MLP(bottom[-1] + num_user * dim + 4 * dim, over)
        self.logit = nn.Linear(over[-1], 1)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        user = self.ebc(features).values()
        sequences = self.ec(features)
        candidate = torch.cat([sequences["cand_item"].values(), sequences["cand_cat"].values()], dim=1)
        item, cat = sequences["hist_item"], sequences["hist_cat"]
        history = torch.cat([item.to_padded_dense(self.max_len), cat.to_padded_dense(self.max_len)], dim=2)
        tokens = torch.cat([history, candidate.unsqueeze(1)], dim=1) + self.positions.unsqueeze(0)
        valid = torch.arange(self.max_len).unsqueeze(0) < item.lengths().unsqueeze(1)
        padding = torch.cat([~valid, torch.zeros_like(valid[:, :1])], dim=1)
        encoded = self.encoder(tokens, src_key_padding_mask=padding)
        weights = valid.float().unsqueeze(2)
        mean = (encoded[:, :self.max_len] * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        top = self.over(torch.cat([self.bottom(dense), user, encoded[:, self.max_len], mean], dim=1))
        return torch.sigmoid(self.logit(top)).reshape(-1)


class TeamPredictModule(PredictModule):
    """TorchRec's predict interface around the model."""

    def __init__(self, model: nn.Module, keys: List[str]) -> None:
        super().__init__(model, torch.device("cpu"))
        self.keys: List[str] = keys

    def predict_forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        features = KeyedJaggedTensor(keys=self.keys, lengths=batch["id_list_features.lengths"],
                                     values=batch["id_list_features.values"])
        return {"default": self.predict_module(batch["float_features"], features)}


def batch_of(request: dict, keys: List[str]) -> Dict[str, torch.Tensor]:
    """A sample-major request (din_requests.sample_major) as TorchRec's
    input dict: key-major, ids int32 (what Narsil sends a TorchRec-signature
    model)."""
    lengths = request["lengths"]
    b, f = lengths.shape
    bags = torch.split(request["ids"], lengths.reshape(-1).tolist())
    ordered = [bags[s * f + j] for j in range(f) for s in range(b)]
    return {"float_features": request["dense"],
            "id_list_features.lengths": lengths.t().contiguous().reshape(-1).to(torch.int32),
            "id_list_features.values": torch.cat(ordered).to(torch.int32)}


def build(args, user: List[str], keys: List[str]) -> nn.Module:
    bound = args.embedding_init
    init = lambda w: nn.init.uniform_(w, -bound, bound)  # noqa: E731
    ec = EmbeddingCollection(tables=[
        EmbeddingConfig(name="item", embedding_dim=args.embedding_dim, num_embeddings=args.item_rows,
                        feature_names=["hist_item", "cand_item"], init_fn=init),
        EmbeddingConfig(name="cat", embedding_dim=args.embedding_dim, num_embeddings=args.cat_rows,
                        feature_names=["hist_cat", "cand_cat"], init_fn=init),
    ], device=torch.device("cpu"))
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=name, embedding_dim=args.embedding_dim, num_embeddings=args.user_rows,
                           feature_names=[name], pooling=PoolingType.SUM, init_fn=init) for name in user
    ], device=torch.device("cpu"))
    if args.kind == "din":
        model = TeamDin(ec, ebc, args.num_dense, args.embedding_dim, len(user), args.max_len, args.bottom_arch,
                        args.attention_arch, args.over_arch)
    else:
        model = TeamBst(ec, ebc, args.num_dense, args.embedding_dim, len(user), args.max_len, args.bottom_arch,
                        args.over_arch, args.heads)
    # He-initialised MLPs (nn.Linear's default gives every candidate nearly the same score).
    for layer in model.modules():
        if isinstance(layer, nn.Linear) and not isinstance(layer, nn.modules.linear.NonDynamicallyQuantizableLinear):
            nn.init.normal_(layer.weight, std=math.sqrt(2.0 / layer.in_features))
            nn.init.uniform_(layer.bias, -0.1, 0.1)
    # Exported as teams export a trained model: in eval mode, its parameters
    # still asking for gradients. (Narsil runs every forward, its load-time
    # probe included, without gradients: a BST's scripted transformer layer
    # run once with them fails in inference mode afterwards, "Inference
    # tensors cannot be saved for backward".)
    return TeamPredictModule(model, keys).eval()


def main() -> int:
    p = parser(__doc__, None, name="team-din")
    p.add_argument("--kind", choices=["din", "bst"], default="din")
    p.add_argument("--num-dense", type=int, default=8)
    sequence_flags(p, 3, "pooled user features (user_0, ...), one table each", dim=16)
    p.add_argument("--cat-rows", type=int, default=50)
    p.add_argument("--bottom-arch", type=int_list, default=[32, 16])
    p.add_argument("--attention-arch", type=int_list, default=[32, 16], help="din: the attention MLP")
    p.add_argument("--heads", type=int, default=2, help="bst: attention heads")
    p.add_argument("--over-arch", type=int_list, default=[64, 32])
    p.add_argument("--extract", action="store_true",
                   help="then split model.pt as a team would, with models/extract_split.py, into OUT/extracted")
    args = p.parse_args()
    out: Path = args.out
    started = begin_export(args, log, args.extract and "extracted/schema.json")
    if started is None:
        return 0
    user = [f"user_{i}" for i in range(args.num_user)]
    keys = user + CANDIDATE + HISTORY
    request_level = user + HISTORY + ["dense"]
    rows = {**{f: args.user_rows for f in user}, "cand_item": args.item_rows, "cand_cat": args.cat_rows,
            "hist_item": args.item_rows, "hist_cat": args.cat_rows}
    module = build(args, user, keys)
    draw = Draw(args, args.seed + 1)
    flat = served_golden_requests(draw, args.max_len)
    ranking = ranking_requests(draw)

    log(f"packaging a TorchRec {args.kind} (EmbeddingCollection over history and candidate): "
        "quantize_inference_model, FX-traced with TorchRec's tracer, scripted")
    quantized = quantize_inference_model(module)
    with torch.inference_mode():
        quantized(batch_of(sample_major(flat[8][0]), keys))
    torch.jit.script(torchrec_symbolic_trace(quantized)).save(str(out / "model.pt"))
    config = {"name": args.name, "version": args.version, "dense_features": args.num_dense,
              "sparse_features": [{"name": k, "num_rows": rows[k]} for k in keys], "outputs": ["default"],
              "request_level": request_level,
              "sequences": [{"name": "history", "features": HISTORY, "max_len": args.max_len, "keep": "last"}]}
    (out / "model.json").write_text(json.dumps(config, indent=2) + "\n")

    log("scoring the golden requests with model.pt (histories cut as Narsil serves them)")
    loaded = torch.jit.load(str(out / "model.pt"))
    scored = Scored()
    with torch.inference_mode():
        for served, dropped, sent in flat:
            scored.add_flat(served, sent, dropped, loaded(batch_of(sample_major(served), keys))["default"])
        for request in ranking:
            samples, dropped = tiled(request, args.max_len)
            scored.add_ranking(request, dropped, loaded(batch_of(sample_major(samples), keys))["default"])
    log(f"scores: {scored.spread()}")
    goldens = scored.files(config, request_level)
    write_json_files(out, goldens)
    if args.extract:
        log("extracting the split form from model.pt alone (models/extract_split.py)")
        extract(out, out / "extracted")
    fields = {"kind": args.kind, "name": args.name, "seed": args.seed, "num_dense": args.num_dense,
              "num_user": args.num_user, "item_rows": args.item_rows, "cat_rows": args.cat_rows,
              "user_rows": args.user_rows, "embedding_dim": args.embedding_dim, "max_len": args.max_len}
    files = ["model.pt", "model.json", "golden.json", "golden_ranking.json"] + (["extracted/"] if args.extract else [])
    write_manifest(out, EXPORT_FORMAT, fields, files, started, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
