"""Server CPU per item on 32-text requests: `eg2 serve` with tests/fake_engine.py's engine (no model work),
8 concurrent clients, 600 requests after 50 untimed; server CPU seconds / items. Dev machine (2 cores).

    python docs/results/2026-11-30-cpu/server_cpu_per_item.py    (from the repository root)
"""

import asyncio
import json
import os
import sys
import time

from server_cpu_per_request import SERVER, cpu_s, send  # its server and client (this script's folder)

from app.bench_scale import running

BODY = json.dumps(
    {
        "model": "eg2",
        "input": [f"what is the capital of country number {i}" for i in range(32)],
        "encoding_format": "base64",
    }
).encode()
port = 8970
url = f"http://127.0.0.1:{port}"
with running([sys.executable, "-c", SERVER, str(port)], dict(os.environ), url) as server:
    asyncio.run(send(url, 50, 8))
    c0, t0 = cpu_s(server.pid), time.perf_counter()
    asyncio.run(send(url, 600, 8))
    wall, used = time.perf_counter() - t0, cpu_s(server.pid) - c0
print(
    f"32-item requests at concurrency 8: {600 * 32 / wall:.0f} items/s, server CPU {1e6 * used / 600 / 32:.1f} us per item"
)
