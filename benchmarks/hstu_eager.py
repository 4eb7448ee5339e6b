#!/usr/bin/env python3
"""The HSTU ranker's own eager forward, timed as the model serves itself: one
forward per request, its candidates appended to the user's history
(`Hstu.rank`: TorchRec's quantized lookups, then the whole padded sequence's
attention under the target-aware mask), at --threads intra-op threads. The
row the generative-ranker comparison holds Narsil's grouped and flat rows
against (docs/guide/sequences.md#generative-rankers).

The model is rebuilt from the export's manifest (same seed, same shape:
models/export_hstu.py) and checked against the export's golden ranking
scores before timing, so the weights are the ones Narsil serves.

Requests: users drawn uniformly, --history-len positions (one length, or
A-B drawn per request), items, actions and ages uniform, --candidates
candidates. Prints candidates/s, requests/s and latency percentiles, and
the multiply-adds per request of the three ways to compute it (the eager
sequence, Narsil's history once, flat per-candidate samples); writes JSON
with --out.

  taskset -c 0 .venv/bin/python benchmarks/hstu_eager.py --model-dir models/generated/bench-hstu
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))

import fbgemm_gpu  # noqa: E402,F401
from torchrec.inference.modules import quantize_inference_model  # noqa: E402

from din_requests import golden_requests, ranking_requests  # noqa: E402
from export_hstu import HstuDraw, one_forward  # noqa: E402
from hstu_model import CANDIDATE, HISTORY, build  # noqa: E402


def history_lengths(spec: str):
    low, _, high = spec.partition("-")
    return int(low), int(high or low)


def multiply_adds(manifest: dict, history: int, candidates: int) -> dict:
    """Multiply-adds of the STU layers per request (projections and
    attention; the head and lookups aside) for the three computations."""
    d, width = manifest["model_dim"], manifest["heads"] * manifest["head_dim"]
    contexts, layers = manifest["num_user"], manifest["layers"]
    per_token = d * 4 * width + width * d

    def sequence(tokens: int, attended: int) -> int:
        return tokens * per_token + 2 * attended * width

    n = contexts + history
    eager = sequence(n + candidates, (n + candidates) ** 2)  # the whole padded [N, N] attention
    once = sequence(n, n * n) + sequence(candidates, candidates * (n + 1))
    flat = candidates * (sequence(n, n * n) + sequence(1, n + 1))
    return {k: layers * v for k, v in {"eager": eager, "history_once": once, "flat": flat}.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=Path("models/generated/bench-hstu"))
    p.add_argument("--history-len", default="256", help="positions per history: N, or A-B drawn per request")
    p.add_argument("--candidates", type=int, default=100)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    manifest = json.loads((args.model_dir / "manifest.json").read_text())
    shape = argparse.Namespace(**manifest, embedding_init=0.5, num_dense=0)
    torch.manual_seed(manifest["seed"])
    user = [f"user_{i}" for i in range(manifest["num_user"])]
    keys = user + CANDIDATE + HISTORY
    quantized = quantize_inference_model(build(shape, user))
    golden = json.loads((args.model_dir / "golden_ranking.json").read_text())["requests"]
    draw = HstuDraw(shape, manifest["seed"] + 1)
    golden_requests(draw)  # the export's draws, in order, up to its ranking requests
    with torch.inference_mode():
        for request, want in zip(ranking_requests(draw), golden):
            got = one_forward(quantized, request, keys, manifest["max_len"])
            diff = (got - torch.tensor(want["scores_int8"])).abs().max().item()
            if not diff <= 1e-6:
                raise SystemExit(f"the rebuilt model differs from the export's golden scores by {diff}")
    print(f"rebuilt {args.model_dir}'s model: its golden ranking scores reproduced", file=sys.stderr)

    low, high = history_lengths(args.history_len)
    timing = HstuDraw(argparse.Namespace(**{**vars(shape), "max_len": high}), 12345)
    requests = []
    for _ in range(args.warmup + args.requests):
        items = timing.history("max")
        length = timing.int(low, high + 1)
        requests.append({"dense": torch.zeros(0), "user": timing.user(),
                         "history": [channel[:length] for channel in items],
                         "candidates": [timing.candidate() for _ in range(args.candidates)]})
    latencies = []
    with torch.inference_mode():
        for i, request in enumerate(requests):
            started = time.perf_counter()
            one_forward(quantized, request, keys, manifest["max_len"])
            if i >= args.warmup:
                latencies.append(time.perf_counter() - started)
    total = sum(latencies)
    quantiles = statistics.quantiles(latencies, n=100)
    report = {
        "model_dir": str(args.model_dir), "history_len": args.history_len, "candidates": args.candidates,
        "threads": args.threads, "requests": args.requests, "torch": torch.__version__,
        "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "candidates_per_s": args.requests * args.candidates / total, "requests_per_s": args.requests / total,
        "p50_ms": quantiles[49] * 1e3, "p99_ms": quantiles[98] * 1e3,
        "multiply_adds_per_request": multiply_adds(manifest, (low + high) // 2, args.candidates),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
