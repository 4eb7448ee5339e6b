"""The split form of a ranker with one behaviour sequence (models/export_din.py
and models/export_hstu.py --split): its INT8 tables, `schema.json` with the
history as a sequence, `dense.pt` (the model's dense network, scripted) and,
with --pt2, `dense.pt2` (and `dense_bf16.pt2` where the CPU has bf16
instructions), checked against TorchRec's eager quantized forward
through an emulation of Narsil's embedding stage (`Stage`): rows
dequantized from the table files' bytes as FBGEMM does, bags pooled, each
unit's positions laid out once, units as Narsil numbers them (a batch's rows
first, then its request blocks; those no row attends to dropped when empty).
A model's `Layout` names its history's
channels and its candidate's features."""

import argparse
import copy
import json
import shutil
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Tuple

import numpy as np
import torch
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection

import din_model
from din_requests import cut_history, features, sample_major
from dense_packages import isa_cpu_flags, load_unlinked_package, package_precisions, sequence_form_timings
from split_model import SPLIT_FORMAT, named_int8_tables, write_int8_table

class Layout(NamedTuple):
    """A sequence model's features: the history's channels (aligned, in
    the order a position's rows are concatenated, the last features in
    wire order), the candidate's pooled features, the schema's
    `sequences` entry, and the split form's bounds against the reference
    (FP32): the dense network in FP32 and in bf16."""
    history: List[str]
    candidate: List[str]
    sequence: dict
    bound: float = 1e-6
    bf16_bound: float = 1e-2


def din_layout(max_len: int, working_set: dict) -> Layout:
    """DIN's layout, its sequence declaring `working_set`
    (models/working_sets.py)."""
    return Layout(din_model.HISTORY, din_model.CANDIDATE,
                  dict(din_model.sequence_json(max_len), working_set=working_set))


class Stage:
    """Narsil's embedding stage for this model, in Python: rows dequantized
    from the table files' bytes as FBGEMM's nobag lookup does (`q * scale +
    bias`, FP32: the product is exact, one rounding), pooled bags summed as
    FBGEMM's pooled lookup does (`fma(scale, q, acc + bias)` per value), the
    history's positions laid out unit after unit."""

    def __init__(self, tables: Dict[str, torch.Tensor], feature_table: Dict[str, str], dim: int,
                 user: List[str], layout: Layout) -> None:
        self.rows = {name: fused.numpy() for name, fused in tables.items()}
        self.feature_table = feature_table
        self.dim = dim
        self.layout = layout
        self.pooled = user + layout.candidate

    def parts(self, table: str, ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        raw = self.rows[table][ids]
        scale = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
        bias = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
        return raw[:, 4:4 + self.dim].astype(np.float32), scale, bias

    def rows_of(self, table: str, ids: np.ndarray) -> np.ndarray:
        """`[n, dim]`: FBGEMM's nobag rows."""
        q, scale, bias = self.parts(table, ids)
        return q * scale + bias

    def pool(self, table: str, ids: np.ndarray) -> np.ndarray:
        """FBGEMM's pooled sum of a bag: `acc = fma(scale, q, acc + bias)`
        (the fma exact in float64 -- q * scale has at most 19 significant
        bits -- and rounded once)."""
        acc = np.zeros(self.dim, dtype=np.float32)
        q, scale, bias = self.parts(table, ids)
        for k in range(len(ids)):
            shifted = (acc + bias[k]).astype(np.float64)
            acc = (q[k].astype(np.float64) * np.float64(scale[k, 0]) + shifted).astype(np.float32)
        return acc

    def batch(self, rows: List[dict], blocks: List[dict]) -> tuple:
        """The dense network's inputs for a fused batch: `rows` (each: its
        `dense`, its pooled bags by feature, its own history bags or a
        `block` index) and `blocks` (request blocks: user bags and
        history). Units as Narsil lays them out: row r is unit r (its own
        history, empty for a row of a block), then block b is unit
        `len(rows) + b`."""
        pooled, units = [], []
        for row in rows:
            pooled.append(np.concatenate([self.pool(self.feature_table[f], row["bags"][f].numpy())
                                          for f in self.pooled]))
            units.append(row.get("history", [torch.zeros(0, dtype=torch.int64)] * len(self.layout.history)))
        units += [block["history"] for block in blocks]
        values = [np.concatenate([self.rows_of(self.feature_table[f], channel.numpy())
                                  for f, channel in zip(self.layout.history, unit)], axis=1) for unit in units]
        lengths = [len(unit[0]) for unit in units]
        width = len(self.layout.history) * self.dim
        values = np.concatenate(values) if values else np.zeros((0, width), dtype=np.float32)
        row_unit = [r if row.get("block") is None else len(rows) + row["block"] for r, row in enumerate(rows)]
        # Units no row attends to that hold no position (a grouped row's
        # own) dropped, the others renumbered in order, as Narsil does.
        attended = set(row_unit)
        kept = [u for u in range(len(units)) if u in attended or lengths[u] > 0]
        renumbered = {u: k for k, u in enumerate(kept)}
        offsets = np.concatenate([[0], np.cumsum([lengths[u] for u in kept])]).astype(np.int64)
        row_unit = np.array([renumbered[u] for u in row_unit], dtype=np.int64)
        dense = torch.stack([row["dense"] for row in rows])
        return (dense, torch.from_numpy(np.stack(pooled)), torch.from_numpy(values.reshape(-1, width)),
                torch.from_numpy(offsets), torch.from_numpy(row_unit))


def flat_rows(samples: List[dict], keys: List[str], layout: Layout) -> List[dict]:
    """Flat samples as stage rows: each row its own unit."""
    return [{"dense": s["dense"], "bags": dict(zip(keys, s["bags"])),
             "history": s["bags"][len(keys) - len(layout.history):]} for s in samples]


def grouped_rows(request: dict, block: int, keys: List[str], max_len: int,
                 layout: Layout) -> Tuple[List[dict], dict]:
    """A ranking request as stage rows of one block: the user's pooled bags
    pooled once (here: per row, the same bytes), the history cut as served."""
    history, _ = cut_history(request["history"], max_len)
    user = dict(zip(keys, request["user"]))
    rows = [{"dense": request["dense"], "bags": {**user, **dict(zip(layout.candidate, c))}, "block": block}
            for c in request["candidates"]]
    return rows, {"history": history}


def write_split(out: Path, quantized: torch.nn.Module, network: torch.nn.Module, layout: Layout,
                args: argparse.Namespace, keys: List[str], user: List[str], request_level: List[str],
                flat: List[Tuple[List[dict], torch.Tensor]], ranking: List[Tuple[dict, torch.Tensor]],
                log) -> Dict[str, float]:
    """Writes the split form into `out` and checks it, through the
    emulated stage, against the reference's scores of `flat` (served
    samples and scores) and `ranking` (requests and scores): each flat
    request alone (every row its own unit), each ranking request alone (one
    unit for its rows), and all of them fused into one batch, through
    `network` (the dense network, in eval mode). Returns the largest
    differences."""
    shutil.rmtree(out, ignore_errors=True)
    (out / "tables").mkdir(parents=True)
    ec, ebc = quantized.sequence_collection, quantized.pooled_collection
    tables = {**named_int8_tables(ec), **named_int8_tables(ebc)}
    feature_table = {}
    described = []
    for collection in (ec, ebc):
        configs = collection.embedding_configs() if collection is ec else collection.embedding_bag_configs()
        for config in configs:
            described.append(write_int8_table(out, config.name, tables[config.name], config.embedding_dim))
            feature_table.update({f: config.name for f in config.feature_names})
    features_json = [{"name": f, "table": feature_table[f], "pooling": "none" if f in layout.history else "sum",
                      "weighted": False} for f in keys]
    scripted = torch.jit.script(network)
    scripted.save(str(out / "dense.pt"))
    schema = {
        "format": SPLIT_FORMAT, "name": args.name, "version": args.version, "num_dense": args.num_dense,
        "tables": described, "features": features_json, "outputs": ["default"], "dense_network": "dense.pt",
        "request_level": request_level,
        "sequences": [layout.sequence],
    }
    (out / "schema.json").write_text(json.dumps(schema, indent=2) + "\n")
    log(f"wrote {len(described)} INT8 tables ({sum(t['rows'] * t['row_bytes'] for t in described) / 2**20:.2f} "
        f"MiB), dense.pt and schema.json into {out}")

    stage = Stage(tables, feature_table, args.embedding_dim, user, layout)
    loaded = torch.jit.load(str(out / "dense.pt"))
    # As Narsil serves it with --dense-precision bf16: weights cast, float inputs bf16.
    bf16 = torch.jit.load(str(out / "dense.pt")).to(torch.bfloat16)
    worst = {"flat": 0.0, "grouped": 0.0, "fused": 0.0, "bf16": 0.0}
    checked = []  # every batch's inputs

    def check(kind: str, rows: List[dict], blocks: List[dict], expected: torch.Tensor) -> None:
        with torch.inference_mode():
            inputs = stage.batch(rows, blocks)
            scores = loaded(*inputs)
            bf16_scores = bf16(*(x.to(torch.bfloat16) if x.is_floating_point() else x for x in inputs))
        diff = (scores - expected).abs().max().item()
        if not diff <= layout.bound:
            raise SystemExit(f"split export check failed ({kind} batch of {len(rows)} rows, {len(blocks)} blocks): "
                             f"dense.pt's scores differ from TorchRec's eager quantized forward's by {diff}")
        bf16_diff = (bf16_scores.float() - expected).abs().max().item()
        if not bf16_diff <= layout.bf16_bound:
            raise SystemExit(f"split export check failed ({kind} batch): dense.pt in bf16 differs from TorchRec's "
                             f"eager quantized forward (FP32) by {bf16_diff}, over {layout.bf16_bound}")
        worst[kind] = max(worst[kind], diff)
        worst["bf16"] = max(worst["bf16"], bf16_diff)
        checked.append(inputs)

    for samples, expected in flat:
        check("flat", flat_rows(samples, keys, layout), [], expected)
    fused_rows, fused_blocks, fused_expected = [], [], []
    users_rows, users_blocks, largest_user = [], [], ([], [])
    for request, expected in ranking:
        rows, block = grouped_rows(request, 0, keys, args.max_len, layout)
        check("grouped", rows, [block], expected)
        if len(rows) > len(largest_user[0]):
            largest_user = (rows, [block])
        rows, block = grouped_rows(request, len(users_blocks), keys, args.max_len, layout)
        users_rows += rows
        users_blocks.append(block)
        rows, block = grouped_rows(request, len(fused_blocks), keys, args.max_len, layout)
        fused_rows += rows
        fused_blocks.append(block)
        fused_expected.append(expected)
        # A flat request between the ranking requests.
        samples, expected = flat[len(fused_blocks) % len(flat)]
        fused_rows += flat_rows(samples, keys, layout)
        fused_expected.append(expected)
    check("fused", fused_rows, fused_blocks, torch.cat(fused_expected))
    check_stage_rows(stage, ec, ebc, flat, keys, user, layout, log)
    if args.pt2:
        # What --dense-form auto weighs: ranking requests, as a sequence model is served (each history once per
        # request; flat rows each look theirs up): every golden ranking request fused, and the largest alone.
        with torch.inference_mode():
            served = [stage.batch(users_rows, users_blocks), stage.batch(*largest_user)]
        timings = {}
        for precision in package_precisions():
            package_file, worst[f"pt2 {precision} from dense.pt"] = write_dense_package(
                out, network, checked, args, log, precision, layout.bf16_bound)
            schema["dense_package" if precision == "fp32" else f"dense_package_{precision}"] = package_file
            timings.update(sequence_form_timings(out, load_unlinked_package(str(out / package_file)),
                                                 [(b, b[0].shape[0]) for b in served], log, precision))
        if "bf16" not in package_precisions():
            log("dense_bf16.pt2 not compiled: this CPU has no bf16 instructions (AVX512-BF16 or AMX-BF16)")
        schema["dense_form_timings"] = timings
        (out / "schema.json").write_text(json.dumps(schema, indent=2) + "\n")
    return worst


def write_dense_package(out: Path, network: torch.nn.Module, batches: List[tuple],
                        args: argparse.Namespace, log, precision: str = "fp32",
                        bf16_bound: float = 1e-2) -> Tuple[str, float]:
    """`network` compiled ahead of time into `out/dense.pt2` (FP32) or, for
    `precision` "bf16", `out/dense_bf16.pt2` (its floating-point parameters
    and inputs bf16, as Narsil's bf16 casts them): torch.export with dynamic
    rows R, positions P (0 included), units U (1 included) and the longest
    unit known at run time only, then AOTInductor, for this CPU's vector ISA
    without -march=native, kernels not linking libtorch (as
    models/split_model.py compiles the pooled models' packages; Inductor's
    defaults). Checked against `out/dense.pt` in FP32 on `batches` and on a
    row alone with an empty history (P == 0, U == 1): FP32 within 1e-5,
    bf16 within `bf16_bound` (the bound dense.pt in bf16 keeps against the
    reference). Returns the file's name and the largest difference."""
    import torch.fx.experimental._config as fx_config
    from torch._inductor import aoti_compile_and_package
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    started = time.time()
    name = "dense.pt2" if precision == "fp32" else f"dense_{precision}.pt2"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    bound = 1e-5 if precision == "fp32" else bf16_bound
    module = network if precision == "fp32" else copy.deepcopy(network).to(dtype)

    def cast(inputs: tuple) -> tuple:
        return tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)

    vec_isa = pick_vec_isa()
    flags = isa_cpu_flags(vec_isa.build_arch_flags())
    rows = torch.export.Dim("rows", min=1, max=1 << 20)
    positions = torch.export.Dim("positions", min=0, max=1 << 24)
    offsets = torch.export.Dim("units_plus_one", min=2, max=1 << 20)
    example = next(b for b in batches if b[2].shape[0] > 1 and b[3].shape[0] > 2)
    # Sizes 0 and 1 not specialised: a lone flat row is one unit, an empty history no position.
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        program = torch.export.export(module, cast(example), dynamic_shapes=(
            {0: rows}, {0: rows}, {0: positions}, {0: offsets}, {0: rows}))
    settings = "Inductor defaults"
    with torch.no_grad():
        path = aoti_compile_and_package(program, package_path=str(out / name), inductor_configs={
            "cpp.march": "",
            "aot_inductor.link_libtorch": False,
            "aot_inductor.metadata": {"narsil_cpu_flags": " ".join(flags), "narsil_vec_isa": str(vec_isa),
                                      "narsil_settings": settings, "narsil_links_libtorch": "false"},
        })
    package = load_unlinked_package(path)
    scripted = torch.jit.load(str(out / "dense.pt"))
    lone = (torch.randn(1, args.num_dense), batches[0][1][:1], torch.zeros(0, batches[0][2].shape[1]),
            torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    worst = 0.0
    with torch.inference_mode():
        for inputs in batches + [lone]:
            worst = max(worst, (package(*cast(inputs)).float() - scripted(*inputs)).abs().max().item())
    if not worst <= bound:
        raise SystemExit(f"{name} check failed: {worst} from dense.pt (FP32), over {bound:g}")
    log(f"compiled {name} with AOTInductor for {vec_isa} ({settings}) in {time.time() - started:.0f} s; "
        f"within {worst:.1e} of dense.pt (FP32) on {len(batches) + 1} batches")
    return name, worst


def check_stage_rows(stage: Stage, ec: QuantEmbeddingCollection, ebc: QuantEmbeddingBagCollection,
                     flat: List[Tuple[List[dict], torch.Tensor]], keys: List[str], user: List[str],
                     layout: Layout, log) -> None:
    """The emulated stage's rows and bags against TorchRec's quantized
    collections on every golden sample, bit for bit: the history's and the
    candidate's positions against `QuantEmbeddingCollection` (nobag), the
    user bags against `QuantEmbeddingBagCollection`, and the candidate's
    bag of one id pooled as a pooled feature against its nobag row."""
    with torch.inference_mode():
        for samples, _ in flat:
            request = sample_major(samples)
            *_, kjt = features(request, keys)
            nobag = ec(kjt)
            pooled = ebc(kjt).to_dict()
            for f in layout.history + layout.candidate:
                ids = torch.cat([s["bags"][keys.index(f)] for s in samples]).numpy()
                mine = stage.rows_of(stage.feature_table[f], ids)
                if not np.array_equal(mine.view(np.uint32), nobag[f].values().numpy().view(np.uint32)):
                    raise SystemExit(f"stage check failed: {f}'s rows dequantized as q * scale + bias differ from "
                                     "QuantEmbeddingCollection's")
            for s, sample in enumerate(samples):
                for f in user:
                    mine = stage.pool(stage.feature_table[f], sample["bags"][keys.index(f)].numpy())
                    if not np.array_equal(mine.view(np.uint32), pooled[f][s].numpy().view(np.uint32)):
                        raise SystemExit(f"stage check failed: {f}'s bag pooled as fma(scale, q, acc + bias) "
                                         "differs from QuantEmbeddingBagCollection's")
                for f in layout.candidate:
                    ids = sample["bags"][keys.index(f)].numpy()
                    if not np.array_equal(stage.pool(stage.feature_table[f], ids).view(np.uint32),
                                          stage.rows_of(stage.feature_table[f], ids)[0].view(np.uint32)):
                        raise SystemExit(f"stage check failed: {f}'s bag of one id pooled differs from its nobag row")
    log("the emulated stage's rows equal QuantEmbeddingCollection's and its bags QuantEmbeddingBagCollection's, "
        "bit for bit; a candidate's pooled bag of one id equals its nobag row, bit for bit")
