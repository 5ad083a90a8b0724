"""The batcher's max_queue_delay_ms, 0 against 2 (at the default): latency and throughput of single-text requests at 1, 8
and 32 concurrent clients, against `eg2 serve` with tests/fake_engine.py's engine whose GPU step sleeps
4 ms (the GIL released, as a CUDA sync does). Dev machine (2 cores, client and server sharing them).

    python docs/results/2026-11-30-cpu/queue_delay.py    (from the repository root)
"""

import asyncio
import json
import os
import statistics
import sys
import time

import httpx

from app.bench_scale import running  # start, wait for /ready, stop

SERVER = """
import sys; sys.path.insert(0, "."); sys.path.insert(0, "tests")
from app.settings import Settings
from app.server import serve
from fake_engine import FakeEngine
serve(Settings(port=int(sys.argv[1]), log_level="warning", model=None, max_queue_delay_ms=float(sys.argv[2])), FakeEngine(embed_delay_s=0.004))
"""
BODY = json.dumps(
    {"model": "eg2", "input": "what is the capital of france", "encoding_format": "base64"}
).encode()


async def send(url: str, seconds: float, c: int) -> tuple[float, float]:
    """c clients, each posting one request after another for `seconds`: (requests/s, p50 ms)."""
    lat = []
    n = 0
    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=c)) as client:
        end = time.perf_counter() + seconds

        async def loop():
            nonlocal n
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                r = await client.post(
                    "/v1/embeddings", content=BODY, headers={"content-type": "application/json"}
                )
                assert r.status_code == 200, r.text
                lat.append(time.perf_counter() - t0)
                n += 1

        await asyncio.gather(*(loop() for _ in range(c)))
    return n / seconds, statistics.median(lat) * 1e3


for delay in ("0", "2"):
    port = 8990 + int(delay)
    url = f"http://127.0.0.1:{port}"
    with running([sys.executable, "-c", SERVER, str(port), delay], dict(os.environ), url):
        for c in (1, 8, 32):
            asyncio.run(send(url, 1, c))
            rps, p50 = asyncio.run(send(url, 4, c))
            print(f"delay {delay} ms, c={c}: {rps:.0f} req/s, p50 {p50:.2f} ms", flush=True)
