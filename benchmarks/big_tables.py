#!/usr/bin/env python3
"""The default DLRM at realistic table sizes, in both forms Narsil serves, on
the same weights: 26 INT8 tables of --rows rows each (80-byte rows in
FBGEMM's fused row-wise layout: 8.3 GB at 4M rows).

Writes, in --out:

  model_default.pt   the single-file TorchScript model: the default export
                     (models/generated/default/model_default.pt) with its
                     FBGEMM lookup's weights, rows per table and table offsets,
                     and its Narsil schema's rows, enlarged in place
  split/             the split form (benchmarks/tables_beyond_ram.py writes
                     it): schema, tables/, the default split dense network

Each table is the default model's table repeated, so row r holds the default
table's row r % 100000 in both forms: no FP32 weights are ever built, and the
default model's golden requests (ids below 100000) keep their golden scores.
The script checks that the default split tables are the single-file model's
own weights (so both forms start from the same bytes) and that the enlarged
single-file model still gives the golden scores, and the default model's
scores on ids drawn over all rows (taken modulo 100000 for the default); `--verify` also serves each
form with `narsil serve` and runs `narsil verify` against the golden requests.

Then compare them with TorchRec's C++ server on the same weights:
  .venv/bin/python benchmarks/torchrec_dlrm_compare.py --model OUT/model_default.pt \\
      --split-model OUT/split --table-rows ROWS --id-distribution uniform zipf:1.05

Run with the project venv: .venv/bin/python benchmarks/big_tables.py
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch

import fbgemm_gpu  # noqa: F401  (registers FBGEMM's operators)

from benchlib import DEFAULT_BINARY, ROOT, free_port, require_binary, wait_serving
from bf16_numerics import golden_inputs
from tables_beyond_ram import write_model

DEFAULT = os.path.join(ROOT, "models", "generated", "default")
LOOKUP = "fbgemm::int_nbit_split_embedding_codegen_lookup_function"
BOUNDS_CHECK = "fbgemm::bounds_check_indices"


def lookup_constants(predictor):
    """Names of the attributes the single FBGEMM lookup reads its weights and
    table offsets from, and the one the bounds check reads rows per table from."""
    graph = predictor.graph
    lookups = graph.findAllNodes(LOOKUP, recurse=True)
    checks = graph.findAllNodes(BOUNDS_CHECK, recurse=True)
    if len(lookups) != 1 or len(checks) != 1:
        raise SystemExit(f"expected one {LOOKUP} and one {BOUNDS_CHECK}, found {len(lookups)} and {len(checks)}")

    def attribute(value):
        node = value.node()
        if node.kind() != "prim::GetAttr":
            raise SystemExit(f"lookup input {value.debugName()} is not a module attribute")
        return node.s("name")

    lookup = list(lookups[0].inputs())
    # dev_weights, uvm_weights, weights_placements, weights_offsets, ...
    return attribute(lookup[0]), attribute(lookup[3]), attribute(list(checks[0].inputs())[0])


def enlarge(model, split_source, rows):
    """Enlarges the model's tables in place to `rows` rows each; returns the bytes."""
    predictor = model.predictor
    weights_name, offsets_name, rows_name = lookup_constants(predictor)
    weights = getattr(predictor, weights_name)
    old_rows = getattr(predictor, rows_name)
    offsets = getattr(predictor, offsets_name)
    schema = json.load(open(os.path.join(split_source, "schema.json")))
    tables = schema["tables"]
    if len(tables) != len(old_rows):
        raise SystemExit(f"split model has {len(tables)} tables, the single-file model {len(old_rows)}")
    big = torch.empty(sum(rows * t["row_bytes"] for t in tables), dtype=torch.uint8)
    new_offsets = torch.empty_like(offsets)
    at = 0
    for i, table in enumerate(tables):
        row_bytes, source_rows = table["row_bytes"], int(old_rows[i])
        source = weights[int(offsets[i]):int(offsets[i]) + source_rows * row_bytes]
        on_disk = torch.frombuffer(bytearray(open(os.path.join(split_source, table["file"]), "rb").read()),
                                   dtype=torch.uint8)
        if not torch.equal(source, on_disk):
            raise SystemExit(f"{table['file']} is not the single-file model's table {i}: export both from "
                             "the same weights (models/export_dlrm.py --split)")
        new_offsets[i] = at
        size = rows * row_bytes
        for start in range(0, size, source.numel()):
            n = min(source.numel(), size - start)
            big[at + start:at + start + n] = source[:n]
        at += size
    setattr(predictor, weights_name, big)
    setattr(predictor, offsets_name, new_offsets)
    setattr(predictor, rows_name, torch.full_like(old_rows, rows))
    served = json.loads(model.schema_json)  # what Narsil checks ids against
    for feature in served["sparse"]:
        feature["num_rows"] = rows
    model.schema_json = json.dumps(served)
    return big.numel()


def check_scores(model, source, golden, rows, tolerance=1e-5):
    """The enlarged model's scores: the golden ones on the golden requests,
    and the source model's on ids over all `rows` (row r is row r % the
    source's rows). Returns the largest difference."""
    worst = 0.0
    num_sparse = len(golden["schema"]["sparse"])
    with torch.inference_mode():
        for i, request in enumerate(golden["requests"]):
            got = model(*golden_inputs(request, num_sparse))
            diff = (got - torch.tensor(request["scores_int8"])).abs().max().item()
            if not diff <= tolerance:
                raise SystemExit(f"enlarged model: golden request {i} differs by {diff}")
            worst = max(worst, diff)
        source_rows = json.loads(source.schema_json)["sparse"][0]["num_rows"]
        generator = torch.Generator().manual_seed(0)
        dense = torch.randn(64, golden["schema"]["num_dense"], generator=generator)
        lengths = torch.ones(64 * num_sparse, dtype=torch.int64)
        ids = torch.randint(0, rows, (64 * num_sparse,), generator=generator)
        diff = (model(dense, lengths, ids) - source(dense, lengths, ids % source_rows)).abs().max().item()
        if not diff <= tolerance:
            raise SystemExit(f"enlarged model: ids up to {rows} differ from the source's rows by {diff}")
    return max(worst, diff)


def verify_served(binary, model, extra):
    """Serves `model` with narsil and checks every golden request over gRPC."""
    addr = f"127.0.0.1:{free_port()}"
    server = subprocess.Popen([binary, "serve", "--log-level", "warn", "--backend", "torch", "--model", model,
                               "--addr", addr, "--metrics-addr", f"127.0.0.1:{free_port()}"] + extra,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_serving(binary, addr, server, timeout=600)
        subprocess.run([binary, "verify", "--addr", f"http://{addr}", "--golden", DEFAULT, "--scores", "int8"],
                       check=True)
    finally:
        server.terminate()
        server.wait(timeout=60)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4_000_000, help="rows per table")
    p.add_argument("--out", default="/var/tmp/narsil-big-tables", help="where both forms are written (on disk)")
    p.add_argument("--verify", action="store_true", help="also serve each form and run narsil verify")
    p.add_argument("--binary", default=DEFAULT_BINARY)
    args = p.parse_args()
    source_model = os.path.join(DEFAULT, "model_default.pt")
    split_source = os.path.join(DEFAULT, "split")
    for needed in (source_model, os.path.join(split_source, "schema.json")):
        if not os.path.exists(needed):
            raise SystemExit(f"{needed} not found: models/export_dlrm.py --out {DEFAULT} --split")
    os.makedirs(args.out, exist_ok=True)
    single = os.path.join(args.out, "model_default.pt")
    started = time.time()
    if not os.path.exists(single) or os.path.getmtime(single) < os.path.getmtime(source_model):
        print(f"enlarging {source_model} to {args.rows:,} rows per table", file=sys.stderr, flush=True)
        model = torch.jit.load(source_model)
        total = enlarge(model, split_source, args.rows)
        golden = json.load(open(os.path.join(DEFAULT, "golden.json")))
        worst = check_scores(model, torch.jit.load(source_model), golden, args.rows)
        print(f"  golden scores, and the source's on ids up to {args.rows:,}, within {worst:.1e}; "
              f"writing {total / 1e9:.1f} GB", file=sys.stderr, flush=True)
        model.save(single + ".partial")
        os.rename(single + ".partial", single)
        del model
    print(f"writing the split form to {args.out}/split", file=sys.stderr, flush=True)
    total, _ = write_model(split_source, os.path.join(args.out, "split"), args.rows)
    print(json.dumps({"rows_per_table": args.rows, "table_bytes": total, "single_file": single,
                      "split": os.path.join(args.out, "split"), "written_s": round(time.time() - started, 1)}))
    if args.verify:
        require_binary(args.binary, "--features torch")
        verify_served(args.binary, single, [])
        verify_served(args.binary, os.path.join(args.out, "split"), ["--table-store", "memory"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
