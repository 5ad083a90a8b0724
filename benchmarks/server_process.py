"""A server under test as a process of its own: started, waited on until /ready says 200, stopped.

Used by the (d) configurations of `eg2 bench`, by benchmarks/scale.py, by the service-side scripts
(server_cpu.py, queue_delay.py, gc_pauses.py) and by tests that need a real `eg2 serve` / `eg2
serve-ray`. The service-side scripts serve tests/support/fake_engine.py's engine (no model time), so what
they measure is the server's own cost.
"""

from __future__ import annotations

import contextlib
import os
import random
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
# free_port draws from here up to the ephemeral range: below it lie most services' customary ports
# (5432, 6379, 8000, 8080, ...).
PORTS_FROM = 10_000


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server that must be told its port before it binds.

    Drawn below the kernel's ephemeral range (net.ipv4.ip_local_port_range), from which every outgoing
    connection and every port-0 bind takes its port: a port the OS picked from that range can go to any
    client socket in the seconds before the server binds it (it did, in CI: EADDRINUSE). Below it,
    only another explicit bind can take it. A server that can bind port 0 itself and report the port
    avoids even that (tests/support/load.py's `Serve`).
    """
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(PORTS_FROM, low) if low > PORTS_FROM + 1000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken: draw again
            return int(s.getsockname()[1])
    raise OSError("no free port below the ephemeral range in 100 draws")


def _ephemeral_low(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """The first port of the kernel's ephemeral range (Linux's default is 32768)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


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
