"""The batcher's max_queue_delay_ms, 0 against 2 (the default): latency and throughput of single-text
requests at 1, 8 and 32 concurrent clients, against the real app serving tests/support/fake_engine.py's
engine whose GPU step sleeps 4 ms (the GIL released, as a CUDA sync does).

    python -m benchmarks.queue_delay       (from the repository root)
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx

from benchmarks.http_load import HEADERS, PATH
from benchmarks.server_process import fake_engine_server, free_port, running

BODY = json.dumps({"model": "eg2", "input": "what is the capital of france", "encoding_format": "base64"})
GPU_STEP_S = 0.004


async def clients(url: str, seconds: float, concurrency: int) -> tuple[float, float]:
    """`concurrency` clients, each posting one request after another for `seconds`: (requests/s, p50 ms)."""
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        end = time.perf_counter() + seconds

        async def loop() -> None:
            while time.perf_counter() < end:
                start = time.perf_counter()
                r = await client.post(PATH, content=BODY.encode(), headers=HEADERS)
                r.raise_for_status()
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return len(latencies) / seconds, statistics.median(latencies) * 1e3


def main() -> None:
    for delay in ("0", "2"):
        port = free_port()
        cmd, env = fake_engine_server(port, GPU_STEP_S, max_queue_delay_ms=delay)
        url = f"http://127.0.0.1:{port}"
        with running(cmd, env, url):
            for concurrency in (1, 8, 32):
                asyncio.run(clients(url, 1, concurrency))  # warm
                rate, p50 = asyncio.run(clients(url, 4, concurrency))
                print(
                    f"delay {delay} ms, {concurrency} clients: {rate:.0f} req/s, p50 {p50:.2f} ms", flush=True
                )


if __name__ == "__main__":
    main()
