#!/usr/bin/env python3
"""How far bf16 dense arithmetic moves the scores: the model as Narsil runs it
with --dense-precision bf16 against --dense-precision fp32 (both prepared as
Narsil prepares them at load, see benchmarks/torchrec_cpp/adapt_model.py), on
the export's golden requests and on --samples random samples (one-hot and
multi-hot halves, ids uniform over each table), in forwards of --rows rows.
Prints max and mean |score difference|.

Run with the project venv: .venv/bin/python benchmarks/bf16_numerics.py [--model-dir DIR]
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrec_cpp"))
from adapt_model import ROOT, prepare  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "models"))
from export_common import key_major  # noqa: E402


def golden_inputs(request, num_sparse):
    """A golden request (flattened as in golden.json) as the model's key-major inputs."""
    batch = request["batch_size"]
    return key_major({
        "dense": torch.tensor(request["dense"], dtype=torch.float32).reshape(batch, -1),
        "lengths": torch.tensor(request["lengths"], dtype=torch.int32).reshape(batch, num_sparse),
        "ids": torch.tensor(request["ids"], dtype=torch.int64),
    })


def random_batch(rows, num_dense, num_sparse, num_rows, multi_hot, g):
    dense = torch.randn(rows, num_dense, generator=g) * 2.0
    if multi_hot:
        lengths = torch.randint(0, 8, (num_sparse * rows,), generator=g, dtype=torch.int32)
    else:
        lengths = torch.ones(num_sparse * rows, dtype=torch.int32)
    ids = torch.randint(0, num_rows, (int(lengths.sum()),), generator=g)
    return dense, lengths, ids


def summary(diffs):
    d = torch.cat(diffs)
    return f"max |diff| {d.max().item():.3e}, mean {d.mean().item():.3e} over {d.numel():,} scores"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=os.path.join(ROOT, "models", "generated", "default"))
    p.add_argument("--samples", type=int, default=10_000)
    p.add_argument("--rows", type=int, default=100, help="rows per forward")
    args = p.parse_args()
    torch.set_num_threads(1)
    path = os.path.join(args.model_dir, "model_default.pt")
    fp32 = prepare(torch.jit.load(path), "fp32")
    bf16 = prepare(torch.jit.load(path), "bf16")
    golden = json.load(open(os.path.join(args.model_dir, "golden.json")))
    schema = golden["schema"]
    num_sparse, num_dense = len(schema["sparse"]), schema["num_dense"]
    num_rows = schema["sparse"][0]["num_rows"]
    with torch.inference_mode():
        diffs = [(bf16(*golden_inputs(r, num_sparse)) - fp32(*golden_inputs(r, num_sparse))).abs()
                 for r in golden["requests"]]
        print(f"golden requests: {summary(diffs)}")
        g = torch.Generator().manual_seed(11)
        for multi_hot in (False, True):
            diffs = []
            for _ in range(max(1, args.samples // 2 // args.rows)):
                batch = random_batch(args.rows, num_dense, num_sparse, num_rows, multi_hot, g)
                diffs.append((bf16(*batch) - fp32(*batch)).abs())
            print(f"random {'multi-hot (0-7 ids per bag)' if multi_hot else 'one-hot'}: {summary(diffs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
