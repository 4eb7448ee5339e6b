#!/usr/bin/env python3
"""`narsil tables map` of a vocabulary far larger than the memory it may
use: the peak that lets it map tables larger than RAM.

1. Writes, in a work directory (`--dir`, on disk, not tmpfs; its free space
   is checked first: the vocabulary, the sorted runs and the map take ~8 +
   16 + 32..64 bytes an id, 6.7 GB at 100M), a split model's schema.json
   with one table of `--ids` rows (no table file: `tables map` never reads
   the rows) and a vocabulary of `--ids` distinct random-looking 64-bit raw
   ids (a bijection of the row number, so no id is given twice; `--format
   i64le`, 8 bytes each, or `text`, a decimal line each, ~21 bytes), then drops the vocabulary's pages from the page cache
   (`posix_fadvise`: the command reads it from disk, charged to its cgroup).
2. Runs `narsil tables map` (a release build) in a memory cgroup limited to
   `--limit-mib` (cgroup v1 `memory.limit_in_bytes`, or v2 `memory.max`;
   page cache included), and reports whether it completed, its seconds, its
   peak RSS (the VmHWM the command prints; not the kernel's maxrss of
   children, which a fork of this script inflates), the cgroup's peak (`memory.max_usage_in_bytes` / `memory.peak`:
   page cache included, so it reaches the limit whenever the files are
   larger; what the limit bounds) and OOM kills.
3. Checks the result: the map's size and SHA-256 against the schema, and
   `--check-ids` rows' raw ids looked up in the map file as the server does
   (MurmurHash3 fmix64 home slot, linear probing), plus ids it must not hold.
4. Removes the work directory (unless `--keep`).

Needs root (a memory cgroup), a release build with `--features torch`
(`cargo build --release --features torch`). Standard library only (numpy,
when importable, writes the vocabulary faster).
"""

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import time

from benchlib import DEFAULT_BINARY, machine, require_binary

M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def raw_id(row):
    """Row `row`'s raw id (as u64): a bijection of u64, so distinct."""
    x = ((row + 1) * GOLDEN) & M64
    return x ^ (x >> 31)


def fmix64(k):
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & M64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & M64
    return k ^ (k >> 33)


def write_vocabulary(path, ids, form):
    """`ids` raw ids, row 0's first: `i64le` (8 bytes each) or `text` (a
    decimal line each, unsigned: half are above i64::MAX)."""
    chunk = 1 << 22
    with open(path, "wb") as f:
        for start in range(0, ids, chunk):
            end = min(ids, start + chunk)
            try:
                import numpy as np
                x = np.arange(start + 1, end + 1, dtype=np.uint64) * np.uint64(GOLDEN)
                block = x ^ (x >> np.uint64(31))
                values = block.tolist() if form == "text" else None
                data = block.astype("<u8").tobytes() if form == "i64le" else None
            except ImportError:
                values = [raw_id(r) for r in range(start, end)]
                data = struct.pack(f"<{len(values)}Q", *values) if form == "i64le" else None
            if form == "text":
                data = ("\n".join(map(str, values)) + "\n").encode()
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def write_schema(model, rows):
    os.makedirs(os.path.join(model, "tables"), exist_ok=True)
    schema = {
        "format": "narsil-split-1", "name": "tables-map-bench", "version": "1", "num_dense": 1,
        "tables": [{"name": "items", "rows": rows, "dim": 8, "storage": "int8_rowwise", "row_bytes": 16,
                    "file": "tables/items.bin", "sha256": ""}],
        "features": [{"name": "item", "table": "items", "pooling": "sum", "weighted": False}],
        "outputs": ["default"], "dense_network": "dense.pt",
    }
    with open(os.path.join(model, "schema.json"), "w") as f:
        json.dump(schema, f, indent=2)


def map_bytes(ids):
    home_slots = 1 << max(0, (2 * ids - 1).bit_length())
    return 64 + 16 * home_slots


class Cgroup:
    """A memory cgroup limited to `limit` bytes (v1, else v2)."""

    def __init__(self, limit):
        name = f"narsil-tables-map-{os.getpid()}"
        if os.path.isdir("/sys/fs/cgroup/memory"):
            self.v1, self.path = True, os.path.join("/sys/fs/cgroup/memory", name)
        else:
            root = "/sys/fs/cgroup/unified" if os.path.isdir("/sys/fs/cgroup/unified") else "/sys/fs/cgroup"
            self.v1, self.path = False, os.path.join(root, name)
        os.makedirs(self.path, exist_ok=True)
        self.write("memory.limit_in_bytes" if self.v1 else "memory.max", str(limit))

    def write(self, name, value):
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def read(self, name):
        try:
            with open(os.path.join(self.path, name)) as f:
                return f.read()
        except OSError:
            return None

    def peak(self):
        text = self.read("memory.max_usage_in_bytes" if self.v1 else "memory.peak")
        return None if text is None else int(text)

    def oom_kills(self):
        text = self.read("memory.oom_control" if self.v1 else "memory.events") or ""
        found = re.search(r"oom_kill (\d+)", text)
        return int(found.group(1)) if found else None

    def limit_hits(self):
        text = self.read("memory.failcnt") if self.v1 else None
        return None if text is None else int(text)

    def remove(self):
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def check_map(model, ids, samples):
    """The map's file against the schema, and `samples` lookups."""
    schema = json.load(open(os.path.join(model, "schema.json")))
    spec = schema["tables"][0]["ids"]["map"]
    path = os.path.join(model, spec["file"])
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while block := f.read(1 << 22):
            sha.update(block)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    assert sha.hexdigest() == spec["sha256"], "the map is not the file schema.json names"
    with open(path, "rb") as f:
        magic, home_slots, slots, entries, rows = struct.unpack("<16s4Q", f.read(48))
        assert magic == b"NARSIL-IDMAP-1\n\0" and entries == ids and rows == ids, (magic, entries, rows)

        def lookup(raw):
            at = fmix64(raw) & (home_slots - 1)
            while at < slots:
                f.seek(64 + 16 * at)
                held, row = struct.unpack("<QQ", f.read(16))
                if row == M64:
                    return None
                if held == raw:
                    return row
                at += 1
            return None

        rng = random.Random(7)
        for row in [0, ids - 1] + [rng.randrange(ids) for _ in range(samples)]:
            assert lookup(raw_id(row)) == row, f"row {row}'s raw id is not found"
        for row in range(ids, ids + samples // 10):
            assert lookup(raw_id(row)) is None, f"raw id of row {row} (past the vocabulary) is found"
    return os.path.getsize(path), spec["sha256"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", default=DEFAULT_BINARY)
    p.add_argument("--dir", default="/var/tmp/narsil-tables-map", help="work directory (removed at the end)")
    p.add_argument("--ids", type=int, default=100_000_000, help="raw ids in the vocabulary (and the table's rows)")
    p.add_argument("--limit-mib", type=int, default=256, help="the cgroup's memory limit, MiB")
    p.add_argument("--format", choices=["i64le", "text"], default="i64le", help="the vocabulary's format")
    p.add_argument("--memory-bytes", type=int, default=None,
                   help="`tables map --memory-bytes` (default: the command's own default)")
    p.add_argument("--check-ids", type=int, default=10_000, help="raw ids looked up in the map afterwards")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args()
    require_binary(args.binary, "--features torch")
    if os.path.exists(args.dir):
        raise SystemExit(f"{args.dir} exists: remove it or name another --dir")
    parent = os.path.dirname(os.path.abspath(args.dir))
    need = (8 if args.format == "i64le" else 21) * args.ids + 16 * args.ids + map_bytes(args.ids) + (1 << 30)
    free = shutil.disk_usage(parent).free
    if free < need:
        raise SystemExit(f"{parent} has {free / 1e9:.1f} GB free; {args.ids:,} ids need {need / 1e9:.1f} GB "
                         "(vocabulary, sorted runs, map, 1 GB spare)")
    os.makedirs(args.dir)
    model, vocabulary = os.path.join(args.dir, "model"), os.path.join(args.dir, f"vocabulary.{args.format}")
    cgroup = None
    try:
        started = time.time()
        write_schema(model, args.ids)
        write_vocabulary(vocabulary, args.ids, args.format)
        print(json.dumps({"machine": machine(), "ids": args.ids, "format": args.format, "vocabulary_bytes": os.path.getsize(vocabulary),
                          "written_s": round(time.time() - started, 1), "free_gb_before": round(free / 1e9, 1)}),
              flush=True)
        cgroup = Cgroup(args.limit_mib << 20)
        cmd = [args.binary, "tables", "map", model, "--table", "items", "--vocabulary", vocabulary,
               "--vocabulary-format", args.format, "--default-row", "0"]
        if args.memory_bytes:
            cmd += ["--memory-bytes", str(args.memory_bytes)]
        # Joins the cgroup before exec: every page it touches is charged there.
        script = f'echo $$ > {cgroup.path}/cgroup.procs && exec "$@"'
        started = time.time()
        run = subprocess.run(["sh", "-c", script, "sh"] + cmd, capture_output=True, text=True)
        seconds = time.time() - started
        sys.stderr.write(run.stderr[-4000:])
        found = re.search(r"peak RSS ([\d.]+) MiB", run.stdout)
        result = {
            "ids": args.ids, "format": args.format, "limit_mib": args.limit_mib, "memory_bytes": args.memory_bytes or "default",
            "completed": run.returncode == 0, "exit": run.returncode, "seconds": round(seconds, 1),
            "vmhwm_mib": float(found.group(1)) if found else None,
            "cgroup_peak_mib": None if cgroup.peak() is None else round(cgroup.peak() / 2**20, 1),
            "cgroup_limit_hits": cgroup.limit_hits(), "oom_kills": cgroup.oom_kills(),
        }
        if run.returncode == 0:
            result["map_bytes"], result["sha256"] = check_map(model, args.ids, args.check_ids)
            result["checked_ids"] = args.check_ids
        result["output"] = run.stdout.strip()
        print(json.dumps(result), flush=True)
        print(f"\n| ids | format | memory limit | --memory-bytes | completed | s | VmHWM MiB | cgroup peak MiB | map GB |")
        print("|---|---|---|---|---|---|---|---|---|")
        print(f"| {args.ids:,} | {args.format} | {args.limit_mib} MiB | {result['memory_bytes']} | {result['completed']} | "
              f"{result['seconds']} | {result['vmhwm_mib']} | {result['cgroup_peak_mib']} | "
              f"{result.get('map_bytes', 0) / 1e9:.2f} |")
        if run.returncode != 0:
            raise SystemExit(f"tables map failed ({run.returncode}): {run.stderr[-2000:]}")
    finally:
        if cgroup:
            cgroup.remove()
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
