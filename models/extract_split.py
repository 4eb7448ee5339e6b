#!/usr/bin/env python3
"""Turns a TorchRec-packaged single-file model into a split model
(models/README.md, "Split models"): its INT8 tables apart from its dense
network, with the same scores.

  extract_split.py MODEL_DIR [--out DIR] [--pt2]

MODEL_DIR holds what Narsil serves for a TorchRec-signature model:
`model.pt` (TorchScript, `forward(batch: Dict[str, Tensor])`, packaged the
way `torchrec/inference` does it: quantized table-batched lookups, FX-traced,
scripted) and `model.json` (its features and outputs). With `golden.json`
beside them (requests and their scores), the split model's scores are
checked against them and the file is copied into the split model.

How, and what it relies on:
  * Every lookup is FBGEMM's `int_nbit_split_embedding_codegen_lookup_function`
    over a table-batched module's buffers (`weights_host`, `weights_offsets`,
    `D_offsets`, `rows_per_table`, `weights_tys`), rows on the host, every
    table INT8 row-wise. Features whose `weights_offsets` are equal share a
    table. Anything else (FP16 or INT4 tables, tables on a GPU, lookups that
    are not FBGEMM's) is refused with a message naming it.
  * Pooling mode (sum or mean) is read from each lookup call's arguments;
    which features are weighted from model.json, checked by measurement.
    A lookup in pooling mode none (an `EmbeddingCollection`'s: sequence
    features, one row per id) makes the model a sequence model, split by
    models/extract_sequences.py: its history in the stage, looked up once
    per unit, and each row's positions gathered inside the graph.
  * Which request feature feeds which lookup column is measured, not parsed:
    the model runs once per feature with one id in that feature's bag and
    every other bag empty, returning its lookups' outputs; the one non-zero
    block names the feature's place. So the extraction does not depend on
    how a TorchRec version permutes or splits its jagged tensors.
  * The dense network is the packaged module itself, its lookups' outputs
    replaced by inputs (`narsil.pooled.N` in the batch dict), and everything
    its outputs do not depend on (the lookups, their bounds checks, the
    jagged-tensor bookkeeping that fed them) removed from its graph; the
    table buffers are emptied.
  * A TorchRec managed-collision model (its features `"raw_ids": true` in
    model.json; ids reach it as int64) keeps, per table, an
    MCHManagedCollisionModule whose remapping buffers
    (`_mch_sorted_raw_ids`, `_mch_remapped_ids_mapping`) turn raw ids into
    rows. Each becomes the table's id map (models/id_map.py, `tables/T.idmap`,
    `"ids": {"map": ...}` in schema.json), with TorchRec's rule for the ids
    it does not hold: evicted and never-seen ids go to one row, the default.
    Which module serves which feature, and that default row, are measured:
    one raw id in one feature's bag, the row its pooled block equals read
    back from the table; and a sample of raw ids per table is checked to
    give through the map the row TorchRec gives them. A hash-ZCH module
    (HashZchManagedCollisionModule) is refused: the ids it does not hold
    fall back to a hashed slot each, not to one default row.
  * With --pt2, that dense network is also compiled by AOTInductor
    (dense.pt2, and dense_bf16.pt2 on a CPU with bf16 instructions): its
    TorchScript graph is retraced for torch.export by ts_retrace.py (run
    node by node, tensor ops recorded), since torch.export cannot trace a
    TorchScript module and PyTorch's own converter stops at TorchRec's
    `KeyedTensor` objects and loops.
"""

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch
from torch import nn

import fbgemm_gpu  # noqa: F401  (registers FBGEMM's operators)

from id_map import I64_MAX, lookup, mch_remapping, write_map
from dense_packages import write_dense_packages
from export_common import logger
from extract_sequences import extract_sequence_model
from packaged_graph import (POOLING_NONE, Lookup, block, dequantized, one_id_request, place_features, returning_lookups,
                            wire_batch, without_lookups)
from split_model import SPLIT_FORMAT, dense_flops_per_sample
from ts_retrace import RetracedScript

log = logger("extract_split")


class PackagedDense(nn.Module):
    """Narsil's dense-network interface over a packaged model without its
    lookups: forward(dense f32[B, D], pooled f32[B, sum of dims] in request
    feature order) -> f32[outputs, B]."""

    def __init__(self, inner: torch.jit.ScriptModule, columns: List[torch.Tensor], outputs: List[str]) -> None:
        super().__init__()
        self.inner = inner
        self.outputs = outputs
        self.columns = columns

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        batch: Dict[str, torch.Tensor] = {"float_features": dense}
        for i, columns in enumerate(self.columns):
            batch["narsil.pooled." + str(i)] = pooled.index_select(1, columns)
        result = self.inner(batch)
        assert torch.jit.isinstance(result, Dict[str, torch.Tensor])
        return torch.stack([result[name] for name in self.outputs])


class MchModule:
    """One MCHManagedCollisionModule of the packaged model: its path and
    remapping buffers."""

    def __init__(self, path: str, module) -> None:
        self.path = path
        self.sorted_raw_ids = module._mch_sorted_raw_ids.clone()
        self.mapping = module._mch_remapped_ids_mapping.clone()
        held = self.sorted_raw_ids != I64_MAX
        self.held = self.sorted_raw_ids[held]
        self.held_rows = self.mapping[held]


def mch_modules(module: torch.jit.ScriptModule) -> List[MchModule]:
    """Every managed-collision module the packaged model holds; refuses the
    kinds whose remapping an id map cannot reproduce."""
    found = []
    for path, sub in module.named_modules():
        buffers = {name for name, _ in sub.named_buffers(recurse=False)}
        if "_hash_zch_identities" in buffers or any(n.startswith("_hash_zch") for n in buffers):
            raise SystemExit(f"{path}: a HashZchManagedCollisionModule; ids it does not hold fall back to a hashed "
                             "slot each (fbgemm's zero_collision_hash), which an id map with one default row "
                             "cannot reproduce: not extracted")
        if {"_mch_sorted_raw_ids", "_mch_remapped_ids_mapping"} <= buffers:
            found.append(MchModule(path, sub))
    return found


def measured_row(probe, lookups: List["Lookup"], place: Tuple[int, int], config: dict, j: int, raw: int,
                 table: torch.Tensor) -> int:
    """The row of `table` (dequantized) that one raw id alone in feature
    `j`'s bag pools to, as the packaged model computes it."""
    i, p = place
    with torch.inference_mode():
        pooled = block(probe(wire_batch(config, one_id_request(config, j, raw)))[i], lookups[i], p)[0]
    distance = (table - pooled).abs().max(dim=1).values
    row = int(distance.argmin())
    if distance[row] > 1e-5 * max(1.0, float(pooled.abs().max())):
        raise SystemExit(f"feature {config['sparse_features'][j]['name']}: raw id {raw} pooled to no row of its "
                         f"table (nearest row {row} off by {float(distance[row]):.3g})")
    return row


def measure_id_maps(probe, lookups: List["Lookup"], places: List[Tuple[int, int]], config: dict,
                    modules: List[MchModule]) -> Dict[Tuple[int, int], dict]:
    """Per table (lookup, weights offset) of a managed-collision model, the
    MCH module that remaps its ids and the row TorchRec sends the ids it
    does not hold to, both measured by looking raw ids up (module docs).
    Tables no module remaps are absent (their ids are rows)."""
    features = config["sparse_features"]
    found: Dict[Tuple[int, int], dict] = {}
    for j, (i, p) in enumerate(places):
        key = (i, lookups[i].offsets[p])
        if key in found:
            found[key]["features"].append(j)
            continue
        table = dequantized(lookups[i].table_rows(p), lookups[i].dims[p])
        # A raw id none of the modules holds: its row is the default row.
        unheld = next(r for r in range(-(1 << 40), 0, 7919) if all(bool((m.held != r).all()) for m in modules))
        default = measured_row(probe, lookups, (i, p), config, j, unheld, table)
        matches = []
        for m in modules:
            if m.sorted_raw_ids.numel() != table.shape[0]:
                continue
            sample = [k for k in range(m.held.numel()) if int(m.held_rows[k]) != default][:4]
            if sample and all(measured_row(probe, lookups, (i, p), config, j, int(m.held[k]), table)
                              == int(m.held_rows[k]) for k in sample):
                matches.append(m)
        if len(matches) > 1:
            raise SystemExit(f"feature {features[j]['name']}: {len(matches)} managed-collision modules "
                             f"({', '.join(m.path for m in matches)}) remap its ids alike; cannot tell which is its")
        if matches:
            found[key] = {"module": matches[0], "default_row": default, "features": [j]}
        elif features[j].get("raw_ids"):
            raise SystemExit(f"feature {features[j]['name']}: model.json says it takes raw ids but no "
                             "managed-collision module of the model remaps them")
    return found


def check_id_map(probe, lookups, place, config: dict, j: int, data: bytes, found: dict, table: torch.Tensor) -> int:
    """Raw ids (a sample of those held, and ids held by none) looked up by
    the packaged model and through the map give the same row; returns how
    many were checked."""
    m = found["module"]
    step = max(1, m.held.numel() // 24)
    raws = m.held[::step].tolist() + [-(1 << 62) + 3, (1 << 61) + 11, I64_MAX, -(1 << 63), -1, 0]
    want = [measured_row(probe, lookups, place, config, j, raw, table) for raw in raws]
    got = lookup(data, raws, found["default_row"]).tolist()
    for raw, g, w in zip(raws, got, want):
        if g != w:
            raise SystemExit(f"id map check failed: {m.path}: raw id {raw} maps to row {g}, the packaged model "
                             f"looks up row {w}")
    return len(raws)


def extract(model_dir: Path, out: Path, pt2: bool = False) -> None:
    config = json.loads((model_dir / "model.json").read_text())
    features = config["sparse_features"]
    for feature in features:  # model.json's defaults
        feature.setdefault("weighted", False)
    outputs = config.get("outputs", ["default"])
    probe, lookups = returning_lookups(model_dir / "model.pt")
    log(f"{len(lookups)} table-batched lookups: " + ", ".join(
        f"{l.path} ({len(l.dims)} features, {l.pooling})" for l in lookups))
    places = place_features(probe, lookups, config)
    modules = mch_modules(probe)
    if any(l.pooling == POOLING_NONE for l in lookups):
        if modules:
            raise SystemExit(f"{modules[0].path}: a managed-collision module in a model with sequence features "
                             "(an EmbeddingCollection's unpooled lookups): not extracted; serve model.pt as a "
                             "single file")
        extract_sequence_model(model_dir, out, config, probe, lookups, places, pt2, log)
        return
    id_maps = measure_id_maps(probe, lookups, places, config, modules) if modules else {}
    if modules:
        log(f"{len(modules)} managed-collision (MCH) modules remap raw ids for {len(id_maps)} tables")

    shutil.rmtree(out, ignore_errors=True)
    (out / "tables").mkdir(parents=True)
    tables: Dict[Tuple[int, int], dict] = {}  # (lookup, weights offset) -> table
    described, schema_features = [], []
    for j, feature in enumerate(features):
        i, p = places[j]
        lookup = lookups[i]
        key = (i, lookup.offsets[p])
        if key not in tables:
            rows = lookup.table_rows(p)
            tables[key] = {"rows": rows, "dim": lookup.dims[p], "features": []}
        tables[key]["features"].append(feature["name"])
    names = {}
    for key, table in tables.items():
        name = "t_" + "_".join(table["features"])
        names[key] = name
        data = table["rows"].contiguous().numpy().tobytes()
        file = f"tables/{name}.bin"
        (out / file).write_bytes(data)
        described.append({"name": name, "rows": table["rows"].shape[0], "dim": table["dim"],
                          "storage": "int8_rowwise", "row_bytes": table["rows"].shape[1], "file": file,
                          "sha256": hashlib.sha256(data).hexdigest()})
        if key in id_maps:
            found = id_maps[key]
            m = found["module"]
            raws, rows, _ = mch_remapping(m.sorted_raw_ids, m.mapping, found["default_row"])
            map_file = f"tables/{name}.idmap"
            sha = write_map(out / map_file, raws, rows, table["rows"].shape[0])
            described[-1]["ids"] = {"map": {"file": map_file, "sha256": sha, "default_row": found["default_row"]}}
            j = found["features"][0]
            i, p = places[j]
            checked = check_id_map(probe, lookups, (i, p), config, j, (out / map_file).read_bytes(), found,
                                   dequantized(lookups[i].table_rows(p), lookups[i].dims[p]))
            log(f"{map_file}: {raws.size} raw ids from {m.path}, default row {found['default_row']} "
                f"({checked} raw ids checked against the packaged model's lookups)")
    for j, feature in enumerate(features):
        i, p = places[j]
        schema_features.append({"name": feature["name"], "table": names[(i, lookups[i].offsets[p])],
                                "pooling": lookups[i].pooling, "weighted": feature["weighted"]})
    log(f"wrote {len(described)} INT8 tables ({sum(t['rows'] * t['row_bytes'] for t in described) / 2**20:.2f} MiB) "
        f"for {len(features)} features into {out / 'tables'}")

    # Lookup i's input columns: its blocks in order, each the columns of the
    # request feature placed there.
    feature_start = [0]
    for j in range(len(features)):
        i, p = places[j]
        feature_start.append(feature_start[-1] + lookups[i].dims[p])
    columns = []
    for i, lookup in enumerate(lookups):
        block_of = {p: j for j, (li, p) in enumerate(places) if li == i}
        if sorted(block_of) != list(range(len(lookup.dims))):
            raise SystemExit(f"{lookup.path}: column blocks {sorted(set(range(len(lookup.dims))) - set(block_of))} "
                             "are fed by no request feature")
        cols = [c for p in range(len(lookup.dims)) for c in range(feature_start[block_of[p]], feature_start[block_of[p] + 1])]
        columns.append(torch.tensor(cols, dtype=torch.int64))
    dense = torch.jit.script(PackagedDense(without_lookups(model_dir / "model.pt"), columns, outputs))
    dense.save(str(out / "dense.pt"))
    schema = {"format": SPLIT_FORMAT, "name": f"{model_dir.name}-extracted", "version": "1",
              "num_dense": config["dense_features"], "tables": described, "features": schema_features,
              "outputs": outputs, "dense_network": "dense.pt",
              "dense_flops_per_sample": dense_flops_per_sample(dense, config["dense_features"], feature_start[-1])}
    if pt2:
        retraced = RetracedScript(torch.jit.load(str(out / "dense.pt")))
        schema.update(write_dense_packages(out, retraced, config["dense_features"], feature_start[-1], log))
    (out / "schema.json").write_text(json.dumps(schema, indent=2) + "\n")

    golden_path = model_dir / "golden.json"
    if not golden_path.exists():
        log(f"no {golden_path}: scores not checked")
        return
    golden = json.loads(golden_path.read_text())
    dense = torch.jit.load(str(out / "dense.pt"))
    worst = 0.0
    with torch.inference_mode():
        for n, request in enumerate(golden["requests"]):
            batch = wire_batch(config, request)
            pooled_blocks = probe(batch)
            per_feature = [block(pooled_blocks[i], lookups[i], p) for i, p in places]
            scores = dense(batch["float_features"], torch.cat(per_feature, dim=1))
            for k, output in enumerate(outputs):
                diff = (scores[k] - torch.tensor(request["outputs"][output])).abs().max().item()
                worst = max(worst, diff)
                if diff > 1e-6:
                    raise SystemExit(f"extraction check failed: golden request {n} output {output} differs "
                                     f"from the packaged model's by {diff}")
    shutil.copyfile(golden_path, out / "golden.json")
    log(f"wrote the split model {out}: scores of {len(golden['requests'])} golden requests within {worst:.1e} "
        "of the packaged model's")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path, help="a directory with model.pt and model.json (and golden.json)")
    p.add_argument("--out", type=Path, help="the split model's directory (default MODEL_DIR/extracted)")
    p.add_argument("--pt2", action="store_true",
                   help="also compile the dense network with AOTInductor (dense.pt2, and dense_bf16.pt2 on a CPU "
                        "with bf16 instructions; needs a C++ compiler)")
    args = p.parse_args()
    for name in ("model.pt", "model.json"):
        if not (args.model_dir / name).exists():
            p.error(f"{args.model_dir / name} does not exist")
    started = time.time()
    extract(args.model_dir, args.out or args.model_dir / "extracted", pt2=args.pt2)
    log(f"done in {time.time() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
