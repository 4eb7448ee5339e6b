"""The compare script's GR rows (benchmarks/torchrec_dlrm_compare.py
--gr-eager SET): a generative-recommenders DlrmHSTU checkpoint served by
GR's own eager forward (benchmarks/baselines/gr_eager_server.py: its
PyTorch path, one request at a time, the same threads) beside Narsil
serving its import (models/import_gr.py), grouped with users fused and
flat, all driven by the same `narsil load` requests.

Before each GR-model row is loaded, `narsil verify` sends the import's
golden requests (GR's own alone scores of the first task, golden.json) to its server, so a
row whose server does not give GR's scores stops the run; the largest
difference goes in the row. The GR server answers ModelInfo with what
Narsil answered for the import (saved from the first Narsil row), so the
load generator builds the same requests for both.
"""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER = os.path.join(ROOT, "benchmarks", "baselines", "gr_eager_server.py")
MODEL_INFO_METHOD = "/narsil.v1.Predictor/ModelInfo"
# The Narsil rows' memory bound: the import declares the working set of its .pt2 form (every block pair at once),
# ~110 MiB for a 1,024-position history, charged from admission, so 16 such requests in flight need ~1.8 GiB; under
# the default 256 MiB most of them would be refused with RESOURCE_EXHAUSTED (docs/guide/gr-models.md#memory).
NARSIL_FLAGS = ["--max-queue-bytes", str(4 << 30)]


def check_args(args) -> None:
    """--gr-eager's requirements, checked before any server starts."""
    if args.candidates <= 0:
        raise SystemExit("--gr-eager needs --candidates N (the GR rows are ranking rows)")
    if not os.environ.get("GR_CHECKOUT"):
        raise SystemExit("--gr-eager: set GR_CHECKOUT to a generative-recommenders checkout (models/gr/README.md)")
    args.gr_checkpoint = args.gr_checkpoint or os.path.join(ROOT, "models", "generated", "gr", args.gr_eager,
                                                            "checkpoint")
    for needed in (args.gr_checkpoint, os.path.join(args.ranking_model, "golden.json")):
        if not os.path.exists(needed):
            raise SystemExit(f"--gr-eager: {needed} not found (models/gr/README.md: writing and importing a "
                             "benchmark checkpoint)")
    with open(os.path.join(args.ranking_model, "golden.json")) as f:
        args.gr_task = next(iter(json.load(f)["requests"][0]["outputs"]))  # the first task's scores are checked
    args.gr_model_info = args.out + ".gr_model_info.bin"
    if os.path.exists(args.gr_model_info):
        os.remove(args.gr_model_info)


def eager_server(args, cores, python):
    """(name, command builder taking the address, `narsil load` flags) of GR's eager server."""
    def command(addr):
        return [python, SERVER, "--set", args.gr_eager, "--checkpoint", args.gr_checkpoint,
                "--model-info", args.gr_model_info, "--intra-op-threads", str(cores), "--addr", addr]
    return "GR eager fp32", command, ["--protocol", "narsil", "--ranking-form", "grouped"]


def before_load(args, name, addr, binary, precision_bound) -> dict:
    """For a GR-model row: keeps Narsil's ModelInfo for the GR server (once)
    and checks the server against GR's golden scores; the row's fields."""
    if name.startswith("Narsil") and not os.path.exists(args.gr_model_info):
        import grpc

        with grpc.insecure_channel(addr) as channel:
            info = channel.unary_unary(MODEL_INFO_METHOD)(b"", timeout=30)
        with open(args.gr_model_info, "wb") as f:
            f.write(info)
    golden = os.path.join(args.ranking_model, "golden.json")
    out = subprocess.run([binary, "verify", "--addr", f"http://{addr}", "--golden", golden, "--scores", args.gr_task,
                          "--tolerance", str(precision_bound), "--wait-secs", "30"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{name} does not give GR's golden scores:\n{(out.stdout + out.stderr)[-2000:]}")
    worst = re.search(r"max \|diff\| ([0-9.e+-]+)", out.stdout + out.stderr)
    diff = float(worst.group(1)) if worst else None
    print(f"    GR golden scores: within {diff:.1e}", file=sys.stderr, flush=True)
    return {"max_abs_diff_vs_gr_golden": diff}
