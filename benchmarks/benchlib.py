"""Helpers shared by Narsil's benchmark scripts (standard library only):
ports, core pinning, health waiting, process memory, machine description."""

import os
import platform
import socket
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_BINARY = os.path.join(ROOT, "target", "release", "narsil")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned(cmd, core):
    """`cmd` under `taskset -c core` when the machine has two or more cores."""
    if core is not None and (os.cpu_count() or 1) > 1:
        return ["taskset", "-c", str(core)] + cmd
    return cmd


def wait_serving(binary, addr, process=None, timeout=120, protocol="narsil"):
    """Waits until a Predict of one sample (in `protocol`: narsil or
    torchrec) succeeds; returns the seconds it took."""
    started = time.time()
    while time.time() - started < timeout:
        if process is not None and process.poll() is not None:
            err = process.stderr.read().decode(errors="replace") if process.stderr else ""
            raise SystemExit(f"server exited with {process.returncode} before serving:\n{err[-2000:]}")
        probe = subprocess.run(
            [binary, "load", "--addr", f"http://{addr}", "--protocol", protocol, "--requests", "1",
             "--warmup", "0", "--samples-per-request", "1", "--json"],
            capture_output=True, text=True)
        if probe.returncode == 0 and '"OK"' in probe.stdout:
            return time.time() - started
        time.sleep(0.05)
    raise SystemExit(f"server at {addr} never answered")


def status_mib(pid, field):
    """A memory field of /proc/PID/status (VmRSS, VmHWM, ...), MiB; None if unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def peak_rss_mib(pid):
    """The process's peak resident set (VmHWM), MiB; None if unreadable."""
    return status_mib(pid, "VmHWM")


def machine():
    """Git sha, CPU model and core count, for every report."""
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                         capture_output=True, text=True).stdout.strip()
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    return {"git_sha": sha, "cpu": cpu, "cores": os.cpu_count()}


def require_binary(binary, features=""):
    if not os.path.exists(binary):
        raise SystemExit(f"{binary} not found: build it first (cargo build --release {features}".rstrip() + ")")
