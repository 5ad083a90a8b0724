"""The service's own CPU per request and per item: the real app serving tests/support/fake_engine.py's engine
(no model time), driven from this process; server CPU seconds (from /proc) over what it answered.

    python -m benchmarks.server_cpu        (from the repository root; figures for this machine only)

Three loads, each after an untimed warm-up: single-text requests at 1 and at 32 concurrent clients,
and 32-text requests at 8. The figures behind app/server.py's event loop and parser choice, the
startup-heap freeze (app/service.py) and the batcher's one preprocessing job per request's text.
"""

from __future__ import annotations

import asyncio
import json
import time

from benchmarks.http_load import burst
from benchmarks.server_process import cpu_seconds, fake_engine_server, free_port, running

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


def main() -> None:
    port = free_port()
    cmd, env = fake_engine_server(port)
    url = f"http://127.0.0.1:{port}"
    with running(cmd, env, url) as server:
        for name, body, items, concurrency, count in LOADS:
            asyncio.run(burst(url, body.encode(), count // 10, concurrency))  # warm
            cpu0, t0 = cpu_seconds(server.pid), time.perf_counter()
            asyncio.run(burst(url, body.encode(), count, concurrency))
            wall, used = time.perf_counter() - t0, cpu_seconds(server.pid) - cpu0
            print(
                f"{name}: {count / wall:,.0f} requests/s, server CPU {1e3 * used / count:.3f} ms per request, "
                f"{1e6 * used / (count * items):.1f} us per item",
                flush=True,
            )


if __name__ == "__main__":
    main()
