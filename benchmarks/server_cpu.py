"""The service's own CPU per request and per item: the real app serving tests/support/fake_engine.py's engine
(no model time), driven from this process; server CPU seconds (from /proc) over what it answered.

    python -m benchmarks.server_cpu                      (from the repository root; figures for this machine only)
    python -m benchmarks.server_cpu --against ../base    (A/B: this checkout and another, e.g. a `git worktree`
                                                          of the commit before a change, served side by side)
    python -m benchmarks.server_cpu --floor              (beside benchmarks/bare_server.py: uvicorn and FastAPI
                                                          alone, and uvicorn with a bare ASGI callable)
    python -m benchmarks.server_cpu --base-setting log_level=info
                                                         (A/B of a setting: this checkout twice, the base side
                                                          with EG2_LOG_LEVEL=info; --setting sets this side's)

Both sides log at `warning` unless a setting says otherwise (at `info` each request writes an access
log line); each server's log goes to a file of its own, as a container runtime's would.

Three loads, each after an untimed warm-up: single-text requests at 1 and at 32 concurrent clients,
and 32-text requests at 8. With --against or --floor, the servers run at once (idle while another is
loaded), the loads alternate between them for --rounds rounds, each round in the reverse order of the
last, and each line gives each side's median and the median of each round's ratio to this checkout:
a change is judged against its baseline measured in the same run, on the same machine, under the same
background load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from app.settings import Settings
from benchmarks.http_load import burst
from benchmarks.server_process import ROOT, cpu_seconds, fake_engine_server, free_port, running

SINGLE = json.dumps({"model": "eg2", "input": "what is the capital of france", "encoding_format": "base64"})
BATCH = json.dumps(
    {
        "model": "eg2",
        "input": [f"what is the capital of country number {i}" for i in range(32)],
        "encoding_format": "base64",
    }
)
LOADS = (  # (name, body, items per request, concurrency, requests)
    ("single texts, 1 client", SINGLE, 1, 1, 2000),
    ("single texts, 32 clients", SINGLE, 1, 32, 3000),
    ("32-text requests, 8 clients", BATCH, 32, 8, 600),
)


def measure(url: str, pid: int, body: bytes, concurrency: int, count: int) -> tuple[float, float]:
    """(requests/s, server CPU seconds per request) of one timed burst, after an untimed tenth."""
    asyncio.run(burst(url, body, count // 10, concurrency))
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    asyncio.run(burst(url, body, count, concurrency))
    wall, used = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    return count / wall, used / count


def parse_settings(parser: argparse.ArgumentParser, pairs: list[str]) -> dict[str, str]:
    """KEY=VALUE pairs, each KEY a field of app.settings.Settings (pydantic-settings ignores an
    unknown EG2_ variable, so a misspelt key would measure nothing)."""
    settings = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in Settings.model_fields:
            parser.error(f"{pair!r}: expected KEY=VALUE with KEY a setting (app/settings.py)")
        settings[key] = value
    return settings


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", type=Path, help="another checkout of this repository: the baseline")
    parser.add_argument(
        "--floor", action="store_true", help="also serve benchmarks/bare_server.py, both ways"
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternations per load with a second side")
    parser.add_argument(
        "--setting", action="append", default=[], help="KEY=VALUE: an EG2_ setting of this side"
    )
    parser.add_argument(
        "--base-setting", action="append", default=[], help="KEY=VALUE: an EG2_ setting of the base side"
    )
    args = parser.parse_args()
    base = args.against.resolve() if args.against else ROOT if args.base_setting else None
    sides = {"this": ROOT} | ({"base": base} if base is not None else {})
    settings = {
        "this": parse_settings(parser, args.setting),
        "base": parse_settings(parser, args.base_setting),
    }
    logs = Path(tempfile.mkdtemp(prefix="server_cpu-"))
    print(f"server logs: {logs}", flush=True)
    rounds = max(1, args.rounds) if len(sides) > 1 or args.floor else 1
    with contextlib.ExitStack() as stack:
        servers = {}
        for side, root in sides.items():
            port = free_port()
            cmd, env = fake_engine_server(port, 0.0, **settings[side])
            cmd[1] = str(root / "tests" / "support" / "fake_engine.py")  # it imports the app beside it
            url = f"http://127.0.0.1:{port}"
            log = stack.enter_context((logs / f"{side}.log").open("wb"))
            servers[side] = (url, stack.enter_context(running(cmd, env, url, stderr=log)).pid)
        for side, flags in (("floor", []), ("asgi", ["--raw"])) if args.floor else ():
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, str(ROOT / "benchmarks" / "bare_server.py"), str(port), *flags]
            servers[side] = (url, stack.enter_context(running(cmd, dict(os.environ), url)).pid)
        for name, body, items, concurrency, count in LOADS:
            data = body.encode()
            got: dict[str, list[tuple[float, float]]] = {side: [] for side in servers}
            order = list(servers.items())
            for _ in range(rounds):
                for side, (url, pid) in order:
                    got[side].append(measure(url, pid, data, concurrency, count))
                order.reverse()  # no side always first
            line = []
            for side, runs in got.items():
                rate = statistics.median(r for r, _ in runs)
                cpu = statistics.median(c for _, c in runs)
                line.append(
                    f"{side}: {rate:,.0f} requests/s, server CPU {1e3 * cpu:.3f} ms per request, "
                    f"{1e6 * cpu / items:.1f} us per item"
                )
            # Each round's ratio, then their median: a round's pair shares the machine's state.
            for other in [side for side in got if side != "this"]:
                ratio = statistics.median(t[1] / o[1] for t, o in zip(got["this"], got[other], strict=True))
                line.append(f"CPU per request this/{other} {ratio:.3f}x")
            print(f"{name}: " + "; ".join(line), flush=True)


if __name__ == "__main__":
    main()
