"""Server CPU per item on 32-text requests: `eg2 serve` with tests/fake_engine.py's engine (no model work),
8 concurrent clients, 600 requests after 50 untimed; server CPU seconds / items. Dev machine (2 cores).

    python docs/results/2026-11-30-cpu/server_cpu_per_item.py    (from the repository root)
"""

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

# The server and the client of server_cpu_per_request.py, run from the repository root.
exec(
    Path("docs/results/2026-11-30-cpu/server_cpu_per_request.py")
    .read_text()
    .split("for port, concurrency")[0]
)
BODY = json.dumps(
    {
        "model": "eg2",
        "input": [f"what is the capital of country number {i}" for i in range(32)],
        "encoding_format": "base64",
    }
).encode()
port = 8970
server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
url = f"http://127.0.0.1:{port}"
for _ in range(100):
    try:
        if httpx.get(f"{url}/ready").status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(0.2)
asyncio.run(send(url, 50, 8))
c0, t0 = cpu_s(server.pid), time.perf_counter()
asyncio.run(send(url, 600, 8))
wall, used = time.perf_counter() - t0, cpu_s(server.pid) - c0
print(
    f"32-item requests at concurrency 8: {600 * 32 / wall:.0f} items/s, server CPU {1e6 * used / 600 / 32:.1f} us per item"
)
server.terminate()
server.wait()
