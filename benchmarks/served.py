"""A (d) configuration: `eg2 serve` as a real server process, called over loopback HTTP by client processes.

The server is the user's command (`python -m app.cli serve`, the `eg2` entry point's code) with its
defaults; EG2_* variables apply as they would for `eg2 serve`, except the API key, host, port and log
level, which the benchmark sets. Its boot is its own: load, warm-up, graph capture at start.

Steps, each timed as a phase of the process's GPU memory (sampled from here, by PID):
    boot    start -> /ready says 200 (load, warm-up, graphs): `ready` is the reading then, and the
            phase's peak is the boot peak
    named   the named workloads, one request per call from one client process
    sweep   single-item requests from C concurrent clients over several client processes
Also recorded: /metrics' eg2_gpu_memory_bytes{kind} (the engine's own report) at each point, and
/info at the end (the memory plan, the limits in effect). The server's log goes to a file beside the
results.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.http_load import measure_named, sweep
from benchmarks.process_memory import PeakSampler, memory_record
from benchmarks.server_process import free_port, serve_command, stop, wait_ready
from benchmarks.timing import Budget, Progress, Stopped, failure
from benchmarks.workloads import Input, Workload

_GAUGE = re.compile(r'^eg2_gpu_memory_bytes\{kind="(\w+)"\}\s+(\S+)$', re.M)
# Settings the benchmark sets itself: anything else in EG2_* applies as it would for `eg2 serve`.
_OWN = ("EG2_API_KEY", "EG2_HOST", "EG2_PORT", "EG2_LOG_LEVEL", "EG2_MODEL")


@dataclass(frozen=True)
class Served:
    """One server configuration: which checkpoint, which flags, what to run against it."""

    model_dir: Path
    device: str
    modalities: tuple[str, ...] | None = None
    gpu_memory_mib: int | None = None
    sweep: bool = True

    def command(self, port: int) -> list[str]:
        flags = ["--model", str(self.model_dir), "--host", "127.0.0.1", "--port", str(port)]
        flags += ["--device", self.device, "--log-level", "warning"]
        if self.modalities is not None:
            flags += ["--modalities", ",".join(self.modalities)]
        if self.gpu_memory_mib is not None:
            flags += ["--gpu-memory-mib", str(self.gpu_memory_mib)]
        return serve_command(*flags)


def gpu_gauges(url: str) -> dict[str, float] | None:
    """/metrics' eg2_gpu_memory_bytes by kind (empty on a CPU), or None if /metrics failed."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    return {kind: float(value) for kind, value in _GAUGE.findall(text)}


def run_served(
    key: str,
    served: Served,
    named: Sequence[Workload],
    sweep_rows: Sequence[tuple[str, Input, int]],
    budget: Budget,
    pool: Executor,
    processes: int,
    log_path: Path,
    time_limit_s: float,
    t_origin: float,
    progress: Progress,
) -> dict[str, Any]:
    """Start the server, measure it, stop it. Past `time_limit_s` the server is stopped, what ran is
    kept, and what did not fails with its error."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = served.command(port)
    env = {k: v for k, v in os.environ.items() if k not in _OWN}
    out: dict[str, Any] = {"command": cmd, "url": url, "log": str(log_path), "points": {}, "phases": {}}
    sampler = PeakSampler()  # before the server starts: the fallback's baseline excludes it
    gauges: dict[str, Any] = {}
    t_start = time.time()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    out["pid"] = proc.pid
    sampler.start(proc.pid)
    timed_out = threading.Event()

    def out_of_time() -> None:  # what ran is kept; what runs now fails against a stopped server
        timed_out.set()
        stop(proc, 5)

    timer = threading.Timer(time_limit_s, out_of_time)
    if math.isfinite(time_limit_s):
        timer.start()
    phase_start = t_start

    def point(name: str) -> None:
        nonlocal phase_start
        now = time.time()
        out["points"][name] = sampler.read()
        out["phases"][name] = (phase_start, now)
        gauges[name] = gpu_gauges(url)
        phase_start = now

    try:
        wait_ready(url, proc, timeout=time_limit_s)
        out["ready_s"] = time.time() - t_start
        point("ready")
        progress(f"{key} ready in {out['ready_s']:.1f} s ({_mib(out['points']['ready'])} MiB)")
        out["named"] = pool.submit(measure_named, url, list(named), budget, key, t_origin).result()
        point("named")
        if served.sweep and sweep_rows:
            out["sweep"] = sweep(pool, processes, url, sweep_rows, budget, lambda s: progress(f"{key} {s}"))
            point("sweep")
        out["info"] = httpx.get(f"{url}/info", timeout=120).json()
    except Exception as e:
        out["error"], out["traceback"] = failure(e)
        if timed_out.is_set():
            out["error"] = f"stopped after {time_limit_s:.0f} s (its time limit); what it measured is kept"
        out["error"] += _tail(log_path)
        progress(f"{key} FAILED: {out['error']}")
    except Stopped:
        out["error"] = "stopped by a signal; what it measured is kept"
    finally:
        timer.cancel()
        stop(proc)
        sampler.stop()
        out["engine_gpu_gauges"] = gauges
        out["memory"] = memory_record(sampler, out["points"], out["phases"])
        out["exit_code"] = proc.returncode
    if timed_out.is_set() and not out.get("error"):  # the sweep's rows failed, the steps did not
        out["error"] = f"stopped after {time_limit_s:.0f} s (its time limit); what it measured is kept"
    if out.get("error", "").startswith("stopped by a signal"):
        raise Stopped(out)
    return out


def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / (1 << 20):,.0f}"


def _tail(log_path: Path, lines: int = 15) -> str:
    try:
        text = log_path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return ("\nserver log, last lines:\n" + "\n".join(text)) if text else ""
