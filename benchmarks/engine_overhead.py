#!/usr/bin/env python3
"""Engine overhead with the fixed-latency mock backend.

Starts `narsil serve --backend mock` and drives it with `narsil load` (closed
loop) at several concurrencies, for worker mode (many lanes) and batch mode
(one lane). Reports observed latency and the engine's added latency
(observed minus the mock's forward latency), and for batch mode the
throughput against the ideal (requests per fused batch / forward latency).

Then, per protocol (narsil.v1 and TorchRec's), the server's CPU per request:
a 0 ms mock, an open-loop load at --cpu-rate requests/s (below capacity) for
--cpu-seconds, and the server process's CPU time (user + system, from
/proc/PID/stat) over the load divided by the requests answered.

"Added" latency is observed minus the mock's nominal latency; "outside
forward" is, per request, observed minus the forward time the server
reports, so a forward that overran its nominal time (a sleeping mock's
wake-up on a virtual CPU) is not charged to the engine.

The transport floor (`examples/grpc_floor.rs`: the same gRPC server settings
and protocols, decoding each request and answering zeros, no engine) gets the
same CPU-per-request run and a concurrency-1 latency run: what tonic, HTTP/2
and loopback TCP cost here, which Narsil's numbers include.

Server and load generator are pinned to separate cores when there are two or
more. Standard library only; needs a release build (`cargo build --release`,
and `cargo build --release --example grpc_floor` for the floor).
"""

import os

import argparse
import json
import subprocess
import sys

from benchlib import DEFAULT_BINARY, free_port, machine, pinned, require_binary, wait_serving


def with_server(args, command, protocol, run):
    """Starts `command(addr)` pinned to core 0, waits until it answers in
    `protocol`, returns `run(addr, server)`, and stops it."""
    addr = f"127.0.0.1:{free_port()}"
    server = subprocess.Popen(pinned(command(addr), 0), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_serving(args.binary, addr, server, protocol=protocol)
        return run(addr, server)
    finally:
        server.terminate()
        server.wait(timeout=30)


def load(args, addr, protocol, *flags):
    """`narsil load` pinned to core 1; its JSON report."""
    command = [args.binary, "load", "--addr", f"http://{addr}", "--protocol", protocol,
               "--samples-per-request", str(args.samples), "--json", *map(str, flags)]
    out = subprocess.run(pinned(command, 1), capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def closed_loop(args, addr, protocol, concurrency):
    length = ["--duration", args.duration] if args.duration else ["--requests", args.requests]
    return load(args, addr, protocol, "--concurrency", concurrency, "--warmup", args.warmup, *length)


def run_case(args, mode, lanes, concurrency):
    def serve(addr):
        return [args.binary, "serve", "--addr", addr, "--backend", "mock",
                "--mock-latency-ms", str(args.latency_ms), "--execution-mode", mode,
                "--lanes", str(lanes), "--max-batch-requests", str(args.batch_size),
                "--batch-timeout-ms", "0", "--log-level", "warn"]
    return with_server(args, serve, "narsil", lambda addr, _: closed_loop(args, addr, "narsil", concurrency))


def cpu_seconds(pid):
    """User + system CPU time of a process so far, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def narsil_server(args):
    return lambda addr: [args.binary, "serve", "--addr", addr, "--backend", "mock", "--mock-latency-ms", "0",
                         "--max-batch-requests", str(args.batch_size), "--log-level", "warn"]


def floor_server(args, forward_ms=0.0):
    return lambda addr: [args.floor_binary, addr, str(forward_ms)]


def floor_c1(args, protocol, forward_ms):
    """Concurrency-1 latency through the floor server, each request holding
    its handler thread for `forward_ms`."""
    return with_server(args, floor_server(args, forward_ms), protocol,
                       lambda addr, _: closed_loop(args, addr, protocol, 1))


def cpu_per_request(args, protocol, server=narsil_server):
    """Server CPU microseconds per request at a fixed offered rate."""
    def measure(addr, process):
        before = cpu_seconds(process.pid)
        report = load(args, addr, protocol, "--rate", args.cpu_rate, "--duration", args.cpu_seconds,
                      "--warmup", 0)
        used = cpu_seconds(process.pid) - before
        return {"protocol": protocol, "cpu_s": used, "ok": report["ok"], "req_per_s": report["req_per_s"],
                "us_per_request": used / max(1, report["ok"]) * 1e6}
    return with_server(args, server(args), protocol, measure)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", default=DEFAULT_BINARY)
    p.add_argument("--latency-ms", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--worker-lanes", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16, help="requests per fused batch (batch mode)")
    p.add_argument("--samples", type=int, default=100, help="samples per request")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--duration", type=float, help="seconds per case instead of --requests")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--cpu-rate", type=float, default=1000, help="offered req/s for the CPU-per-request runs")
    p.add_argument("--cpu-seconds", type=float, default=10)
    p.add_argument("--skip-latency", action="store_true", help="only the CPU-per-request runs")
    p.add_argument("--floor-binary", default=os.path.join(os.path.dirname(DEFAULT_BINARY), "examples", "grpc_floor"),
                   help="the transport floor server (cargo build --release --example grpc_floor)")
    p.add_argument("--skip-floor", action="store_true")
    p.add_argument("--json-out", help="write all results to this file")
    args = p.parse_args()
    require_binary(args.binary)
    host = machine()
    print(f"# engine overhead: mock {args.latency_ms} ms/forward, {args.samples} samples/request, "
          f"git {host['git_sha']}, {host['cpu']}, {host['cores']} cores")
    rows = []
    cases = [] if args.skip_latency else [("worker", args.worker_lanes), ("batch", 1)]
    if not args.skip_floor and not os.path.exists(args.floor_binary):
        raise SystemExit(f"{args.floor_binary} not found: cargo build --release --example grpc_floor "
                         "(or pass --skip-floor)")
    print("| mode | lanes | conc | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | forward ms (mean) "
          "| outside forward p50 ms | outside forward p99 ms | mean fused reqs | ideal req/s | vs ideal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode, lanes in cases:
        for c in args.concurrency:
            r = run_case(args, mode, lanes, c)
            added50 = r["p50_ms"] - args.latency_ms
            added99 = r["p99_ms"] - args.latency_ms
            fused_reqs = r["mean_fused_rows"] / args.samples if r["mean_fused_rows"] else 0
            # Ideal: every forward back to back (batch mode: with the measured
            # requests per fused batch), nothing added by the engine.
            per_forward = fused_reqs if mode == "batch" else min(c, lanes)
            ideal = per_forward / (args.latency_ms / 1e3)
            ratio = r["req_per_s"] / ideal
            rows.append({"mode": mode, "lanes": lanes, "concurrency": c, "ideal_req_per_s": ideal,
                         "added_p50_ms": added50, "added_p99_ms": added99, **r})
            print(f"| {mode} | {lanes} | {c} | {r['req_per_s']:.0f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} "
                  f"| {added50:.3f} | {added99:.3f} | {r['mean_compute_ms']:.3f} | {r['outside_forward_p50_ms']:.3f} "
                  f"| {r['outside_forward_p99_ms']:.3f} | {fused_reqs:.1f} | {ideal:.0f} | {ratio:.3f} |",
                  flush=True)
    floor = {}
    if not args.skip_floor:
        print("\nfloor server at concurrency 1 (no engine): the handler sleeps the forward time on the "
              "thread that read the request, no hand-off\n")
        print("| protocol | forward ms | p50 ms | p99 ms | added p50 ms |")
        print("|---|---|---|---|---|")
        for protocol in ("narsil", "torchrec"):
            for forward_ms in (0.0, args.latency_ms):
                r = floor_c1(args, protocol, forward_ms)
                floor[f"c1_{protocol}_{forward_ms:g}ms"] = r
                print(f"| {protocol} | {forward_ms:g} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} "
                      f"| {r['p50_ms'] - forward_ms:.3f} |", flush=True)
    print(f"\nserver CPU per request: 0 ms mock, batch mode, open loop at {args.cpu_rate:.0f} req/s for "
          f"{args.cpu_seconds:.0f} s, {args.samples} samples/request\n")
    print("| protocol | req/s answered | server CPU s | µs per request | transport floor µs | engine µs |")
    print("|---|---|---|---|---|---|")
    cpu = []
    for protocol in ("torchrec", "narsil"):
        r = cpu_per_request(args, protocol)
        if not args.skip_floor:
            r["floor_us_per_request"] = cpu_per_request(args, protocol, floor_server)["us_per_request"]
        cpu.append(r)
        floor_us = r.get("floor_us_per_request")
        floor_cells = "- | -" if floor_us is None else f"{floor_us:.0f} | {r['us_per_request'] - floor_us:.0f}"
        print(f"| {protocol} | {r['req_per_s']:.0f} | {r['cpu_s']:.2f} | {r['us_per_request']:.0f} | {floor_cells} |",
              flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({**host, "args": vars(args), "results": rows, "floor": floor, "cpu_per_request": cpu},
                      f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
