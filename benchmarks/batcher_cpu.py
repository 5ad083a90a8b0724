"""The service's CPU per request below HTTP: `Service.embed` (the batcher, its hand-off of each batch to
the engine thread and back) serving tests/support/fake_engine.py's engine (no model time), driven
in-process by concurrent callers on one event loop (uvloop, as served). No sockets, no framework.

    python -m benchmarks.batcher_cpu [--requests 20000] [--clients 8]     (from the repository root)

Process CPU seconds (all threads) over the requests answered, for single short-text requests, with the
service's default settings. Set beside `benchmarks/server_cpu.py`, it says how much of a request's CPU
over HTTP is the batcher's and how much the HTTP side's.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import uvloop

from app.metrics import Metrics
from app.service import Service, State
from app.settings import Settings
from eg2_runtime.inputs import Item, PrepareOptions, TextPart
from tests.support.fake_engine import FakeEngine

ITEMS = [Item((TextPart("what is the capital of france"),))]


async def run(requests: int, clients: int) -> tuple[float, float]:
    """(CPU seconds per request, requests/s) of `requests` single-text embeds, after an untimed tenth."""
    engine = FakeEngine(record=False)
    service = Service(Settings(), Metrics(), engine)
    service.start()
    while service.state is not State.READY:
        if service.state is State.FAILED:
            raise RuntimeError(f"the service failed to start: {service.failure}")
        await asyncio.sleep(0.01)

    async def client(n: int) -> None:
        for _ in range(n):
            await service.embed(ITEMS, PrepareOptions())

    try:
        await asyncio.gather(*(client(requests // 10 // clients) for _ in range(clients)))
        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(client(requests // clients) for _ in range(clients)))
        used, wall = time.process_time() - cpu0, time.perf_counter() - t0
    finally:
        engine.release()
        await service.stop()
    answered = requests // clients * clients
    return used / answered, answered / wall


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    cpu, rate = uvloop.run(run(args.requests, args.clients))
    print(
        f"single texts, {args.clients} in-process callers: {1e3 * cpu:.3f} ms CPU per request, {rate:,.0f} requests/s"
    )


if __name__ == "__main__":
    main()
