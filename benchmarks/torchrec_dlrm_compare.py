#!/usr/bin/env python3
"""Narsil vs TorchRec-style serving, side by side, in one run.

Servers (each started in turn, pinned to core 0, waited for, warmed up,
measured, stopped):

  * Narsil batch  - `narsil serve --execution-mode batch` (--narsil-backend)
  * Narsil worker - `narsil serve --execution-mode worker`
  * Narsil burn   - `narsil serve --backend burn` on the FP32 weights (batch mode)
  * Python baseline - benchmarks/baselines/torchrec_python_server.py: grpcio,
    one TorchScript forward per request (how most teams serve TorchRec models)
  * TorchRec C++ server - only with --torchrec-server-bin: the script runs
    `BIN [--torchrec-server-args]` (default: the model path) and expects it
    on 127.0.0.1:50051, TorchRec's default port

Every server is driven the same way: `narsil load --protocol torchrec`
(TorchRec's inference protocol, so every server sees identical bytes),
closed loop at each --concurrency, pinned to core 1, same intra-op threads.
Prints one table (Server | Concurrency | Req/s | Samples/s | p50 ms | p99 ms |
peak RSS MiB), writes JSON (git sha, CPU, flags, raw reports) and a PNG of
throughput and p99 against concurrency.

Needs `scripts/serve.sh` to have run once (venv, default model, release build).
Run with the project venv: .venv/bin/python benchmarks/torchrec_dlrm_compare.py
"""

import argparse
import json
import os
import subprocess
import sys

from benchlib import DEFAULT_BINARY, ROOT, free_port, machine, peak_rss_mib, pinned, require_binary, wait_serving

VENV_PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
MODELS = os.path.join(ROOT, "models", "generated", "default")



def servers(args):
    """(name, command builder taking the address) for every server in the run."""
    narsil = [args.binary, "serve", "--log-level", "warn", "--lanes", str(args.narsil_lanes),
              "--intra-op-threads", str(args.intra_op_threads), "--batch-size", str(args.narsil_batch_size),
              "--batch-timeout-ms", str(args.narsil_batch_timeout_ms)]
    model = args.narsil_torch_model if args.narsil_backend == "torch" else None
    backend = ["--backend", args.narsil_backend] + (["--model", model] if model else [])
    modes = [args.narsil_execution_mode] if args.narsil_execution_mode else ["batch", "worker"]
    out = []
    for mode in modes:
        out.append((f"Narsil {mode} ({args.narsil_backend})",
                    lambda addr, mode=mode: narsil + backend + ["--execution-mode", mode, "--addr", addr]))
    if args.narsil_backend != "burn" and not args.skip_burn:
        out.append(("Narsil burn (FP32)", lambda addr: narsil + ["--backend", "burn", "--model", args.burn_model,
                                                                 "--execution-mode", "batch", "--addr", addr]))
    if not args.skip_python_baseline:
        out.append(("Python baseline (TorchRec protocol)", lambda addr: [
            VENV_PYTHON, os.path.join(ROOT, "benchmarks", "baselines", "torchrec_python_server.py"),
            "--model", args.narsil_torch_model, "--addr", addr, "--intra-op-threads", str(args.intra_op_threads)]))
    if args.torchrec_server_bin and not args.skip_torchrec:
        extra = (args.torchrec_server_args or args.torchrec_model).split()
        out.append(("TorchRec C++ server", lambda addr: [args.torchrec_server_bin] + extra))
    return out


def measure(args, name, command):
    fixed_addr = "127.0.0.1:50051" if name.startswith("TorchRec C++") else None
    addr = fixed_addr or f"127.0.0.1:{free_port()}"
    print(f"  starting {name} on {addr}", file=sys.stderr, flush=True)
    process = subprocess.Popen(pinned(command(addr), 0), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rows = []
    try:
        ready_s = wait_serving(args.binary, addr, process, args.start_timeout, protocol="torchrec")
        for concurrency in args.concurrency:
            load = [args.binary, "load", "--addr", f"http://{addr}", "--protocol", "torchrec",
                    "--concurrency", str(concurrency), "--requests", str(args.requests),
                    "--warmup", str(args.warmup), "--batch-size", str(args.batch_size), "--json"]
            out = subprocess.run(pinned(load, 1), capture_output=True, text=True)
            if out.returncode != 0:
                raise SystemExit(f"load against {name} failed:\n{out.stderr[-2000:]}")
            report = json.loads(out.stdout)
            rows.append({"server": name, "concurrency": concurrency, "ready_s": ready_s, **report,
                         "peak_rss_mib": peak_rss_mib(process.pid)})
            print(f"    concurrency {concurrency}: {report['req_per_s']:.1f} req/s, p99 {report['p99_ms']:.1f} ms",
                  file=sys.stderr, flush=True)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
    return rows


def chart(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no chart (run scripts/setup_python.sh)", file=sys.stderr)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in dict.fromkeys(r["server"] for r in rows):
        mine = [r for r in rows if r["server"] == name]
        xs = [r["concurrency"] for r in mine]
        ax1.plot(xs, [r["samples_per_s"] for r in mine], marker="o", label=name)
        ax2.plot(xs, [r["p99_ms"] for r in mine], marker="o", label=name)
    ax1.set(xlabel="concurrency", ylabel="samples/s", title="throughput")
    ax2.set(xlabel="concurrency", ylabel="p99 ms", title="p99 latency")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", default=DEFAULT_BINARY)
    p.add_argument("--narsil-backend", default="torch", choices=["torch", "burn", "mock"])
    p.add_argument("--narsil-torch-model", default=os.path.join(MODELS, "model_default.pt"))
    p.add_argument("--burn-model", default=os.path.join(MODELS, "weights_fp32.safetensors"))
    p.add_argument("--narsil-execution-mode", choices=["batch", "worker"], help="default: both")
    p.add_argument("--narsil-batch-size", type=int, default=16)
    p.add_argument("--narsil-batch-timeout-ms", type=float, default=0.0)
    p.add_argument("--narsil-lanes", type=int, default=1)
    p.add_argument("--intra-op-threads", type=int, default=1, help="every server's libtorch threads")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--batch-size", type=int, default=100, help="samples per request")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--skip-burn", action="store_true")
    p.add_argument("--skip-python-baseline", action="store_true")
    p.add_argument("--skip-torchrec", action="store_true")
    p.add_argument("--torchrec-server-bin", help="a TorchRec C++ inference server you built")
    p.add_argument("--torchrec-model", default=os.path.join(MODELS, "model_default.pt"))
    p.add_argument("--torchrec-server-args", help="arguments for the TorchRec server (default: the model path)")
    p.add_argument("--start-timeout", type=float, default=180)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "torchrec_dlrm_compare"),
                   help="path prefix of the .json and .png written")
    args = p.parse_args()
    require_binary(args.binary, "--features torch")
    for needed in ([args.narsil_torch_model] if args.narsil_backend == "torch" or not args.skip_python_baseline
                   else []) + ([] if args.skip_burn else [args.burn_model]):
        if not os.path.exists(needed):
            raise SystemExit(f"{needed} not found: run scripts/serve.sh once (it exports the default model)")

    host = machine()
    rows = []
    for name, command in servers(args):
        rows.extend(measure(args, name, command))

    print(f"# {host['cpu']}, {host['cores']} cores, git {host['git_sha']}; {args.batch_size} samples/request, "
          f"{args.intra_op_threads} intra-op thread(s), Narsil lanes {args.narsil_lanes}, "
          f"batch size {args.narsil_batch_size}; load: narsil load --protocol torchrec, {args.requests} requests "
          f"after {args.warmup} warm-up\n")
    print("| Server | Concurrency | Req/s | Samples/s | p50 ms | p99 ms | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        rss = f"{r['peak_rss_mib']:.0f}" if r["peak_rss_mib"] else "?"
        errors = r["requests"] - r["ok"]
        note = f" ({errors} errors)" if errors else ""
        print(f"| {r['server']}{note} | {r['concurrency']} | {r['req_per_s']:.1f} | {r['samples_per_s']:.0f} | "
              f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {rss} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({**host, "args": vars(args), "rows": rows}, f, indent=2)
    chart(rows, args.out + ".png")
    print(f"\nwrote {args.out}.json and {args.out}.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
