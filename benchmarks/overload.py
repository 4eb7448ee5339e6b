#!/usr/bin/env python3
"""Overload: the real binary at several times its capacity, mock backend.

1. Starts `narsil serve --backend mock` (batch mode, one lane) with a queue
   timeout and a Prometheus endpoint, pinned to core 0.
2. Measures capacity: `narsil load` closed loop, twice the batch size in
   flight (one batch running, one waiting), pinned to core 1.
3. Offers `--factor` times that rate open loop for `--duration` seconds,
   sampling the server's resident memory every 0.25 s.
4. Reads the server's outcome counters from /metrics, sends SIGTERM and
   checks the exit code.

Reports OK latency percentiles against the bound `queue timeout + one batch
time`, the answer mix, the server's RSS and the exit code. Standard library
only; needs a release build (`cargo build --release`).
"""

import argparse
import json
import re
import subprocess
import threading
import time
import urllib.request

from benchlib import (DEFAULT_BINARY, free_port, machine, peak_rss_mib, pinned, require_binary, status_mib,
                      wait_serving)


def outcomes(metrics_addr):
    text = urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=5).read().decode()
    counts = {}
    # Summed over the model/version labels (and the requests refused before routing).
    for m in re.finditer(r'^narsil_requests_total\{(?:[^}]*,)?outcome="(\w+)"\} (\S+)$', text, re.M):
        counts[m.group(1)] = counts.get(m.group(1), 0) + int(float(m.group(2)))
    return counts


def load(args, addr, extra):
    cmd = [args.binary, "load", "--addr", f"http://{addr}", "--samples-per-request", str(args.samples),
           "--warmup", "50", "--json", "--allow-failures"] + extra
    out = subprocess.run(pinned(cmd, 1), capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", default=DEFAULT_BINARY)
    p.add_argument("--latency-ms", type=float, default=20.0, help="mock forward time (one batch time)")
    p.add_argument("--batch-size", type=int, default=4, help="requests per fused forward")
    p.add_argument("--queue-timeout-ms", type=float, default=100.0)
    p.add_argument("--max-queue-requests", type=int, default=64)
    p.add_argument("--samples", type=int, default=1, help="samples per request")
    p.add_argument("--factor", type=float, default=4.0, help="offered load / measured capacity")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of overload")
    p.add_argument("--json-out", help="write the results to this file")
    args = p.parse_args()
    require_binary(args.binary)

    addr, metrics_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    serve = [args.binary, "serve", "--addr", addr, "--metrics-addr", metrics_addr, "--backend", "mock",
             "--mock-latency-ms", str(args.latency_ms), "--max-batch-requests", str(args.batch_size),
             "--max-queue-requests", str(args.max_queue_requests),
             "--queue-timeout-ms", str(args.queue_timeout_ms), "--log-level", "warn"]
    server = subprocess.Popen(pinned(serve, 0), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_serving(args.binary, addr, server)
        capacity = load(args, addr, ["--concurrency", str(2 * args.batch_size), "--duration", "5"])
        rate = args.factor * capacity["req_per_s"]
        rss, done = [], threading.Event()

        def sample():
            started = time.time()
            while not done.is_set():
                rss.append((time.time() - started, status_mib(server.pid, "VmRSS")))
                time.sleep(0.25)

        sampler = threading.Thread(target=sample)
        sampler.start()
        before = outcomes(metrics_addr)
        over = load(args, addr, ["--rate", f"{rate:.1f}", "--duration", str(args.duration),
                                 "--connections", "4"])
        done.set()
        sampler.join()
        after = outcomes(metrics_addr)
        peak = peak_rss_mib(server.pid)
    finally:
        server.terminate()
        exit_code = server.wait(timeout=60)

    counts = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    bound_ms = args.queue_timeout_ms + args.latency_ms
    steady = [m for t, m in rss if t >= 5 and m is not None]
    result = {
        "machine": machine(),
        "config": vars(args),
        "capacity_req_per_s": capacity["req_per_s"],
        "offered_req_per_s": rate,
        "client_by_code": over["by_code"],
        "client_overflow": over["client_overflow"],
        "server_outcomes": counts,
        "ok_req_per_s": over["req_per_s"],
        "ok_p50_ms": over["p50_ms"],
        "ok_p99_ms": over["p99_ms"],
        "ok_max_ms": over["max_ms"],
        "bound_ms": bound_ms,
        "mean_fused_requests": over["mean_fused_rows"] / args.samples,
        "rss_mib_at_5s": steady[0] if steady else None,
        "rss_mib_max_after_5s": max(steady) if steady else None,
        "peak_rss_mib": peak,
        "server_mean_queue_ms": over["mean_queue_ms"],
        "server_mean_compute_ms": over["mean_compute_ms"],
        "exit_code_after_sigterm": exit_code,
    }
    print(f"# overload: mock {args.latency_ms} ms/forward, {args.batch_size} requests/forward, "
          f"queue timeout {args.queue_timeout_ms} ms, {args.samples} sample(s)/request; {machine()}")
    print(f"capacity {capacity['req_per_s']:.0f} req/s; offered {rate:.0f} req/s ({args.factor}x) "
          f"for {args.duration:.0f} s")
    print(f"client saw {over['by_code']} (client overflow {over['client_overflow']})")
    print(f"server counted {counts}")
    print(f"OK {over['req_per_s']:.0f} req/s, p50 {over['p50_ms']:.1f} ms, p99 {over['p99_ms']:.1f} ms, "
          f"max {over['max_ms']:.1f} ms (bound: queue timeout + one batch = {bound_ms:.0f} ms); "
          f"{result['mean_fused_requests']:.1f} requests per forward")
    print(f"server RSS {result['rss_mib_at_5s']} MiB at 5 s, max {result['rss_mib_max_after_5s']} MiB "
          f"after, peak {peak} MiB; exit code after SIGTERM {exit_code}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
