#!/usr/bin/env python3
"""Wraps a Narsil export (model_default.pt) in TorchRec's inference signature,
same weights, so TorchRec's C++ server can load it:

  forward(batch: Dict[str, Tensor]) -> Dict[str, Tensor]
    reads  float_features [B, D] f32, id_list_features.lengths, id_list_features.values
    returns {"default": probabilities [B] f32}

TorchRec's server sends int32 lengths and ids (its warm-up sends int64); the
adapter casts them to what the model takes (i32 lengths, i64 ids).

The module is prepared as Narsil prepares it at load: frozen, and with
--dense-precision bf16 its floating-point weights cast to bf16 and the INT8
embedding lookups asked for bf16 output. Both servers then run the same
forward, and the comparison measures the serving around it.

Run with the project venv: .venv/bin/python benchmarks/torchrec_cpp/adapt_model.py --out FILE
"""

import argparse
import os
import sys
from typing import Dict

import torch
from torch import nn

import fbgemm_gpu  # noqa: F401  (registers FBGEMM's operators)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPARSE_TYPE_BF16 = 5  # fbgemm_gpu SparseType.BF16
LOOKUP = "fbgemm::int_nbit_split_embedding_codegen_lookup_function"


class TorchRecSignature(nn.Module):
    def __init__(self, model: torch.jit.ScriptModule) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        dense = batch["float_features"]
        lengths = batch["id_list_features.lengths"].to(torch.int32)
        ids = batch["id_list_features.values"].to(torch.int64)
        return {"default": self.model(dense, lengths, ids)}


def bf16_lookups(module: torch.jit.ScriptModule) -> int:
    graph = module.graph
    arguments = torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function.default._schema.arguments
    index = [a.name for a in arguments].index("output_dtype")
    rewritten = 0
    for node in graph.findAllNodes(LOOKUP, recurse=True):
        constant = graph.insertConstant(SPARSE_TYPE_BF16)
        constant.node().moveBefore(node)
        node.replaceInput(index, constant)
        rewritten += 1
    return rewritten


def prepare(model: torch.jit.ScriptModule, precision: str) -> torch.jit.ScriptModule:
    """What Narsil does at load (crates/narsil-torch/csrc/script_module.cpp):
    bf16 casts the floating-point weights, then the module is frozen, then bf16
    asks the INT8 lookups for bf16 output."""
    model = model.eval()
    if precision == "bf16":
        model.to(torch.bfloat16)  # nn.Module.to: floating-point tensors only
    frozen = torch.jit.freeze(model)
    if precision == "bf16":
        print(f"{bf16_lookups(frozen)} INT8 embedding lookup(s) switched to bf16 output", file=sys.stderr)
    return frozen


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(ROOT, "models", "generated", "default", "model_default.pt"))
    p.add_argument("--out", required=True)
    p.add_argument("--dense-precision", choices=["fp32", "bf16"], default="fp32")
    args = p.parse_args()

    model = torch.jit.load(args.model).eval()
    wrapped = prepare(torch.jit.script(TorchRecSignature(model)), args.dense_precision)
    # Same scores as the model it wraps, on a small request.
    batch_size = 4
    num_sparse = 26
    dense = torch.randn(batch_size, 13)
    lengths = torch.ones(num_sparse * batch_size, dtype=torch.int32)
    ids = torch.zeros(num_sparse * batch_size, dtype=torch.int32)
    with torch.inference_mode():
        got = wrapped({"float_features": dense, "id_list_features.lengths": lengths,
                       "id_list_features.values": ids})["default"]
        want = model(dense, lengths, ids.to(torch.int64))
    diff = (got - want).abs().max().item()
    if diff > 1e-2:
        raise SystemExit(f"adapted model differs from {args.model} by {diff}")
    wrapped.save(args.out)
    print(f"wrote {args.out} ({args.dense_precision})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
