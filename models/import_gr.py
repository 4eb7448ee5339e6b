#!/usr/bin/env python3
"""Imports a generative-recommenders (GR) `DlrmHSTU` checkpoint into a
Narsil split model (docs/guide/gr-models.md).

  .venv/bin/python models/import_gr.py CHECKPOINT_DIR HPARAMS_JSON OUT_DIR \\
      [--clamp pytorch|triton] [--int8] [--bf16] [--pt2] [--block 64] [--golden GR_GOLDEN_JSON] [--force]

CHECKPOINT_DIR is what GR's `save_dmp_checkpoint` writes (dlrm_v3/
checkpoint.py): the embedding tables as a torch.distributed.checkpoint
under `sparse/`, every other weight in `non_sparse.ckpt`'s `dense_dict`
(read with torch's own readers; GR is not imported). A folder holding one
such checkpoint per batch index (`CHECKPOINT_DIR/<batch>/`) is read at its
highest batch. HPARAMS_JSON holds GR's hyperparameters as a GR user has
them from dlrm_v3/configs.py with their overrides: `{"hstu_config":
{DlrmHSTUConfig fields}, "tables": [{"name", "num_embeddings",
"embedding_dim", "data_type", "feature_names"}, ...]}`.

Writes OUT_DIR, a split model (models/split_model.py's format
`narsil-split-1`):

  schema.json   features under GR's KJT names: the contextual features
                (request-level, pooled sum of their one id), the candidate
                features (embedded ones pooled sum, the others raw integer
                inputs, one per row), the history `uih` (one request-level
                sequence of GR's uih features: embedded ones looked up,
                the others raw channels; `request_rows`); one output per
                GR task, named by task
  tables/T.bin  every GR table, FP32 (FP16 rows widened exactly) or, with
                --int8, FBGEMM's row-wise INT8
  dense.pt      models/gr_model.py's GrDenseNetwork, TorchScript, its
                time-bucket clamp fixed (--clamp; default pytorch); with
                --bf16 its weights bf16 (arithmetic bf16, scores FP32)
  dense.pt2     with --pt2: the same network compiled by AOTInductor (FP32),
                kept only where it scores within 1e-5 of the network
  import.json   what was imported: the checkpoint, hparams, clamp, options
  golden.json   with --golden (GR's golden file, models/gr/make_gr_golden.py's):
                `narsil verify`'s golden requests: each user of the clamp's
                cases a ranking request (contexts and history once, in the
                request block), expecting GR's alone scores per task
                (`verify_golden`)
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from check_gr_parity import cases_for
from export_common import logger
from gr_checkpoint import checkpoint_dir, read_dense, write_tables
from gr_model import CLAMPS, DEFAULT_CLAMP, GROUP_TOKENS, GrDenseNetwork, GrLayout
from split_model import SPLIT_FORMAT

log = logger("import_gr")

# Raised when what is written changes: scripts/lib.sh's import_gr_model re-imports older ones.
IMPORT_FORMAT = 8
SEQUENCE = "uih"


def task_type(task: dict) -> int:
    """GR's MultitaskTaskType as its value (0 binary, 1 regression)."""
    kind = task["task_type"]
    if isinstance(kind, str):
        kind = {"BINARY_CLASSIFICATION": 0, "REGRESSION": 1}.get(kind.split(".")[-1], kind)
    if kind not in (0, 1):
        raise SystemExit(f"task {task.get('task_name')}: unknown task_type {task['task_type']!r}")
    return kind


class Plan:
    """How GR's inputs map onto Narsil's (GR_INTERFACE section 3): the
    schema's features in order, the sequence's channels, and the network's
    column layout."""

    def __init__(self, config: dict, tables: List[dict], additional_inputs: int = -1) -> None:
        """`additional_inputs`: the checkpoint's additional-embedding MLP's
        input width, where known (-1: not checked)."""
        self.config = config
        table_of = {f: t["name"] for t in tables for f in t["feature_names"]}
        self.table_of = table_of
        dims = {t["embedding_dim"] for t in tables}
        e = config["hstu_embedding_table_dim"]
        if dims != {e}:
            raise SystemExit(f"tables of dims {sorted(dims)}: GR's DlrmHSTU reads every table at "
                             f"hstu_embedding_table_dim ({e})")
        contextual = dict(config.get("contextual_feature_to_max_length") or {})
        longer = {f: n for f, n in contextual.items() if n != 1}
        if longer:
            raise SystemExit(f"contextual features of max length other than 1 ({longer}): Narsil serves each "
                             "contextual feature as one pooled id")
        self.contexts = list(contextual)
        uih = [f for f in config["hstu_uih_feature_names"] if f not in contextual]
        self.candidates = list(config["hstu_candidate_feature_names"])
        self.channels = uih
        missing = [f for f in self.contexts if f not in table_of]
        if missing:
            raise SystemExit(f"contextual features {missing} have no table")
        # Feature order: contexts, candidate features, the history's channels.
        self.pooled = self.contexts + [f for f in self.candidates if f in table_of]
        self.raw = [f for f in self.candidates if f not in table_of]
        self.lookups = [f for f in uih if f in table_of]
        self.raw_channels = [f for f in uih if f not in table_of]
        post = config["uih_post_id_feature_name"]
        mapping = {u: c for u, c in config["merge_uih_candidate_feature_mapping"]}
        items = list(config["item_embedding_feature_names"])
        users = list(config["user_embedding_feature_names"])
        # GR's additional embeddings: uih features embedded (user side) whose candidate
        # counterpart is an item feature, the post id excepted.
        additional = [u for u, c in config["merge_uih_candidate_feature_mapping"]
                      if c in items and u in users and u != post]
        if additional_inputs >= 0 and additional_inputs != len(additional) * e:
            # GR leaves the post id out with `is not` (identity): a config whose strings are not the
            # interned literals of GR's configs.py keeps it. The checkpoint's MLP says which GR built.
            with_post = [u for u, c in config["merge_uih_candidate_feature_mapping"] if c in items and u in users]
            if additional_inputs != len(with_post) * e:
                raise SystemExit(f"the checkpoint's additional-embedding MLP takes {additional_inputs} inputs; "
                                 f"the hparams give {additional} ({len(additional) * e})")
            additional = with_post
        for feature in [post] + additional:
            if feature not in self.lookups or mapping.get(feature) not in self.pooled:
                raise SystemExit(f"{feature}: GR embeds it in the history and as {mapping.get(feature)} for "
                                 "candidates; both need a table")
        for name in (config["uih_action_time_feature_name"],):
            if name not in self.raw_channels:
                raise SystemExit(f"the history's time feature {name} is not a raw uih feature")
        query_time = config["candidates_querytime_feature_name"]
        if query_time not in self.raw:
            raise SystemExit(f"the candidates' query time {query_time} is not a raw candidate feature")
        action = config.get("uih_weight_feature_name") or ""
        if config.get("action_weights") and action not in self.raw_channels:
            raise SystemExit(f"the history's action feature {action!r} is not a raw uih feature")
        missing = [f for f in items if f not in self.pooled]
        if missing:
            raise SystemExit(f"item features {missing} are not embedded candidate features")
        self.layout = GrLayout(
            table_dim=e,
            contexts=[self.pooled.index(f) * e for f in self.contexts],
            context_min_lengths=[int((config.get("contextual_feature_to_min_uih_length") or {}).get(f, 0))
                                 for f in self.contexts],
            candidate_post=self.pooled.index(mapping[post]) * e,
            candidate_additional=[self.pooled.index(mapping[f]) * e for f in additional],
            item_columns=[self.pooled.index(f) * e for f in items],
            history_post=self.lookups.index(post) * e,
            history_additional=[self.lookups.index(f) * e for f in additional],
            action_raw=self.raw_channels.index(action) if config.get("action_weights") else -1,
            time_raw=self.raw_channels.index(config["uih_action_time_feature_name"]),
            query_time_raw=self.raw.index(query_time))
        self.tasks = [t["task_name"] for t in config["multitask_configs"]]

    def features(self) -> List[dict]:
        """schema.json's `features`, in order."""
        def feature(name: str, pooling: str) -> dict:
            if name in self.table_of:
                return {"name": name, "table": self.table_of[name], "pooling": pooling, "weighted": False}
            return {"name": name, "pooling": "raw"}
        return [feature(f, "sum") for f in self.contexts + self.candidates] \
            + [feature(f, "none") for f in self.channels]


def working_set(config: dict, contexts: int, block: int, kind: str = "unit_attention") -> dict:
    """GrDenseNetwork's working set with conservative sizes (the wider of
    the value and key heads, the widest per-token state: the model dim or
    the preprocessor's hidden layer): `unit_attention` for `dense.pt`
    (`attend_units`: one unit's query block at a time, units in groups of
    GROUP_TOKENS), `block_attention` for the `.pt2` (every block pair of
    every unit at once, as HstuDenseNetwork attends)."""
    declared = {"kind": kind, "block": block, "heads": config["hstu_num_heads"],
                "head_dim": max(config["hstu_attn_linear_dim"], config["hstu_attn_qk_dim"]), "contexts": contexts,
                "model_dim": max(config["hstu_transducer_embedding_dim"], config["hstu_preprocessor_hidden_dim"]),
                "bytes_per_value": 4}
    if kind == "unit_attention":
        declared["group_tokens"] = GROUP_TOKENS
    return declared


def normalized_config(config: dict) -> dict:
    """The hparams' `hstu_config` with GR's defaults (DlrmHSTUConfig) filled
    in where it leaves them out, task types as values."""
    defaults = {"max_seq_len": 16384, "hstu_num_heads": 1, "hstu_attn_linear_dim": 256, "hstu_attn_qk_dim": 128,
                "hstu_attn_num_layers": 12, "hstu_embedding_table_dim": 192, "hstu_preprocessor_hidden_dim": 256,
                "hstu_transducer_embedding_dim": 0, "hstu_group_norm": False, "action_weights": None,
                "enable_postprocessor": True, "use_layer_norm_postprocessor": False,
                "contextual_feature_to_max_length": {}, "contextual_feature_to_min_uih_length": {},
                "uih_weight_feature_name": ""}
    config = {**defaults, **config}
    if config["hstu_group_norm"]:
        raise SystemExit("hstu_group_norm: GR's group-norm STU layers are not implemented")
    config["multitask_configs"] = [{**t, "task_type": task_type(t)} for t in config["multitask_configs"]]
    kinds = [t["task_type"] for t in config["multitask_configs"]]
    if kinds != sorted(kinds) or not kinds:
        raise SystemExit("multitask_configs must be non-empty and sorted by task type (GR asserts it)")
    return config


def build_network(config: dict, plan: Plan, dense: Dict[str, torch.Tensor], clamp: str, block: int,
                  dtype: torch.dtype = torch.float32) -> GrDenseNetwork:
    """GrDenseNetwork with the checkpoint's weights, in eval mode."""
    network = GrDenseNetwork(config, plan.layout, clamp=clamp, block=block)
    network.load_gr(dense)
    return network.to(dtype).eval()


def schema_json(name: str, version: str, plan: Plan, tables: List[dict], config: dict, block: int) -> dict:
    return {
        "format": SPLIT_FORMAT, "name": name, "version": version, "num_dense": 0,
        "tables": tables,
        "features": plan.features(),
        "outputs": plan.tasks,
        "dense_network": "dense.pt",
        "request_level": plan.contexts + plan.channels,
        "sequences": [{"name": SEQUENCE, "features": plan.channels, "max_len": int(config["max_seq_len"]),
                       "keep": "last", "request_rows": True,
                       "working_set": working_set(config, len(plan.contexts), block)}],
    }


def example_inputs(plan: Plan, units: int = 3, seed: int = 0, history: int = 0, candidates: int = 0) -> tuple:
    """A small fused batch of the network's inputs (random rows, increasing
    times): for scripting checks and torch.export; with `history` and
    `candidates`, `units` units of that many positions and rows each."""
    g = torch.Generator().manual_seed(seed)
    e = plan.layout.table_dim
    lengths = torch.tensor([5, 0, 40][:units] + [7] * max(units - 3, 0))
    per_unit = torch.tensor([3, 1, 2][:units] + [2] * max(units - 3, 0)) * (1 + seed * 20)
    if history:
        lengths, per_unit = torch.full((units,), history), torch.full((units,), candidates)
    rows, positions = int(per_unit.sum()), int(lengths.sum())
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    # Rows of a unit not contiguous: the last unit's first row comes first.
    row_unit = torch.repeat_interleave(torch.arange(units), per_unit)
    row_unit = torch.cat([row_unit[-1:], row_unit[:-1]])
    raw_channels = torch.randint(0, 32, (positions, len(plan.raw_channels)), generator=g)
    raw_channels[:, plan.layout.time_raw] = 1_700_000_000 + torch.arange(positions) * 3600
    raw = torch.randint(0, 32, (rows, len(plan.raw)), generator=g)
    # Query times differ between a unit's rows (the unit's, `seq0_unit_raw`, is its request's last
    # row's: here its last row in the batch), seconds or milliseconds.
    scale = 1000 if seed % 2 else 1
    raw_channels[:, plan.layout.time_raw] *= scale
    raw[:, plan.layout.query_time_raw] = (1_700_000_000 + 3600 * positions
                                          + torch.randint(0, 30 * 86400, (rows,), generator=g)) * scale
    return (torch.zeros(rows, 0), torch.rand(rows, len(plan.pooled) * e, generator=g) * 2 - 1,
            torch.rand(positions, len(plan.lookups) * e, generator=g) * 2 - 1, offsets, row_unit, raw_channels,
            per_unit.clone(), raw.index_select(0, last_rows(row_unit, units)), raw)


def last_rows(row_unit: torch.Tensor, units: int) -> torch.Tensor:
    """Each unit's last row (every unit has one)."""
    rows = torch.arange(row_unit.numel())
    return torch.stack([rows[row_unit == u].max() for u in range(units)])


def write_package(out: Path, network: torch.nn.Module, plan: Plan) -> Optional[str]:
    """`network` compiled ahead of time into `out/dense.pt2`: torch.export
    with dynamic rows, positions (0 included), units (1 included) and the
    longest unit known at run time, then AOTInductor (FP32, this CPU's
    vector ISA without -march=native, kernels not linking libtorch, as
    models/sequence_split.py compiles HSTU's). Checked within 1e-5 of the
    network on batches of second and millisecond timestamps; a package
    over it is removed (None returned): a lowering of Inductor's that
    differs from eager PyTorch where GR's arithmetic is sensitive (the
    timestamp postprocessor's float floor division and remainder, written
    out in models/gr_model.py for that) would otherwise pass unnoticed."""
    import torch.fx.experimental._config as fx_config
    from torch._inductor import aoti_compile_and_package
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    from dense_packages import isa_cpu_flags, load_unlinked_package

    started = time.time()
    vec_isa = pick_vec_isa()
    flags = isa_cpu_flags(vec_isa.build_arch_flags())
    rows = torch.export.Dim("rows", min=1, max=1 << 20)
    positions = torch.export.Dim("positions", min=0, max=1 << 24)
    units = torch.export.Dim("units", min=1, max=1 << 20)
    offsets = units + 1
    example = example_inputs(plan)
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        program = torch.export.export(network, example, dynamic_shapes=(
            {0: rows}, {0: rows}, {0: positions}, {0: offsets}, {0: rows}, {0: positions}, {0: units}, {0: units},
            {0: rows}))
    with torch.no_grad():
        path = aoti_compile_and_package(program, package_path=str(out / "dense.pt2"), inductor_configs={
            "cpp.march": "",
            "aot_inductor.link_libtorch": False,
            "aot_inductor.metadata": {"narsil_cpu_flags": " ".join(flags), "narsil_vec_isa": str(vec_isa),
                                      "narsil_settings": "Inductor defaults", "narsil_links_libtorch": "false"},
        })
    package = load_unlinked_package(path)
    worst = 0.0
    with torch.inference_mode():
        for batch in (example_inputs(plan, 1, 1), example_inputs(plan, 5, 2), example_inputs(plan, 4, 3), example):
            worst = max(worst, (package(*batch) - network(*batch)).abs().max().item())
    if not worst <= 1e-5:
        (out / "dense.pt2").unlink()
        log(f"dense.pt2 not written: its scores are {worst:.1e} from the network's (over 1e-5); serve dense.pt")
        return None
    log(f"compiled dense.pt2 for {vec_isa} in {time.time() - started:.0f} s; within {worst:.1e} of the network")
    return "dense.pt2"


def form_timings(out: Path, plan: Plan) -> dict:
    """`dense_form_timings` (dense_packages.sequence_form_timings) on two
    ranking batches: one user of 512 positions and 64 candidates, four of
    256 positions and 32 candidates fused."""
    from dense_packages import load_unlinked_package, sequence_form_timings

    batches = [(example_inputs(plan, 1, 1, history=512, candidates=64), 64),
               (example_inputs(plan, 4, 2, history=256, candidates=32), 128)]
    return sequence_form_timings(out, load_unlinked_package(str(out / "dense.pt2")), batches, log)


def verify_golden(schema: dict, cases: List[dict]) -> dict:
    """`narsil verify`'s golden file (`{"requests": [...]}`) from GR's golden
    `cases` of one clamp: each user a ranking request (its contexts and
    history once in the request block, its candidates the rows, raw values
    as sent, no dense), expecting GR's `scores_alone` per task
    (`outputs`)."""
    request_level = set(schema["request_level"])
    block_features = [f["name"] for f in schema["features"] if f["name"] in request_level]
    row_features = [f["name"] for f in schema["features"] if f["name"] not in request_level]
    requests = []
    for case in cases:
        for user in case["users"]:
            rows = len(user["scores_alone"][schema["outputs"][0]])
            block = {"lengths": [len(user["uih"][name]) for name in block_features],
                     "ids": [v for name in block_features for v in user["uih"][name]]}
            requests.append({"batch_size": rows, "dense": [], "lengths": [1] * (rows * len(row_features)),
                             "ids": [user["candidates"][name][r] for r in range(rows) for name in row_features],
                             "request": block,
                             "outputs": {task: user["scores_alone"][task] for task in schema["outputs"]}})
    return {"requests": requests}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="GR's checkpoint folder (non_sparse.ckpt and sparse/)")
    p.add_argument("hparams", type=Path, help="JSON: {hstu_config: {...}, tables: [...]}")
    p.add_argument("out", type=Path, help="the split model to write")
    p.add_argument("--clamp", choices=CLAMPS, default=DEFAULT_CLAMP,
                   help="time-bucket clamp: pytorch (GR's PyTorch/CPU path: the model dim - 1, the default) or "
                        "triton (GR's GPU kernels: 2048)")
    p.add_argument("--int8", action="store_true", help="tables as FBGEMM row-wise INT8 (default: FP32, exact)")
    p.add_argument("--bf16", action="store_true", help="dense.pt's weights and arithmetic bf16 (scores FP32)")
    p.add_argument("--pt2", action="store_true", help="also compile dense.pt2 with AOTInductor (FP32)")
    p.add_argument("--block", type=int, default=64, help="the network's attention block (tokens)")
    p.add_argument("--name", default=None, help="model name (default: OUT_DIR's name)")
    p.add_argument("--version", default="1")
    p.add_argument("--golden", type=Path, default=None,
                   help="GR's golden.json: also write OUT_DIR/golden.json for narsil verify (verify_golden)")
    p.add_argument("--force", action="store_true", help="overwrite OUT_DIR")
    args = p.parse_args()
    if args.bf16 and args.pt2:
        p.error("--pt2 compiles the FP32 network; import without --bf16 for it")
    out: Path = args.out
    if out.exists() and not args.force:
        log(f"{out} exists; pass --force to overwrite")
        return 1
    started = time.time()
    path = checkpoint_dir(args.checkpoint)
    hparams = json.loads(args.hparams.read_text())
    config = normalized_config(hparams["hstu_config"])
    dense = read_dense(path)
    width = dense.get("_hstu_transducer._input_preprocessor._additional_embedding_mlp.0.weight")
    plan = Plan(config, hparams["tables"], -1 if width is None else width.shape[1])
    log(f"{path}: {len(dense)} dense tensors; {len(plan.contexts)} contextual features, "
        f"{len(plan.channels)} history features, {len(plan.candidates)} candidate features, tasks {plan.tasks}")
    shutil.rmtree(out, ignore_errors=True)
    (out / "tables").mkdir(parents=True)
    tables = write_tables(out, path, hparams["tables"], args.int8)
    network = build_network(config, plan, dense, args.clamp, args.block)
    scripted = torch.jit.script(network if not args.bf16 else network.to(torch.bfloat16))
    scripted.save(str(out / "dense.pt"))
    schema = schema_json(args.name or out.name, args.version, plan, tables, config, args.block)
    if args.pt2:
        package = write_package(out, build_network(config, plan, dense, args.clamp, args.block), plan)
        if package is not None:
            schema["dense_package"] = package
            schema["dense_form_timings"] = form_timings(out, plan)
            schema["sequences"][0]["package_working_set"] = working_set(
                config, len(plan.contexts), args.block, "block_attention")
    (out / "schema.json").write_text(json.dumps(schema, indent=2) + "\n")
    if args.golden is not None:
        golden = verify_golden(schema, cases_for(json.loads(args.golden.read_text()), args.clamp))
        (out / "golden.json").write_text(json.dumps(golden) + "\n")
        log(f"golden.json: {len(golden['requests'])} users (ranking requests) of {args.golden} ({args.clamp} clamp)")
    (out / "import.json").write_text(json.dumps({
        "import_format": IMPORT_FORMAT, "checkpoint": str(path), "hparams": str(args.hparams), "clamp": args.clamp,
        "int8": args.int8,
        "bf16": args.bf16, "block": args.block, "torch": torch.__version__}, indent=2) + "\n")
    log(f"wrote {out} in {time.time() - started:.1f} s (clamp {args.clamp}, tables "
        f"{'INT8' if args.int8 else 'FP32'}, dense {'bf16' if args.bf16 else 'FP32'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
