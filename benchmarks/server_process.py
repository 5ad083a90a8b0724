"""A server under test as a process of its own: started, waited on until /ready says 200, stopped.

Used by the (d) configurations of `eg2 bench`, by benchmarks/scale.py, by the service-side scripts
(server_cpu.py, queue_delay.py, gc_pauses.py) and by tests that need a real `eg2 serve` / `eg2
serve-ray`; the one place that knows how a server under test gets its port (`free_port`,
`listening_port`). The service-side scripts serve tests/support/fake_engine.py's engine (no model time), so what
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on `address` now, for a server that must be told its port before it binds.

    Outgoing connections and port-0 binds take their ports from the kernel's ephemeral range
    (net.ipv4.ip_local_port_range), so any of them could take a port drawn from there before the
    server binds it. This draws outside that range and outside the ranges Ray binds on its own
    (workers from 10002, Serve's replicas in HAProxy mode from 30000): from 20000 up to the range or
    30000, else from above the range, where only another explicit bind can take the port. A server
    that can bind port 0 and report it needs none of this (`listening_port`).
    """
    low, high = _ephemeral_range()
    spans = [(20_000, min(low, 30_000)), (max(high + 1, 31_001), 65_536)]
    start, stop = next(((a, b) for a, b in spans if b - a >= 1000), (0, 0))
    if not stop:
        raise OSError(f"no 1,000 free-to-draw ports outside the ephemeral range {low}-{high}")
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    for _ in range(100):
        with socket.socket(family) as s:
            try:
                s.bind((address, random.randrange(start, stop)))
            except OSError:
                continue  # taken: draw again
            return int(s.getsockname()[1])
    raise OSError(f"no free port in {start}-{stop - 1} in 100 draws")


def _ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default: 32768-60999)."""
    try:
        low, high = (int(x) for x in path.read_text().split()[:2])
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def listening_port(pid: int) -> int | None:
    """The TCP port process `pid` listens on (its first listening socket, IPv4 before IPv6), or None
    while it listens on none. A server started with port 0 binds a free port itself, so nothing can
    take it between the choice and the bind. Read from /proc, which the caller must be allowed to
    inspect: the process's socket inodes, matched against the LISTEN rows (state 0A) of its network
    namespace's TCP tables."""
    inodes: set[str] = set()
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):  # closed since the listing
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = row.split()  # sl local rem st queues timer retransmits uid timeout inode ...
                if fields[3] == "0A" and fields[9] in inodes:
                    return int(fields[1].rsplit(":", 1)[1], 16)
    return None


def wait_listening(pid: int, alive: Callable[[], bool], log: Callable[[], str], timeout_s: float) -> int:
    """The port `pid` listens on, once it does (a cold start imports torch first)."""
    deadline = time.monotonic() + timeout_s
    while (port := listening_port(pid)) is None:
        if not alive():
            raise RuntimeError(f"the server exited before it listened:\n{log()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not listen within {timeout_s:g} s:\n{log()[-3000:]}")
        time.sleep(0.05)
    return port


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
