"""Configuration (d): the HTTP service end to end, driven over loopback by a load generator.

The real app (`app.server.build_server`: FastAPI, the batcher, its preprocessing pool, one GPU thread)
serves the engine of configuration (a) from a uvicorn thread of this process. The service's knobs are
its defaults (EG2_* variables apply, as for `eg2 serve`); only host, port, API key and logging are
fixed here. Bodies are OpenAI requests serialised before timing (media as base64 data URIs / input_audio),
with `encoding_format: base64`, the OpenAI SDK's default. Two kinds of figures:

- the named workloads, one request per call of the workload, one at a time (a synchronous client);
- the sweep: one single-item request per client at concurrency 1, 32 and 128 (asyncio + httpx), for
  each input of the matrix; p50/p99 client latency, items/s, and the server's own x-queue-time-ms and
  x-inference-time-ms headers, which split a tail into waiting for a batch and running it.

Assumes: this module sits above the runtime, as app/cli.py does (eg2_runtime itself never imports app:
only this tool does, lazily). The load generator runs in a process of its own (spawned), as a real
client would: in the server's interpreter it competed with the event loop and the GPU thread for the
GIL, and its own CPU time was counted against the server. Its CPU time is still recorded
(`client_cpu_s`), to show when the client rather than the server is the limit.
"""

from __future__ import annotations

import asyncio
import base64
import json
import multiprocessing
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import numpy as np

from eg2_runtime.api import EngineMemory, PreparedItem
from eg2_runtime.engine import Engine
from eg2_runtime.errors import EG2Error
from eg2_runtime.inputs import Item, PrepareOptions
from eg2_runtime.tools.bench_measure import Budget, Progress, cell_header, stats, time_rounds
from eg2_runtime.tools.bench_workloads import MIME, Input, Named

PATH = "/v1/embeddings"
SWEEP_SCALE = 4  # a sweep row's time box, in multiples of the budget's cell time box
CLIENT_PROCESSES = 4  # the sweep's load generator processes
HEADERS = {"content-type": "application/json"}


@dataclass(frozen=True)
class Request:
    body: bytes
    items: int
    tokens: int


def request(inputs: Sequence[Input]) -> Request:
    """The OpenAI body for these items, as a client sends it."""
    items: list[Any] = []
    for x in inputs:
        if x.kind == "text":
            items.append(x.text)
            continue
        b64 = base64.b64encode(x.data).decode()
        if x.kind == "audio":
            items.append({"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}})
        else:
            key = "image_url" if x.kind == "image" else "video_url"
            items.append({"type": key, key: {"url": f"data:{MIME[x.kind]};base64,{b64}"}})
    body = {"model": "eg2", "input": items, "encoding_format": "base64"}
    return Request(json.dumps(body).encode(), len(inputs), sum(x.tokens for x in inputs))


class _Prewarmed:
    """The (a) engine as the service sees it, without the boot warm-up. That warm-up runs one
    full-size batch per modality (8192 text tokens, 1120-token images, 32-frame video) to prove it
    fits; the bench warms the engine on its own inputs instead, and on a CPU the boot batches alone
    would take longer than the whole quick mode."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.modalities = engine.modalities
        self.prompts = engine.prompts
        self.default_prompt_name = engine.default_prompt_name
        self.max_text_tokens = engine.max_text_tokens

    def estimate_many(self, items: Sequence[Item], options: PrepareOptions) -> list[int | EG2Error]:
        return self._engine.estimate_many(items, options)

    def prepare_many(
        self, items: Sequence[Item], options: PrepareOptions, cancel: threading.Event | None = None
    ) -> list[PreparedItem | EG2Error]:
        return self._engine.prepare_many(items, options, cancel)

    def embed(self, batch: Sequence[PreparedItem]) -> np.ndarray:
        return self._engine.embed(batch)

    def warm_up(self, max_batch_items: int, max_batch_tokens: int) -> dict[str, int]:
        return self._engine.batch_token_limits()

    def capture_graphs(self) -> int:  # as `eg2 serve` boots: no request pays for a graph capture
        return self._engine.capture_graphs()

    def info(self) -> dict[str, Any]:
        return self._engine.info()

    def memory(self) -> EngineMemory:
        return self._engine.memory()


class LiveService:
    """create_app under a real uvicorn on 127.0.0.1 (a free port), in a thread of this process."""

    def __init__(self, engine: Engine) -> None:
        from app.server import build_server  # the service: only configuration (d) needs it
        from app.settings import Settings

        self.settings = Settings(host="127.0.0.1", port=0, api_key=None, log_level="warning", log_json=False)
        self.server = build_server(self.settings, _Prewarmed(engine))
        self._thread = threading.Thread(target=self.server.run, name="bench-uvicorn", daemon=True)

    def __enter__(self) -> LiveService:
        from app.service import State

        self._thread.start()
        deadline = time.monotonic() + 120
        while not (self.server.started and self.server.service.state is State.READY):
            if not self._thread.is_alive() or self.server.service.state is State.FAILED:
                raise RuntimeError(f"the service did not start: {self.server.service.failure}")
            if time.monotonic() > deadline:
                raise RuntimeError("the service was not ready within 120 s")
            time.sleep(0.01)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)


# -------------------------------------------------------------------------------------- named calls


def _post(client: httpx.Client, requests: Sequence[Request], i: int) -> None:
    r = client.post(PATH, content=requests[i].body, headers=HEADERS)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")


def measure_named(url: str, named: Sequence[Named], budget: Budget, progress: Progress) -> dict[str, Any]:
    """Each named workload as sequential requests, one per call, timed like the in-process cells."""
    cells: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=600) as client:
        for n in named:
            w = n.workload
            requests = [request(c) for c in w.calls]
            cell = cell_header(w)
            try:
                first = client.post(PATH, content=requests[0].body, headers=HEADERS)
                first.raise_for_status()
                if len(first.json()["data"]) != w.batch:
                    raise RuntimeError(f"{len(first.json()['data'])} vectors for {w.batch} items")
                cell["call"] = time_rounds(partial(_post, client, requests), w, budget)
            except Exception as e:
                cell["error"] = f"{type(e).__name__}: {e}"[:500]
            cells[w.key] = cell
            c = cell.get("call")
            line = (
                f"p50 {c['p50_ms']:.1f} ms, {c['items_per_s']:.1f} items/s"
                if c
                else f"FAILED {cell['error']}"
            )
            progress(f"d {w.key}: {line}")
    return cells


# ----------------------------------------------------------------------------------------- the sweep


async def _clients(
    url: str, body: bytes, concurrency: int, seconds: float, min_requests: int
) -> dict[str, Any]:
    """`concurrency` clients each sending `body` back to back until `min_requests` are answered and
    `seconds` have passed (or 4 x seconds, for slow requests). Raw figures, merged by `drive`."""
    latencies: list[float] = []
    queue_ms: list[float] = []
    inference_ms: list[float] = []
    failures: Counter[str] = Counter()
    replicas: Counter[str] = Counter()
    issued = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        start = time.perf_counter()

        async def client_loop() -> None:
            nonlocal issued
            while True:
                elapsed = time.perf_counter() - start
                if issued >= min_requests and elapsed >= seconds:
                    return
                if issued >= concurrency and elapsed >= 4 * seconds:  # slow requests: one each, at least
                    return
                issued += 1
                s = time.perf_counter()
                try:
                    r = await client.post(PATH, content=body, headers=HEADERS)
                except httpx.HTTPError as e:
                    failures[type(e).__name__] += 1
                    continue
                if r.status_code != 200:
                    failures[f"HTTP {r.status_code}"] += 1
                    continue
                latencies.append(time.perf_counter() - s)
                queue_ms.append(float(r.headers.get("x-queue-time-ms", "nan")))
                inference_ms.append(float(r.headers.get("x-inference-time-ms", "nan")))
                replicas[r.headers.get("x-replica-id", "-")] += 1

        cpu0 = time.process_time()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {
        "latencies": latencies,
        "queue_ms": queue_ms,
        "inference_ms": inference_ms,
        "failures": dict(failures),
        "replicas": dict(replicas),
        "issued": issued,
        "cpu_s": time.process_time() - cpu0,
        "wall_s": wall,
    }


def _client_process(
    url: str, body: bytes, concurrency: int, seconds: float, min_requests: int
) -> dict[str, Any]:
    return asyncio.run(_clients(url, body, concurrency, seconds, min_requests))


def drive(
    pool: Executor,
    processes: int,
    url: str,
    req: Request,
    concurrency: int,
    seconds: float,
    min_requests: int,
) -> dict[str, Any]:
    """`concurrency` clients spread over `processes` of the pool's processes (one client process tops
    out at a few hundred requests/s: it would measure itself, not the server). One merged row."""
    processes = max(1, min(concurrency, processes))
    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    jobs = [
        pool.submit(_client_process, url, req.body, c, seconds, max(1, min_requests * c // concurrency))
        for c in shares
    ]
    parts = [j.result() for j in jobs]
    failures: Counter[str] = Counter()
    replicas: Counter[str] = Counter()
    for p in parts:
        failures.update(p["failures"])
        replicas.update(p["replicas"])
    wall = max(p["wall_s"] for p in parts)
    out: dict[str, Any] = {
        "concurrency": concurrency,
        "client_processes": processes,
        "requests": sum(p["issued"] for p in parts),
        "failures": dict(failures),
        "by_replica": dict(replicas),
        # The busiest client process's CPU over the wall time: near 100% the client is the limit.
        "client_cpu_s": max(p["cpu_s"] for p in parts),
        "wall_s": wall,
        "error": None,
    }
    latencies = [x for p in parts for x in p["latencies"]]
    if not latencies:
        out["error"] = f"no request succeeded: {dict(failures)}"
        return out
    n = len(latencies)
    out |= stats(latencies, n * req.items, n * req.tokens, wall, req.items)
    for name in ("queue", "inference"):
        v = np.asarray([x for p in parts for x in p[f"{name}_ms"]])
        out[f"server_{name}_p50_ms"] = float(np.nanpercentile(v, 50)) if np.isfinite(v).any() else None
        out[f"server_{name}_p99_ms"] = float(np.nanpercentile(v, 99)) if np.isfinite(v).any() else None
    return out


def sweep(
    pool: Executor,
    processes: int,
    url: str,
    inputs: Sequence[tuple[str, Input]],
    concurrencies: Sequence[int],
    budget: Budget,
    progress: Progress,
) -> list[dict[str, Any]]:
    rows = []
    for family, x in inputs:
        req = request([x])
        for c in concurrencies:
            if budget.warmup:  # one untimed request per client: its connection is open, its batch
                drive(pool, processes, url, req, c, 0.0, c)  # shapes have been seen once
            row = {"family": family, "modality": x.kind, "tokens_per_item": x.tokens}
            # A window several times a cell's: every client must go round many times in it, or the
            # figure measures the ramp-up of c clients rather than the steady state.
            min_requests = max(budget.min_rounds + 1, c * budget.per_client)
            row |= drive(pool, processes, url, req, c, SWEEP_SCALE * budget.seconds, min_requests)
            rows.append(row)
            progress(_sweep_line(row))
    return rows


def _sweep_line(row: dict[str, Any]) -> str:
    head = f"d sweep {row['family']} c={row['concurrency']}: "
    if row["error"]:
        return head + f"FAILED {row['error']}"
    return head + (
        f"p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms, {row['items_per_s']:.1f} items/s "
        f"({row['requests']} requests)"
    )


def run_service(
    engine: Engine,
    named: Sequence[Named],
    sweep_inputs: Sequence[tuple[str, Input]],
    concurrencies: Sequence[int],
    budget: Budget,
    progress: Progress,
) -> dict[str, Any]:
    """Configuration (d): the named workloads one request at a time, then the concurrency sweep."""
    # Clients in processes of their own (spawned: a fresh interpreter, no fork of CUDA state), as real
    # clients would be: in the server's interpreter they competed with it for the GIL.
    spawn = multiprocessing.get_context("spawn")
    processes = 1 if budget.per_client <= 1 else CLIENT_PROCESSES  # quick mode: one is plenty
    with LiveService(engine) as live, ProcessPoolExecutor(processes, mp_context=spawn) as pool:
        settings = live.settings.model_dump(mode="json", exclude={"api_key"})
        settings["max_batch_tokens_in_effect"] = live.server.service.batch_tokens()
        out: dict[str, Any] = {"settings": settings}
        out["named"] = pool.submit(_named_process, live.url, list(named), budget).result()
        out["sweep"] = sweep(pool, processes, live.url, sweep_inputs, concurrencies, budget, progress)
    return out


def _named_process(url: str, named: Sequence[Named], budget: Budget) -> dict[str, Any]:
    """The named workloads from a client process: one synchronous client, one request at a time."""
    start = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[client {time.perf_counter() - start:6.1f} s] {line}", file=sys.stderr, flush=True)

    return measure_named(url, named, budget, progress)
