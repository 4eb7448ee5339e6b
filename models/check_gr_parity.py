#!/usr/bin/env python3
"""Checks an imported GR model (models/import_gr.py) against GR's own
golden scores (models/testdata/gr/<set>/golden.json, written by GR's
forward: GR_INTERFACE section 4), per candidate and task, feeding the
exported network exactly what Narsil's stage gives it.

  .venv/bin/python models/check_gr_parity.py OUT_DIR GOLDEN_JSON [--bound 1e-5] [--fused-bound 1e-6]

Each golden user is one grouped request (its contexts and history in the
request block, one row per candidate). `stage_inputs` builds the dense
network's inputs as the stage does (docs/guide/gr-models.md): table rows by
id (FP32 rows as stored; INT8 rows dequantized `fma(scale, q, bias)`),
contextual features pooled (the sum of their ids' rows, zeros for none),
the history's channels in the sequence's order (looked-up rows side by
side, raw channels as int64), cut to the sequence's `max_len` (the last
kept), one unit per user with `unit_rows` its candidates, raw candidate
features one per row. The checks, per golden case of the model's clamp
(import.json):

  * alone: each user in a forward of its own, against `scores_alone`;
  * fused: every user of the case in one forward, against the same user
    alone (Narsil's scores do not depend on who shares a forward; GR's
    `scores_in_batch` do, and are reported, not checked).

`check_model` is written to be mirrored by a test over gRPC: the same
users, each a grouped request, the same bounds.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch

BOUND = 1e-5
FUSED_BOUND = 1e-6


class Model:
    """An imported GR model: its schema, tables (as the stage reads them)
    and dense network."""

    def __init__(self, schema: dict, tables: Dict[str, np.ndarray], network, dtype: torch.dtype = torch.float32,
                 clamp=None) -> None:
        self.schema, self.tables, self.network, self.dtype, self.clamp = schema, tables, network, dtype, clamp
        self.features = {f["name"]: f for f in self.schema["features"]}
        self.sequence = self.schema["sequences"][0]
        channels = set(self.sequence["features"])
        self.pooled = [f["name"] for f in self.schema["features"] if f["pooling"] == "sum"]
        self.raw = [f["name"] for f in self.schema["features"] if f["pooling"] == "raw" and f["name"] not in channels]
        self.lookups = [f for f in self.sequence["features"] if self.features[f]["pooling"] == "none"]
        self.raw_channels = [f for f in self.sequence["features"] if self.features[f]["pooling"] == "raw"]
        self.request_level = set(self.schema.get("request_level", []))

    @classmethod
    def load(cls, out: Path, dtype: torch.dtype = torch.float32, package: bool = False) -> "Model":
        """The imported model in `out`: its dense.pt, cast to `dtype` as
        Narsil's --dense-precision does, or with `package` its dense.pt2."""
        schema = json.loads((out / "schema.json").read_text())
        clamp = json.loads((out / "import.json").read_text())["clamp"] if (out / "import.json").exists() else None
        if package:
            from dense_packages import load_unlinked_package
            network = load_unlinked_package(str(out / schema["dense_package"]))
        else:
            network = torch.jit.load(str(out / schema["dense_network"])).eval()
            if dtype != torch.float32:
                network = network.to(dtype)
        return cls(schema, {t["name"]: cls.table(out, t) for t in schema["tables"]}, network, dtype, clamp)

    @staticmethod
    def table(out: Path, table: dict) -> np.ndarray:
        """`[rows, dim]` FP32 rows as the stage yields them."""
        data = np.fromfile(out / table["file"], dtype=np.uint8).reshape(table["rows"], table["row_bytes"])
        dim = table["dim"]
        if table["storage"] == "fp32":
            return data.view(np.float32)[:, :dim]
        if table["storage"] == "int8_rowwise":
            scale = data[:, 0:2].copy().view(np.float16).astype(np.float64)
            bias = data[:, 2:4].copy().view(np.float16).astype(np.float64)
            # fma(scale, q, bias) in FP32: the product is exact in float64, one rounding.
            return (data[:, 4:4 + dim].astype(np.float64) * scale + bias).astype(np.float32)
        raise SystemExit(f"table {table['name']}: storage {table['storage']} not read here")

    def rows(self, feature: str, ids: List[int]) -> np.ndarray:
        table = self.tables[self.features[feature]["table"]]
        return table[np.asarray(ids, dtype=np.int64)].reshape(len(ids), table.shape[1])

    def stage_inputs(self, users: List[dict]) -> tuple:
        """The dense network's inputs for `users` fused in one forward, each
        its own grouped request (module docstring)."""
        pooled, raw, values, raw_channels, lengths, row_unit, unit_rows, unit_raw = [], [], [], [], [], [], [], []
        max_len, keep = self.sequence["max_len"], self.sequence.get("keep", "last")
        for u, user in enumerate(users):
            uih, candidates = user["uih"], user["candidates"]
            length = len(uih[self.sequence["features"][0]])
            kept = slice(max(length - max_len, 0), length) if keep == "last" else slice(0, min(length, max_len))
            n = min(length, max_len)
            cols = [self.rows(f, uih[f][kept]) for f in self.lookups]
            values.append(np.concatenate(cols, axis=1) if cols else np.zeros((n, 0), np.float32))
            raw_channels.append(np.array([uih[f][kept] for f in self.raw_channels], dtype=np.int64).T.reshape(
                n, len(self.raw_channels)))
            lengths.append(n)
            count = len(candidates[next(iter(candidates))])
            for r in range(count):
                block = []
                for f in self.pooled:
                    ids = uih.get(f, []) if f in self.request_level else candidates[f][r:r + 1]
                    block.append(self.rows(f, ids).sum(axis=0, dtype=np.float32) if ids
                                 else np.zeros(self.tables[self.features[f]["table"]].shape[1], np.float32))
                pooled.append(np.concatenate(block))
                raw.append([candidates[f][r] for f in self.raw])
                row_unit.append(u)
            unit_rows.append(count)
            unit_raw.append(raw[-1])  # the request's last candidate's
        cast = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.dtype)  # noqa: E731
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        return (torch.zeros(len(row_unit), 0, dtype=self.dtype), cast(np.stack(pooled)),
                cast(np.concatenate(values)), torch.from_numpy(offsets), torch.tensor(row_unit, dtype=torch.int64),
                torch.from_numpy(np.ascontiguousarray(np.concatenate(raw_channels))),
                torch.tensor(unit_rows, dtype=torch.int64),
                torch.tensor(unit_raw, dtype=torch.int64).reshape(-1, len(self.raw)),
                torch.tensor(raw, dtype=torch.int64).reshape(-1, len(self.raw)))

    def scores(self, users: List[dict]) -> torch.Tensor:
        """`[tasks, candidates of every user]`, FP32."""
        with torch.inference_mode():
            return self.network(*self.stage_inputs(users)).float().reshape(len(self.schema["outputs"]), -1)


def expected(user: dict, key: str, tasks: List[str]) -> torch.Tensor:
    return torch.tensor([user[key][t] for t in tasks], dtype=torch.float32)


def check_model(model: Model, cases: List[dict], bound: float = BOUND, fused_bound: float = FUSED_BOUND,
                log=print) -> Dict[str, float]:
    """The checks of the module docstring on `cases`; returns the largest
    differences (alone vs GR alone, fused vs alone, GR in batch vs GR
    alone). Raises SystemExit naming the case, user, task and candidate of
    the first difference over its bound."""
    tasks = model.schema["outputs"]
    worst = {"alone": 0.0, "fused": 0.0, "gr_batch_vs_alone": 0.0}
    for c, case in enumerate(cases):
        alone = []
        for u, user in enumerate(case["users"]):
            mine, theirs = model.scores([user]), expected(user, "scores_alone", tasks)
            diff = (mine - theirs).abs()
            if not diff.max().item() <= bound:
                t, k = divmod(int(diff.argmax()), diff.shape[1])
                raise SystemExit(f"case {c} user {u} task {tasks[t]} candidate {k}: {mine[t, k].item():.8f}, GR "
                                 f"alone {theirs[t, k].item():.8f} (|diff| {diff.max().item():.2e} > {bound:g})")
            worst["alone"] = max(worst["alone"], diff.max().item())
            alone.append(mine)
            if "scores_in_batch" in user:
                worst["gr_batch_vs_alone"] = max(worst["gr_batch_vs_alone"], (
                    expected(user, "scores_in_batch", tasks) - theirs).abs().max().item())
        fused = model.scores(case["users"])
        diff = (fused - torch.cat(alone, dim=1)).abs().max().item()
        if not diff <= fused_bound:
            raise SystemExit(f"case {c}: its {len(case['users'])} users fused differ from alone by {diff:.2e} "
                             f"(> {fused_bound:g})")
        worst["fused"] = max(worst["fused"], diff)
    log(f"{len(cases)} cases, {sum(len(c['users']) for c in cases)} users: alone within {worst['alone']:.1e} of "
        f"GR alone, fused within {worst['fused']:.1e} of alone (GR's own in-batch scores differ from its alone "
        f"ones by up to {worst['gr_batch_vs_alone']:.1e})")
    return worst


def cases_for(golden: dict, clamp: str) -> List[dict]:
    """The golden cases of `clamp` (`{"clamp": {clamp: [cases]}}`)."""
    cases = golden.get("clamp", {}).get(clamp)
    if not cases:
        raise SystemExit(f"the golden file has no cases for clamp {clamp!r} (has: {sorted(golden.get('clamp', {}))})")
    return cases


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="the imported model (import_gr.py's OUT_DIR)")
    p.add_argument("golden", type=Path, help="GR's golden.json")
    p.add_argument("--clamp", default=None, help="the golden cases' clamp (default: the import's)")
    p.add_argument("--bound", type=float, default=BOUND)
    p.add_argument("--fused-bound", type=float, default=FUSED_BOUND)
    p.add_argument("--bf16", action="store_true", help="run dense.pt in bf16 (reports the bound, checks none)")
    p.add_argument("--pt2", action="store_true", help="run the import's dense.pt2 instead of dense.pt")
    args = p.parse_args()
    model = Model.load(args.out, torch.bfloat16 if args.bf16 else torch.float32, package=args.pt2)
    clamp = args.clamp or model.clamp
    cases = cases_for(json.loads(args.golden.read_text()), clamp)
    if args.bf16:
        worst = check_model(model, cases, bound=float("inf"), fused_bound=float("inf"))
        print(json.dumps({"clamp": clamp, "bf16": worst}))
        return 0
    worst = check_model(model, cases, args.bound, args.fused_bound)
    print(json.dumps({"clamp": clamp, **worst}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
