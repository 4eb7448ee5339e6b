#!/usr/bin/env python3
"""Narsil vs TorchRec's own C++ inference server, side by side, in one run.

For every configuration (cores x ids per bag x id distribution), each
server is started in turn, waited for, measured at every --concurrency, and
stopped. `--id-distribution uniform zipf:1.05` measures uniformly random ids
and skewed (Zipf) traffic, whose hot ids repeat within and across requests:

  * Narsil batch fp32 / bf16 - `narsil serve --backend torch
    --dense-precision {fp32,bf16}` on model_default.pt
  * TorchRec C++ fp32 / bf16 - TorchRec's `torchrec/inference/server.cpp`,
    built for the CPU by benchmarks/torchrec_cpp/build.sh, on the same
    weights in TorchRec's signature (benchmarks/torchrec_cpp/adapt_model.py:
    frozen as Narsil freezes it; the bf16 file runs the arithmetic Narsil's
    bf16 runs), with libtorch's huge pages on (THP_MEM_ALLOC_ENABLE=1, which
    Narsil sets for itself) unless --torchrec-no-thp
  * with --split-model DIR: Narsil split fp32 / bf16 - the same weights in
    the split form (tables served by Narsil's embedding stage,
    --split-table-store), each also with the stage one batch ahead
    (`--stage-ahead`), Narsil split pt2 fp32 / bf16 (`--dense-form pt2`),
    and Narsil default fp32 (what scripts/serve.sh serves: `--dense-form
    auto`, which picks the form the export timed faster on this CPU)
    where DIR's schema names an AOTInductor package for the precision;
    `--precisions int8` adds Narsil split pt2 int8 (DIR exported with
    `--int8`), held against TorchRec's bf16
  * with --baselines: Narsil worker fp32, Narsil burn (FP32), and the Python
    baseline (benchmarks/baselines/torchrec_python_server.py)

Cores: `1` pins every server to core 0 (Narsil 1 lane, TorchRec with 1
intra-op thread, as its OpenMP team follows the affinity) and the load
generator to core 1; `2` gives the server both cores (Narsil 2 lanes,
TorchRec its default threads) and leaves the load generator unpinned.

Each row's "of limit" is its samples/s per server core over this core's
limit for the row's precision: the peak `narsil bench-forward` measures (the
multiply-add instruction's own peak or the best libtorch GEMM, whichever is
higher) over the dense network's FLOPs per sample (the split model's count,
the same network in every form), measured once before the servers.

Every server gets identical TorchRec-protocol bytes from `narsil load
--protocol torchrec` (closed loop). Prints one table per configuration,
ratios against TorchRec C++, and writes JSON (git sha, CPU, flags, raw
reports) and a PNG chart.

Ranking workload (opt-in, `--candidates N`): each request is one user and N
candidates (`narsil load --candidates N`: users drawn Zipf, 13 request-level
sparse features of 20 ids each and the dense features the user's, 13 one-hot
candidate features, Zipf ids; the issue's workload at N=500). The same
requests (the same draws) go, per precision:

  * Narsil grouped {prec} - the split model (--ranking-model, default
    --split-model, else models/generated/default/split; it must declare its
    request-level features, or pass --ranking-request-level), `--dense-form
    auto`, sent over narsil.v1 with the user's features once per request
    (`--ranking-form grouped`); before the run each prebuilt request's flat
    twin is sent to the same server and every grouped answer is compared
    with it (`--compare-flat`): `max_abs_diff_vs_flat` is the largest
    |grouped - flat| score over the run
  * Narsil flat {prec} - the same server command, the same requests over
    narsil.v1 with the user repeated on every row (`--ranking-form flat`)
  * TorchRec C++ flat {prec} - TorchRec's server on the same weights, the
    same requests flat over TorchRec's protocol (`--protocol torchrec
    --ranking-form flat`); int8 rows are held against its bf16

  * with --ranking-single-file FILE: Narsil single-file flat {prec} - a
    single-file model of the same weights (a sequence model as its team
    hands it over: TorchRec's own modules, scripted) with the same requests
    flat; `--history-len` sets a sequence model's history lengths

  * with --gr-eager SET (--ranking-model a GR import, models/import_gr.py):
    GR eager fp32 - GR's own eager forward on the same checkpoint, one
    request at a time (benchmarks/baselines/gr_eager_server.py, needs
    GR_CHECKOUT), sent the same grouped requests; every GR-model row's
    server is first checked against GR's golden scores (benchmarks/gr_rows.py)

Their table gives candidates/s, req/s, the whole request's p50/p99, request
bytes on the wire, ratios to Narsil flat and TorchRec C++ flat of the same
precision, and max_abs_diff_vs_flat; the JSON keeps them under
"ranking_rows" ("rows" holds the standard rows only). `--ranking-only`
skips the standard rows.

Needs `scripts/serve.sh` to have run once (venv, default model, release
build). TorchRec's server is found at benchmarks/torchrec_cpp/build/
torchrec_server, or built from --torchrec-checkout; without either its rows
are skipped with a message saying how to build it.
Run with the project venv: .venv/bin/python benchmarks/torchrec_dlrm_compare.py
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys

import gr_rows
from benchlib import DEFAULT_BINARY, ROOT, free_port, machine, peak_rss_mib, pinned, require_binary, wait_serving

VENV_PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
MODELS = os.path.join(ROOT, "models", "generated", "default")
TORCHREC_DIR = os.path.join(ROOT, "benchmarks", "torchrec_cpp")
TORCHREC_BIN = os.path.join(TORCHREC_DIR, "build", "torchrec_server")
TORCHREC_ADDR = "127.0.0.1:50051"  # fixed upstream (0.0.0.0:50051)


def cpu_has_bf16():
    """Whether the CPU has the bf16 instructions Narsil's bf16 needs."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:
        return True  # not Linux: let the server decide
    return "avx512_bf16" in flags or "amx_bf16" in flags


def torchrec_server(args):
    """The TorchRec C++ server binary, built if a checkout was given; None
    (with a message) when neither is there."""
    if args.torchrec_checkout and not os.path.exists(args.torchrec_bin):
        subprocess.run(["bash", os.path.join(TORCHREC_DIR, "build.sh"), args.torchrec_checkout,
                        os.path.dirname(args.torchrec_bin)], check=True)
    if os.path.exists(args.torchrec_bin):
        return args.torchrec_bin
    print(f"TorchRec C++ server not found at {args.torchrec_bin}: its rows are skipped. Build it with\n"
          f"  benchmarks/torchrec_cpp/build.sh TORCHREC_CHECKOUT   (a clone of "
          f"https://github.com/meta-pytorch/torchrec), or pass --torchrec-checkout", file=sys.stderr)
    return None


def torchrec_model(args, precision):
    """model_default.pt in TorchRec's signature, written once per precision."""
    path = os.path.join(os.path.dirname(args.model), f"model_torchrec_{precision}.pt")
    if not os.path.exists(path) or os.path.getmtime(path) < os.path.getmtime(args.model):
        subprocess.run([VENV_PYTHON, os.path.join(TORCHREC_DIR, "adapt_model.py"), "--model", args.model,
                        "--out", path, "--dense-precision", precision], check=True)
    return path


def narsil_serve(args, cores):
    """`narsil serve` as every Narsil row runs it on `cores` cores."""
    lanes = "1" if cores == 1 else str(args.lanes_on_two_cores)
    return [args.binary, "serve", "--log-level", "warn", "--lanes", lanes, "--intra-op-threads", "1",
            "--max-batch-requests", str(args.narsil_batch_size), "--batch-timeout-ms", "0"]


def torchrec_command(args, torchrec_bin, precision):
    """TorchRec's C++ server on the model of `precision`, as a command builder taking the address."""
    model = torchrec_model(args, precision)
    env = [] if args.torchrec_no_thp else ["env", "THP_MEM_ALLOC_ENABLE=1"]
    return lambda addr: env + [torchrec_bin, model]


def servers(args, cores, torchrec_bin):
    """(name, command builder taking the address) for every server of a configuration."""
    narsil = narsil_serve(args, cores)
    torch_model = ["--backend", "torch", "--model", args.model]
    out = []
    # INT8 is a split model's package only (dense_int8.pt2).
    whole_model_precisions = [p for p in args.precisions if p != "int8"]
    for precision in whole_model_precisions:
        out.append((f"Narsil batch {precision}", lambda addr, p=precision: narsil + torch_model + [
            "--dense-precision", p, "--execution-mode", "batch", "--addr", addr]))
    if args.split_model:
        split = narsil + ["--backend", "torch", "--model", args.split_model, "--table-store",
                          args.split_table_store, "--execution-mode", "batch"]
        with open(os.path.join(args.split_model, "schema.json")) as f:
            schema = json.load(f)
        # What scripts/serve.sh serves: the split model, FP32, in the form
        # `--dense-form auto` picks on this CPU (the server's log says which).
        if "fp32" in args.precisions:
            out.append(("Narsil default fp32", lambda addr: split + ["--dense-precision", "fp32", "--dense-form",
                                                                    "auto", "--addr", addr]))
        for precision in args.precisions:
            if precision != "int8":
                torchscript = split + ["--dense-precision", precision, "--dense-form", "torchscript"]
                out.append((f"Narsil split {precision}", lambda addr, c=torchscript: c + ["--addr", addr]))
                out.append((f"Narsil split {precision} ahead", lambda addr, c=torchscript: c + [
                    "--stage-ahead", "--addr", addr]))
            if schema.get("dense_package" if precision == "fp32" else f"dense_package_{precision}"):
                out.append((f"Narsil split pt2 {precision}", lambda addr, p=precision: split + [
                    "--dense-precision", p, "--dense-form", "pt2", "--addr", addr]))
    if torchrec_bin:
        for precision in whole_model_precisions:
            out.append((f"TorchRec C++ {precision}", torchrec_command(args, torchrec_bin, precision)))
    if args.baselines:
        out.append(("Narsil worker fp32", lambda addr: narsil + torch_model + ["--execution-mode", "worker",
                                                                            "--addr", addr]))
        out.append(("Narsil burn fp32", lambda addr: narsil + ["--backend", "burn", "--model", args.burn_model,
                                                               "--addr", addr]))
        out.append(("Python baseline fp32", lambda addr: [
            VENV_PYTHON, os.path.join(ROOT, "benchmarks", "baselines", "torchrec_python_server.py"),
            "--model", args.model, "--addr", addr, "--intra-op-threads", "1"]))
    return out


@contextlib.contextmanager
def served(args, name, command, cores, started, protocol):
    """Starts server `name` (`command` of its address) pinned to its cores,
    waits until it serves `protocol`, yields (address, process, ready_s,
    the load's core) and stops it; `started` is what the progress line says
    of it."""
    addr = TORCHREC_ADDR if name.startswith("TorchRec C++") else f"127.0.0.1:{free_port()}"
    server_cores = "0" if cores == 1 else "0,1"
    print(f"  [{cores} core(s), {started}] starting {name} on {addr}", file=sys.stderr, flush=True)
    process = subprocess.Popen(["taskset", "-c", server_cores] + command(addr), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    try:
        ready_s = wait_serving(args.binary, addr, process, args.start_timeout, protocol=protocol)
        yield addr, process, ready_s, 1 if cores == 1 else None
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def load_report(load, load_core, what):
    """`narsil load ... --json` run on `load_core`: its report."""
    out = subprocess.run(pinned(load, load_core), capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{what} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def measure(args, name, command, cores, ids_per_bag, distribution):
    rows = []
    # Every server of these rows answers TorchRec's protocol (the Python baseline only it).
    with served(args, name, command, cores, f"{ids_per_bag} id(s)/bag, {distribution} ids", "torchrec") as (
            addr, process, ready_s, load_core):
        for concurrency in args.concurrency:
            load = [args.binary, "load", "--addr", f"http://{addr}", "--protocol", "torchrec",
                    "--concurrency", str(concurrency), "--requests", str(args.requests),
                    "--warmup", str(args.warmup), "--samples-per-request", str(args.batch_size),
                    "--ids-per-feature", str(ids_per_bag), "--id-distribution", distribution,
                    "--table-rows", str(args.table_rows), "--json", "--allow-failures"]
            report = load_report(load, load_core, f"load against {name}")
            rows.append({"server": name, "cores": cores, "ids_per_bag": ids_per_bag, "concurrency": concurrency,
                         "ready_s": ready_s, **report, "peak_rss_mib": peak_rss_mib(process.pid)})
            print(f"    concurrency {concurrency}: {report['req_per_s']:.1f} req/s, p50 {report['p50_ms']:.1f} ms, "
                  f"p99 {report['p99_ms']:.1f} ms", file=sys.stderr, flush=True)
    return rows


def roofline(args):
    """Per precision, this core's limit in samples/s (`narsil bench-forward`
    on core 0: its peak over the dense FLOPs per sample), or {} when the
    model states no FLOPs count."""
    model = args.split_model or args.model
    limits = {}
    for precision in args.precisions:
        out = subprocess.run(pinned([args.binary, "bench-forward", "--backend", "torch", "--model", model,
                                     "--dense-precision", precision, "--rows", "100", "--seconds", "0.1",
                                     "--peak-seconds", "2", "--log-level", "warn", "--json"], 0),
                             capture_output=True, text=True)
        report = json.loads(out.stdout) if out.returncode == 0 else {}
        if report.get("limit_samples_per_s"):
            limits[precision] = {"samples_per_s": report["limit_samples_per_s"],
                                 "dense_flops_per_sample": report["dense_flops_per_sample"],
                                 "roofline": report["roofline"]}
        else:
            print(f"no {precision} limit: {(out.stderr or 'the model states no dense FLOPs per sample')[-300:]}",
                  file=sys.stderr)
    return limits


def ranking_servers(args, cores, torchrec_bin):
    """(name, command builder taking the address, `narsil load` flags) for
    every server of the ranking workload on `cores` cores."""
    split = narsil_serve(args, cores) + [
        "--backend", "torch", "--model", args.ranking_model, "--table-store", args.split_table_store,
        "--execution-mode", "batch", "--dense-form", "auto"]
    if args.ranking_request_level:
        split += ["--request-level", args.ranking_request_level]
    if args.gr_eager:
        split += gr_rows.NARSIL_FLAGS
    grouped = ["--protocol", "narsil", "--ranking-form", "grouped", "--compare-flat",
               str(args.compare_flat_requests)]
    flat = ["--protocol", "narsil", "--ranking-form", "flat"]
    out = []
    for precision in args.precisions:
        command = split + ["--dense-precision", precision]
        out.append((f"Narsil grouped {precision}", lambda addr, c=command: c + ["--addr", addr], grouped))
        out.append((f"Narsil flat {precision}", lambda addr, c=command: c + ["--addr", addr], flat))
    if args.ranking_single_file:
        # The model as its team hands it over (TorchRec's own modules,
        # scripted): its lanes take every request flat.
        single = narsil_serve(args, cores) + ["--backend", "torch", "--model", args.ranking_single_file,
                                              "--execution-mode", "batch"]
        for precision in [p for p in args.precisions if p != "int8"]:
            command = single + ["--dense-precision", precision]
            out.append((f"Narsil single-file flat {precision}", lambda addr, c=command: c + ["--addr", addr], flat))
    if torchrec_bin:
        torchrec_flat = ["--protocol", "torchrec", "--ranking-form", "flat", "--table-rows", str(args.table_rows)]
        for precision in [p for p in args.precisions if p != "int8"]:
            out.append((f"TorchRec C++ flat {precision}", torchrec_command(args, torchrec_bin, precision),
                        torchrec_flat))
    if args.gr_eager:
        out.append(gr_rows.eager_server(args, cores, VENV_PYTHON))
    return out


def measure_ranking(args, name, command, load_flags, cores):
    """One server of the ranking workload, started, loaded at every
    --concurrency with `--candidates`, stopped; its rows."""
    rows = []
    protocol = "torchrec" if name.startswith("TorchRec C++") else "narsil"
    with served(args, name, command, cores, f"ranking: 1 user x {args.candidates} candidates", protocol) as (
            addr, process, ready_s, load_core):
        checked = gr_rows.before_load(args, name, addr, args.binary, 3e-2 if "bf16" in name else 1e-5) \
            if args.gr_eager else {}
        for concurrency in args.concurrency:
            flat = "--ranking-form" in load_flags and load_flags[load_flags.index("--ranking-form") + 1] == "flat"
            requests = args.ranking_flat_requests if flat and args.ranking_flat_requests else args.ranking_requests
            warmup = min(args.ranking_warmup, requests)
            load = [args.binary, "load", "--addr", f"http://{addr}", "--concurrency", str(concurrency),
                    "--requests", str(requests), "--warmup", str(warmup),
                    "--candidates", str(args.candidates), "--json", "--allow-failures"] + load_flags
            if args.history_len:
                load += ["--history-len", args.history_len]
            report = load_report(load, load_core, f"ranking load against {name}")
            rows.append({"server": name, "workload": "ranking", "cores": cores, "concurrency": concurrency,
                         "ready_s": ready_s, **report, **checked, "peak_rss_mib": peak_rss_mib(process.pid)})
            diff = report.get("max_abs_diff_vs_flat")
            vs_flat = f", max |grouped - flat| {diff:.2e}" if diff is not None else ""
            print(f"    concurrency {concurrency}: {report['candidates_per_s']:.0f} candidates/s, "
                  f"{report['req_per_s']:.1f} req/s, p50 {report['p50_ms']:.1f} ms, p99 {report['p99_ms']:.1f} ms, "
                  f"{report['request_bytes_mean'] / 1e3:.1f} KB/request{vs_flat}", file=sys.stderr, flush=True)
    return rows


def print_ranking_tables(rows):
    for cores in dict.fromkeys(r["cores"] for r in rows):
        mine = [r for r in rows if r["cores"] == cores]
        first = mine[0]
        gr = any("max_abs_diff_vs_gr_golden" in r for r in mine)
        print(f"\n### Ranking, {cores} core(s): 1 user x {first['candidates_per_request']} candidates, "
              f"{first['request_features']} request-level sparse features (and the dense ones), "
              f"{first['id_distribution']} ids\n")
        print("| Server | Concurrency | Candidates/s | Req/s | p50 ms | p99 ms | KB/request | "
              "vs Narsil flat same precision | vs TorchRec C++ flat same precision (int8: bf16) | "
              "max abs diff vs flat | peak RSS MiB |" + (" vs GR eager fp32 | max abs diff vs GR golden |" if gr else ""))
        print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if gr else ""))
        for r in mine:
            def ratio(server):
                ref = next((x for x in mine if x["server"] == server and x["concurrency"] == r["concurrency"]), None)
                if not ref or not ref["candidates_per_s"] or ref is r:
                    return "-"
                return f"{r['candidates_per_s'] / ref['candidates_per_s']:.2f}x"
            precision = r["server"].split()[-1]
            rss = f"{r['peak_rss_mib']:.0f}" if r["peak_rss_mib"] else "?"
            errors = r["requests"] - r["ok"]
            note = f" ({errors} errors)" if errors else ""
            diff = r.get("max_abs_diff_vs_flat")
            diff = "-" if "grouped" not in r["server"] else ("none compared" if diff is None else f"{diff:.2e}")
            if r.get("vs_flat_mismatches"):
                diff += f" ({r['vs_flat_mismatches']} not comparable)"
            print(f"| {r['server']}{note} | {r['concurrency']} | {r['candidates_per_s']:.0f} | {r['req_per_s']:.1f} | "
                  f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['request_bytes_mean'] / 1e3:.1f} | "
                  f"{ratio('Narsil flat ' + precision)} | "
                  f"{ratio('TorchRec C++ flat ' + ('bf16' if precision == 'int8' else precision))} | "
                  f"{diff} | {rss} |" + (f" {ratio('GR eager fp32')} | {r.get('max_abs_diff_vs_gr_golden', 0):.1e} |"
                                           if gr else ""))


def config(row):
    """The table a row belongs to: cores, ids per bag, id distribution."""
    return row["cores"], row["ids_per_bag"], row.get("id_distribution", "uniform")


def print_tables(rows, limits):
    configs = list(dict.fromkeys(config(r) for r in rows))
    for cores, ids, distribution in configs:
        print(f"\n### {cores} core(s), {ids} id(s) per bag, {distribution} ids\n")
        print("| Server | Concurrency | Req/s | Samples/s | p50 ms | p99 ms | vs TorchRec C++ fp32 req/s | "
              "vs TorchRec C++ same precision (int8: bf16) | of limit | peak RSS MiB |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        mine = [r for r in rows if config(r) == (cores, ids, distribution)]
        for r in mine:
            def ratio(server):
                ref = next((x for x in mine if x["server"] == server and x["concurrency"] == r["concurrency"]), None)
                return f"{r['req_per_s'] / ref['req_per_s']:.2f}x" if ref and ref["req_per_s"] else "-"
            precision = next((w for w in r["server"].split() if w in ("fp32", "bf16", "int8")), "fp32")
            rss = f"{r['peak_rss_mib']:.0f}" if r["peak_rss_mib"] else "?"
            limit = limits.get(precision, {}).get("samples_per_s")
            of_limit = f"{r['samples_per_s'] / (limit * cores):.2f}" if limit else "-"
            errors = r["requests"] - r["ok"]
            note = f" ({errors} errors)" if errors else ""
            print(f"| {r['server']}{note} | {r['concurrency']} | {r['req_per_s']:.1f} | {r['samples_per_s']:.0f} | "
                  f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {ratio('TorchRec C++ fp32')} | "
                  f"{ratio('TorchRec C++ ' + ('bf16' if precision == 'int8' else precision))} | {of_limit} | {rss} |")


def chart(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no chart (run scripts/setup_python.sh)", file=sys.stderr)
        return
    configs = list(dict.fromkeys(config(r) for r in rows))
    concurrencies = list(dict.fromkeys(r["concurrency"] for r in rows))
    fig, axes = plt.subplots(len(concurrencies), 1, figsize=(11, 3.6 * len(concurrencies)), squeeze=False)
    names = list(dict.fromkeys(r["server"] for r in rows))
    width = 0.8 / max(1, len(names))
    for ax, concurrency in zip(axes[:, 0], concurrencies):
        for i, name in enumerate(names):
            values = [next((r["req_per_s"] for r in rows if r["server"] == name and r["concurrency"] == concurrency
                            and config(r) == c), 0) for c in configs]
            ax.bar([x + i * width for x in range(len(configs))], values, width, label=name)
        ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(configs))])
        ax.set_xticklabels([f"{c} core(s), {i} id(s)/bag, {d}" for c, i, d in configs])
        ax.set(ylabel="req/s (100 samples each)", title=f"concurrency {concurrency}")
        ax.grid(alpha=0.3, axis="y")
    axes[0, 0].legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", default=DEFAULT_BINARY)
    p.add_argument("--model", default=os.path.join(MODELS, "model_default.pt"))
    p.add_argument("--burn-model", default=os.path.join(MODELS, "weights_fp32.safetensors"))
    p.add_argument("--precisions", nargs="+", choices=["fp32", "bf16", "int8"], default=["fp32", "bf16"],
                   help="int8: the split model's INT8 package only (--split-model exported with --int8)")
    p.add_argument("--cores", type=int, nargs="+", choices=[1, 2], default=[1, 2])
    p.add_argument("--ids-per-bag", type=int, nargs="+", default=[1, 4],
                   help="ids per bag: 1 one-hot, above 1 multi-hot (bag sizes uniform in [0, 2n-1])")
    p.add_argument("--id-distribution", nargs="+", default=["uniform"],
                   help="ids sent (narsil load --id-distribution): uniform, zipf:ALPHA (e.g. zipf:1.05)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--narsil-batch-size", type=int, default=16, help="most requests per fused forward")
    p.add_argument("--lanes-on-two-cores", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=100, help="samples per request")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--split-model", help="also Narsil on this split model (the same weights as --model in the "
                   "split form, e.g. written by benchmarks/big_tables.py)")
    p.add_argument("--split-table-store", default="memory", help="--table-store of the split model's server")
    p.add_argument("--table-rows", type=int, default=100_000,
                   help="rows per table of --model: the ids sent are drawn from 0..table-rows")
    p.add_argument("--baselines", action="store_true",
                   help="also Narsil worker, Narsil burn and the Python baseline")
    p.add_argument("--skip-torchrec", action="store_true")
    p.add_argument("--torchrec-bin", default=TORCHREC_BIN)
    p.add_argument("--torchrec-no-thp", action="store_true",
                   help="run TorchRec's server without THP_MEM_ALLOC_ENABLE=1 (Narsil sets it for itself)")
    p.add_argument("--torchrec-checkout", help="a torchrec clone to build the C++ server from when it is missing")
    p.add_argument("--candidates", type=int, default=0,
                   help="also run the ranking workload: 1 user x this many candidates per request (500: the "
                   "issue's workload), Narsil grouped and flat and TorchRec C++ flat; 0 (default): not run")
    p.add_argument("--ranking-only", action="store_true",
                   help="with --candidates: only the ranking rows (no standard rows, no roofline, no chart)")
    p.add_argument("--ranking-model",
                   help="split model the ranking rows' Narsil serves (declaring its request-level features); "
                   "default: --split-model, else models/generated/default/split")
    p.add_argument("--ranking-request-level",
                   help="`narsil serve --request-level` for the ranking rows' Narsil (e.g. "
                   "cat_0,...,cat_12,dense for an export made before the default DLRM declared them); "
                   "default: what the model declares")
    p.add_argument("--ranking-single-file",
                   help="also a row for this single-file model served flat (a sequence model as its team hands "
                   "it over: models/generated/test-din/model.pt), e.g. with --ranking-model its split form")
    p.add_argument("--history-len",
                   help="narsil load --history-len for the ranking rows (a sequence model's history: N or MIN-MAX)")
    p.add_argument("--ranking-requests", type=int, default=500, help="measured ranking requests per row")
    p.add_argument("--ranking-warmup", type=int, default=50, help="ranking warm-up requests per row")
    p.add_argument("--ranking-flat-requests", type=int,
                   help="measured requests of the flat ranking rows (default --ranking-requests): a generative "
                        "ranker's flat request encodes its history once per candidate")
    p.add_argument("--compare-flat-requests", type=int, default=200,
                   help="Narsil grouped rows: how many of the prebuilt requests' flat twins are sent first and "
                   "compared with every grouped answer (narsil load --compare-flat)")
    p.add_argument("--gr-eager", metavar="SET",
                   help="GR rows: --ranking-model is models/import_gr.py's import of the checkpoint "
                        "models/gr/make_gr_golden.py wrote for SET (e.g. dlrmv3-cpu); adds GR's own eager forward "
                        "(benchmarks/baselines/gr_eager_server.py, needs GR_CHECKOUT) and checks every row's "
                        "server against GR's golden scores first (benchmarks/gr_rows.py)")
    p.add_argument("--gr-checkpoint", help="--gr-eager's checkpoint (default models/generated/gr/SET/checkpoint)")
    p.add_argument("--start-timeout", type=float, default=180)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "torchrec_dlrm_compare"),
                   help="path prefix of the .json and .png written")
    args = p.parse_args()
    if args.ranking_only and args.candidates <= 0:
        p.error("--ranking-only needs --candidates N")
    if args.candidates > 0:
        args.ranking_model = args.ranking_model or args.split_model or os.path.join(MODELS, "split")
    require_binary(args.binary, "--features torch")
    for needed in ([] if args.ranking_only else [args.model]) + ([args.burn_model] if args.baselines else []):
        if not os.path.exists(needed):
            raise SystemExit(f"{needed} not found: run scripts/serve.sh once (it exports the default model)")
    torchrec_bin = None if args.skip_torchrec else torchrec_server(args)
    if "bf16" in args.precisions and not cpu_has_bf16():
        # Narsil refuses bf16 on such CPUs (it would be emulated, slower than FP32).
        print("this CPU has neither AVX512-BF16 nor AMX-BF16: the bf16 rows are skipped", file=sys.stderr)
        args.precisions = [p for p in args.precisions if p != "bf16"]
    if args.candidates > 0 and not os.path.exists(os.path.join(args.ranking_model, "schema.json")):
        raise SystemExit(f"--candidates: no split model at {args.ranking_model} (pass --ranking-model or "
                         "--split-model, or run scripts/serve.sh once)")
    if args.gr_eager:
        gr_rows.check_args(args)
    if "int8" in args.precisions:
        schema_path = os.path.join(args.split_model or args.ranking_model or "", "schema.json")
        with_int8 = os.path.exists(schema_path) and json.load(open(schema_path)).get("dense_package_int8")
        if not with_int8:
            print("int8 rows need --split-model with an INT8 package (models/export_dlrm.py --split --int8): "
                  "skipped", file=sys.stderr)
            args.precisions = [p for p in args.precisions if p != "int8"]

    host = machine()
    limits = {} if args.ranking_only else roofline(args)
    for precision, limit in limits.items():
        print(f"{precision} limit: {limit['samples_per_s']:.0f} samples/s per core "
              f"({limit['dense_flops_per_sample'] / 1e6:.2f} MFLOP/sample)", file=sys.stderr)
    rows = []
    for cores in [] if args.ranking_only else args.cores:
        for ids_per_bag in args.ids_per_bag:
            for distribution in args.id_distribution:
                for name, command in servers(args, cores, torchrec_bin):
                    rows.extend(measure(args, name, command, cores, ids_per_bag, distribution))
    ranking_rows = []
    if args.candidates > 0:
        for cores in args.cores:
            for name, command, load_flags in ranking_servers(args, cores, torchrec_bin):
                ranking_rows.extend(measure_ranking(args, name, command, load_flags, cores))

    if rows:
        print(f"# {host['cpu']}, {host['cores']} cores, git {host['git_sha']}; {args.batch_size} samples/request; "
              f"Narsil batch size {args.narsil_batch_size}, batch timeout 0; load: narsil load --protocol torchrec, "
              f"{args.requests} requests after {args.warmup} warm-up")
        print_tables(rows, limits)
    if ranking_rows:
        print(f"\n# {host['cpu']}, {host['cores']} cores, git {host['git_sha']}; ranking: 1 user x "
              f"{args.candidates} candidates/request; Narsil batch size {args.narsil_batch_size}, batch timeout 0, "
              f"{args.ranking_model}; load: narsil load --candidates {args.candidates}, {args.ranking_requests} "
              f"requests after {args.ranking_warmup} warm-up")
        print_ranking_tables(ranking_rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    result = {**host, "args": vars(args), "limits": limits, "rows": rows}
    if args.candidates > 0:
        result["ranking_rows"] = ranking_rows
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    if rows:
        chart(rows, args.out + ".png")
        print(f"\nwrote {args.out}.json and {args.out}.png", file=sys.stderr)
    else:
        print(f"\nwrote {args.out}.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
