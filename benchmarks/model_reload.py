#!/usr/bin/env python3
"""Live reload and several models, measured on the real binary.

`switch` (default):
1. Serves a model repository holding version 1 of `dlrm` (the model file is
   linked, not copied), one lane, pinned to core 0.
2. Each round: `narsil load` closed loop (pinned to core 1) for `--duration`
   seconds in steady state; then the same load while a new version is
   published one second in (written under a dot-name, renamed into place,
   then SIGHUP so no poll interval is counted).
3. Reports, per round, the time from the rename to the new version taking
   requests (GET /v1/models shows it READY and the old one gone), and the
   p50/p99 latency and throughput of the steady and the switching window.

`memory`: publishes `--versions` versions in turn, alternating between
`--model` and `--model-b` (default: the FP32 exports of the two small test
models), each once its predecessor is gone, under closed-loop load the
whole time, and reports the server's RSS after each publish: a serving
process must not keep anything of a version it retired.

`models`: the same server with two models (`alpha`, `beta`, the same file)
under c8 each, against one model under c16, alternating, to show what
serving two models on separate lanes costs when cores are the limit.

Standard library only; needs a release build with `--features torch`.
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

from benchlib import DEFAULT_BINARY, ROOT, free_port, machine, pinned, require_binary, status_mib, wait_serving


def publish(repo, model, version, model_file):
    """Publishes `model_file` (a TorchScript file, linked as model.pt, or a
    split model's directory, its files hard-linked) as `version`."""
    staging = os.path.join(repo, model, f".incoming-{version}")
    if os.path.isdir(model_file):
        shutil.copytree(model_file, staging, copy_function=os.link)
    else:
        os.makedirs(staging)
        os.symlink(os.path.abspath(model_file), os.path.join(staging, "model.pt"))
    os.rename(staging, os.path.join(repo, model, str(version)))


def versions(admin):
    listed = json.load(urllib.request.urlopen(f"http://{admin}/v1/models", timeout=5))
    return {m["name"]: {v["version"]: v["state"] for v in m["versions"]} for m in listed["models"]}


def load(args, addr, concurrency, duration, model=""):
    cmd = [args.binary, "load", "--addr", f"http://{addr}", "--concurrency", str(concurrency),
           "--samples-per-request", str(args.samples), "--duration", str(duration), "--warmup", "20",
           "--json", "--allow-failures", "--model", model]
    out = subprocess.run(pinned(cmd, 1), capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def summary(report):
    return {k: round(report[k], 2) for k in ("req_per_s", "p50_ms", "p99_ms", "max_ms")} | {
        "non_ok": report["requests"] - report["ok"]}


def start_server(args, repo, extra=()):
    addr, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    cmd = [args.binary, "serve", "--addr", addr, "--metrics-addr", admin, "--model-repository", repo,
           "--repository-poll-secs", "0", "--log-level", "warn", "--lanes", "1", *extra]
    server = subprocess.Popen(pinned(cmd, 0), stderr=subprocess.PIPE)
    wait_serving(args.binary, addr, server)
    return server, addr, admin


def switch(args, repo):
    publish(repo, "dlrm", 1, args.model)
    server, addr, admin = start_server(args, repo)
    rounds = []
    try:
        for r in range(args.rounds):
            steady = load(args, addr, args.concurrency, args.duration)
            version = r + 2
            result = {}

            def publish_and_time():
                time.sleep(1.0)
                started = time.time()
                publish(repo, "dlrm", version, args.model)
                server.send_signal(signal.SIGHUP)
                while True:
                    states = versions(admin)["dlrm"]
                    if states.get(str(version)) == "READY" and str(version - 1) not in states:
                        result["publish_to_serving_s"] = round(time.time() - started, 3)
                        return
                    time.sleep(0.01)

            timer = threading.Thread(target=publish_and_time)
            timer.start()
            switching = load(args, addr, args.concurrency, args.duration)
            timer.join()
            rounds.append({"round": r + 1, "steady": summary(steady), "switching": summary(switching), **result})
            print(json.dumps(rounds[-1]), flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    return rounds


def memory(args, repo):
    model_b = args.model_b or os.path.join(ROOT, "models", "generated", "test-small-b", "model_fp32.pt")
    publish(repo, "dlrm", 1, args.model)
    server, addr, admin = start_server(args, repo, args.serve_arg)
    cmd = [args.binary, "load", "--addr", f"http://{addr}", "--concurrency", str(args.concurrency),
           "--samples-per-request", str(args.samples), "--duration", "100000", "--warmup", "0", "--json"]
    loader = subprocess.Popen(pinned(cmd, 1), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rss = []
    try:
        for version in range(2, args.versions + 2):
            publish(repo, "dlrm", version, model_b if version % 2 == 0 else args.model)
            server.send_signal(signal.SIGHUP)
            deadline = time.time() + 60
            while True:
                states = versions(admin)["dlrm"]
                if states.get(str(version)) == "READY" and str(version - 1) not in states:
                    break
                if time.time() > deadline:
                    raise SystemExit(f"version {version} not serving alone within 60 s: {states}")
                time.sleep(0.01)
            time.sleep(args.settle)
            rss.append(round(status_mib(server.pid, "VmRSS"), 1))
            print(json.dumps({"publish": version - 1, "rss_mib": rss[-1]}), flush=True)
    finally:
        loader.kill()
        loader.wait()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    tenth = rss[min(9, len(rss) - 1)]
    return {"model_b": os.path.relpath(model_b, ROOT), "rss_mib_after_each_publish": rss,
            "rss_mib_growth_publish_10_to_last": round(rss[-1] - tenth, 1)}


def models(args, repo):
    for name in ("alpha", "beta"):
        publish(repo, name, 1, args.model)
    server, addr, admin = start_server(args, repo, ["--default-model", "alpha"])
    rounds = []
    try:
        for r in range(args.rounds):
            one = load(args, addr, args.concurrency, args.duration, "alpha")
            both = [None, None]

            def run(i, name):
                both[i] = load(args, addr, args.concurrency // 2, args.duration, name)

            threads = [threading.Thread(target=run, args=(i, n)) for i, n in enumerate(("alpha", "beta"))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            rounds.append({"round": r + 1, "one_model": summary(one),
                           "two_models": [summary(b) for b in both],
                           "two_models_req_per_s": round(sum(b["req_per_s"] for b in both), 1)})
            print(json.dumps(rounds[-1]), flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    return rounds


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", nargs="?", choices=["switch", "memory", "models"], default="switch")
    p.add_argument("--binary", default=DEFAULT_BINARY)
    p.add_argument("--model", default=os.path.join(ROOT, "models", "generated", "default", "model_default.pt"))
    p.add_argument("--model-b", help="memory: the version published in turn with --model "
                   "(default: models/generated/test-small-b/model_fp32.pt)")
    p.add_argument("--versions", type=int, default=50, help="memory: versions published")
    p.add_argument("--settle", type=float, default=0.5, help="memory: seconds between a switch and reading RSS")
    p.add_argument("--serve-arg", action="append", default=[], help="memory: extra `narsil serve` argument")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=10.0, help="seconds of each load window")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--samples", type=int, default=100, help="samples per request")
    p.add_argument("--json-out", help="write the results to this file")
    args = p.parse_args()
    require_binary(args.binary, "--features torch")
    if not os.path.exists(args.model):
        raise SystemExit(f"{args.model} not found: run scripts/serve.sh once to export the default model")
    repo = tempfile.mkdtemp(prefix="narsil-repo-")
    try:
        rounds = {"switch": switch, "memory": memory, "models": models}[args.scenario](args, repo)
    finally:
        shutil.rmtree(repo)
    result = {"machine": machine(), "scenario": args.scenario, "model": os.path.relpath(args.model, ROOT),
              "concurrency": args.concurrency, "samples": args.samples, "duration_s": args.duration,
              "rounds": rounds}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
