#!/usr/bin/env python3
"""MLPerf's LoadGen drives a running Narsil over gRPC (benchmarks/loadgen/).

  benchmarks/loadgen/.venv/bin/python benchmarks/loadgen/run.py --addr 127.0.0.1:50051 \\
      --scenario Server --find-peak --qps-high 40 --out benchmarks/results/loadgen

Results are MLPerf-shaped, unverified: never MLPerf results. Runs may be
short (`--duration-s`, LoadGen's min_duration) and load fewer samples than
MLPerf's (`--queries`, its performance_sample_count_override); every run
writes a user.conf saying so and is marked "not a submission".

* Scenarios: `Server` (Poisson arrivals at --target-qps, latency counted
  from each query's scheduled time; VALID only when the p99 stays within
  the model key's bound) and `Offline` (every sample at once, at most
  --max-inflight calls in flight). Performance only, or `--mode accuracy`:
  every golden query of the export's loadgen_golden.npz once, its scores
  checked against the golden ones (--score-bound).
* Constraints come from LoadGen's own mlperf.conf under the exact model key
  (`--model-key dlrm-v2`: Server p99 <= 60 ms; `dlrm-v3`: 80 ms). Any other
  key falls back to `*.Server.target_latency = 10` ms without a word (MLPerf's
  reference script passes its model path there); the bound in force is read
  back from LoadGen's detail log and printed with every run.
* `--find-peak`: the highest Server target QPS whose run is VALID, by
  bisection between --qps-low and --qps-high (raised while VALID), each
  step's LoadGen summary and detail logs kept in its own directory under
  --out; `--confirm-s` reruns the rate found at that duration.
* Queries: MLPerf-shaped (models/mlperf_traffic.py): 100-700 pairs from
  MLPerf's quantile list, 214 ids a pair, the first id of a bag Zipf-like
  (--zipf), drawn for the served tables (ModelInfo's rows, or MLPerf's sizes
  capped at --max-rows, which must fit the served ones). With `--model-key
  dlrm-v3`, against a served GR import (models/import_gr.py, GR's streaming
  feature set): DLRMv3-shaped queries (models/dlrmv3_traffic.py), one user's
  contexts and history (--history) once and its candidates (--candidates)
  as rows, in time order; a query's pairs are its candidates. The same
  queries drive GR's own eager forward behind
  benchmarks/baselines/gr_eager_server.py.

Prints one line per run and writes --out/results.json. Needs the harness's
own venv (benchmarks/loadgen/setup.sh) and a Narsil serving the model.
"""

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time

import mlperf_loadgen as lg
import numpy as np

from queries import Dlrmv3Queries, Queries, mlperf_traffic
from sut import NarsilSut

LABEL = "MLPerf-shaped, unverified (not a submission)"


def user_conf(path: str, args, scenario: str, qps: float) -> str:
    """The run's user.conf: LoadGen's mlperf.conf stays in force under
    --model-key; only the run's length, sample count and rate are set."""
    key = args.model_key
    lines = [f"# {LABEL}: shortened run, fewer samples than MLPerf loads.",
             f"{key}.*.min_duration = {int(args.duration_s * 1000)}",
             f"{key}.*.min_query_count = {args.min_queries or (700 if scenario == 'Server' else 100)}",
             f"{key}.*.performance_sample_count_override = {args.queries}",
             f"{key}.{scenario}.target_qps = {qps}"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def summary_of(directory: str) -> dict:
    """The figures of LoadGen's mlperf_log_summary.txt and the latency bound
    its detail log says was in force."""
    text = open(os.path.join(directory, "mlperf_log_summary.txt")).read()

    def field(pattern, cast=float):
        m = re.search(pattern, text, re.M)
        return cast(m.group(1)) if m else None

    out = {
        "result": field(r"^Result is : (\w+)", str),
        "samples_per_s": field(r"^(?:Completed samples per second|Samples per second)\s*:\s*([\d.]+)"),
        "scheduled_samples_per_s": field(r"^Scheduled samples per second\s*:\s*([\d.]+)"),
        "p50_ms": field(r"^50\.00 percentile latency \(ns\)\s*:\s*(\d+)"),
        "p99_ms": field(r"^99\.00 percentile latency \(ns\)\s*:\s*(\d+)"),
        "p90_ms": field(r"^90\.00 percentile latency \(ns\)\s*:\s*(\d+)"),
        "max_ms": field(r"^Max latency \(ns\)\s*:\s*(\d+)"),
    }
    for k in ("p50_ms", "p90_ms", "p99_ms", "max_ms"):
        out[k] = out[k] / 1e6 if out[k] is not None else None
    detail = open(os.path.join(directory, "mlperf_log_detail.txt")).read()
    m = re.search(r'"key": "effective_target_latency_ns", "value": (\d+)', detail)
    out["latency_bound_ms"] = int(m.group(1)) / 1e6 if m else None
    return out


def one_run(args, sut: NarsilSut, scenario: str, mode: str, qps: float, name: str) -> dict:
    """One LoadGen test; its logs in --out/NAME."""
    directory = os.path.join(args.out, name)
    os.makedirs(directory, exist_ok=True)
    settings = lg.TestSettings()
    settings.scenario = lg.TestScenario.Server if scenario == "Server" else lg.TestScenario.Offline
    conf = user_conf(os.path.join(directory, "user.conf"), args, scenario, qps)
    if settings.FromConfig(conf, args.model_key, scenario) != 0:
        raise SystemExit(f"LoadGen refused {conf}")
    settings.mode = lg.TestMode.AccuracyOnly if mode == "accuracy" else lg.TestMode.PerformanceOnly
    log_out = lg.LogOutputSettings()
    log_out.outdir = directory
    log_out.copy_summary_to_stdout = False
    log_settings = lg.LogSettings()
    log_settings.log_output = log_out
    log_settings.enable_trace = False
    sut.failures.clear()
    pairs_before, completed_before = sut.pairs_done, sut.completed
    wall = sut.run(settings, log_settings)
    result = {"name": name, "scenario": scenario, "mode": mode, "target_qps": qps, "wall_s": round(wall, 1),
              "failures": dict(sut.failures), "logs": directory}
    if mode == "performance":
        result.update(summary_of(directory))
        samples = sut.completed - completed_before
        mean_pairs = (sut.pairs_done - pairs_before) / samples if samples else 0.0
        result["mean_pairs_per_query"] = round(mean_pairs, 1)
        result["pairs_per_s"] = round(result["samples_per_s"] * mean_pairs, 1) if result["samples_per_s"] else None
        if sut.failures and result["result"] == "VALID":
            result["result"] = "INVALID (failed calls)"
        if result["latency_bound_ms"] is None or (scenario == "Server" and
                                                  abs(result["latency_bound_ms"] - args.expected_bound_ms) > 1e-6):
            raise SystemExit(f"LoadGen ran with a latency bound of {result['latency_bound_ms']} ms, not the "
                             f"{args.expected_bound_ms} ms of {args.model_key}: the model key did not take")
    print(f"[{LABEL}] {name}: " + ", ".join(f"{k}={v}" for k, v in result.items()
                                             if k not in ("logs", "name")), flush=True)
    return result


def valid(result: dict) -> bool:
    return result["result"] == "VALID"


def child_run(args, scenario: str, qps: float, duration: float, name: str) -> dict:
    """One performance test in a process of its own: LoadGen applies its
    built-in mlperf.conf only on a process's first TestSettings.FromConfig,
    so a second test in the same process would run with LoadGen's bare
    defaults (a 100 ms Server bound, other seeds) instead of the model key's.
    Its logs and results.json go to --out/NAME."""
    skip = {"--find-peak": 0, "--child": 0, "--out": 1, "--target-qps": 1, "--duration-s": 1, "--scenario": 1, "--confirm-s": 1}
    argv, i = [], 0
    while i < len(sys.argv[1:]):
        arg = sys.argv[1 + i]
        flag = arg.split("=", 1)[0]
        if flag in skip:
            i += 1 + (skip[flag] if "=" not in arg else 0)
            continue
        argv.append(arg)
        i += 1
    out = os.path.join(args.out, name)
    subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--scenario", scenario, "--target-qps",
                    str(qps), "--duration-s", str(duration), "--out", out, "--child"], check=True)
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)["run"]


def find_peak(args) -> dict:
    """The highest VALID Server target QPS, by bisection (each step a
    LoadGen test of its own, `child_run`)."""
    runs = []

    def attempt(qps, duration=None):
        qps = round(qps, 3)
        duration = duration or args.duration_s
        runs.append(child_run(args, "Server", qps, duration, f"server-qps{qps:.3f}-{duration:g}s"))
        return runs[-1]

    lo, hi = args.qps_low, max(args.qps_high, args.qps_low * 2)
    while not valid(attempt(lo)):  # a VALID lower end
        floor = len(runs) > 1 and runs[-1]["p99_ms"] and runs[-2]["p99_ms"] and \
            runs[-1]["p99_ms"] > 0.9 * runs[-2]["p99_ms"] and runs[-1]["p99_ms"] > runs[-1]["latency_bound_ms"]
        if floor or lo / 2 < args.qps_min:
            # Halving the rate no longer lowers the p99: it is the queries' own latency, not queueing.
            why = (f"p99 {runs[-1]['p99_ms']:.1f} ms at {lo} queries/s, no lower than at {2 * lo}: over the "
                   f"{runs[-1]['latency_bound_ms']:g} ms bound at any rate" if floor else "no VALID rate found")
            print(f"[{LABEL}] {why}", flush=True)
            return {"peak_qps": None, "runs": runs, "why": why}
        hi, lo = lo, lo / 2
    raised = 0
    while valid(attempt(hi)):  # an upper end that is not
        if raised == 4:
            return {"peak_qps": hi, "runs": runs, "note": "VALID at the highest rate tried"}
        lo, hi, raised = hi, hi * 2, raised + 1
    steps = 0
    while hi - lo > args.precision * hi and steps < args.max_steps:
        mid = (lo + hi) / 2
        if valid(attempt(mid)):
            lo = mid
        else:
            hi = mid
        steps += 1
    peak = {"peak_qps": lo, "runs": runs}
    if args.confirm_s:
        while True:
            confirm = attempt(lo, args.confirm_s)
            if valid(confirm) or lo <= args.qps_min:
                break
            lo *= 0.9
        peak.update(peak_qps=lo if valid(confirm) else None, confirmed=confirm)
    return peak


def span(text: str) -> tuple:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def served_rows(info, args) -> list:
    """The table rows DLRM-v2's traffic draws from: MLPerf's capped at
    --max-rows, checked against what the server serves (its ModelInfo), or
    the server's own."""
    rows = [f.num_rows for f in info.sparse_features]
    if len(rows) != 26 or info.num_dense != mlperf_traffic.NUM_DENSE:
        raise SystemExit(f"the served model has {info.num_dense} dense and {len(rows)} sparse features, "
                         f"not DLRM-v2's 13 and 26")
    if args.max_rows:
        wanted = mlperf_traffic.capped_rows(args.max_rows)
        short = [i for i, (w, r) in enumerate(zip(wanted, rows)) if r and w > r]
        if short:
            raise SystemExit(f"--max-rows {args.max_rows} draws ids past the served tables of features {short}")
        return wanted
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--addr", default="127.0.0.1:50051", help="Narsil's gRPC address (host:port)")
    p.add_argument("--model", default="", help="model name on a repository server (default: its default)")
    p.add_argument("--scenario", choices=["Server", "Offline"], default="Server")
    p.add_argument("--mode", choices=["performance", "accuracy"], default="performance")
    p.add_argument("--model-key", choices=["dlrm-v2", "dlrm-v3"], default="dlrm-v2",
                   help="LoadGen's model key: its mlperf.conf's constraints for that benchmark")
    p.add_argument("--target-qps", type=float, default=10.0, help="Server: queries/s; Offline: expected queries/s")
    p.add_argument("--find-peak", action="store_true", help="Server: bisect for the highest VALID target QPS")
    p.add_argument("--qps-low", type=float, default=1.0)
    p.add_argument("--qps-high", type=float, default=20.0)
    p.add_argument("--qps-min", type=float, default=0.25, help="--find-peak gives up below this")
    p.add_argument("--precision", type=float, default=0.05, help="--find-peak stops within this fraction")
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--confirm-s", type=float, default=0.0, help="--find-peak: rerun the peak for this long")
    p.add_argument("--duration-s", type=float, default=60.0, help="LoadGen's min_duration (MLPerf: 600)")
    p.add_argument("--min-queries", type=int, default=0,
                   help="LoadGen's min_query_count (default: Server 700, enough for LoadGen's early stopping to "
                        "accept a p99 with one query over the bound (662); Offline 100)")
    p.add_argument("--queries", type=int, default=1024, help="distinct queries loaded (MLPerf: 204,800)")
    p.add_argument("--zipf", type=float, default=1.05, help="exponent of the bags' first ids")
    p.add_argument("--max-rows", type=int, default=0,
                   help="draw ids for MLPerf's tables capped at this (the export's --max-rows); 0: the server's")
    p.add_argument("--history", default="256-1024",
                   help="--model-key dlrm-v3: a query's history positions, MIN-MAX (uniform)")
    p.add_argument("--candidates", default="64-256",
                   help="--model-key dlrm-v3: a query's candidates, MIN-MAX (uniform; MLPerf's DLRMv3: 2,048)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--channels", type=int, default=4, help="gRPC channels, round robin")
    p.add_argument("--max-inflight", type=int, default=-1,
                   help="most calls in flight (default: unbounded for Server, 4 for Offline)")
    p.add_argument("--golden", default="", help="--mode accuracy: the export's loadgen_golden.npz")
    p.add_argument("--score-bound", type=float, default=1e-5,
                   help="--mode accuracy: largest |score - golden| allowed (FP32 dense: 1e-5; bf16: about 1e-2)")
    p.add_argument("--out", default="benchmarks/results/loadgen", help="LoadGen's logs and results.json")
    p.add_argument("--note", default="", help="free text kept in results.json (CPU pinning, precision, ...)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one test, started by child_run
    args = p.parse_args()
    args.expected_bound_ms = {"dlrm-v2": 60.0, "dlrm-v3": 80.0}[args.model_key]
    if args.max_inflight < 0:
        args.max_inflight = 4 if args.scenario == "Offline" else 0
    os.makedirs(args.out, exist_ok=True)

    report = {"label": LABEL, "cpu": cpu_name(), "cores": os.cpu_count(), "client_affinity": sorted(os.sched_getaffinity(0)),
              "loadgen": "mlcommons-loadgen " + package_version(), "model_key": args.model_key,
              "argv": sys.argv[1:], "note": args.note, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.find_peak and args.scenario == "Server" and args.mode == "performance":
        report["peak"] = find_peak(args)
        print(f"[{LABEL}] highest VALID Server target: {report['peak']['peak_qps']} queries/s", flush=True)
    else:
        probe = NarsilSut(args.addr, Queries([], []), channels=1, model=args.model)
        info = probe._run(probe.model_info())
        rows = served_rows(info, args) if args.model_key == "dlrm-v2" else None
        probe.close()
        if args.model_key == "dlrm-v3":
            if args.mode == "accuracy":
                raise SystemExit("--model-key dlrm-v3 runs performance only (check a GR import's scores with "
                                 "narsil verify and its golden.json)")
            queries = Dlrmv3Queries.drawn(info, args.queries, span(args.history), span(args.candidates), args.seed)
            print(f"drew {len(queries)} DLRMv3 queries ({np.mean([queries.pairs(i) for i in range(len(queries))]):.0f}"
                  f" candidates on average)", flush=True)
        elif args.mode == "accuracy":
            if not args.golden:
                raise SystemExit("--mode accuracy needs --golden (the export's loadgen_golden.npz)")
            queries = Queries.golden(args.golden)
            args.queries = len(queries)
        else:
            started = time.time()
            queries = Queries.drawn(args.queries, rows, args.zipf, args.seed)
            print(f"drew {len(queries)} queries ({np.mean([len(d) for d in queries.dense]):.0f} pairs on average) "
                  f"in {time.time() - started:.1f} s", flush=True)
        sut = NarsilSut(args.addr, queries, channels=args.channels, max_inflight=args.max_inflight, model=args.model,
                        keep_scores=args.mode == "accuracy")
        try:
            if args.mode == "accuracy":
                report["accuracy"] = accuracy(args, sut, queries)
            else:
                report["run"] = one_run(args, sut, args.scenario, "performance", args.target_qps,
                                        f"{args.scenario.lower()}-qps{args.target_qps:.3f}")
        finally:
            sut.close()
        rate = (report.get("run") or {}).get("samples_per_s") or 0
        if (args.scenario == "Offline" and "run" in report and not valid(report["run"]) and rate > args.target_qps
                and not args.child):
            # Offline issues target_qps x min_duration samples: too few ran short; once more at 1.5x the rate seen
            # (neighbours on a shared machine move the rate between runs).
            report["first_run"] = report["run"]
            report["run"] = child_run(args, "Offline", round(rate * 1.5, 3), args.duration_s, "retuned")
    path = os.path.join(args.out, "results.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}")
    return 0


def accuracy(args, sut: NarsilSut, queries: Queries) -> dict:
    """Every golden query once through LoadGen (AccuracyOnly); the scores
    against the golden ones."""
    result = one_run(args, sut, "Offline", "accuracy", 1.0, "accuracy")
    missing = [i for i in range(len(queries)) if i not in sut.scores]
    diffs = np.concatenate([np.abs(sut.scores[i] - queries.golden_scores[i]) for i in sut.scores]) \
        if sut.scores else np.array([np.inf])
    ok = not missing and not result["failures"] and float(diffs.max()) <= args.score_bound
    got = np.concatenate([sut.scores[i] for i in sorted(sut.scores)]) if sut.scores else np.zeros(0)
    want = np.concatenate([queries.golden_scores[i] for i in sorted(sut.scores)]) if sut.scores else np.zeros(0)
    out = {**result, "queries": len(queries), "pairs": int(sum(len(d) for d in queries.dense)),
           "missing": missing, "max_abs_diff": float(diffs.max()), "mean_abs_diff": float(diffs.mean()),
           "golden_score_std": float(want.std()) if len(want) else None,
           "rank_correlation": rank_correlation(got, want), "score_bound": args.score_bound, "passed": ok}
    print(f"[{LABEL}] accuracy: {'PASSED' if ok else 'FAILED'}: max |score - golden| {out['max_abs_diff']:.2e} "
          f"(bound {args.score_bound:g}), mean {out['mean_abs_diff']:.2e} (golden scores' std "
          f"{out['golden_score_std']:.2e}), rank correlation {out['rank_correlation']:.6f}, {len(missing)} queries "
          f"missing", flush=True)
    return out


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation of two score vectors (how far the order
    of the pairs agrees; ties broken by position)."""
    if len(a) < 2:
        return float("nan")
    ra, rb = np.argsort(np.argsort(a)).astype(np.float64), np.argsort(np.argsort(b)).astype(np.float64)
    return float(np.corrcoef(ra, rb)[0, 1])


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def package_version() -> str:
    try:
        from importlib.metadata import version
        return version("mlcommons-loadgen")
    except Exception:  # noqa: BLE001 (a version string only)
        return "?"


if __name__ == "__main__":
    sys.exit(main())
