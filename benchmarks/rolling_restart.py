#!/usr/bin/env python3
"""Zero-loss rolling restart: HAProxy in front of Narsil replicas on one host.

1. Installs HAProxy if missing (scripts/setup_system.sh haproxy) and starts
   `--replicas` Narsil servers on 127.0.0.1, each with `--drain-grace-secs`,
   and HAProxy (deploy/haproxy/haproxy.cfg.in) balancing gRPC per call and
   checking each replica's `/healthz`.
2. Steady state: `narsil load` closed loop through HAProxy for `--duration`.
3. Rolling restart: the same load while each replica in turn gets SIGTERM,
   exits, starts again and turns healthy.
4. Reports every answer by status code (any non-OK answer, or a request with
   no answer, is a loss), p50/p99 in both windows, each replica's exit code
   and restart time. Exits 1 if anything was lost.

Standard library only; needs a release build with `--features torch` for a
TorchScript `--model` (the default DLRM from scripts/serve.sh), or
`--model mock` for the engine's fixed-latency mock.
"""

import argparse
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

from benchlib import DEFAULT_BINARY, ROOT, free_port, machine, require_binary, wait_serving


def healthy(admin):
    try:
        return urllib.request.urlopen(f"http://{admin}/healthz", timeout=1).status == 200
    except (urllib.error.URLError, OSError):
        return False


class Replica:
    def __init__(self, args, index):
        self.args, self.index = args, index
        self.port, self.admin_port = free_port(), free_port()
        self.admin = f"127.0.0.1:{self.admin_port}"
        self.process = None

    def start(self):
        cmd = [self.args.binary, "serve", "--addr", f"127.0.0.1:{self.port}", "--metrics-addr", self.admin,
               "--drain-grace-secs", str(self.args.drain_grace), "--lanes", "1", "--log-level", "warn"]
        cmd += ["--backend", "mock", "--mock-latency-ms", "2"] if self.args.model == "mock" else [
            "--model", self.args.model]
        self.process = subprocess.Popen(cmd)

    def wait_healthy(self, timeout=120):
        started = time.time()
        while not healthy(self.admin):
            if self.process.poll() is not None or time.time() - started > timeout:
                raise SystemExit(f"replica {self.index} did not turn healthy")
            time.sleep(0.05)

    def restart(self):
        """SIGTERM, wait for the drain and exit, start again, wait healthy."""
        started = time.time()
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=120)
        stopped = time.time()
        self.start()
        self.wait_healthy()
        return {"replica": self.index, "exit_code": code, "drain_s": round(stopped - started, 2),
                "back_healthy_s": round(time.time() - stopped, 2)}


def load(args, addr, duration, rate=None):
    cmd = [args.binary, "load", "--addr", f"http://{addr}", "--concurrency", str(args.concurrency),
           "--samples-per-request", str(args.samples), "--duration", str(duration), "--warmup", "20",
           "--timeout-ms", "30000", "--json", "--allow-failures"]
    if rate is not None:
        cmd += ["--rate", str(rate)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def summary(report):
    return {"requests": report["requests"], "ok": report["ok"], "by_code": report["by_code"],
            "req_per_s": round(report["req_per_s"], 1), "p50_ms": round(report["p50_ms"], 2),
            "p99_ms": round(report["p99_ms"], 2), "max_ms": round(report["max_ms"], 2)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", default=DEFAULT_BINARY)
    p.add_argument("--model", default=os.path.join(ROOT, "models", "generated", "default", "model_default.pt"),
                   help="TorchScript model, or `mock`")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--drain-grace", type=float, default=1.0, help="--drain-grace-secs of each replica")
    p.add_argument("--duration", type=float, default=15.0, help="seconds of the steady window")
    p.add_argument("--rolling-window", type=float, default=0.0,
                   help="seconds of load while replicas restart (default: 2 + 8 per replica + 2)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--samples", type=int, default=100, help="samples per request")
    p.add_argument("--no-restart", action="store_true", help="measure the steady window only (capacity)")
    p.add_argument("--rates", default="", help="open-loop rates to measure (req/s, comma-separated), steady only")
    p.add_argument("--json-out", help="write the results to this file")
    args = p.parse_args()
    require_binary(args.binary, "--features torch")
    subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup_system.sh"), "haproxy"], check=True)

    replicas = [Replica(args, i) for i in range(args.replicas)]
    haproxy = None
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_healthy()
        front = free_port()
        with open(os.path.join(ROOT, "deploy", "haproxy", "haproxy.cfg.in")) as f:
            config = f.read()
        servers = "\n".join(f"    server r{r.index} 127.0.0.1:{r.port} port {r.admin_port}" for r in replicas)
        config = config.replace("@FRONT_PORT@", str(front)).replace("@SERVERS@", servers)
        cfg = tempfile.NamedTemporaryFile("w", suffix=".cfg", delete=False)
        cfg.write(config)
        cfg.close()
        haproxy = subprocess.Popen(["haproxy", "-db", "-f", cfg.name])
        addr = f"127.0.0.1:{front}"
        wait_serving(args.binary, addr, haproxy)

        steady = load(args, addr, args.duration)
        print(json.dumps({"steady": summary(steady)}), flush=True)
        result = {"machine": machine(), "model": args.model, "replicas": args.replicas,
                  "drain_grace_s": args.drain_grace, "concurrency": args.concurrency, "samples": args.samples,
                  "steady": summary(steady)}
        if args.rates:
            result["open_loop"] = [{"rate": float(r), **summary(load(args, addr, args.duration, float(r)))}
                                   for r in args.rates.split(",")]
        if args.no_restart or args.rates:
            print(json.dumps(result, indent=2))
            return
        restarts = []

        def roll():
            time.sleep(2.0)
            for r in replicas:
                restarts.append(r.restart())
                time.sleep(1.0)

        roller = threading.Thread(target=roll)
        roller.start()
        window = args.rolling_window or 2.0 + 8.0 * args.replicas + 2.0
        rolling = load(args, addr, window)
        load_ended = time.time()
        roller.join()
        if time.time() - load_ended > 0.5:
            raise SystemExit(f"the restarts outlasted the {window} s window: raise --rolling-window")
        result |= {"rolling": summary(rolling), "restarts": restarts}
    finally:
        if haproxy is not None:
            haproxy.terminate()
            haproxy.wait(timeout=10)
        for r in replicas:
            if r.process is not None and r.process.poll() is None:
                r.process.send_signal(signal.SIGTERM)
                r.process.wait(timeout=60)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    lost = [w for w in ("steady", "rolling") if result[w]["ok"] != result[w]["requests"]]
    if lost or any(r["exit_code"] != 0 for r in restarts) or len(restarts) != args.replicas:
        raise SystemExit(f"calls lost or replicas failed: {lost} {restarts}")


if __name__ == "__main__":
    main()
