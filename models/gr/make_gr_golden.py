#!/usr/bin/env python3
"""Writes GR-oracle test data: small DlrmHSTU checkpoints saved by Meta's
generative-recommenders (GR) and the scores GR itself gives for them.

For each feature set (``streaming``: GR's DLRMv3 streaming set; ``kuairand``: its
KuaiRand-1K set), scaled down so the data is small but keeping GR's feature
names and structure, this script:

1. builds GR's ``DlrmHSTU`` from GR's own configs (``dlrm_v3/configs.py``) with
   smaller dims and table sizes, the way GR's trainer does (``make_model``);
2. shards it with torchrec's ``DistributedModelParallel`` in a one-process gloo
   group on the CPU, fills every table with seeded random FP16 rows (GR's configs
   use FP16 tables) and every dense parameter with seeded random values, and saves
   it with GR's ``save_dmp_checkpoint`` (``dlrm_v3/checkpoint.py``);
3. reloads it through GR's inference loading path (``get_hstu_model`` +
   ``load_sparse_checkpoint`` + ``load_nonsparse_checkpoint``) and checks every
   tensor came back equal;
4. scores cases with the reloaded model in GR's serving mode (``is_inference``,
   eval, the PyTorch kernels) and writes ``golden.json``.

Two clamp settings are recorded. ``pytorch`` is GR's PyTorch path as it is: it
clamps the time bucket at ``ts_embeddings.size(1) - 1`` (the embedding dim - 1).
``triton`` is what GR's Triton kernel (GPU only) does: clamp at the time table's
rows - 1 (2048). It is reproduced by recompiling GR's
``pytorch_add_timestamp_positional_embeddings`` at run time from GR's own source
with that one expression changed (``size(1)`` -> ``size(0)``); see
``triton_clamp``.

Layout written (read by Narsil's GR importer tests):
  OUT/<set>/checkpoint/    what save_dmp_checkpoint writes (sparse/, non_sparse.ckpt)
  OUT/<set>/hparams.json   {"hstu_config": {...}, "tables": [...]}
  OUT/<set>/golden.json    {"clamp": {"pytorch": [cases], "triton": [cases]}}

Needs a GR checkout named by GR_CHECKOUT (tested with commit db1bf8f) and GR's
extra Python dependencies (gin-config, pandas, tensorboard) importable. CI never
runs this script; its output is committed.

    GR_CHECKOUT=/path/to/generative-recommenders python models/gr/make_gr_golden.py
    ... --sets dlrmv3-cpu --out models/generated/gr   # a benchmark checkpoint (models/gr/README.md)
    ... --bench   # also time GR's eager forward on one core (DLRMv3-like CPU shape)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import types
from typing import Dict, List, Tuple

import torch

SETS = ("streaming", "kuairand")
# Not test data: a DLRMv3-like shape scaled to a CPU, for benchmarks
# (benchmarks/gr_compare.py); written with --sets dlrmv3-cpu --out models/generated/gr.
BENCH_SETS = ("dlrmv3-cpu",)


def import_gr():
    """Puts GR_CHECKOUT on sys.path; supplies the one torchrec module GR needs
    that torchrec 1.8 lacks (its forward is index_select)."""
    checkout = os.environ.get("GR_CHECKOUT")
    if not checkout or not os.path.isdir(
        os.path.join(checkout, "generative_recommenders")
    ):
        sys.exit("set GR_CHECKOUT to a generative-recommenders checkout")
    sys.path.insert(0, os.path.abspath(checkout))
    try:
        import torchrec.modules.sorted_index_select  # noqa: F401
    except ImportError:
        shim = types.ModuleType("torchrec.modules.sorted_index_select")

        def maybe_sorted_index_select(x, index, use_sorted=False):
            return torch.index_select(x, 0, index)

        shim.maybe_sorted_index_select = maybe_sorted_index_select
        sys.modules[shim.__name__] = shim
    return os.path.abspath(checkout)


# ---------------------------------------------------------------- configs


@dataclasses.dataclass
class SetSpec:
    dataset: str  # GR's dataset name for dlrm_v3/configs.py
    table_rows: Dict[str, int]
    table_dim: int
    transducer_dim: int
    max_history: int  # longest history in the golden cases
    max_candidates: int
    time_unit: int  # 1 = seconds, 1000 = milliseconds
    seed: int
    layers: int = 2
    heads: int = 2
    head_dim: int = 16  # attention qk and linear dims, per head
    hidden: int = 64  # preprocessor hidden dim
    max_seq_len: int = 256


SPECS = {
    "streaming": SetSpec(
        dataset="streaming-100b",
        table_rows={"item_id": 2000, "item_category_id": 128, "user_id": 500},
        table_dim=32,
        transducer_dim=24,
        max_history=240,
        max_candidates=16,
        time_unit=1,
        seed=1234,
    ),
    "kuairand": SetSpec(
        dataset="kuairand-1k",
        table_rows={
            "video_id": 2000,
            "user_id": 1000,
            "user_active_degree": 8,
            "follow_user_num_range": 9,
            "fans_user_num_range": 9,
            "friend_user_num_range": 8,
            "register_days_range": 8,
        },
        table_dim=32,
        transducer_dim=16,
        max_history=240,
        max_candidates=16,
        time_unit=1000,
        seed=4321,
    ),
    # issue 70's CPU shape: 3 layers, dim 256, histories up to 1,024, up to 256 candidates
    "dlrmv3-cpu": SetSpec(
        dataset="streaming-100b",
        table_rows={"item_id": 100_000, "item_category_id": 128, "user_id": 10_000},
        table_dim=128,
        transducer_dim=256,
        max_history=1024,
        max_candidates=256,
        time_unit=1,
        seed=2468,
        layers=3,
        heads=4,
        head_dim=64,
        hidden=256,
        max_seq_len=2048,
    ),
}


def gr_configs(name: str):
    """GR's own configs for the set, scaled down (dims, layers, table rows)."""
    from generative_recommenders.dlrm_v3.configs import (
        get_embedding_table_config,
        get_hstu_configs,
    )

    spec = SPECS[name]
    hc = get_hstu_configs(spec.dataset)
    hc.hstu_num_heads = spec.heads
    hc.hstu_attn_linear_dim = spec.head_dim
    hc.hstu_attn_qk_dim = spec.head_dim
    hc.hstu_attn_num_layers = spec.layers
    hc.hstu_embedding_table_dim = spec.table_dim
    hc.hstu_preprocessor_hidden_dim = spec.hidden
    hc.hstu_transducer_embedding_dim = spec.transducer_dim
    hc.max_seq_len = spec.max_seq_len
    hc.max_num_candidates = spec.max_candidates
    hc.max_num_candidates_inference = spec.max_candidates
    tables = get_embedding_table_config(spec.dataset)
    assert set(tables) == set(spec.table_rows), (set(tables), spec.table_rows)
    for t in tables.values():
        t.num_embeddings = spec.table_rows[t.name]
        t.embedding_dim = spec.table_dim
    return hc, tables


def jsonable(x):
    if dataclasses.is_dataclass(x):
        return {f.name: jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, enum.Enum):
        return x.name if not isinstance(x, int) else int(x)
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def hparams(hc, tables) -> dict:
    cfg = jsonable(hc)
    for task in cfg["multitask_configs"]:
        # MultitaskTaskType is an IntEnum; keep its name too.
        task["task_type_name"] = (
            "BINARY_CLASSIFICATION" if task["task_type"] == 0 else "REGRESSION"
        )
    return {
        "hstu_config": cfg,
        "tables": [
            {
                "name": t.name,
                "num_embeddings": t.num_embeddings,
                "embedding_dim": t.embedding_dim,
                "data_type": t.data_type.name,
                "feature_names": list(t.feature_names),
            }
            for t in tables.values()
        ],
    }


# ---------------------------------------------------------------- checkpoint


@contextlib.contextmanager
def gloo_group():
    import torch.distributed as dist

    store_dir = tempfile.mkdtemp(prefix="gr_gloo_")
    dist.init_process_group(
        "gloo", init_method=f"file://{store_dir}/store", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
        shutil.rmtree(store_dir, ignore_errors=True)


def fill_seeded(model: torch.nn.Module, seed: int) -> None:
    """Seeded random values for every table row and dense parameter.

    Tables: uniform(-1, 1) rounded to their FP16 type. Dense: GR's own init is
    kept where it is random and scaled-up where it is tiny; LayerNorm weights
    (GR: ones) and biases (GR: zeros) get seeded noise so a served network that
    dropped or swapped them would not match. Time and position embeddings are
    drawn at +-0.5 (GR's init: +-0.02) so the clamp setting visibly moves scores.
    """
    from torchrec.distributed.types import ShardedTensor

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, v in sorted(model.state_dict().items()):
            if isinstance(v, ShardedTensor):
                for shard in v.local_shards():
                    t = shard.tensor
                    r = torch.rand(t.shape, generator=g) * 2 - 1
                    t.copy_(r.to(t.dtype))
                continue
            if not v.is_floating_point():
                continue  # buffers such as _combined_action_weights
            if "_period_units" in key or "_units_per_period" in key:
                continue  # constant buffers (hour/day periods)
            if (
                "_position_embeddings_weight" in key
                or "_timestamp_embeddings_weight" in key
            ):
                v.copy_(torch.rand(v.shape, generator=g) - 0.5)
            elif v.dim() == 1 and key.endswith("weight"):
                # LayerNorm / SwishLayerNorm weights (GR: ones)
                v.copy_(1.0 + 0.2 * torch.randn(v.shape, generator=g))
            elif v.dim() == 1:
                # biases (GR: mostly zeros), _uvqk_beta
                v.copy_(0.1 * torch.randn(v.shape, generator=g))
            else:
                # matrices: fan-in scaled normal. GR stores _uvqk_weight and
                # _output_weight as [in, out], contextual weights as [n, in, out],
                # torch Linear as [out, in].
                if "_uvqk_weight" in key or "_output_weight" in key:
                    fan_in = v.shape[0]
                elif v.dim() == 3:
                    fan_in = v.shape[1]
                else:
                    fan_in = v.shape[-1]
                v.copy_(torch.randn(v.shape, generator=g) / max(fan_in, 1) ** 0.5)


def write_checkpoint(name: str, ckpt_dir: str) -> Dict[str, torch.Tensor]:
    """Builds GR's DlrmHSTU as GR's trainer does, shards it with DMP on the CPU,
    fills it, saves it with GR's save_dmp_checkpoint into ckpt_dir. Returns the
    saved values (plain tensors) for the reload check."""
    from generative_recommenders.dlrm_v3.checkpoint import save_dmp_checkpoint
    from generative_recommenders.dlrm_v3.utils import MetricsLogger
    from generative_recommenders.modules.dlrm_hstu import DlrmHSTU
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.distributed.types import ShardedTensor, ShardingEnv
    import torch.distributed as dist

    spec = SPECS[name]
    hc, tables = gr_configs(name)
    torch.manual_seed(spec.seed)
    # = generative_recommenders.dlrm_v3.train.utils.make_model with scaled configs
    model = DlrmHSTU(hstu_configs=hc, embedding_tables=tables, is_inference=False)
    sharders = get_default_sharders()
    planner = EmbeddingShardingPlanner(
        topology=Topology(local_world_size=1, world_size=1, compute_device="cpu")
    )
    pg = dist.GroupMember.WORLD
    plan = planner.collective_plan(model, sharders, pg)
    env = ShardingEnv.from_process_group(pg)
    dmp = DistributedModelParallel(
        module=model, device=torch.device("cpu"), plan=plan, sharders=sharders, env=env
    )
    fill_seeded(dmp, spec.seed)
    dense_params = [p for p in dmp.parameters() if not isinstance(p, ShardedTensor)]
    optimizer = torch.optim.SGD(dense_params, lr=0.0)
    metrics = MetricsLogger(
        multitask_configs=hc.multitask_configs,
        batch_size=1,
        window_size=1,
        device=torch.device("cpu"),
        rank=0,
    )
    with tempfile.TemporaryDirectory() as tmp:
        save_dmp_checkpoint(dmp, optimizer, metrics, rank=0, batch_idx=0, path=tmp)
        if os.path.exists(ckpt_dir):
            shutil.rmtree(ckpt_dir)
        shutil.copytree(os.path.join(tmp, "0"), ckpt_dir)
    saved = {}
    for k, v in dmp.state_dict().items():
        if isinstance(v, ShardedTensor):
            full = torch.empty(v.size(), dtype=v.dtype)
            for shard in v.local_shards():
                off = shard.metadata.shard_offsets
                sl = tuple(
                    slice(o, o + s) for o, s in zip(off, shard.metadata.shard_sizes)
                )
                full[sl] = shard.tensor
            saved[k] = full
        else:
            saved[k] = v.detach().clone()
    return saved


def load_model(name: str, ckpt_dir: str, saved: Dict[str, torch.Tensor] | None):
    """GR's inference loading path, on the CPU, FP32 dense, FP16 tables."""
    from generative_recommenders.common import HammerKernel
    from generative_recommenders.dlrm_v3.checkpoint import (
        load_nonsparse_checkpoint,
        load_sparse_checkpoint,
    )
    from generative_recommenders.dlrm_v3.inference.inference_modules import (
        get_hstu_model,
        set_is_inference,
    )

    hc, tables = gr_configs(name)
    set_is_inference(is_inference=True)
    model = get_hstu_model(tables, hc, table_device="cpu")
    load_sparse_checkpoint(model=model, path=ckpt_dir)
    load_nonsparse_checkpoint(model=model, device=torch.device("cpu"), path=ckpt_dir)
    model.eval()
    model.set_hammer_kernel(HammerKernel.PYTORCH)
    if saved is not None:
        own = model.state_dict()
        assert set(own) == set(saved), set(own) ^ set(saved)
        for k, v in saved.items():
            assert own[k].dtype == v.dtype, (k, own[k].dtype, v.dtype)
            assert torch.equal(own[k], v), f"reloaded {k} differs from what was saved"
        print(f"[{name}] reload: all {len(saved)} tensors equal to what was saved")
    return model, hc


# ---------------------------------------------------------------- clamps


@contextlib.contextmanager
def triton_clamp():
    """GR's Triton kernel (triton_position.py) clamps the time bucket at
    ts_embeddings.shape[0] - 1 (2048); GR's PyTorch path clamps at
    ts_embeddings.size(1) - 1 (the embedding dim - 1). Within this context the
    PyTorch function is recompiled from GR's own source with that one expression
    changed, so everything else stays GR's code."""
    import generative_recommenders.ops.position as position
    import generative_recommenders.ops.pytorch.pt_position as pt_position

    original = pt_position.pytorch_add_timestamp_positional_embeddings
    src = textwrap.dedent(inspect.getsource(original))
    needle = "num_time_buckets = ts_embeddings.size(1) - 1"
    assert src.count(needle) == 1, "GR changed its time-bucket clamp; revisit"
    src = src.replace(needle, "num_time_buckets = ts_embeddings.size(0) - 1")
    namespace = dict(vars(pt_position))
    exec(compile(src, inspect.getsourcefile(original), "exec"), namespace)
    patched = namespace[original.__name__]
    position.pytorch_add_timestamp_positional_embeddings = patched
    pt_position.pytorch_add_timestamp_positional_embeddings = patched
    try:
        yield
    finally:
        position.pytorch_add_timestamp_positional_embeddings = original
        pt_position.pytorch_add_timestamp_positional_embeddings = original


# ---------------------------------------------------------------- cases


class UserMaker:
    """Builds one user's features as GR's datasets lay them out."""

    def __init__(self, name: str, hc, seed: int) -> None:
        self.name = name
        self.hc = hc
        self.spec = SPECS[name]
        self.g = torch.Generator().manual_seed(seed)
        self.contexts = list(hc.contextual_feature_to_max_length)
        self.rows = self.spec.table_rows

    def _ints(self, lo: int, hi: int, n: int) -> List[int]:
        return [int(x) for x in torch.randint(lo, hi, (n,), generator=self.g)]

    def _bitmasks(self, n: int) -> List[int]:
        w = self.hc.action_weights
        out = []
        for _ in range(n):
            bits = torch.rand(len(w), generator=self.g) < 0.35
            out.append(sum(int(x) for x, b in zip(w, bits) if b))
        return out

    def user(
        self,
        history: int,
        candidates: int,
        span_s: int = 14 * 86400,
        query_gap_s: int = 120,
        varied_query_times: bool = False,
    ) -> dict:
        """history positions with increasing timestamps over span_s seconds,
        candidates queried query_gap_s after the last one."""
        u = self.spec.time_unit
        g = self.g
        now = 1_700_000_000 + int(torch.randint(0, 30 * 86400, (1,), generator=g))
        if history:
            offs = sorted(
                int(x) for x in torch.randint(0, span_s * u, (history,), generator=g)
            )
            start = now * u - span_s * u
            times = [start + o for o in offs]
        else:
            times = []
        last = times[-1] if times else now * u - span_s * u
        q = last + query_gap_s * u
        if varied_query_times:
            qs = sorted(q + int(x) for x in torch.randint(0, 600 * u, (candidates,), generator=g))
        else:
            qs = [q] * candidates
        uih: Dict[str, List[int]] = {}
        cand: Dict[str, List[int]] = {}
        rows = self.rows
        for f in self.contexts:
            # every contextual feature of these sets has a table of its name
            uih[f] = self._ints(0, rows[f], 1)
        if self.spec.dataset == "streaming-100b":
            items = self._ints(0, rows["item_id"], history)
            ratings = self._ints(1, 6, history)
            citems = self._ints(0, rows["item_id"], candidates)
            per_cat = rows["item_id"] // rows["item_category_id"]
            uih.update(
                item_id=items,
                item_rating=ratings,
                action_timestamp=times,
                item_weights=self._bitmasks(history),
                dummy_watch_time=[0] * history,
                item_category_id=[min(i // per_cat, rows["item_category_id"] - 1) for i in items],
            )
            cand.update(
                item_candidate_id=citems,
                item_candidate_rating=self._ints(1, 6, candidates),
                item_query_time=qs,
                item_action_weights=self._bitmasks(candidates),
                item_dummy_watchtime=[1] * candidates,
                item_candidate_category_id=[
                    min(i // per_cat, rows["item_category_id"] - 1) for i in citems
                ],
            )
        else:
            uih.update(
                video_id=self._ints(0, rows["video_id"], history),
                action_timestamp=times,
                action_weight=self._bitmasks(history),
                watch_time=self._ints(0, 60_000, history),
            )
            cand.update(
                item_video_id=self._ints(0, rows["video_id"], candidates),
                item_action_weight=self._bitmasks(candidates),
                item_target_watchtime=self._ints(0, 60_000, candidates),
                item_query_time=qs,
            )
        assert set(uih) == set(self.hc.hstu_uih_feature_names)
        assert set(cand) == set(self.hc.hstu_candidate_feature_names)
        # GR's feature order
        uih = {f: uih[f] for f in self.hc.hstu_uih_feature_names}
        cand = {f: cand[f] for f in self.hc.hstu_candidate_feature_names}
        return {"uih": uih, "candidates": cand}


def to_kjts(user: dict):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def kjt(d: Dict[str, List[int]]):
        keys = list(d)
        return KeyedJaggedTensor(
            keys=keys,
            values=torch.tensor([v for k in keys for v in d[k]], dtype=torch.int64),
            lengths=torch.tensor([len(d[k]) for k in keys], dtype=torch.int64),
        )

    return kjt(user["uih"]), kjt(user["candidates"])


def gr_scores(model, hc, users: List[dict]) -> List[Dict[str, List[float]]]:
    """One GR forward over the users (batched with GR's collate_fn)."""
    from generative_recommenders.dlrm_v3.datasets.dataset import collate_fn

    batch = collate_fn([to_kjts(u) for u in users])
    with torch.no_grad():
        _, _, _, preds, _, _ = model(
            batch.uih_features_kjt, batch.candidates_features_kjt
        )
    preds = preds.view(len(hc.multitask_configs), -1)
    out = []
    start = 0
    for u in users:
        c = len(next(iter(u["candidates"].values())))
        out.append(
            {
                # float32 scores; 9 significant digits round-trip them exactly
                t.task_name: [float(f"{float(x):.9g}") for x in preds[i, start : start + c]]
                for i, t in enumerate(hc.multitask_configs)
            }
        )
        start += c
    assert start == preds.shape[1]
    return out


def case_plan(name: str, mk: UserMaker, hc) -> List[Tuple[str, List[dict]]]:
    spec = SPECS[name]
    C = spec.max_candidates
    H = spec.max_history
    cases: List[Tuple[str, List[dict]]] = []
    add = lambda label, users: cases.append((label, users))  # noqa: E731
    add("alone_1_candidate", [mk.user(50, 1)])
    add("alone_max_candidates", [mk.user(60, C)])
    add("empty_history_1_candidate", [mk.user(0, 1)])
    add("empty_history_max_candidates", [mk.user(0, C)])
    gate = max(hc.contextual_feature_to_min_uih_length.values(), default=0)
    if gate:
        # history + candidates just below, at and above the gate
        for total in (gate - 1, gate, gate + 1):
            add(f"gate_{total}_of_{gate}_4_candidates", [mk.user(total - 4, 4)])
            add(f"gate_{total}_of_{gate}_1_candidate", [mk.user(total - 1, 1)])
    else:
        for h in (1, 2, 19, 20, 21):
            add(f"short_history_{h}", [mk.user(h, 3)])
    add("max_history_1_candidate", [mk.user(H, 1)])
    add("max_history_max_candidates", [mk.user(H, C, span_s=400 * 86400)])
    add("recent_history_within_an_hour", [mk.user(40, 5, span_s=3600, query_gap_s=5)])
    add("long_history_over_a_year", [mk.user(120, 8, span_s=2 * 365 * 86400, query_gap_s=86400)])
    add("varied_candidate_query_times", [mk.user(30, 6, varied_query_times=True)])
    add("batch_3_mixed", [mk.user(10, 3), mk.user(H, C), mk.user(0, 1)])
    add("batch_4_mixed", [mk.user(25, 2), mk.user(100, 7), mk.user(5, C), mk.user(200, 1)])
    if gate:
        add(
            "batch_4_gate_edges",
            [mk.user(gate - 3, 2), mk.user(gate - 2, 2), mk.user(gate - 1, 2), mk.user(gate + 30, 5)],
        )
    add("batch_3_same_shape", [mk.user(40, 4), mk.user(40, 4), mk.user(40, 4)])
    return cases


def score_cases(model, hc, plan) -> List[dict]:
    out = []
    for label, users in plan:
        in_batch = gr_scores(model, hc, users)
        recs = []
        for u, s in zip(users, in_batch):
            alone = gr_scores(model, hc, [u])[0]
            recs.append(
                {
                    "uih": u["uih"],
                    "candidates": u["candidates"],
                    "scores_alone": alone,
                    "scores_in_batch": s,
                }
            )
        out.append({"name": label, "users": recs})
    return out


def max_diff(a: List[dict], b: List[dict], ka: str, kb: str) -> float:
    m = 0.0
    for ca, cb in zip(a, b):
        for ua, ub in zip(ca["users"], cb["users"]):
            for task, xs in ua[ka].items():
                for x, y in zip(xs, ub[kb][task]):
                    m = max(m, abs(x - y))
    return m


def write_set(name: str, out_root: str, gr_commit: str) -> dict:
    out = os.path.join(out_root, name)
    ckpt = os.path.join(out, "checkpoint")
    os.makedirs(out, exist_ok=True)
    with gloo_group():
        saved = write_checkpoint(name, ckpt)
        model, hc = load_model(name, ckpt, saved)
    _, tables = gr_configs(name)
    with open(os.path.join(out, "hparams.json"), "w") as f:
        h = hparams(hc, tables)
        h["written_by"] = {"generative_recommenders_commit": gr_commit, "script": "models/gr/make_gr_golden.py"}
        json.dump(h, f, indent=1)
        f.write("\n")
    mk = UserMaker(name, hc, SPECS[name].seed + 1)
    plan = case_plan(name, mk, hc)
    golden = {"clamp": {}}
    golden["clamp"]["pytorch"] = score_cases(model, hc, plan)
    with triton_clamp():
        golden["clamp"]["triton"] = score_cases(model, hc, plan)
    with open(os.path.join(out, "golden.json"), "w") as f:
        json.dump(golden, f, separators=(",", ":"))
        f.write("\n")
    py, tr = golden["clamp"]["pytorch"], golden["clamp"]["triton"]
    stats = {
        "cases": len(py),
        "alone_vs_in_batch_max_abs": max(
            max_diff(py, py, "scores_alone", "scores_in_batch"),
            max_diff(tr, tr, "scores_alone", "scores_in_batch"),
        ),
        "pytorch_vs_triton_clamp_max_abs": max_diff(py, tr, "scores_alone", "scores_alone"),
    }
    for cp, cb in zip(py, tr):
        print(
            f"[{name}] {cp['name']:<34} alone-vs-batch pytorch "
            f"{max_diff([cp], [cp], 'scores_alone', 'scores_in_batch'):.2e} triton "
            f"{max_diff([cb], [cb], 'scores_alone', 'scores_in_batch'):.2e}; "
            f"pytorch-vs-triton {max_diff([cp], [cb], 'scores_alone', 'scores_alone'):.2e}"
        )
    print(f"[{name}] {json.dumps(stats)}")
    return stats


def verify_set(name: str, out_root: str) -> None:
    """Rescores golden.json's cases from the committed checkpoint in this
    process (GR's loading path only) and reports the largest difference."""
    out = os.path.join(out_root, name)
    model, hc = load_model(name, os.path.join(out, "checkpoint"), None)
    with open(os.path.join(out, "golden.json")) as f:
        golden = json.load(f)
    for clamp, cases in golden["clamp"].items():
        ctx = triton_clamp() if clamp == "triton" else contextlib.nullcontext()
        with ctx:
            again = score_cases(
                model,
                hc,
                [
                    (c["name"], [{"uih": u["uih"], "candidates": u["candidates"]} for u in c["users"]])
                    for c in cases
                ],
            )
        d = max(
            max_diff(cases, again, "scores_alone", "scores_alone"),
            max_diff(cases, again, "scores_in_batch", "scores_in_batch"),
        )
        print(f"[{name}] verify {clamp}: {len(cases)} cases rescored from the checkpoint, max |diff| {d:.3g}")
        assert d <= 1e-6, d


# ---------------------------------------------------------------- bench


def bench(history: int, candidates: int, layers: int, dim: int, reps: int) -> None:
    """GR's eager forward (PyTorch kernels, FP32 dense, FP16 tables) on one core,
    one request per forward, for a DLRMv3-like shape scaled to a CPU."""
    from generative_recommenders.common import HammerKernel
    from generative_recommenders.dlrm_v3.inference.inference_modules import (
        get_hstu_model,
        set_is_inference,
    )

    torch.set_num_threads(1)
    hc, tables = gr_configs("streaming")
    hc.hstu_num_heads = 4
    hc.hstu_attn_linear_dim = dim // 4
    hc.hstu_attn_qk_dim = dim // 4
    hc.hstu_attn_num_layers = layers
    hc.hstu_embedding_table_dim = dim
    hc.hstu_preprocessor_hidden_dim = dim
    hc.hstu_transducer_embedding_dim = dim
    hc.max_seq_len = history + candidates
    for t in tables.values():
        t.embedding_dim = dim
    set_is_inference(True)
    torch.manual_seed(0)
    model = get_hstu_model(tables, hc, table_device="cpu")
    model.eval()
    model.set_hammer_kernel(HammerKernel.PYTORCH)
    mk = UserMaker("streaming", hc, 99)
    users = [mk.user(history, candidates) for _ in range(4)]
    gr_scores(model, hc, [users[0]])  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(reps):
        gr_scores(model, hc, [users[i % 4]])
    wall = (time.perf_counter() - t0) / reps
    cpu_s = (time.process_time() - c0) / reps
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(
        (ln.split(":", 1)[0].strip(), ln.split(":", 1)[1].strip())
        for ln in lscpu.splitlines()
        if ":" in ln
    )
    cpu_name = f"{fields.get('Model name', '?')} (family {fields.get('CPU family', '?')} model {fields.get('Model', '?')})"
    load = os.getloadavg()[0]
    print(
        f"[bench] GR eager forward, 1 thread, {cpu_name}, load {load:.1f}: layers={layers} "
        f"dim={dim} heads=4 history={history} candidates={candidates}, one request per forward: "
        f"{wall * 1e3:.1f} ms wall ({candidates / wall:.0f} candidates/s), "
        f"{cpu_s * 1e3:.1f} ms CPU ({candidates / cpu_s:.0f} candidates/s per CPU-second)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "testdata", "gr"))
    ap.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS + BENCH_SETS)
    ap.add_argument("--bench", action="store_true", help="also time GR's eager forward")
    ap.add_argument("--bench-only", action="store_true")
    ap.add_argument(
        "--verify",
        action="store_true",
        help="rescore the committed golden cases from the committed checkpoints; write nothing",
    )
    args = ap.parse_args()
    checkout = import_gr()
    try:
        commit = subprocess.run(
            ["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = "unknown"
    print(f"GR checkout {checkout} at {commit}")
    if args.verify:
        for name in args.sets:
            verify_set(name, os.path.abspath(args.out))
    elif not args.bench_only:
        for name in args.sets:
            write_set(name, os.path.abspath(args.out), commit)
    if args.bench or args.bench_only:
        for dim in (128, 256):
            bench(history=512, candidates=128, layers=3, dim=dim, reps=10)


if __name__ == "__main__":
    main()
