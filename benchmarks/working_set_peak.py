#!/usr/bin/env python3
"""The peak memory of one forward of a sequence model's split dense network
(HSTU's `HstuDenseNetwork`, DIN's `DinDenseNetwork`, TorchScript, one
thread), against the working set models/hstu_model.py's and
models/din_model.py's declarations charge for it (crates/narsil-core's
`working_set`, mirrored here): the check that the formula is an upper bound
within a stated factor (docs/guide/sequences.md#memory).

Each shape runs in a fresh process: the network is scripted and run once on
a tiny input (so its graph and weights are resident), then on the shape;
the peak's rise (VmHWM after minus VmHWM before) is what the forward
allocated at once. Random weights: memory does not depend on them.

  .venv/bin/python benchmarks/working_set_peak.py                # the test models' shapes, and a scaled bench-hstu
  .venv/bin/python benchmarks/working_set_peak.py --bench-hstu 400   # the bench-hstu shape, 400 rows x 512 positions
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))

import torch  # noqa: E402

from din_model import DinDenseNetwork  # noqa: E402
from din_model import build as build_din  # noqa: E402
from hstu_model import HstuDenseNetwork, HstuNetwork  # noqa: E402
from working_sets import din_working_set, hstu_working_set  # noqa: E402
from import_gr import Plan, normalized_config, working_set as gr_working_set  # noqa: E402
from gr_model import GrDenseNetwork  # noqa: E402


def gr_plan(shape: dict) -> Plan:
    """An imported GR model's plan of the streaming feature set (GR's
    dlrm_v3/configs.py "streaming" names) at `shape`'s sizes."""
    config = normalized_config({
        "max_seq_len": 4096, "hstu_num_heads": shape["heads"], "hstu_attn_linear_dim": shape["head_dim"],
        "hstu_attn_qk_dim": shape["head_dim"], "hstu_attn_num_layers": shape["layers"],
        "hstu_embedding_table_dim": shape["table_dim"], "hstu_preprocessor_hidden_dim": shape["hidden"],
        "hstu_transducer_embedding_dim": shape["model_dim"], "action_weights": [1, 2, 4, 8, 16],
        "contextual_feature_to_max_length": {"user_id": 1}, "contextual_feature_to_min_uih_length": {"user_id": 20},
        "user_embedding_feature_names": ["item_id", "user_id", "item_category_id"],
        "item_embedding_feature_names": ["item_candidate_id", "item_candidate_category_id"],
        "uih_post_id_feature_name": "item_id", "uih_action_time_feature_name": "action_timestamp",
        "candidates_querytime_feature_name": "item_query_time", "uih_weight_feature_name": "item_weights",
        "merge_uih_candidate_feature_mapping": [
            ["item_id", "item_candidate_id"], ["action_timestamp", "item_query_time"],
            ["item_weights", "item_action_weights"], ["item_category_id", "item_candidate_category_id"]],
        "hstu_uih_feature_names": ["user_id", "item_id", "action_timestamp", "item_weights", "item_category_id"],
        "hstu_candidate_feature_names": ["item_candidate_id", "item_query_time", "item_action_weights",
                                         "item_candidate_category_id"],
        "multitask_configs": [{"task_name": "rating", "task_weight": 1, "task_type": 0}]})
    tables = [{"name": n, "num_embeddings": 100, "embedding_dim": shape["table_dim"], "feature_names": f}
              for n, f in (("item_id", ["item_id", "item_candidate_id"]), ("user_id", ["user_id"]),
                           ("item_category_id", ["item_category_id", "item_candidate_category_id"]))]
    return Plan(config, tables)


# The memory policy `narsil serve` sets for itself on a 2-core machine (its
# log's "glibc malloc" line; src/main/process_memory.rs): one arena, blocks
# of 32 MiB and more mapped and unmapped, at most 64 MiB of free heap top
# kept; libtorch's large allocations on huge pages. Each measured forward
# runs under it, so its peak is the server's, not Python's default heap's.
SERVER_MALLOC = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
                 "MALLOC_TRIM_THRESHOLD_": str(64 << 20), "THP_MEM_ALLOC_ENABLE": "1"}


def vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no VmHWM in /proc/self/status")


def inputs(kind: str, shape: dict, rows: int, positions: int, ranking: bool):
    """A flat request (`rows` units of `positions` each) or a ranking one
    (one unit of `positions` for `rows` rows), as the stage hands it."""
    d = shape.get("embedding_dim", 0)
    units = 1 if ranking else rows
    if kind == "gr":
        plan = gr_plan(shape)
        e, positions_all = shape["table_dim"], units * positions
        raw_channels = torch.randint(0, 32, (positions_all, len(plan.raw_channels)))
        raw_channels[:, plan.layout.time_raw] = 1_700_000_000 + torch.arange(positions_all)
        raw = torch.full((rows, len(plan.raw)), 1_700_100_000, dtype=torch.int64)
        offsets = torch.arange(units + 1, dtype=torch.int64) * positions
        row_unit = torch.zeros(rows, dtype=torch.int64) if ranking else torch.arange(rows, dtype=torch.int64)
        unit_rows = torch.full((units,), rows if ranking else 1, dtype=torch.int64)
        unit_raw = raw[:units]  # every row's query time is the same
        return (torch.zeros(rows, 0), torch.rand(rows, len(plan.pooled) * e),
                torch.rand(positions_all, len(plan.lookups) * e), offsets, row_unit, raw_channels, unit_rows,
                unit_raw, raw)
    if kind == "hstu":
        dense, pooled = torch.zeros(rows, 0), torch.rand(rows, (shape["contexts"] + 1) * d)
        values = torch.rand(units * positions, 3 * d)
    else:
        dense, pooled = torch.rand(rows, shape["num_dense"]), torch.rand(rows, (shape["num_user"] + 2) * d)
        values = torch.rand(units * positions, 2 * d)
    offsets = torch.arange(units + 1, dtype=torch.int64) * positions
    row_unit = torch.zeros(rows, dtype=torch.int64) if ranking else torch.arange(rows, dtype=torch.int64)
    return dense, pooled, values, offsets, row_unit


def network(kind: str, shape: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gr":
        plan = gr_plan(shape)
        return GrDenseNetwork(plan.config, plan.layout, block=shape["block"]).eval()
    if kind == "hstu":
        hstu = HstuNetwork(shape["embedding_dim"], shape["contexts"], shape["model_dim"], shape["layers"],
                           shape["heads"], shape["head_dim"], shape["max_len"], [shape["model_dim"]])
        return HstuDenseNetwork(hstu.eval(), shape["block"]).eval()
    args = SimpleNamespace(embedding_init=0.5, item_rows=100, cat_rows=10, user_rows=10, num_dense=shape["num_dense"],
                           embedding_dim=shape["embedding_dim"], bottom_arch=[64, 32],
                           attention_arch=shape["attention_arch"], over_arch=[128, 64])
    din = build_din(args, [f"user_{i}" for i in range(shape["num_user"])])
    return DinDenseNetwork(din, shape["num_user"], shape["embedding_dim"], factored=shape["factored"]).eval()


def measure(kind: str, shape: dict, rows: int, positions: int, ranking: bool) -> int:
    """In this process: the peak's rise over one forward."""
    torch.set_num_threads(1)
    scripted = torch.jit.script(network(kind, shape))
    with torch.inference_mode():
        for _ in range(2):
            scripted(*inputs(kind, shape, 2, 3, False))
        request = inputs(kind, shape, rows, positions, ranking)
        before = vm_hwm()
        scripted(*request)
    return vm_hwm() - before


SHAPES = {
    # models/export_hstu.py's defaults (test-hstu) and the bench-hstu flags.
    "test-hstu": ("hstu", dict(embedding_dim=16, contexts=2, model_dim=32, layers=2, heads=2, head_dim=16,
                               max_len=64, block=32)),
    "bench-hstu": ("hstu", dict(embedding_dim=64, contexts=2, model_dim=128, layers=3, heads=4, head_dim=32,
                                max_len=512, block=32)),
    # An imported GR model: models/testdata/gr's shape, and benchmarks/gr_forward.py's.
    "test-gr": ("gr", dict(table_dim=32, model_dim=24, layers=2, heads=2, head_dim=16, hidden=64, block=64)),
    "bench-gr": ("gr", dict(table_dim=128, model_dim=256, layers=3, heads=4, head_dim=64, hidden=256, block=64)),
    # models/export_din.py's defaults (test-din), factored and exact.
    "test-din": ("din", dict(embedding_dim=32, num_user=3, num_dense=8, attention_arch=[64, 16], factored=True)),
    "test-din-exact": ("din", dict(embedding_dim=32, num_user=3, num_dense=8, attention_arch=[64, 16],
                                   factored=False)),
}


def declared(kind: str, shape: dict) -> dict:
    if kind == "gr":
        plan = gr_plan(shape)
        return gr_working_set(plan.config, len(plan.contexts), shape["block"])
    if kind == "hstu":
        return hstu_working_set(shape["block"], shape["heads"], shape["head_dim"], shape["contexts"],
                                shape["model_dim"])
    return din_working_set(shape["embedding_dim"], shape["attention_arch"], shape["factored"])


def formula(working_set: dict, rows: int, positions: int, ranking: bool) -> int:
    """crates/narsil-core/src/working_set.rs's `WorkingSet::bytes`, for one
    request of `rows` rows: flat (a unit each) or ranking (one unit)."""
    units = [(positions, rows)] if ranking else [(positions, 1)] * rows
    value, index = working_set.get("bytes_per_value", 4), 8
    total_rows = sum(r for _, r in units)
    if working_set["kind"] == "gather":
        longest, all_positions = max(p for p, _ in units), sum(p for p, _ in units)
        return (total_rows * longest * (working_set["width"] * value + index + 1)
                + all_positions * working_set.get("position_width", 0) * value)
    b, heads, hd = working_set["block"], working_set["heads"], working_set["head_dim"]
    contexts, dim = working_set.get("contexts", 0), working_set["model_dim"]
    if working_set["kind"] == "unit_attention":
        per = (4 * dim + 22 * heads * hd) * value + 2 * index
        group_tokens, most, group, held = working_set.get("group_tokens", 0), 0, 0, 0
        for p, r in units:
            if group_tokens and held and held + p + r > group_tokens:
                most, group, held = max(most, group), 0, 0
            held, group = held + p + r, group + p + contexts + r
        longest, pairs = max(p + contexts for p, _ in units), max(r * (p + contexts) for p, r in units)
        return max(most, group) * per + (b * longest + pairs) * 4 * heads * value
    tokens = blocks = pairs = 0
    most = 2
    for p, r in units:
        n = p + contexts
        k = max(-(-n // b), 1)
        tokens, blocks, pairs, most = tokens + n, blocks + k, pairs + k * (k + 1) // 2, max(most, r)
    attention = heads * hd
    per_pair = (3 * heads * b * value + 2 * index + value) * b + 3 * b * attention * value
    per_block = b * (4 * attention * value + 3 * index)
    per_token = (4 * dim + 8 * attention) * value + 2 * index
    per_row = (4 * dim + 12 * attention) * value + 2 * index
    return (pairs * per_pair + blocks * per_block + tokens * per_token + total_rows * per_row
            + blocks * most * 4 * heads * (b + hd) * value + len(units) * most * 3 * attention * value)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gr", action="store_true", help="measure only the imported GR network's shapes")
    p.add_argument("--bench-hstu", type=int, default=0, help="measure only bench-hstu, this many rows x 512 positions")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        name, rows, positions, ranking = json.loads(args.one)
        kind, shape = SHAPES[name]
        print(measure(kind, shape, rows, positions, ranking))
        return 0
    if args.gr:
        cases = [("test-gr", 200, 240, False), ("test-gr", 16, 240, True), ("bench-gr", 16, 1024, False),
                 ("bench-gr", 256, 1024, True), ("bench-gr", 64, 256, True), ("bench-gr", 200, 64, False)]
    elif args.bench_hstu:
        cases = [("bench-hstu", args.bench_hstu, 512, False)]
    else:
        cases = [("test-hstu", 400, 64, False), ("test-hstu", 2000, 64, False), ("test-hstu", 2000, 64, True),
                 ("bench-hstu", 25, 512, False), ("bench-hstu", 50, 512, False), ("bench-hstu", 100, 256, False),
                 ("bench-hstu", 500, 512, True),
                 ("test-din", 1000, 64, False), ("test-din", 4000, 64, False), ("test-din", 4000, 64, True),
                 ("test-din-exact", 2000, 64, False)]
    worst = 0.0
    for name, rows, positions, ranking in cases:
        out = subprocess.run([sys.executable, __file__, "--one", json.dumps([name, rows, positions, ranking])],
                             check=True, capture_output=True, text=True, env={**os.environ, **SERVER_MALLOC}).stdout
        measured = int(out.strip().splitlines()[-1])
        kind, shape = SHAPES[name]
        charged = formula(declared(kind, shape), rows, positions, ranking)
        ratio = charged / max(measured, 1)
        worst = max(worst, measured / charged)
        print(f"{name:15} {'ranking' if ranking else 'flat':8} {rows:5} rows x {positions:3}: peak rise "
              f"{measured / 2**20:8.1f} MiB, charged {charged / 2**20:8.1f} MiB ({ratio:.2f}x)", flush=True)
    print(f"largest measured / charged: {worst:.2f} (the formula is an upper bound where this is at most 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
