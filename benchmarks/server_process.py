"""A server under test as a process of its own: started, waited on until /ready says 200, stopped.

Used by the (d) configurations of `eg2 bench`, by benchmarks/scale.py, by the service-side scripts
(server_cpu.py, queue_delay.py, gc_pauses.py) and by tests that need a real `eg2 serve` / `eg2
serve-ray`. The service-side scripts serve tests/support/fake_engine.py's engine (no model time), so what
they measure is the server's own cost.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; a small race with other processes remains)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command(*flags: str) -> list[str]:
    """`eg2 serve FLAGS...` with this interpreter (the same as the `eg2` entry point)."""
    return [sys.executable, "-m", "app.cli", "serve", *flags]


def fake_engine_server(
    port: int, embed_delay_s: float = 0.0, **settings: str
) -> tuple[list[str], dict[str, str]]:
    """(command, environment) of the real app serving tests/support/fake_engine.py's engine, whose GPU step
    sleeps `embed_delay_s` with the GIL released (as a CUDA sync does). `settings`: EG2_* values."""
    env = {**os.environ, "EG2_HOST": "127.0.0.1", "EG2_PORT": str(port), "EG2_LOG_LEVEL": "warning"}
    env |= {f"EG2_{k.upper()}": v for k, v in settings.items()}
    env.pop("EG2_API_KEY", None)
    return [
        sys.executable,
        str(ROOT / "tests" / "support" / "fake_engine.py"),
        "--embed-delay",
        str(embed_delay_s),
    ], env


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"the server was not ready after {timeout:g} s")


def stop(proc: subprocess.Popen[bytes], grace_s: float = 90) -> None:
    """SIGTERM (it drains and, under Ray, shuts its cluster down), then whatever its session left is
    killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever it left in its session
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


@contextlib.contextmanager
def running(
    cmd: list[str],
    env: dict[str, str],
    url: str,
    ready_timeout: float = 300,
    stdout: int | IO[bytes] | None = None,
    stderr: int | IO[bytes] | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """A server command in a session of its own, from ready (its /ready says 200) to stopped."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=stdout, stderr=stderr)
    try:
        wait_ready(url, proc, ready_timeout)
        yield proc
    finally:
        stop(proc)
