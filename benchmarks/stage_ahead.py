#!/usr/bin/env python3
"""A split model's embedding stage run one batch ahead (`--stage-ahead`) or
on the lane, served over gRPC, against its dense network alone.

For each id distribution and each server layout, `narsil serve` on a split
model is measured with and without `--stage-ahead` (closed loop, `narsil
load`, --concurrency callers, --samples per request):

  * 1 core: the server pinned to core 0 (one lane, one intra-op thread; with
    stage ahead the stage thread shares that core), the load generator on
    core 1.
  * 2 cores, 1 lane: the server on both cores, one lane (its dense network
    on one core while its stage thread pools on the other); the load
    generator unpinned (it shares the cores: noisier).
  * 2 cores, 2 lanes: both lanes and, with stage ahead, both stage threads
    on two cores; the load generator unpinned.

Then `narsil bench-forward` (core 0) times the forward at the mean fused
rows the served runs reached, whole and in its two parts: the stage alone
and the dense network alone with its pooled input given, on one thread.
"of dense alone" is served samples/s over that dense network's samples/s
times the server's cores: what hiding the stage entirely would reach (1.0)
if the dense network scaled with cores and nothing else ran on them.

Needs a release build with the torch feature and a split model, e.g.
  .venv/bin/python models/export_dlrm.py --out /tmp/bench/default --split --no-pt2
  .venv/bin/python benchmarks/stage_ahead.py --model /tmp/bench/default/split
"""

import argparse
import json
import os
import subprocess
import sys

from benchlib import DEFAULT_BINARY, free_port, machine, pinned, require_binary, wait_serving

# (name, server core or None, lanes, load generator core or None)
LAYOUTS = [("1 core", 0, 1, 1), ("2 cores, 1 lane", None, 1, None), ("2 cores, 2 lanes", None, 2, None)]
SERVER_CORES = {"1 core": 1, "2 cores, 1 lane": 2, "2 cores, 2 lanes": 2}


def serve_and_load(args, core, lanes, load_core, stage_ahead, ids):
    addr = f"127.0.0.1:{free_port()}"
    serve = [args.binary, "serve", "--addr", addr, "--backend", "torch", "--model", args.model,
             "--lanes", str(lanes), "--max-batch-requests", str(args.batch_size), "--log-level", "warn",
             "--table-store", args.table_store]
    serve += ["--max-forward-threads", "1"] if core is not None else []
    serve += ["--stage-ahead", "on" if stage_ahead else "off"]
    server = subprocess.Popen(pinned(serve, core), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_serving(args.binary, addr, server)
        load = [args.binary, "load", "--addr", f"http://{addr}", "--concurrency", str(args.concurrency),
                "--warmup", str(args.warmup), "--samples-per-request", str(args.samples),
                "--duration", str(args.duration), "--id-distribution", ids, "--json"]
        out = subprocess.run(pinned(load, load_core), capture_output=True, text=True, check=True)
        return json.loads(out.stdout)
    finally:
        server.terminate()
        server.wait(timeout=60)


def bench_forward(args, rows, ids):
    cmd = [args.binary, "bench-forward", "--backend", "torch", "--model", args.model, "--intra-op-threads", "1",
           "--rows", ",".join(map(str, rows)), "--request-samples", str(args.samples), "--seconds",
           str(args.bench_seconds), "--peak-seconds", "0", "--id-distribution", ids, "--table-store",
           args.table_store, "--log-level", "warn", "--json"]
    out = subprocess.run(pinned(cmd, 0), capture_output=True, text=True, check=True)
    return {r["rows"]: r for r in json.loads(out.stdout)["results"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", default=DEFAULT_BINARY)
    p.add_argument("--model", required=True, help="a split model's directory")
    p.add_argument("--table-store", default="memory")
    p.add_argument("--id-distribution", nargs="+", default=["uniform", "zipf:1.05"])
    p.add_argument("--layouts", nargs="+", type=int, default=list(range(len(LAYOUTS))),
                   help="indexes into: " + ", ".join(f"{i}: {l[0]}" for i, l in enumerate(LAYOUTS)))
    p.add_argument("--batch-size", type=int, default=16, help="most requests per fused forward")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--samples", type=int, default=100, help="samples per request")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of measured load")
    p.add_argument("--warmup", type=int, default=200, help="requests before measuring")
    p.add_argument("--bench-seconds", type=float, default=3.0, help="seconds per raw batch size")
    p.add_argument("--json-out", help="write the results to this file")
    args = p.parse_args()
    require_binary(args.binary, "--features torch")
    host = machine()
    print(f"# stage ahead: {args.model} ({args.table_store}), c{args.concurrency}, {args.samples} samples/request; "
          f"git {host['git_sha']}, {host['cpu']}, {host['cores']} cores")
    results = []
    for ids in args.id_distribution:
        served = []
        for index in args.layouts:
            name, core, lanes, load_core = LAYOUTS[index]
            for stage_ahead in (False, True):
                report = serve_and_load(args, core, lanes, load_core, stage_ahead, ids)
                served.append({"layout": name, "lanes": lanes, "stage_ahead": stage_ahead, "ids": ids,
                               "report": report})
        sizes = sorted({max(1, round(s["report"]["mean_forward_rows"])) for s in served})
        raw = bench_forward(args, sizes, ids)
        print(f"\n## ids {ids}\n")
        print("| layout | stage ahead | req/s | samples/s | p50 ms | p99 ms | rows per forward | "
              "stage ms | dense alone ms | of dense alone |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for s in served:
            r = s["report"]
            rows = max(1, round(r["mean_forward_rows"]))
            staged = raw[rows]["staged"]
            s["of_dense_alone"] = r["samples_per_s"] / (staged["rest_samples_per_s"] * SERVER_CORES[s["layout"]])
            s["raw"] = raw[rows]
            print(f"| {s['layout']} | {'on' if s['stage_ahead'] else 'off'} | {r['req_per_s']:.0f} | "
                  f"{r['samples_per_s']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {rows} | "
                  f"{staged['stage_ms']:.2f} | {staged['rest_ms']:.2f} | {s['of_dense_alone']:.2f} |")
        results += served
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({**host, "args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
