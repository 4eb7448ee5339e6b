#!/usr/bin/env python3
"""Where the DLRM forward's time goes: torch.profiler over the model as Narsil
runs it (frozen; bf16: weights cast and INT8 lookups in bf16, see
benchmarks/torchrec_cpp/adapt_model.py), one thread, at each --rows, for each
precision. Prints each operator's share and a breakdown by stage:

  embedding lookup   FBGEMM's INT8 table-batched lookup and its bounds check
  KJT construction   building the KeyedJaggedTensor: offsets, permute, split
  dense arch / over arch / interaction   grouped by the operators of each
                     (linear layers are told apart by their output width)
  framework          wall time not inside any operator (TorchScript's
                     interpreter, dispatch, allocation)

Run with the project venv, pinned, with libtorch's huge pages as Narsil runs:
THP_MEM_ALLOC_ENABLE=1 taskset -c 0 .venv/bin/python benchmarks/profile_forward.py
"""

import argparse
import collections
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrec_cpp"))
from adapt_model import ROOT, prepare  # noqa: E402

STAGES = [
    ("embedding lookup", ("fbgemm::int_nbit", "fbgemm::bounds_check")),
    ("KJT construction", ("fbgemm::asynchronous", "fbgemm::permute", "aten::cumsum", "aten::split",
                          "aten::zeros", "aten::narrow", "aten::arange", "aten::repeat")),
    ("MLPs (linear + relu)", ("aten::addmm", "aten::linear", "aten::mm", "aten::relu", "aten::clamp_min",
                             "mkldnn", "aten::matmul", "prepacked")),
    ("interaction (cat, bmm, gather)", ("aten::bmm", "aten::cat", "aten::index_select", "aten::transpose")),
    ("sigmoid and casts", ("aten::sigmoid", "aten::to", "aten::_to_copy", "aten::copy_")),
]


def stage_of(name):
    for stage, prefixes in STAGES:
        if name.startswith(prefixes):
            return stage
    return "other operators"


def inputs(rows, ids_per_bag, seed, table_rows):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, 13, generator=g)
    if ids_per_bag == 1:
        lengths = torch.ones(26 * rows, dtype=torch.int32)
    else:
        lengths = torch.randint(0, 2 * ids_per_bag, (26 * rows,), generator=g, dtype=torch.int32)
    ids = torch.randint(0, table_rows, (int(lengths.sum()),), generator=g)
    return dense, lengths, ids


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(ROOT, "models", "generated", "default", "model_default.pt"))
    p.add_argument("--rows", type=int, nargs="+", default=[100, 1600])
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--ids-per-bag", type=int, default=1)
    p.add_argument("--table-rows", type=int, default=100_000, help="rows of every table: ids are uniform below it")
    p.add_argument("--samples", type=int, default=32000, help="rows profiled per size")
    p.add_argument("--top", type=int, default=12, help="operators listed")
    args = p.parse_args()
    torch.set_num_threads(1)
    for precision in args.precisions:
        model = prepare(torch.jit.load(args.model), precision)
        for rows in args.rows:
            batches = [inputs(rows, args.ids_per_bag, s, args.table_rows) for s in range(8)]
            forwards = max(8, args.samples // rows)
            with torch.inference_mode():
                for i in range(10):
                    model(*batches[i % 8])
                with profile(activities=[ProfilerActivity.CPU]):  # the profiler's own first-use cost
                    model(*batches[0])
                started = time.perf_counter()
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for i in range(forwards):
                        model(*batches[i % 8])
                wall = time.perf_counter() - started
            events = prof.key_averages()
            total_self = sum(e.self_cpu_time_total for e in events) / 1e6
            per_forward_ms = wall / forwards * 1e3
            print(f"\n## {precision}, {rows} rows: {per_forward_ms:.2f} ms per forward under the profiler "
                  f"({rows / (wall / forwards):,.0f} samples/s)")
            stages = collections.Counter()
            for e in events:
                stages[stage_of(e.key)] += e.self_cpu_time_total / 1e6
            stages["framework (outside operators)"] = max(0.0, wall - total_self)
            print("| stage | ms per forward | share |\n|---|---|---|")
            for stage, seconds in stages.most_common():
                print(f"| {stage} | {seconds / forwards * 1e3:.3f} | {seconds / wall:.1%} |")
            print(f"\n| top operators (self time) | ms per forward | calls per forward |\n|---|---|---|")
            for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:args.top]:
                print(f"| {e.key} | {e.self_cpu_time_total / 1e3 / forwards:.3f} | {e.count / forwards:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
