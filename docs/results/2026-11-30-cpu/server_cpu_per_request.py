"""The service's own CPU time per request: `eg2`'s app under uvicorn with tests/fake_engine.py's
engine (so no model time), driven from another process; server CPU seconds / requests.

    python docs/results/2026-11-30-cpu/server_cpu_per_request.py [LOOP HTTP]   (from the repository root)

LOOP HTTP (e.g. `asyncio h11`) override the event loop and HTTP parser app/server.py pins.
"""

import asyncio
import json
import os
import sys
import time

import httpx

from app.bench_scale import running  # start, wait for /ready, stop

SERVER = """
import sys; sys.path.insert(0, ".")
from app.settings import Settings
from app.server import serve
from tests.fake_engine import FakeEngine
if len(sys.argv) > 2:
    import uvicorn
    Config = uvicorn.Config
    uvicorn.Config = lambda app, **kw: Config(app, **{**kw, "loop": sys.argv[2], "http": sys.argv[3]})
serve(Settings(port=int(sys.argv[1]), log_level="warning", model=None), FakeEngine())
"""
BODY = json.dumps(
    {"model": "eg2", "input": "what is the capital of france", "encoding_format": "base64"}
).encode()


def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().split(")")[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def send(url: str, count: int, concurrency: int) -> None:
    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=concurrency)) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with gate:
                r = await client.post(
                    "/v1/embeddings", content=BODY, headers={"content-type": "application/json"}
                )
                assert r.status_code == 200, r.text

        await asyncio.gather(*(one() for _ in range(count)))


def main() -> None:
    for port, concurrency, count in ((8950, 1, 2000), (8951, 32, 3000)):
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-c", SERVER, str(port), *sys.argv[1:3]]
        with running(cmd, dict(os.environ), url) as server:
            asyncio.run(send(url, 200, concurrency))  # warm
            c0, t0 = cpu_s(server.pid), time.perf_counter()
            asyncio.run(send(url, count, concurrency))
            wall, used = time.perf_counter() - t0, cpu_s(server.pid) - c0
        print(
            f"concurrency {concurrency}: {count / wall:.0f} requests/s, server CPU {1e3 * used / count:.2f} ms per request"
        )


if __name__ == "__main__":  # server_cpu_per_item.py imports the server and the client
    main()
