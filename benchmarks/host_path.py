#!/usr/bin/env python3
"""The host path's cost and scaling: the zero-cost mock under closed-loop load.

Starts `narsil serve --backend mock --mock-latency-ms 0` (a forward that
computes the mock's scores and sleeps nothing) in batch mode and in worker
mode, drives it with `narsil load` at each concurrency and samples per
request, and reports per case:

* req/s and latency (p50, p99) as `narsil load` measured them;
* server CPU per request: the server process's user + system CPU time
  (`/proc/PID/stat`) over the load run, divided by the requests answered;
* busy cores: that CPU time divided by the run's wall time (how many cores
  the server kept busy: a host path that serialises stays near a few
  however many cores it has);
* where the server's CPU went, by thread group (`/proc/PID/task/*/stat`:
  tokio workers, lanes, the rest), in cores busy;
* the load generator's own busy cores (if it saturates its cores, the
  server is not the limit).

Server and load generator run on disjoint cores (`taskset`): by default the
first three quarters of the machine's cores for the server (core 0 alone
on a 2-core machine) and the rest for the load. `--runtime-threads` sets
the server's tokio workers (`TOKIO_WORKER_THREADS`), so contention among
many workers can be provoked even on few cores.

Standard library only; needs a release build (`cargo build --release`).
"""

import argparse
import json
import os
import subprocess
import sys
import time

from benchlib import DEFAULT_BINARY, free_port, machine, require_binary, wait_serving

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    """User + system CPU time of a process so far, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def thread_group(name):
    if name.startswith("tokio-r"):
        return "tokio"
    if name.startswith("narsil-lane") or name.startswith("narsil-stage"):
        return "lanes"
    return "other"


def threads_cpu(pid):
    """CPU seconds so far per thread group (tokio, lanes, other)."""
    groups = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return groups
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        group = thread_group(name)
        groups[group] = groups.get(group, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return groups


def cores(spec):
    """`taskset -c` list for a list of core numbers."""
    return ",".join(map(str, spec))


def default_split():
    n = os.cpu_count() or 1
    if n == 1:
        return [0], [0]
    if n == 2:
        return [0], [1]
    server = max(1, (3 * n) // 4)
    return list(range(server)), list(range(server, n))


def parse_cores(text):
    out = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out


def run_case(args, mode, lanes, samples, concurrency):
    addr = f"127.0.0.1:{free_port()}"
    command = [args.binary, "serve", "--addr", addr, "--backend", "mock", "--mock-latency-ms", "0",
               "--execution-mode", mode, "--lanes", str(lanes), "--max-batch-requests", str(args.batch_size),
               "--batch-timeout-ms", "0", "--log-level", "warn"]
    env = dict(os.environ)
    if args.runtime_threads:
        env["TOKIO_WORKER_THREADS"] = str(args.runtime_threads)
    server = subprocess.Popen(["taskset", "-c", cores(args.server_cores)] + command, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_serving(args.binary, addr, server)
        load = [args.binary, "load", "--addr", f"http://{addr}", "--samples-per-request", str(samples),
                "--concurrency", str(concurrency), "--connections", str(args.connections),
                "--json", "--warmup", str(args.warmup), "--duration", str(args.duration)]
        # The warm-up runs first, inside the same load process: measure
        # over the whole process and count its warm-up requests too.
        before, threads_before, started = cpu_seconds(server.pid), threads_cpu(server.pid), time.time()
        children_before = children_cpu_seconds()
        out = subprocess.run(["taskset", "-c", cores(args.load_cores)] + load, capture_output=True, text=True)
        wall = time.time() - started
        used, threads_after = cpu_seconds(server.pid) - before, threads_cpu(server.pid)
        if out.returncode != 0:
            raise SystemExit(f"narsil load failed:\n{out.stderr[-2000:]}")
        report = json.loads(out.stdout)
        load_cpu = children_cpu_seconds() - children_before
    finally:
        server.terminate()
        server.wait(timeout=30)
    answered = report["ok"] + args.warmup
    groups = {g: (threads_after.get(g, 0.0) - threads_before.get(g, 0.0)) / wall for g in ("tokio", "lanes", "other")}
    return {
        "mode": mode, "lanes": lanes, "samples": samples, "concurrency": concurrency,
        "runtime_threads": args.runtime_threads, "req_per_s": report["req_per_s"], "ok": report["ok"],
        "p50_ms": report["p50_ms"], "p99_ms": report["p99_ms"], "mean_fused_rows": report.get("mean_fused_rows"),
        "server_cpu_s": used, "wall_s": wall, "us_per_request": used / max(1, answered) * 1e6,
        "busy_cores": used / wall, "busy_by_threads": groups,
        "load_busy_cores": load_cpu / wall,
    }


def children_cpu_seconds():
    """CPU seconds of this script's finished children so far (the load
    generator's, once it has exited)."""
    usage = os.times()
    return usage.children_user + usage.children_system


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", default=DEFAULT_BINARY)
    p.add_argument("--modes", nargs="+", default=["batch", "worker"], choices=["batch", "worker"])
    p.add_argument("--batch-lanes", type=int, default=1, help="lanes in batch mode")
    p.add_argument("--worker-lanes", type=int, default=4, help="lanes in worker mode")
    p.add_argument("--batch-size", type=int, default=16, help="most requests per fused batch (batch mode)")
    p.add_argument("--samples", type=int, nargs="+", default=[100, 10], help="samples per request")
    p.add_argument("--concurrency", type=int, nargs="+", default=[64])
    p.add_argument("--connections", type=int, default=4, help="the load generator's HTTP/2 connections")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of load per case")
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--runtime-threads", type=int, help="the server's tokio workers (default: its cores)")
    p.add_argument("--server-cores", type=parse_cores, help="e.g. 0-11 (default: 3/4 of the cores; core 0 on 2)")
    p.add_argument("--load-cores", type=parse_cores, help="e.g. 12-15 (default: the rest; core 1 on 2)")
    p.add_argument("--json-out", help="write all results to this file")
    args = p.parse_args()
    require_binary(args.binary)
    server_default, load_default = default_split()
    args.server_cores = args.server_cores or server_default
    args.load_cores = args.load_cores or load_default
    host = machine()
    print(f"# host path: zero-cost mock, git {host['git_sha']}, {host['cpu']}, {host['cores']} cores; "
          f"server on cores {cores(args.server_cores)}, load on {cores(args.load_cores)}, "
          f"tokio workers {args.runtime_threads or 'default'}, {args.duration:g} s per case")
    print("| mode | lanes | samples | conc | req/s | p50 ms | p99 ms | server CPU µs/req | busy cores "
          "| tokio | lanes | other | load busy cores |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for mode in args.modes:
        lanes = args.batch_lanes if mode == "batch" else args.worker_lanes
        for samples in args.samples:
            for c in args.concurrency:
                r = run_case(args, mode, lanes, samples, c)
                rows.append(r)
                g = r["busy_by_threads"]
                print(f"| {mode} | {lanes} | {samples} | {c} | {r['req_per_s']:.0f} | {r['p50_ms']:.3f} "
                      f"| {r['p99_ms']:.3f} | {r['us_per_request']:.1f} | {r['busy_cores']:.2f} "
                      f"| {g['tokio']:.2f} | {g['lanes']:.2f} | {g['other']:.2f} | {r['load_busy_cores']:.2f} |", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({**host, "args": {k: v for k, v in vars(args).items()}, "results": rows}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
