#!/usr/bin/env python3
"""Deadlines under overload: does a replica whose clients send deadlines stay
in its load balancer?

1. Writes (or reuses) a split model with the default DLRM's dense network
   and 26 tables of `--rows` rows (`tables_beyond_ram.write_model`).
2. Starts `narsil serve --table-store disk` (one lane, a small row cache of
   `--cache-mib`, pinned to core 0) and, pinned to core 1, `narsil load`
   closed loop with `--concurrency` callers whose requests carry a deadline
   of `--timeout-ms` (Zipf ids), for `--duration` seconds: far more than the
   replica can serve in time, so whole batches outlive their callers.
3. Meanwhile polls the server's `narsil_backend_healthy` gauge (what
   grpc.health's SERVING / NOT_SERVING follows) `--polls` times.

Reports the polls that said healthy, the client's answers by status code
(the goal: no UNAVAILABLE; every request OK, DEADLINE_EXCEEDED or
RESOURCE_EXHAUSTED), and the server's abandoned batches and failed forwards.
Needs a release build with `--features torch` and
`models/generated/default/split`. Standard library only.
"""

import argparse
import json
import os
import re
import subprocess
import threading
import time
import urllib.request

from benchlib import DEFAULT_BINARY, ROOT, free_port, machine, pinned, require_binary, wait_serving
from tables_beyond_ram import write_model


def metric_sum(text, name):
    """The sum of every sample of `name` (over its labels)."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def scrape(metrics_addr):
    return urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=5).read().decode()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", default=DEFAULT_BINARY)
    p.add_argument("--source", default=os.path.join(ROOT, "models/generated/default/split"))
    p.add_argument("--out", default="/var/tmp/narsil-deadline-health", help="where the big model is written")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows per table")
    p.add_argument("--cache-mib", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--timeout-ms", type=int, default=30)
    p.add_argument("--distribution", default="zipf:1.05")
    p.add_argument("--duration", type=float, default=14)
    p.add_argument("--polls", type=int, default=60)
    p.add_argument("--serve-flag", action="append", default=[], help="one more flag for narsil serve")
    args = p.parse_args()
    require_binary(args.binary, "--features torch")
    write_model(args.source, args.out, args.rows)

    addr, metrics_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    serve = [args.binary, "serve", "--addr", addr, "--metrics-addr", metrics_addr, "--backend", "torch",
             "--model", args.out, "--table-store", "disk", "--table-cache-bytes", str(args.cache_mib << 20),
             "--lanes", "1", "--log-level", "warn"] + args.serve_flag
    server = subprocess.Popen(pinned(serve, 0), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_serving(args.binary, addr, server)
        healthy, done = [], threading.Event()

        def poll():
            interval = args.duration / args.polls
            while not done.is_set() and len(healthy) < args.polls:
                healthy.append(metric_sum(scrape(metrics_addr), "narsil_backend_healthy") > 0)
                time.sleep(interval)

        before = scrape(metrics_addr)
        poller = threading.Thread(target=poll)
        poller.start()
        load = [args.binary, "load", "--addr", f"http://{addr}", "--concurrency", str(args.concurrency),
                "--timeout-ms", str(args.timeout_ms), "--id-distribution", args.distribution,
                "--duration", str(args.duration), "--warmup", "0", "--json", "--allow-failures"]
        out = subprocess.run(pinned(load, 1), capture_output=True, text=True, check=True)
        done.set()
        poller.join()
        after = scrape(metrics_addr)
    finally:
        server.terminate()
        server.wait(timeout=60)

    report = json.loads(out.stdout)
    delta = {name: metric_sum(after, name) - metric_sum(before, name)
             for name in ["narsil_batches_abandoned_total", "narsil_forward_errors_total",
                          "narsil_forwards_total", "narsil_table_store_errors_total"]}
    result = {
        "machine": machine(),
        "config": vars(args),
        "healthy_polls": sum(healthy),
        "polls": len(healthy),
        "client_by_code": report["by_code"],
        "ok_req_per_s": report["req_per_s"],
        "server": delta,
    }
    print(json.dumps(result))
    print(f"# {machine()['cpu']}: healthy at {sum(healthy)} of {len(healthy)} polls; "
          f"client {report['by_code']}; server {delta}")


if __name__ == "__main__":
    main()
