#!/usr/bin/env python3
"""Serving efficiency of a model backend (libtorch by default, or Burn).

1. Starts `narsil serve --backend B` (pinned to core 0) and times its cold
   start to the first successful Predict.
2. Drives it with `narsil load` (pinned to core 1): closed loop at
   --concurrency, --samples per request. Reads served samples/s, latency and
   the server-reported mean fused rows; reads the server's peak RSS.
3. Runs `narsil bench-forward` (core 0): the same model alone, in process, at
   100, 400, 1600, 3200 rows and at the measured mean rows per forward.
4. Serving efficiency = served samples/s / raw samples/s at the mean fused
   rows per forward (goal >= 0.9).

Efficiency splits into two factors, reported per run: "lane busy" (seconds
of forward per second, from the server's per-response forward times: how well
the engine keeps the lane fed) and "forward speed vs raw" (raw forward time
at that size over the served forward time: what serving costs the forward
itself, e.g. cache and core sharing with the network path).

With --repeat N, steps 1-3 run N times in turn and the table shows each run
and the median efficiency: on a shared VM single runs vary by +-10% or more.

Needs a release build with the torch feature and an exported model
(scripts/serve.sh does both).
"""

import argparse
import json
import os
import subprocess
import sys

from benchlib import DEFAULT_BINARY, ROOT, free_port, machine, peak_rss_mib, pinned, require_binary, wait_serving


def serve_and_load(args):
    addr = f"127.0.0.1:{free_port()}"
    serve = [args.binary, "serve", "--addr", addr, "--backend", args.backend, "--model", args.model,
             "--execution-mode", args.execution_mode, "--lanes", str(args.lanes),
             "--max-batch-requests", str(args.batch_size), "--batch-timeout-ms", str(args.batch_timeout_ms),
             "--intra-op-threads", str(args.intra_op_threads), "--log-level", "warn"]
    serve += ["--dense-precision", args.dense_precision] if args.backend == "torch" else []
    server = subprocess.Popen(pinned(serve, 0), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        cold_start_s = wait_serving(args.binary, addr, server)
        load = [args.binary, "load", "--addr", f"http://{addr}", "--concurrency", str(args.concurrency),
                "--warmup", str(args.warmup), "--samples-per-request", str(args.samples),
                "--duration", str(args.duration), "--json"]
        out = subprocess.run(pinned(load, 1), capture_output=True, text=True, check=True)
        report = json.loads(out.stdout)
        report["peak_rss_mib"] = peak_rss_mib(server.pid)
        report["cold_start_s"] = cold_start_s
        return report
    finally:
        server.terminate()
        server.wait(timeout=60)


def bench_forward(args, rows):
    cmd = [args.binary, "bench-forward", "--backend", args.backend, "--model", args.model,
           "--intra-op-threads", str(args.intra_op_threads), "--rows", ",".join(map(str, rows)),
           "--request-samples", str(args.samples), "--seconds", str(args.bench_seconds),
           "--peak-seconds", "0", "--log-level", "warn", "--json"]
    cmd += ["--dense-precision", args.dense_precision] if args.backend == "torch" else []
    out = subprocess.run(pinned(cmd, 0), capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", default=DEFAULT_BINARY)
    p.add_argument("--backend", default="torch", choices=["torch", "burn"])
    p.add_argument("--model", help="default: the exported default DLRM's model_default.pt (torch) "
                   "or weights_fp32.safetensors (burn)")
    p.add_argument("--dense-precision", default="fp32", choices=["fp32", "bf16"], help="torch only")
    p.add_argument("--execution-mode", default="batch", choices=["batch", "worker"])
    p.add_argument("--lanes", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16, help="most requests per fused forward")
    p.add_argument("--batch-timeout-ms", type=float, default=0.0)
    p.add_argument("--intra-op-threads", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--samples", type=int, default=100, help="samples per request")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of measured load")
    p.add_argument("--warmup", type=int, default=200, help="requests before measuring")
    p.add_argument("--bench-seconds", type=float, default=5.0, help="seconds per raw batch size")
    p.add_argument("--repeat", type=int, default=1, help="measure this many times, report each and the median")
    p.add_argument("--json-out", help="write the results to this file")
    args = p.parse_args()
    require_binary(args.binary, "--features torch")
    if args.model is None:
        name = "model_default.pt" if args.backend == "torch" else "weights_fp32.safetensors"
        args.model = os.path.join(ROOT, "models", "generated", "default", name)
    if not os.path.exists(args.model):
        raise SystemExit(f"{args.model} not found: run scripts/serve.sh or models/export_dlrm.py")

    host = machine()
    runs = []
    for _ in range(max(1, args.repeat)):
        served = serve_and_load(args)
        fused = max(1, round(served["mean_forward_rows"]))
        raw = bench_forward(args, sorted({100, 400, 1600, 3200, fused}))
        raw_at_fused = next(r for r in raw["results"] if r["rows"] == fused)
        runs.append({"served": served, "raw": raw,
                     "efficiency": served["samples_per_s"] / raw_at_fused["samples_per_s"],
                     # efficiency = busy x speed: how much of the time the lane
                     # computed, and how fast its forwards ran against raw ones.
                     "busy": served["forward_busy"],
                     "speed": raw_at_fused["mean_ms"] / served["mean_forward_ms"]})
    efficiencies = sorted(r["efficiency"] for r in runs)
    median = efficiencies[len(efficiencies) // 2]

    print(f"# serving efficiency: {args.backend} {os.path.basename(args.model)}, {args.execution_mode} mode, "
          f"{args.lanes} lane(s), {args.intra_op_threads} intra-op thread(s), concurrency {args.concurrency}, "
          f"{args.samples} samples/request; git {host['git_sha']}, {host['cpu']}, {host['cores']} cores")
    print("\nraw forward (narsil bench-forward, in process, one lane thread), samples/s per run:\n")
    sizes = sorted({r["rows"] for run in runs for r in run["raw"]["results"]})
    print("| run | " + " | ".join(f"{n} rows" for n in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for i, run in enumerate(runs):
        by_rows = {r["rows"]: r["samples_per_s"] for r in run["raw"]["results"]}
        print(f"| {i + 1} | " + " | ".join(f"{by_rows[n]:.0f}" if n in by_rows else "" for n in sizes) + " |")
    print("\nserved (narsil load over gRPC):\n")
    print("| run | req/s | samples/s | p50 ms | p99 ms | rows per forward | mean forward ms | "
          "efficiency | lane busy | forward speed vs raw | peak RSS MiB | cold start s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, run in enumerate(runs):
        served = run["served"]
        print(f"| {i + 1} | {served['req_per_s']:.1f} | {served['samples_per_s']:.0f} | {served['p50_ms']:.2f} | "
              f"{served['p99_ms']:.2f} | {served['mean_forward_rows']:.0f} | {served['mean_forward_ms']:.2f} | "
              f"{run['efficiency']:.3f} | {run['busy']:.3f} | {run['speed']:.3f} | {served['peak_rss_mib']:.0f} | "
              f"{served['cold_start_s']:.2f} |")
    print(f"\nmedian efficiency over {len(runs)} run(s): {median:.3f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({**host, "args": vars(args), "runs": runs, "median_efficiency": median}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
