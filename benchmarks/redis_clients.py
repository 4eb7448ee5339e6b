#!/usr/bin/env python3
"""The two async Redis Cluster clients for Rust (`redis` with cluster-async,
`fred`) on the `redis` table store's read pattern: the measurement behind
the store's choice of client.

Builds benchmarks/redis_clients (its own Cargo workspace: Narsil's build
compiles one client only), starts a Redis Cluster (scripts/redis_cluster.sh,
3 masters + 3 replicas) and writes --tables x --rows 80-byte rows in the
store's key layout. Then, for each client and each number of MGETs in
flight (all of a batch's: tables x buckets = 416 by default, or 32):

* steady: one lane fetching batches (--distinct ids per table, one MGET per
  table and bucket) back to back for --seconds: batches/s, p50/p99, the
  client process's CPU time per batch;
* failover (--failover-runs, a fresh cluster each): a master SIGKILLed
  3 s in, 15 s of batches with a 250 ms bound each: failed batches, the
  last failure after the kill (the window until the client reads again),
  and rows that came back wrong (every row is checked against its bytes).

The client is pinned to CPU 0 and the cluster to the other CPUs where the
machine has more than one, so that they compete less.
"""

import argparse
import json
import os
import shutil
import subprocess
import tempfile

from benchlib import ROOT, machine, pinned

CLUSTER = os.path.join(ROOT, "scripts", "redis_cluster.sh")
TOOL_DIR = os.path.join(ROOT, "benchmarks", "redis_clients")
BINARY = os.path.join(ROOT, "target", "release", "narsil-redis-clients")


def start_cluster(work, rest_cpus, args):
    directory = tempfile.mkdtemp(dir=work)
    shutil.rmtree(directory)
    seeds = subprocess.run(pinned(["bash", CLUSTER, "start", directory], rest_cpus), check=True,
                           capture_output=True, text=True).stdout.strip().splitlines()[-1]
    subprocess.run([BINARY, "fill", seeds, "--tables", str(args.tables), "--rows", str(args.rows)], check=True,
                   capture_output=True)
    return directory, seeds


def read(seeds, client, in_flight, args, extra=()):
    cmd = pinned([BINARY, "read", seeds, "--client", client, "--in-flight", str(in_flight), "--tables",
                  str(args.tables), "--rows", str(args.rows), "--distinct", str(args.distinct), *extra], 0)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--distinct", type=int, default=100, help="distinct ids per table per batch")
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--in-flight", type=int, nargs="+", default=[416, 32])
    p.add_argument("--failover-runs", type=int, default=1)
    p.add_argument("--json-out")
    args = p.parse_args()
    subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup_system.sh"), "redis-server"], check=True)
    env = dict(os.environ, CARGO_TARGET_DIR=os.path.join(ROOT, "target"))
    subprocess.run(["cargo", "build", "--release", "-j2", "--manifest-path", os.path.join(TOOL_DIR, "Cargo.toml")],
                   check=True, env=env)
    rest = f"1-{os.cpu_count() - 1}" if os.cpu_count() > 1 else None
    work = tempfile.mkdtemp(prefix="narsil-redis-clients-")
    results = []
    try:
        directory, seeds = start_cluster(work, rest, args)
        for round_ in range(2):
            for client in ("redis", "fred"):
                for in_flight in args.in_flight:
                    row = read(seeds, client, in_flight, args, ["--seconds", str(args.seconds)])
                    row["run"] = f"steady {round_ + 1}"
                    print(json.dumps(row), flush=True)
                    results.append(row)
        subprocess.run(["bash", CLUSTER, "stop", directory], check=True)
        for run in range(args.failover_runs):
            for client in ("redis", "fred"):
                for in_flight in args.in_flight:
                    directory, seeds = start_cluster(work, rest, args)
                    port = seeds.split(",")[0].rsplit(":", 1)[1]
                    pid = open(os.path.join(directory, port, "redis.pid")).read().strip()
                    row = read(seeds, client, in_flight, args,
                               ["--seconds", "15", "--kill-pid", pid, "--kill-at", "3"])
                    row["run"] = f"failover {run + 1}"
                    print(json.dumps(row), flush=True)
                    results.append(row)
                    subprocess.run(["bash", CLUSTER, "stop", directory], check=True)
    finally:
        for name in os.listdir(work):
            subprocess.run(["bash", CLUSTER, "stop", os.path.join(work, name)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    print("\n| run | client | MGETs in flight | batches/s | p50 ms | p99 ms | CPU ms/batch | failed batches "
          "| last failure after kill (s) | wrong rows |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['run']} | {r['client']} | {r['in_flight']} | {r['batches_per_s']} | {r['p50_ms']} | "
              f"{r['p99_ms']} | {r['cpu_ms_per_batch']} | {r['failed_batches']} | "
              f"{r['last_failure_after_kill_s'] if r['killed_at_s'] is not None else '-'} | {r['wrong_rows']} |")
    if args.json_out:
        json.dump({"machine": machine(), "args": vars(args), "results": results}, open(args.json_out, "w"), indent=2)


if __name__ == "__main__":
    main()
