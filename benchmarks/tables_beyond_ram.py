#!/usr/bin/env python3
"""Split-model tables larger than the memory a server may use, served from
memory-mapped files (`--table-store mmap`) or read with direct I/O into a
row cache (`--table-store disk`, `--cache-mib`), against the same tables in
memory (`memory`, run without a limit: they would not fit).

1. Writes a split model with the default DLRM's dense network and 26 tables
   of `--rows` rows (80-byte INT8 rows; each table is the default model's
   table repeated, so no FP32 weights are ever built): 8.3 GB at 4M rows.
2. For each memory limit, store and id distribution: drops the tables'
   pages from the page cache, starts `narsil serve --table-store STORE` (one lane,
   pinned to core 0) inside a cgroup-v1 memory cgroup limited to that many
   MiB (page cache included: the mapped rows the server touches are charged
   to it, so only that much of the tables stays cached), and runs
   `narsil load` (closed loop, pinned to core 1, cycling through
   `--distinct-requests` prebuilt requests) for `--warmup-seconds` (not
   measured: it fills the page cache, with another seed's requests of the
   same distribution) and then for `--duration` seconds.
1b. With `--layouts id,popularity`, also a copy of that model whose tables
   are laid out in popularity order (`narsil tables order`), from an id log
   of the first Zipf distribution's traffic (`narsil load --id-log`, another
   seed's `--id-log-requests` requests: yesterday's traffic, not the
   measured draws); every store is measured on both.
0. With `--disk-baseline` (needs `fio`: `apt-get install fio`), first
   measures the disk's own random-read limit on the table files: 4 KiB
   direct reads, one at a time, 16 at a time from 16 threads (as the disk
   store reads), and 64 in flight (io_uring).
3. Reports throughput, p50/p99, and from the server's metrics the major page
   faults (mmap's disk reads) per request, the row cache's hit rate and the
   rows read from disk per request (disk), and the dedup ratio, as JSON lines
   and a table.

Needs root (cgroup v1 memory controller at /sys/fs/cgroup/memory), a release
build with `--features torch`, and `models/generated/default/split`
(`scripts/serve.sh` exports it; or `models/export_dlrm.py --out
models/generated/default --split`). Standard library only.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request

from benchlib import DEFAULT_BINARY, ROOT, free_port, machine, pinned, require_binary, status_mib, wait_serving

sys.path.insert(0, os.path.join(ROOT, "models"))
from model_files import copy_named_files, read_schema  # noqa: E402  (models/, on the path above)

CGROUP_ROOT = "/sys/fs/cgroup/memory"


def write_model(source, out, rows):
    """A split model in `out` with `source`'s dense network (every file its
    schema names: the cut, the packages, id maps) and schema, each table
    `rows` rows long (the source table repeated)."""
    schema = read_schema(source)
    if any(table.get("layout") for table in schema["tables"]):
        raise SystemExit(f"{source}: its tables are laid out (`narsil tables order`); repeating them would not "
                         "repeat their slot indexes: write the model from one in id order")
    os.makedirs(os.path.join(out, "tables"), exist_ok=True)
    copy_named_files(source, out, schema, skip=[table["file"] for table in schema["tables"]])
    for table in schema["tables"]:
        path = os.path.join(out, table["file"])
        size = rows * table["row_bytes"]
        if not (os.path.exists(path) and os.path.getsize(path) == size):
            block = open(os.path.join(source, table["file"]), "rb").read()
            with open(path + ".partial", "wb") as f:
                left = size
                while left:
                    f.write(block[:left])
                    left -= min(left, len(block))
            os.rename(path + ".partial", path)
        table["rows"] = rows
        # Not hashed (the table is larger than RAM): served unchecked, and
        # the load says so once per table.
        table["sha256"] = ""
    schema["name"] = "dlrm-big"
    json.dump(schema, open(os.path.join(out, "schema.json"), "w"), indent=2)
    return sum(rows * t["row_bytes"] for t in schema["tables"]), schema


def popularity_copy(args, model_dir, distribution):
    """`model_dir` with its tables in popularity order (`narsil tables
    order`), from an id log of `distribution`'s traffic; reused if there."""
    ordered = model_dir.rstrip("/") + "-popularity"
    if os.path.exists(os.path.join(ordered, "schema.json")):
        return ordered
    log = ordered + ".ids"
    addr = f"127.0.0.1:{free_port()}"
    server = subprocess.Popen([args.binary, "serve", "--backend", "torch", "--model", model_dir, "--table-store",
                               "mmap", "--addr", addr, "--log-level", "warn"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_serving(args.binary, addr, server)
        subprocess.run([args.binary, "load", "--addr", f"http://{addr}", "--requests", "1", "--warmup", "0",
                        "--samples-per-request", str(args.samples), "--id-distribution", distribution,
                        "--distinct-requests", str(args.id_log_requests), "--seed", "3", "--id-log", log],
                       check=True, stdout=subprocess.DEVNULL)
    finally:
        server.terminate()
        server.wait(timeout=60)
    subprocess.run([args.binary, "tables", "order", model_dir, "--id-log", log, "--out", ordered], check=True)
    os.remove(log)
    return ordered


def drop_cached(out, schema):
    """Drops the tables' pages from the page cache (written back first: the
    kernel drops only clean, unmapped pages). A page left cached would be
    charged to whoever cached it, not to the server's cgroup."""
    for table in schema["tables"]:
        fd = os.open(os.path.join(out, table["file"]), os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def disk_baseline(model_dir, schema, seconds=10):
    """fio's 4 KiB random direct reads over the table files: IOPS and mean
    latency at queue depth 1, 16 threads, and 64 in flight."""
    files = ":".join(os.path.join(model_dir, t["file"]).replace(":", "\\:") for t in schema["tables"])
    rows = []
    for label, engine, depth, jobs in [("qd1", "psync", 1, 1), ("16 threads", "psync", 1, 16),
                                       ("qd64", "io_uring", 64, 1)]:
        cmd = ["fio", "--name=randread", f"--filename={files}", "--direct=1", "--rw=randread", "--bs=4k",
               f"--ioengine={engine}", f"--iodepth={depth}", f"--numjobs={jobs}", "--group_reporting",
               f"--runtime={seconds}", "--time_based", "--output-format=json"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            rows.append({"fio": label, "error": out.stderr.strip()[-300:]})
            continue
        read = json.loads(out.stdout)["jobs"][0]["read"]
        rows.append({"fio": label, "iops": round(read["iops"]), "mean_latency_us": round(read["clat_ns"]["mean"] / 1e3, 1)})
    return rows


def metrics(admin):
    """Each metric summed over its series, and each series (`name{labels}`) alone."""
    text = urllib.request.urlopen(f"http://{admin}/metrics", timeout=10).read().decode()
    sums = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0]
        sums[name] = sums.get(name, 0.0) + float(value)
        if "{" in series:
            sums[series] = float(value)
    return sums


def table_of(series):
    """The `table` label of a series, if any."""
    match = re.search(r'table="([^"]*)"', series)
    return match.group(1) if match else None


def per_table_hit_rates(delta):
    """Each table's row-cache hit rate over the run."""
    hits, fetched = {}, {}
    for series, value in delta.items():
        if series.startswith("narsil_table_cache_hits_total{"):
            hits[table_of(series)] = value
        elif series.startswith("narsil_table_rows_fetched_total{"):
            fetched[table_of(series)] = value
    return {t: round(hits[t] / (hits[t] + fetched.get(t, 0)), 3) for t in hits if hits[t] + fetched.get(t, 0)}


def run(args, model_dir, limit_mib, store, distribution, layout):
    cgroup = os.path.join(CGROUP_ROOT, f"narsil-bench-{os.getpid()}")
    os.makedirs(cgroup, exist_ok=True)
    with open(os.path.join(cgroup, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit_mib << 20) if limit_mib else "-1")
    addr, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    serve = pinned([args.binary, "serve", "--backend", "torch", "--model", model_dir, "--table-store", store,
                    "--table-cache-bytes", str(args.cache_mib << 20), "--addr", addr, "--metrics-addr", admin,
                    "--lanes", "1", "--intra-op-threads", "1"] + args.serve_flag, 0)
    # Joins the cgroup before exec, so every page the server touches is charged to it.
    script = f'echo $$ > {cgroup}/cgroup.procs && exec "$@"'
    server = subprocess.Popen(["sh", "-c", script, "sh"] + serve, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    try:
        wait_serving(args.binary, addr, server)

        def load(duration, seed):
            cmd = [args.binary, "load", "--addr", f"http://{addr}", "--concurrency", str(args.concurrency),
                   "--samples-per-request", str(args.samples), "--duration", str(duration), "--warmup", "0",
                   "--id-distribution", distribution, "--distinct-requests", str(args.distinct_requests),
                   "--seed", str(seed), "--json", "--allow-failures"]
            out = subprocess.run(pinned(cmd, 1), capture_output=True, text=True, check=True).stdout
            return json.loads(out)

        if args.warmup_seconds:
            # Other requests of the same traffic (another seed: the same hot
            # ids, other draws) fill the page cache first.
            load(args.warmup_seconds, 1)
        before = metrics(admin)
        report = load(args.duration, 2)
        after = metrics(admin)
        peak = int(open(os.path.join(cgroup, "memory.max_usage_in_bytes")).read()) >> 20
        rss = status_mib(server.pid, "VmRSS")
    finally:
        server.terminate()
        server.wait(timeout=60)
        os.rmdir(cgroup)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    requests = max(1, report["ok"])
    hits, from_store = delta.get("narsil_table_cache_hits_total", 0), delta.get("narsil_table_rows_fetched_total", 0)
    return {
        "limit_mib": limit_mib or "none", "store": store, "ids": distribution, "layout": layout,
        "req_per_s": round(report["req_per_s"], 1),
        "p50_ms": round(report["p50_ms"], 2), "p99_ms": round(report["p99_ms"], 2),
        "non_ok": report["requests"] - report["ok"],
        "major_faults_per_request": round(delta.get("narsil_table_major_faults_total", 0) / requests, 1),
        # Only the disk store reads rows by id (the local ones count every distinct row).
        "cache_hit_rate": round(hits / (hits + from_store), 3) if store.startswith("disk") and hits + from_store else None,
        "rows_from_disk_per_request": round(from_store / requests, 1) if store.startswith("disk") else None,
        # A memory table is read in place and not deduplicated (no distinct count).
        "dedup_ratio": round(delta.get("narsil_table_ids_total", 0) / delta["narsil_table_distinct_ids_total"], 2)
        if delta.get("narsil_table_distinct_ids_total") else None,
        "cgroup_peak_mib": peak,
        "rss_mib": None if rss is None else round(rss),
        "hit_rate_by_table": (lambda r: [min(r.values()), max(r.values())] if r and store.startswith("disk") else None)(
            per_table_hit_rates(delta)),
        "disk_kib_per_request": round(delta.get("narsil_table_disk_bytes_read_total", 0) / 1024 / requests, 1)
        if store.startswith("disk") else None,
        "disk_read_mean_us": round(1e6 * delta.get("narsil_table_disk_read_seconds_sum", 0)
                                   / max(1.0, delta.get("narsil_table_disk_read_seconds_count", 0)), 1)
        if store.startswith("disk") else None,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", default=DEFAULT_BINARY)
    p.add_argument("--source", default=os.path.join(ROOT, "models/generated/default/split"))
    p.add_argument("--out", default="/var/tmp/narsil-tables-beyond-ram",
                   help="where the big split model is written (kept between runs; on disk, not tmpfs)")
    p.add_argument("--rows", type=int, default=4_000_000, help="rows per table")
    p.add_argument("--limits-mib", default="0,1024", help="memory limits to run under, MiB (0: none)")
    p.add_argument("--stores", default="mmap", help="table stores to compare (memory runs only without a limit)")
    p.add_argument("--cache-mib", type=int, default=160, help="the disk store's row cache (--table-cache-bytes)")
    p.add_argument("--serve-flag", action="append", default=[], help="one more flag for narsil serve")
    p.add_argument("--distributions", default="zipf:1.05,uniform")
    p.add_argument("--disk-baseline", action="store_true",
                   help="measure the disk's random-read limit with fio first (apt-get install fio)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--samples", type=int, default=100, help="samples per request")
    p.add_argument("--duration", type=float, default=20)
    p.add_argument("--warmup-seconds", type=float, default=0,
                   help="load with other requests of the same distribution first, unmeasured, to fill the cache")
    p.add_argument("--layouts", default="id",
                   help="table layouts to compare: id (as written), popularity (`narsil tables order`)")
    p.add_argument("--id-log-requests", type=int, default=2000,
                   help="requests in the id log the popularity layout is ordered by")
    p.add_argument("--distinct-requests", type=int, default=8000,
                   help="prebuilt requests the load cycles through: enough that the rows of the ones repeated "
                        "within a run are not what the cache holds")
    args = p.parse_args()
    require_binary(args.binary, "--features torch")
    if not os.path.isdir(CGROUP_ROOT):
        raise SystemExit(f"no cgroup-v1 memory controller at {CGROUP_ROOT}")
    if not os.path.exists(os.path.join(args.source, "schema.json")):
        raise SystemExit(f"no split model at {args.source}: models/export_dlrm.py --out "
                         f"{os.path.dirname(args.source)} --split")
    started = time.time()
    total, schema = write_model(args.source, args.out, args.rows)
    print(json.dumps({"machine": machine(), "table_bytes": total, "rows_per_table": args.rows,
                      "tables": len(schema["tables"]), "written_s": round(time.time() - started, 1)}), flush=True)
    baseline = []
    if args.disk_baseline:
        if not shutil.which("fio"):
            raise SystemExit("--disk-baseline needs fio: apt-get install fio")
        baseline = disk_baseline(args.out, schema)
        for row in baseline:
            print(json.dumps(row), flush=True)
    models = {"id": args.out}
    if "popularity" in args.layouts.split(","):
        zipf = next((d for d in args.distributions.split(",") if d.startswith("zipf")), "zipf:1.05")
        started = time.time()
        models["popularity"] = popularity_copy(args, args.out, zipf)
        print(json.dumps({"popularity_layout": models["popularity"], "ordered_by": zipf,
                          "id_log_requests": args.id_log_requests, "s": round(time.time() - started, 1)}), flush=True)
    results = []
    for limit in [int(x) for x in args.limits_mib.split(",")]:
        for store in args.stores.split(","):
            if store == "memory" and limit:
                continue
            for distribution in args.distributions.split(","):
                for layout in args.layouts.split(","):
                    model_dir = models[layout]
                    drop_cached(model_dir, json.load(open(os.path.join(model_dir, "schema.json"))))
                    result = run(args, model_dir, limit, store, distribution, layout)
                    print(json.dumps(result), flush=True)
                    results.append(result)
    print(f"\ntables {total / 2**30:.1f} GiB ({args.rows:,} rows x {len(schema['tables'])}), c{args.concurrency}, "
          f"{args.samples} samples per request, {args.warmup_seconds:g} s warm-up, {args.duration:g} s measured")
    print(f"disk store's row cache: {args.cache_mib} MiB")
    for row in baseline:
        print(f"fio 4 KiB random direct reads, {row['fio']}: " + (
            row.get("error") or f"{row['iops']:,} IOPS, mean {row['mean_latency_us']} us"))
    print("| memory limit | store | ids | layout | req/s | p50 ms | p99 ms | major faults / request | cache hit rate (tables) | "
          "rows from disk / request | KiB read / request | read us | dedup | cgroup peak MiB | RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        limit = "none" if r["limit_mib"] == "none" else f"{r['limit_mib']} MiB"
        hit_rate = "-" if r["cache_hit_rate"] is None else r["cache_hit_rate"]
        from_disk = "-" if r["rows_from_disk_per_request"] is None else r["rows_from_disk_per_request"]
        if r["hit_rate_by_table"]:
            hit_rate = f"{hit_rate} ({r['hit_rate_by_table'][0]}-{r['hit_rate_by_table'][1]})"
        dash = lambda v: "-" if v is None else v
        print(f"| {limit} | {r['store']} | {r['ids']} | {r['layout']} | {r['req_per_s']} | {r['p50_ms']} | {r['p99_ms']} | "
              f"{r['major_faults_per_request']} | {hit_rate} | {from_disk} | {dash(r['disk_kib_per_request'])} | "
              f"{dash(r['disk_read_mean_us'])} | {dash(r['dedup_ratio'])} | {r['cgroup_peak_mib']} | {dash(r['rss_mib'])} |")


if __name__ == "__main__":
    main()
