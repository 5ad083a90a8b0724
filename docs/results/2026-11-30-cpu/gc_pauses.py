"""The garbage collector's pauses inside `eg2 serve` (the real engine on the tiny checkpoint, CPU)
under single-text load at 32 clients, with the startup heap frozen (the service's default since
freeze_startup_heap) or unfrozen again by this probe. gc.callbacks in the server time every pass;
at the end the server times one full collection (what a generation-2 pass costs at that moment).

    python docs/results/2026-11-30-cpu/gc_pauses.py {frozen|unfrozen} MODEL_DIR [REQUESTS]
"""

import asyncio
import json
import os
import signal
import sys
import time

import httpx

from app.bench_scale import running  # start, wait for /ready, stop

SERVER = r"""
import gc, json, signal, sys, time
sys.path.insert(0, ".")
passes = {0: [], 1: [], 2: []}
began = [0.0]
def timer(phase, info):
    if phase == "start":
        began[0] = time.perf_counter()
    else:
        passes[info["generation"]].append(time.perf_counter() - began[0])
gc.callbacks.append(timer)
from app.settings import Settings
from app.server import serve
def measured_phase(*_):
    if sys.argv[2] == "unfrozen":
        gc.unfreeze()
    for v in passes.values():
        v.clear()
def dump(*_):
    gc.callbacks.remove(timer)
    start = time.perf_counter()
    gc.collect()
    full = time.perf_counter() - start
    out = {"passes": passes, "frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects()), "full_collect_s": full}
    json.dump(out, open(sys.argv[3], "w"))
signal.signal(signal.SIGUSR2, measured_phase)
signal.signal(signal.SIGUSR1, dump)
serve(Settings(port=int(sys.argv[1]), log_level="warning", model=sys.argv[4]))
"""
BODY = json.dumps(
    {"model": "eg2", "input": "what is the capital of france", "encoding_format": "base64"}
).encode()


async def send(url: str, count: int, clients: int) -> list[float]:
    latencies = []
    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=clients)) as client:
        gate = asyncio.Semaphore(clients)

        async def one() -> None:
            async with gate:
                start = time.perf_counter()
                r = await client.post(
                    "/v1/embeddings", content=BODY, headers={"content-type": "application/json"}
                )
                assert r.status_code == 200, r.text
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(one() for _ in range(count)))
    return sorted(latencies)


mode, model = sys.argv[1], sys.argv[2]
count = int(sys.argv[3]) if len(sys.argv) > 3 else 20_000
port, out = 8971, f"/tmp/gc_pauses_{mode}.json"
url = f"http://127.0.0.1:{port}"
with running([sys.executable, "-c", SERVER, str(port), mode, out, model], dict(os.environ), url) as server:
    asyncio.run(send(url, 300, 8))  # warm
    os.kill(server.pid, signal.SIGUSR2)  # the measured phase begins (unfrozen: the heap thawed)
    time.sleep(1)
    start = time.perf_counter()
    lat = asyncio.run(send(url, count, 32))
    wall = time.perf_counter() - start
    os.kill(server.pid, signal.SIGUSR1)  # the figures to `out`
    time.sleep(2)
s = json.load(open(out))
ms = lambda x: f"{1e3 * x:.1f}"  # noqa: E731
print(
    f"{mode}: {count} requests, {count / wall:.0f} req/s, client p50 {ms(lat[len(lat) // 2])} ms, "
    f"p99 {ms(lat[int(len(lat) * 0.99)])} ms, max {ms(lat[-1])} ms; frozen objects {s['frozen']}, "
    f"tracked {s['tracked']}; one full collection at the end {ms(s['full_collect_s'])} ms"
)
for gen, times in s["passes"].items():
    if times:
        print(
            f"  generation {gen}: {len(times)} passes, {ms(sum(times))} ms in all, longest {ms(max(times))} ms"
        )
