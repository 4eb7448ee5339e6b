#!/usr/bin/env python3
"""Split-model tables on a Redis Cluster (`--table-store redis://...`),
against the same replicas with the in-memory store.

1. Starts a Redis Cluster (scripts/redis_cluster.sh: 3 masters, 3 replicas
   on loopback) and loads the default DLRM's split tables onto it
   (`narsil tables load`, timed), in a copy of the model.
2. For each store (`memory`; `redis` with its hot-row cache at each
   --cache-percent of the rows' bytes) and each id distribution: starts two
   `narsil serve` replicas behind HAProxy (deploy/haproxy/haproxy.cfg.in,
   per-call balancing) and runs `narsil load` against HAProxy (closed loop,
   --concurrency clients, --warmup-seconds not measured, then --duration
   seconds). Reports throughput, p50/p99, non-OK calls, from the
   replicas' metrics the cache hit rate (hits over distinct ids) and rows
   fetched from the store per request, and each replica's resident memory
   (VmRSS) at the end.
3. With --updates K (redis, --update-cache-percent, Zipf): the same
   measurement while `narsil tables push` writes changed rows (the first
   tables' worth of the measured duration) at K rows/s, each step
   invalidated over pub/sub. Meanwhile --probes times how long an update
   takes to reach each replica: a row of the last table (which the stream
   leaves alone) is changed by its own `narsil tables push`, and a
   one-sample request that reads it is sent to each replica directly
   (KServe v2, every 5 ms, so the old row is cached there) until its score
   changes: the time from the push's start and from its end (rows written
   and the invalidation published) to the new score, per replica.
4. With --failover: the same measurement with a master killed (SIGKILL)
   --failover-at seconds into it: non-OK calls (a closed-loop client whose
   calls HAProxy refuses at once while no replica is healthy counts many),
   and the window from the kill until both replicas are healthy again.

Needs a release build with `--features torch` and
models/generated/default/split (`scripts/serve.sh` exports it). The probes
need the project's venv (tritonclient, numpy). Every process shares the
machine's cores: on a 2-core machine the cluster, the two replicas,
HAProxy and the load generator compete, so the numbers are a lower bound
and noisy.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request

from benchlib import DEFAULT_BINARY, ROOT, free_port, machine, require_binary, status_mib, wait_serving

CLUSTER = os.path.join(ROOT, "scripts", "redis_cluster.sh")
ENTRY_OVERHEAD = 16  # a slot's tag, crates/narsil-embedding/src/row_cache.rs


def healthz(admin):
    try:
        return urllib.request.urlopen(f"http://{admin}/healthz", timeout=1).status == 200
    except Exception:
        return False


def metrics(admin):
    text = urllib.request.urlopen(f"http://{admin}/metrics", timeout=10).read().decode()
    sums = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0]
        sums[name] = sums.get(name, 0.0) + float(value)
    return sums


class Replicas:
    """Two `narsil serve` replicas behind HAProxy."""

    def __init__(self, args, model, store, cache_bytes):
        self.procs, self.admins, self.ports = [], [], []
        ports = self.ports
        for _ in range(2):
            port, admin = free_port(), f"127.0.0.1:{free_port()}"
            cmd = [args.binary, "serve", "--log-level", "warn", "--backend", "torch", "--model", model,
                   "--addr", f"127.0.0.1:{port}", "--metrics-addr", admin, "--lanes", "1",
                   "--intra-op-threads", "1", "--table-store", store, "--table-cache-bytes", str(cache_bytes)]
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
            self.admins.append(admin)
            ports.append(port)
        for proc, port in zip(self.procs, ports):
            wait_serving(args.binary, f"127.0.0.1:{port}", proc, timeout=300)
        front = free_port()
        config = open(os.path.join(ROOT, "deploy", "haproxy", "haproxy.cfg.in")).read()
        servers = "\n".join(f"    server r{i} 127.0.0.1:{p} port {a.rsplit(':', 1)[1]}"
                            for i, (p, a) in enumerate(zip(ports, self.admins)))
        self.cfg = tempfile.NamedTemporaryFile("w", suffix=".cfg", delete=False)
        self.cfg.write(config.replace("@FRONT_PORT@", str(front)).replace("@SERVERS@", servers))
        self.cfg.close()
        self.haproxy = subprocess.Popen(["haproxy", "-db", "-f", self.cfg.name], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        self.addr = f"127.0.0.1:{front}"
        wait_serving(args.binary, self.addr, self.haproxy)

    def metrics(self):
        total = {}
        for admin in self.admins:
            for k, v in metrics(admin).items():
                total[k] = total.get(k, 0.0) + v
        return total

    def rss_mib(self):
        """Each replica's resident memory now."""
        return [round(status_mib(proc.pid, "VmRSS")) for proc in self.procs]

    def stop(self):
        self.haproxy.terminate()
        self.haproxy.wait(timeout=10)
        os.unlink(self.cfg.name)
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(timeout=60)


def load(args, addr, distribution, duration, seed):
    cmd = [args.binary, "load", "--addr", f"http://{addr}", "--concurrency", str(args.concurrency),
           "--connections", "4", "--samples-per-request", str(args.samples), "--duration", str(duration),
           "--warmup", "0", "--id-distribution", distribution, "--distinct-requests", str(args.distinct_requests),
           "--seed", str(seed), "--json", "--allow-failures"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"narsil load failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def measure(args, model, store, cache_bytes, distribution, during=None):
    replicas = Replicas(args, model, store, cache_bytes)
    try:
        if args.warmup_seconds:
            load(args, replicas.addr, distribution, args.warmup_seconds, 1)
        before = replicas.metrics()
        side = threading.Thread(target=during, args=(replicas,)) if during else None
        if side:
            side.start()
        report = load(args, replicas.addr, distribution, args.duration, 2)
        if side:
            side.join()
        after = replicas.metrics()
        rss = replicas.rss_mib()
    finally:
        replicas.stop()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    ok = max(1, report["ok"])
    distinct = max(1.0, delta.get("narsil_table_distinct_ids_total", 0))
    return {
        "store": store.split(":")[0], "cache_mib": round(cache_bytes / 2**20, 1), "ids": distribution,
        "req_per_s": round(report["req_per_s"], 1), "p50_ms": round(report["p50_ms"], 2),
        "p99_ms": round(report["p99_ms"], 2), "non_ok": report["requests"] - report["ok"],
        "cache_hit_rate": round(delta.get("narsil_table_cache_hits_total", 0) / distinct, 3),
        "rows_fetched_per_request": round(delta.get("narsil_table_rows_fetched_total", 0) / ok, 1),
        "dedup_ratio": round(delta.get("narsil_table_ids_total", 0) / distinct, 2),
        "store_errors": delta.get("narsil_table_store_errors_total", 0),
        "rss_mib": rss,
    }


def rotated_copy(model, out, rows_to_change):
    """A copy of `model`'s tables whose first tables (about
    `rows_to_change` rows) have every row moved up by one."""
    schema = json.load(open(os.path.join(model, "schema.json")))
    os.makedirs(os.path.join(out, "tables"), exist_ok=True)
    changed = 0
    for table in schema["tables"]:
        rows = open(os.path.join(model, table["file"]), "rb").read()
        k = table["row_bytes"]
        if changed < rows_to_change:
            rows = rows[k:] + rows[:k]
            changed += table["rows"]
        open(os.path.join(out, table["file"]), "wb").write(rows)
        table["sha256"] = ""
    json.dump(schema, open(os.path.join(out, "schema.json"), "w"))


def probe_updates(args, replicas, model, seeds, work, count, interval):
    """Times `count` single-row updates (`interval` s apart) until each
    replica answers with the new row; returns one dict per probe."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    schema = json.load(open(os.path.join(model, "schema.json")))
    table = schema["tables"][-1]
    feature = next(i for i, f in enumerate(schema["features"]) if f["table"] == table["name"])
    clients = [grpcclient.InferenceServerClient(url=f"127.0.0.1:{port}") for port in replicas.ports]
    rows = open(os.path.join(model, table["file"]), "rb").read()
    k = table["row_bytes"]

    def score(client, row_id):
        ids = np.zeros(len(schema["features"]), dtype=np.int64)
        ids[feature] = row_id
        tensors = []
        for name, array, datatype in (("dense", np.ones((1, schema["num_dense"]), dtype=np.float32), "FP32"),
                                      ("lengths", np.ones((1, len(ids)), dtype=np.int64), "INT64"),
                                      ("ids", ids, "INT64")):
            tensor = grpcclient.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        return float(client.infer(schema["name"], tensors).as_numpy(schema["outputs"][0])[0])

    probes = []
    for n in range(count):
        row_id = 1000 + 7919 * n
        before = [score(c, row_id) for c in clients]
        # A copy of the model whose last table differs in that row only.
        new = os.path.join(work, f"probe-{n}")
        os.makedirs(os.path.join(new, "tables"))
        for t in schema["tables"]:
            if t is not table:
                os.symlink(os.path.join(model, t["file"]), os.path.join(new, t["file"]))
        other = (row_id + 1) * k
        changed = rows[:row_id * k] + rows[other:other + k] + rows[(row_id + 1) * k:]
        open(os.path.join(new, table["file"]), "wb").write(changed)
        json.dump(dict(schema, tables=[dict(t, sha256="") for t in schema["tables"]]),
                  open(os.path.join(new, "schema.json"), "w"))
        started = time.time()
        subprocess.run([args.binary, "tables", "push", model, "--store", seeds, "--from", new], check=True,
                       capture_output=True)
        pushed = time.time()
        seen = [None] * len(clients)
        while None in seen and time.time() - pushed < 10:
            for i, client in enumerate(clients):
                if seen[i] is None and score(client, row_id) != before[i]:
                    seen[i] = time.time()
            time.sleep(0.005)
        probe = {"push_s": round(pushed - started, 3),
                 "visible_after_push_end_s": [s and round(s - pushed, 3) for s in seen],
                 "visible_after_push_start_s": [s and round(s - started, 3) for s in seen]}
        print(f"  probe {n}: {probe}", flush=True)
        probes.append(probe)
        shutil.rmtree(new)
        time.sleep(interval)
    return probes


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", default=DEFAULT_BINARY)
    p.add_argument("--source", default=os.path.join(ROOT, "models/generated/default/split"))
    p.add_argument("--ids", nargs="*", default=["zipf:1.05", "uniform"], help="steady runs (none: skip them)")
    p.add_argument("--cache-percent", type=float, nargs="+", default=[1, 10, 50])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--samples", type=int, default=100, help="samples per request")
    p.add_argument("--distinct-requests", type=int, default=2000)
    p.add_argument("--warmup-seconds", type=float, default=10)
    p.add_argument("--duration", type=float, default=20)
    p.add_argument("--updates", type=int, default=10000, help="rows/s pushed during the update run (0: none)")
    p.add_argument("--update-cache-percent", type=float, default=10)
    p.add_argument("--probes", type=int, default=5, help="update visibility probes during the update run")
    p.add_argument("--failover", action="store_true")
    p.add_argument("--failover-at", type=float, default=5)
    p.add_argument("--json-out")
    args = p.parse_args()
    require_binary(args.binary, "--features torch")
    subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup_system.sh"), "haproxy", "redis-server"], check=True)
    work = tempfile.mkdtemp(prefix="narsil-redis-bench-")
    cluster = os.path.join(work, "cluster")
    model = os.path.join(work, "model")
    results = []
    try:
        seeds = subprocess.run(["bash", CLUSTER, "start", cluster], check=True, capture_output=True,
                               text=True).stdout.strip()
        shutil.copytree(args.source, model)
        started = time.time()
        loaded = subprocess.run([args.binary, "tables", "load", model, "--store", seeds], check=True,
                                capture_output=True, text=True).stdout.strip()
        print(f"{loaded} ({time.time() - started:.1f} s with the cluster on this machine)", flush=True)
        schema = json.load(open(os.path.join(model, "schema.json")))
        table_bytes = sum(t["rows"] * (t["row_bytes"] + ENTRY_OVERHEAD) for t in schema["tables"])

        def run(store, cache_percent, ids, during=None, what=""):
            cache = int(table_bytes * cache_percent / 100)
            row = measure(args, model, store, cache, ids, during)
            row["cache_percent"] = cache_percent if store != "memory" else "-"
            row["run"] = what or "steady"
            print(json.dumps(row), flush=True)
            results.append(row)

        for ids in args.ids:
            # The memory store before and after the Redis runs: on a small
            # machine the spread between the two is the noise.
            run("memory", 0, ids)
            for percent in args.cache_percent:
                run(seeds, percent, ids)
            run("memory", 0, ids, what="steady (again)")
        if args.updates:
            new = os.path.join(work, "new")
            # Changed rows for about the measured duration at that rate.
            rotated_copy(model, new, int(args.updates * (args.duration - 2)))

            def push(replicas):
                time.sleep(1)
                stream = subprocess.Popen([args.binary, "tables", "push", model, "--store", seeds, "--from", new,
                                           "--rows-per-second", str(args.updates)], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True)
                if args.probes:
                    interval = max(0.0, (args.duration - 4) / args.probes - 1)
                    probes.extend(probe_updates(args, replicas, model, seeds, work, args.probes, interval))
                out, err = stream.communicate(timeout=args.duration + 60)
                print(f"  push: {out.strip() or err[-500:]}", flush=True)

            probes = []
            run(seeds, args.update_cache_percent, "zipf:1.05", push, f"updates {args.updates} rows/s")
            if probes:
                after_end = [s for p in probes for s in p["visible_after_push_end_s"]]
                after_start = [s for p in probes for s in p["visible_after_push_start_s"]]
                worst = None if None in after_end else max(after_end)
                results[-1].update(probes=probes, visible_after_push_end_max_s=worst)
                print(f"  update visibility over {len(probes)} probes x {len(probes[0]['visible_after_push_end_s'])} "
                      f"replicas: after the push's end {after_end} (max {worst} s), after its start up to "
                      f"{None if None in after_start else max(after_start)} s", flush=True)
        if args.failover:
            def kill(replicas):
                time.sleep(args.failover_at)
                port = seeds.split(",")[0].rsplit(":", 1)[1]
                pid = int(open(os.path.join(cluster, port, "redis.pid")).read())
                os.kill(pid, signal.SIGKILL)
                killed = time.time()
                print(f"  killed master {port}", flush=True)
                # The window: from the kill until both replicas say healthy
                # again (HAProxy sends nothing to a NOT_SERVING replica).
                unhealthy_seen, healthy_again = None, None
                while time.time() - killed < args.duration:
                    states = [healthz(a) for a in replicas.admins]
                    if not all(states) and unhealthy_seen is None:
                        unhealthy_seen = time.time() - killed
                    if unhealthy_seen is not None and all(states):
                        healthy_again = time.time() - killed
                        break
                    time.sleep(0.05)
                window["unhealthy_after_s"] = unhealthy_seen and round(unhealthy_seen, 2)
                window["healthy_again_after_s"] = healthy_again and round(healthy_again, 2)
                print(f"  a replica NOT_SERVING {unhealthy_seen} s after the kill, both SERVING again "
                      f"{healthy_again} s after it", flush=True)

            window = {}

            run(seeds, args.update_cache_percent, "zipf:1.05", kill, "master killed")
            results[-1].update(window)
    finally:
        subprocess.run(["bash", CLUSTER, "stop", cluster])
        shutil.rmtree(work, ignore_errors=True)
    print("\n| run | store | cache % | ids | req/s | p50 ms | p99 ms | non-OK | cache hit rate | rows fetched/request "
          "| RSS MiB per replica |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['run']} | {r['store']} | {r['cache_percent']} | {r['ids']} | {r['req_per_s']} | {r['p50_ms']} | "
              f"{r['p99_ms']} | {r['non_ok']} | {r['cache_hit_rate']} | {r['rows_fetched_per_request']} | "
              f"{' / '.join(map(str, r['rss_mib']))} |")
    if args.json_out:
        json.dump({"machine": machine(), "args": vars(args), "results": results}, open(args.json_out, "w"), indent=2)


if __name__ == "__main__":
    main()
