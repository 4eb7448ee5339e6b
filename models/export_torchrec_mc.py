#!/usr/bin/env python3
"""Exports a TorchRec DLRM whose sparse arch is a managed-collision
embedding bag collection (`ManagedCollisionEmbeddingBagCollection`, one
`MCHManagedCollisionModule` per table): raw 64-bit ids (large, negative,
the extremes) in, TorchRec's own remapping from raw ids to rows inside the
model, packaged the way TorchRec's inference tooling does it
(`quantize_inference_model` with ManagedCollisionEmbeddingBagCollection
mapped to QuantManagedCollisionEmbeddingBagCollection: INT8 FBGEMM tables;
TorchRec's FX tracer; `torch.jit.script`).

Nothing is trained: the remapping is filled by feeding the collection
batches of raw ids in training mode (as a trainer's forwards would), with
an id population that drifts, so that the MCH module admits ids, evicts
some (LFU by default) and never sees others. The tables keep their seeded
random rows.

  forward(batch: Dict[str, Tensor]) -> Dict[str, Tensor]

reads `float_features` f32[B, D], `id_list_features.lengths` i32[F*B] and
`id_list_features.values` **i64**[N] (key-major; raw ids, the remapping
needs them whole) and returns `default`, f32[B] probabilities.

What TorchRec does with a raw id at inference (`_mch_remap`,
torchrec/modules/mc_modules.py): an id the module holds goes to its row; any
other id -- evicted or never seen -- goes to the module's last row
(`zch_size - 1`), which eviction never hands out (models/id_map.py,
`mch_remapping`, has the exact rule, INT64_MAX included).

Writes into --out: model.pt, model.json (`"raw_ids": true` per feature: Narsil
passes ids to the model as int64), golden.json (requests mixing held,
evicted and never-seen raw ids, and TorchRec's eager quantized forward's
scores for each; the saved TorchScript file is checked to give the same),
mc.json (what the golden requests hold: ids per class, the ids each table's
map lacks) and manifest.json; with --split also OUT/split (the INT8 tables,
the dense network and, per table, an id map written by models/id_map.py
from the MCH module's remapping buffers) and OUT/extracted (the same made
from model.pt alone by models/extract_split.py).
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch
from torch import nn

import fbgemm_gpu  # noqa: F401  (registers FBGEMM's operators)
from torchrec.fx import symbolic_trace as torchrec_symbolic_trace
from torchrec.inference.dlrm_predict import DLRMPredictModule
from torchrec.inference.modules import (
    DEFAULT_QUANT_MAPPING,
    quantize_inference_model,
    trim_torch_package_prefix_from_typename,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import (
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from torchrec.quant.embedding_modules import QuantManagedCollisionEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from export_common import begin_export, embedding_flags, logger, parser, uniform_table, write_json_files, write_manifest
from extract_split import extract
from id_map import I64_MAX, lookup, mch_remapping, write_map
from split_model import DenseNetwork, write_torchrec_split

# Raised when what is written changes: scripts/lib.sh re-exports older ones.
EXPORT_FORMAT = 1
I64_MIN = -(1 << 63)


log = logger("export_torchrec_mc")


class McSparseArch(nn.Module):
    """TorchRec DLRM's SparseArch over a managed-collision collection: the
    collection returns its pooled embeddings and the remapped features; the
    pooled ones are stacked `[B, F, D]` in feature order, as SparseArch
    does (its forward, but for the collection's pair of outputs)."""

    def __init__(self, mc_ebc: nn.Module, feature_names: List[str], dim: int) -> None:
        super().__init__()
        self.embedding_bag_collection = mc_ebc
        self._sparse_feature_names: List[str] = feature_names
        self.F: int = len(feature_names)
        self.D: int = dim

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        embedded, _ = self.embedding_bag_collection(features)
        pooled = embedded.to_dict()
        return torch.cat([pooled[name] for name in self._sparse_feature_names], dim=1).reshape(-1, self.F, self.D)


class PooledLookups:
    """A quantized managed-collision collection seen as the plain quantized
    collection of its tables (what split_model.write_torchrec_split reads):
    its TBEs, configs, and a forward returning the pooled embeddings."""

    def __init__(self, collection: QuantManagedCollisionEmbeddingBagCollection) -> None:
        self.collection = collection
        self._emb_modules = collection._emb_modules

    def is_weighted(self) -> bool:
        return self.collection.is_weighted()

    def embedding_bag_configs(self):
        return self.collection.embedding_bag_configs()

    def __call__(self, features: KeyedJaggedTensor):
        return self.collection(features)[0]


def table_configs(names: List[str], args: argparse.Namespace) -> List[EmbeddingBagConfig]:
    """One sum-pooled table of --zch-size rows per feature, the first two
    features sharing one (a shared table has one MCH module)."""
    groups = [names[:2]] + [[name] for name in names[2:]]
    return [uniform_table("t_" + "_".join(group), group, args.zch_size, args) for group in groups]


def raw_id_population(g: torch.Generator, count: int) -> torch.Tensor:
    """`count` distinct raw ids as production sends them: spread over the
    whole int64 range, about half negative, with the extremes."""
    ids = torch.randint(I64_MIN, I64_MAX, (count * 2,), generator=g, dtype=torch.int64)
    ids = torch.unique(torch.cat([torch.tensor([I64_MIN, -1, 0, 1], dtype=torch.int64), ids]))
    ids = ids[ids != I64_MAX]  # TorchRec's empty-slot filler: the requests send it apart
    return ids[torch.randperm(ids.numel(), generator=g)][:count]


def fill_remapping(mc_ebc: ManagedCollisionEmbeddingBagCollection, names: List[str], tables, args,
                   g: torch.Generator) -> Dict[str, dict]:
    """Feeds the collection batches of raw ids in training mode so that its
    MCH modules admit, evict and skip ids; returns per table the ids it was
    fed and every id it held at some point."""
    feature_table = {f: t.name for t in tables for f in t.feature_names}
    population = {t.name: raw_id_population(g, args.population) for t in tables}
    fed = {t.name: set() for t in tables}
    ever_held = {t.name: set() for t in tables}
    modules = mc_ebc._managed_collision_collection._managed_collision_modules
    mc_ebc.train()
    for step in range(args.fill_steps):
        # The population drifts: each step draws from a window that moves
        # over it, skewed to the window's start, so early ids are admitted
        # and later evicted by more frequent newer ones.
        start = int(step / args.fill_steps * (args.population - args.population // 3))
        window = args.population // 3
        lengths = torch.randint(1, 5, (len(names) * args.fill_batch,), generator=g, dtype=torch.int32)
        values = []
        for j, name in enumerate(names):
            n = int(lengths[j * args.fill_batch:(j + 1) * args.fill_batch].sum())
            skewed = (torch.rand(n, generator=g) ** 2 * window).long() + start
            ids = population[feature_table[name]][skewed]
            fed[feature_table[name]].update(ids.tolist())
            values.append(ids)
        mc_ebc(KeyedJaggedTensor(keys=names, values=torch.cat(values), lengths=lengths))
        for table, module in modules.items():
            held = module._mch_sorted_raw_ids
            ever_held[table].update(held[held != I64_MAX].tolist())
    mc_ebc.eval()
    return {t: {"population": population[t], "fed": fed[t], "ever_held": ever_held[t]} for t in population}


def golden_requests(args, names: List[str], tables, history: Dict[str, dict], modules,
                    g: torch.Generator):
    """`args.requests` requests (sample-major, as on Narsil's wire), each
    id drawn from one class of its feature's table: held (seen), evicted
    (held once, no longer), fed but never admitted, never seen (new random
    raw ids), or one of the extremes (INT64_MIN, INT64_MAX, -1, 0). Returns
    the requests and how many ids of each class they hold."""
    feature_table = {f: t.name for t in tables for f in t.feature_names}
    classes = {}
    for t in tables:
        module = modules[t.name]
        held = module._mch_sorted_raw_ids
        held = set(held[held != I64_MAX].tolist())
        h = history[t.name]
        classes[t.name] = {
            "seen": sorted(held),
            "evicted": sorted(h["ever_held"] - held),
            "fed_never_admitted": sorted(h["fed"] - h["ever_held"]),
        }
    counts = {"seen": 0, "evicted": 0, "fed_never_admitted": 0, "never_seen": 0, "extreme": 0}
    all_fed = set().union(*(h["fed"] for h in history.values()))
    extremes = [I64_MIN, I64_MAX, -1, 0]
    kinds = ["seen"] * 8 + ["evicted"] * 4 + ["fed_never_admitted"] * 2 + ["never_seen"] * 5 + ["extreme"]
    requests = []
    for i in range(args.requests):
        batch_size = [1, 3, 8, 2, 5, 16, 1, 4][i % 8]
        lengths = torch.randint(0, 5, (batch_size, len(names)), generator=g, dtype=torch.int32)
        ids = []
        for s in range(batch_size):
            for j, name in enumerate(names):
                table = classes[feature_table[name]]
                for _ in range(int(lengths[s, j])):
                    kind = kinds[int(torch.randint(0, len(kinds), (1,), generator=g))]
                    if kind != "extreme" and kind != "never_seen" and not table[kind]:
                        kind = "never_seen"
                    if kind == "extreme":
                        raw = extremes[int(torch.randint(0, len(extremes), (1,), generator=g))]
                        kind = "extreme"
                    elif kind == "never_seen":
                        raw = int(torch.randint(I64_MIN, I64_MAX, (1,), generator=g, dtype=torch.int64))
                        while raw in all_fed or raw == I64_MAX:
                            raw = int(torch.randint(I64_MIN, I64_MAX, (1,), generator=g, dtype=torch.int64))
                    else:
                        pool = table[kind]
                        raw = pool[int(torch.randint(0, len(pool), (1,), generator=g))]
                    counts[kind] += 1
                    ids.append(raw)
        requests.append({
            "batch_size": batch_size,
            "dense": torch.randn(batch_size, args.num_dense, generator=g),
            "lengths": lengths,
            "ids": torch.tensor(ids, dtype=torch.int64),
        })
    return requests, counts, classes


def batch_of(request: dict) -> Dict[str, torch.Tensor]:
    """A sample-major request as TorchRec's input dict: key-major, ids
    int64 (raw ids)."""
    lengths = request["lengths"]  # [B, F]
    b, f = lengths.shape
    bags = torch.split(request["ids"], lengths.reshape(-1).tolist())
    order = [(s, j) for j in range(f) for s in range(b)]
    return {
        "float_features": request["dense"],
        "id_list_features.lengths": torch.stack([lengths[s, j] for s, j in order]).to(torch.int32),
        "id_list_features.values": torch.cat([bags[s * f + j] for s, j in order]).to(torch.int64),
    }


def features_of(request: dict, names: List[str]) -> KeyedJaggedTensor:
    batch = batch_of(request)
    return KeyedJaggedTensor(keys=names, lengths=batch["id_list_features.lengths"],
                             values=batch["id_list_features.values"])


def add_id_maps(out: Path, collection, tables, requests: List[dict], names: List[str]) -> Dict[str, int]:
    """Writes each table's id map (models/id_map.py) from its MCH module's
    remapping into `out/tables/NAME.idmap`, names it in `out/schema.json`,
    and checks every golden id's row through the map against TorchRec's own
    remapping. Returns per table how many golden ids the map lacks."""
    modules = collection._managed_collision_collection._managed_collision_modules
    schema = json.loads((out / "schema.json").read_text())
    feature_table = {f: t.name for t in tables for f in t.feature_names}
    unmapped = {}
    for spec in schema["tables"]:
        module = modules[spec["name"]]
        zch_index = module._output_global_offset + module._zch_size - 1
        raws, rows, default = mch_remapping(module._mch_sorted_raw_ids, module._mch_remapped_ids_mapping, zch_index)
        file = f"tables/{spec['name']}.idmap"
        sha = write_map(out / file, raws, rows, spec["rows"])
        spec["ids"] = {"map": {"file": file, "sha256": sha, "default_row": default}}
        data = (out / file).read_bytes()
        held = set(raws.tolist())
        # Every golden id of this table's features, through the map and
        # through TorchRec's remap (eval mode: lookup only, nothing learned).
        ids = []
        for request in requests:
            lengths = request["lengths"]
            bags = torch.split(request["ids"], lengths.reshape(-1).tolist())
            f = len(names)
            ids += [bags[k] for k in range(len(bags)) if feature_table[names[k % f]] == spec["name"]]
        ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)
        remapped = module({spec["name"]: JaggedTensor(values=ids, lengths=torch.tensor([ids.numel()]))})
        want = remapped[spec["name"]].values().numpy()
        got = lookup(data, ids.numpy(), default)
        if not np.array_equal(got, want):
            bad = int(np.flatnonzero(got != want)[0])
            raise SystemExit(f"id map check failed: table {spec['name']} raw id {int(ids[bad])}: the map gives row "
                             f"{got[bad]}, TorchRec's remapping {want[bad]}")
        unmapped[spec["name"]] = sum(1 for raw in ids.tolist() if raw not in held)
        log(f"{file}: {raws.size} raw ids, default row {default}; {ids.numel()} golden ids map as TorchRec "
            f"remaps them ({unmapped[spec['name']]} not held)")
    (out / "schema.json").write_text(json.dumps(schema, indent=2) + "\n")
    return unmapped


def main() -> int:
    p = parser(__doc__, None)
    p.add_argument("--num-dense", type=int, default=13)
    p.add_argument("--num-sparse", type=int, default=5, help="features (the first two share a table)")
    p.add_argument("--zch-size", type=int, default=300, help="rows per table: the MCH module's zch_size")
    embedding_flags(p, 16, 0.5)
    p.add_argument("--eviction", choices=["lfu", "lru"], default="lfu", help="the MCH modules' eviction policy")
    p.add_argument("--population", type=int, default=1200, help="distinct raw ids fed to each table")
    p.add_argument("--fill-steps", type=int, default=40, help="training-mode forwards that fill the remapping")
    p.add_argument("--fill-batch", type=int, default=64, help="samples per filling forward")
    p.add_argument("--requests", type=int, default=200, help="golden requests")
    p.add_argument("--split", action="store_true",
                   help="also write the split form (INT8 tables, id maps, dense network) into OUT/split, and "
                        "the one extracted from model.pt into OUT/extracted")
    args = p.parse_args()
    if args.num_sparse < 3:
        p.error("--num-sparse must be at least 3 (two share a table)")
    out: Path = args.out
    started = begin_export(args, log, args.split and "split/schema.json", args.split and "extracted/schema.json")
    if started is None:
        return 0
    g = torch.Generator().manual_seed(args.seed + 1)

    names = [f"cat_{i}" for i in range(args.num_sparse)]
    tables = table_configs(names, args)
    policy = LFU_EvictionPolicy if args.eviction == "lfu" else LRU_EvictionPolicy
    mcc = ManagedCollisionCollection(
        {t.name: MCHManagedCollisionModule(zch_size=args.zch_size, device=torch.device("cpu"),
                                           eviction_policy=policy(), eviction_interval=1, name=t.name)
         for t in tables},
        tables)
    mc_ebc = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables=tables, device=torch.device("cpu")),
                                                    mcc)
    # TorchRec's DLRMPredictModule, its sparse arch over the managed-collision collection.
    module = DLRMPredictModule(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=args.num_dense,
        dense_arch_layer_sizes=[64, args.embedding_dim],
        over_arch_layer_sizes=[64, 1],
        id_list_features_keys=names,
        dense_device=torch.device("cpu"),
    )
    module.predict_module.sparse_arch = McSparseArch(mc_ebc, names, args.embedding_dim)

    log(f"filling the remapping of {len(tables)} MCH tables ({args.zch_size} rows, {args.eviction} eviction) with "
        f"{args.fill_steps} training-mode forwards over {args.population} raw ids per table")
    history = fill_remapping(mc_ebc, names, tables, args, g)
    module.eval()

    mapping = dict(DEFAULT_QUANT_MAPPING)
    mapping[trim_torch_package_prefix_from_typename(torch.typename(ManagedCollisionEmbeddingBagCollection))] = \
        QuantManagedCollisionEmbeddingBagCollection
    quantized = quantize_inference_model(module, quantization_mapping=mapping)
    collection = quantized.predict_module.sparse_arch.embedding_bag_collection
    if not isinstance(collection, QuantManagedCollisionEmbeddingBagCollection):
        raise SystemExit(f"quantize_inference_model made a {type(collection).__name__}, not a "
                         "QuantManagedCollisionEmbeddingBagCollection")
    modules = collection._managed_collision_collection._managed_collision_modules
    requests, counts, classes = golden_requests(args, names, tables, history, modules, g)
    for t, c in classes.items():
        log(f"{t}: {len(c['seen'])} raw ids held, {len(c['evicted'])} evicted, "
            f"{len(c['fed_never_admitted'])} fed but never admitted")
    if any(not c["evicted"] for c in classes.values()):
        log("a table evicted nothing (its remapping never filled): raise --population or --fill-steps for "
            "evicted ids in the golden requests")

    log("packaging: quantized (INT8 tables), FX-traced with TorchRec's tracer, scripted")
    quantized(batch_of(requests[1]))
    scripted = torch.jit.script(torchrec_symbolic_trace(quantized))
    scripted.save(str(out / "model.pt"))
    config = {
        "dense_features": args.num_dense,
        "sparse_features": [{"name": n, "num_rows": args.zch_size, "weighted": False, "raw_ids": True}
                            for n in names],
        "outputs": ["default"],
    }
    (out / "model.json").write_text(json.dumps(config, indent=2) + "\n")

    log(f"computing golden scores of {len(requests)} requests with TorchRec's eager quantized forward")
    loaded = torch.jit.load(str(out / "model.pt"))
    golden, worst = [], 0.0
    with torch.inference_mode():
        for request in requests:
            batch = batch_of(request)
            scores = quantized(batch)["default"].reshape(-1)
            worst = max(worst, (loaded(batch)["default"].reshape(-1) - scores).abs().max().item())
            golden.append({
                "batch_size": request["batch_size"],
                "dense": request["dense"].reshape(-1).tolist(),
                "lengths": request["lengths"].reshape(-1).tolist(),
                "ids": request["ids"].tolist(),
                "weights": [],
                "outputs": {"default": scores.tolist()},
            })
    if worst > 1e-6:
        raise SystemExit(f"the saved model.pt differs from TorchRec's eager quantized forward by {worst}")
    log(f"model.pt's scores within {worst:.1e} of the eager quantized forward's")
    goldens = {"golden.json": {"config": config, "requests": golden}}
    write_json_files(out, goldens)
    summary = {
        "requests": len(requests),
        "samples": sum(r["batch_size"] for r in requests),
        "ids": counts,
        "default_rows": {t: modules[t]._zch_size - 1 for t in modules},
        "tables": {t: {k: len(v) for k, v in c.items()} for t, c in classes.items()},
    }
    if args.split:
        split = out / "split"
        lookups = PooledLookups(collection)

        def pooled_of(request: dict):
            with torch.inference_mode():
                return request["dense"], collection(features_of(request, names))[0].to_dict()

        write_torchrec_split(split, [lookups], DenseNetwork(quantized.predict_module, len(names)), names,
                             "torchrec-mc", "1", args.num_dense, ["default"], list(zip(requests, golden)),
                             pooled_of, log)
        summary["unmapped"] = add_id_maps(split, collection, tables, requests, names)
        write_json_files(split, goldens)
        log("extracting a split model from model.pt alone (models/extract_split.py)")
        extract(out, out / "extracted")
    (out / "mc.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"golden ids: {counts}")
    files = ["model.pt", "model.json", "golden.json", "mc.json"] + (["split/", "extracted/"] if args.split else [])
    write_manifest(out, EXPORT_FORMAT, {"kind": "dlrm_mch", "seed": args.seed}, files, started, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
