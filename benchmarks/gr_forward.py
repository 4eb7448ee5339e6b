#!/usr/bin/env python3
"""GR's own eager `DlrmHSTU` forward against Narsil's network for it
(models/gr_model.py), one thread, on a DLRMv3-like shape scaled to a CPU:
the streaming feature set (one gated contextual feature, item and category
embeddings, action bitmasks, one task), --layers STU layers of --dim, users
with histories and candidate counts drawn from --history and --candidates.

GR runs as its inference serves on a CPU (PyTorch kernels, eval): one
forward per user (alone: its scores are then its own; fused, GR pads every
user to the batch's longest and divides attention by that length). Timed:
GR's whole forward (its embedding lookups included) and its `main_forward`
alone (the dense part, lookups done before). Narsil's network (TorchScript,
frozen, as Narsil serves dense.pt) runs the same users fused, --users per
forward (c16 by default: one forward for 16 users' requests), and one per
forward; its inputs are built before the timer (the stage's work). Both
score the same weights: checked within 1e-5 of GR alone first.

Times are the least CPU time of --repeats runs (one thread: what the
forward computes, whatever else the machine runs). Prints candidates/s for each, the speedup, and the padding: the token
slots each computes beyond the real tokens (Narsil's TorchScript network:
none, each unit's tokens computed where they lie; its exported .pt2: each
unit's last attention block and its last block of candidates; GR fused:
every user padded to the batch's longest).

  source /work/coord/gr_env.sh   # GR_CHECKOUT on PYTHONPATH (GR commit db1bf8f)
  taskset -c 0 .venv/bin/python benchmarks/gr_forward.py [--layers 3 --dim 256 --history 256-1024 --candidates 64-256]
"""

import argparse
import dataclasses
import json
import os
import random
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))

from check_gr_parity import Model  # noqa: E402
from import_gr import Plan, build_network, normalized_config, schema_json  # noqa: E402


def import_gr():
    """GR's modules from GR_CHECKOUT (or PYTHONPATH): torchrec 1.8 lacks the
    `sorted_index_select` module GR imports; its function is an
    `index_select`."""
    checkout = os.environ.get("GR_CHECKOUT")
    if checkout and checkout not in sys.path:
        sys.path.insert(0, checkout)
    if "torchrec.modules.sorted_index_select" not in sys.modules:
        try:
            import torchrec.modules.sorted_index_select  # noqa: F401
        except ImportError:
            shim = types.ModuleType("torchrec.modules.sorted_index_select")
            shim.maybe_sorted_index_select = \
                lambda values, index, use_sorted=False: torch.index_select(values, 0, index)
            sys.modules["torchrec.modules.sorted_index_select"] = shim
    from generative_recommenders.common import HammerKernel
    from generative_recommenders.dlrm_v3.configs import get_embedding_table_config, get_hstu_configs
    from generative_recommenders.modules.dlrm_hstu import DlrmHSTU
    return HammerKernel, DlrmHSTU, get_hstu_configs, get_embedding_table_config


def span(text: str):
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def gr_model(args):
    """GR's DlrmHSTU (streaming feature set) of the benchmark's shape, its
    tables filled (GR builds them on `meta`), in eval mode on PyTorch
    kernels; and its config and tables as import_gr.py's hparams."""
    HammerKernel, DlrmHSTU, get_hstu_configs, get_embedding_table_config = import_gr()
    from torchrec.modules.embedding_configs import DataType, EmbeddingConfig

    cfg = get_hstu_configs("streaming-100b")
    cfg.hstu_attn_num_layers, cfg.hstu_num_heads = args.layers, args.heads
    cfg.hstu_attn_linear_dim = cfg.hstu_attn_qk_dim = args.head_dim
    cfg.hstu_embedding_table_dim, cfg.hstu_transducer_embedding_dim = args.table_dim, args.dim
    cfg.hstu_preprocessor_hidden_dim = args.dim
    tables = {name: EmbeddingConfig(num_embeddings=min(t.num_embeddings, args.rows), embedding_dim=args.table_dim,
                                    name=name, data_type=DataType.FP32, feature_names=list(t.feature_names))
              for name, t in get_embedding_table_config("streaming-100b").items()}
    torch.manual_seed(args.seed)
    model = DlrmHSTU(hstu_configs=cfg, embedding_tables=tables, is_inference=True)
    model._embedding_collection = model._embedding_collection.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embedding_collection" in name:
                p.uniform_(-0.1, 0.1)
    model.set_hammer_kernel(HammerKernel.PYTORCH)
    config = dataclasses.asdict(cfg)
    config["multitask_configs"] = [{"task_name": t.task_name, "task_weight": t.task_weight,
                                    "task_type": int(t.task_type)} for t in cfg.multitask_configs]
    hp_tables = [{"name": t.name, "num_embeddings": t.num_embeddings, "embedding_dim": t.embedding_dim,
                  "data_type": "FP32", "feature_names": list(t.feature_names)} for t in tables.values()]
    return model.eval(), cfg, normalized_config(config), hp_tables


def draw_users(cfg, rows: dict, args, rng: random.Random):
    """Users as GR's KJTs take them: increasing action times, bitmasks,
    candidates with one query time."""
    users = []
    for _ in range(args.users):
        length, count = rng.randint(*span(args.history)), rng.randint(*span(args.candidates))
        start = 1_700_000_000 + rng.randint(0, 10 ** 7)
        times = sorted(start + rng.randint(0, 60 * 86400) for _ in range(length))
        query = times[-1] + rng.randint(1, 86400)
        uih, candidates = {}, {}
        for f in cfg.hstu_uih_feature_names:
            if f in cfg.contextual_feature_to_max_length:
                uih[f] = [rng.randrange(rows[f])]
            elif f == cfg.uih_action_time_feature_name:
                uih[f] = times
            else:
                uih[f] = [rng.randrange(rows.get(f, 32)) for _ in range(length)]
        for f in cfg.hstu_candidate_feature_names:
            candidates[f] = [query] * count if f == cfg.candidates_querytime_feature_name \
                else [rng.randrange(rows.get(f, 32)) for _ in range(count)]
        users.append({"uih": uih, "candidates": candidates})
    return users


def gr_inputs(cfg, users):
    from torchrec import KeyedJaggedTensor

    def kjt(keys, part):
        lengths, values = [], []
        for k in keys:
            for u in users:
                lengths.append(len(u[part][k]))
                values += u[part][k]
        return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.tensor(values, dtype=torch.int64),
                                                   lengths=torch.tensor(lengths, dtype=torch.int64))
    return kjt(cfg.hstu_uih_feature_names, "uih"), kjt(cfg.hstu_candidate_feature_names, "candidates")


def best(fn, repeats: int) -> float:
    """The least CPU time (this process, one thread) of `repeats` calls
    after a warm-up: CPU time, not wall time, so a machine shared with
    other work does not charge its waits to either side."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.process_time()
        fn()
        times.append(time.process_time() - started)
    return min(times)


def padding(args, users, contexts: int, block: int) -> dict:
    lengths = np.array([len(u["uih"]["item_id"]) for u in users])
    counts = np.array([len(u["candidates"]["item_candidate_id"]) for u in users])
    tokens = contexts + lengths
    real = int(tokens.sum() + counts.sum())
    # The exported .pt2 lays each unit's tokens out in blocks of `block` and its candidates in blocks of 16.
    pt2 = int((np.ceil(tokens / block) * block).sum() + (np.ceil(counts / 16) * 16).sum())
    gr = len(users) * int((tokens + counts).max())
    # TorchScript (what is timed here) computes each unit's tokens where they lie: no padding.
    return {"real_tokens": real, "narsil_slots": real, "narsil_padding": 0.0, "pt2_slots": pt2,
            "pt2_padding": 1 - real / pt2, "gr_fused_slots": gr, "gr_fused_padding": 1 - real / gr}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--dim", type=int, default=256, help="the STU layers' width (transducer dim)")
    p.add_argument("--table-dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64, help="per head: attention qk and linear dims")
    p.add_argument("--rows", type=int, default=100_000, help="rows per table (at most)")
    p.add_argument("--history", default="256-1024")
    p.add_argument("--candidates", default="64-256")
    p.add_argument("--users", type=int, default=16, help="users fused in one Narsil forward (c16)")
    p.add_argument("--block", type=int, default=64, help="Narsil's attention block")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, cfg, config, hp_tables = gr_model(args)
    plan = Plan(config, hp_tables)
    dense = {k: v for k, v in model.state_dict().items() if "embedding_collection" not in k}
    network = torch.jit.freeze(torch.jit.script(build_network(config, plan, dense, "pytorch", args.block)))
    weights = {name: module.weight.detach().numpy()
               for name, module in model._embedding_collection.embeddings.items()}
    described = [{"name": t["name"], "dim": t["embedding_dim"]} for t in hp_tables]
    narsil = Model(schema_json("bench", "1", plan, described, config, args.block), weights, network)
    rows = {f: t["num_embeddings"] for t in hp_tables for f in t["feature_names"]}
    users = draw_users(cfg, rows, args, random.Random(args.seed))
    candidates = sum(len(u["candidates"]["item_query_time"]) for u in users)

    with torch.inference_mode():
        alone_gr = [model(*gr_inputs(cfg, [u]))[3] for u in users]
        fused = narsil.scores(users)
        diff = (fused - torch.cat(alone_gr, dim=1)).abs().max().item()
        if not diff <= 1e-5:
            raise SystemExit(f"Narsil's network differs from GR alone by {diff}")
        gr_batches = [gr_inputs(cfg, [u]) for u in users]
        prepared = [model.preprocess(*b) for b in gr_batches]
        fused_inputs = narsil.stage_inputs(users)
        alone_inputs = [narsil.stage_inputs([u]) for u in users]

        def gr_forward():
            for batch in gr_batches:
                model(*batch)

        def gr_main():
            for pre in prepared:
                # main_forward rewrites its dict of embeddings: a fresh one each time.
                model.main_forward(dict(pre[0]), *pre[1:])

        timings = {
            "gr_forward": best(gr_forward, args.repeats),
            "gr_main_forward": best(gr_main, args.repeats),
            "narsil_fused": best(lambda: network(*fused_inputs), args.repeats),
            "narsil_alone": best(lambda: [network(*x) for x in alone_inputs], args.repeats),
        }
    rates = {k: candidates / v for k, v in timings.items()}
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    result = {"cpu": cpu, "threads": args.threads, "shape": {k: getattr(args, k) for k in (
        "layers", "dim", "table_dim", "heads", "head_dim", "history", "candidates", "users", "block")},
        "candidates": candidates, "max_diff_vs_gr_alone": diff, "seconds": timings, "candidates_per_s": rates,
        "speedup_fused_vs_gr_forward": rates["narsil_fused"] / rates["gr_forward"],
        "speedup_fused_vs_gr_main_forward": rates["narsil_fused"] / rates["gr_main_forward"],
        "padding": padding(args, users, len(plan.contexts), args.block)}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
