"""The HTTP load generator: OpenAI request bodies, sequential named workloads, concurrent clients.

Bodies are built before timing, as a client holds them: media as base64 data URIs / input_audio,
`encoding_format: base64` (the OpenAI SDK's default). Every request runs from client processes of
its own (spawned), never from the process under test nor from the orchestrator:

- named workloads: one synchronous keep-alive client in one client process, one request per call
  of the workload, timed like the in-process cells (benchmarks/timing.py);
- the sweep: C clients (asyncio + httpx) spread over several client processes, each sending one
  single-item request after another. One client process tops out at a few hundred requests/s, so one
  process would measure itself, not the server; the busiest process's CPU time over the wall time
  (`client_cpu_s` / `wall_s`) shows whether the client came near its limit. The server's own
  x-queue-time-ms and x-inference-time-ms headers split a tail into waiting for a batch and running it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.timing import Budget, cell_header, cell_line, failure, stats, time_rounds
from benchmarks.workloads import MIME, Input, Workload

PATH = "/v1/embeddings"
HEADERS = {"content-type": "application/json"}
SWEEP_SCALE = 4  # a sweep row's time box, in multiples of the budget's cell time box
# A row's `cold`: what its untimed first window saw.
COLD_KEYS = ("requests", "failures", "items_per_s", "p50_ms", "p99_ms", "server_inference_p99_ms", "error")


def client_processes() -> int:
    """How many client processes drive the sweep: half the cores, 2 to 8 (the server needs the rest)."""
    return max(2, min(8, (os.cpu_count() or 2) // 2))


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


# -------------------------------------------------------------------------------------- named calls


def _post(client: httpx.Client, requests: Sequence[Request], i: int) -> None:
    r = client.post(PATH, content=requests[i].body, headers=HEADERS)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")


def measure_named(
    url: str, named: Sequence[Workload], budget: Budget, tag: str, t_origin: float
) -> dict[str, Any]:
    """Each named workload as sequential requests on one keep-alive connection, one per call. Run it
    in a client process (`pool.submit`)."""

    def progress(line: str) -> None:
        print(f"[bench {time.time() - t_origin:6.1f} s] {tag} {line}", file=sys.stderr, flush=True)

    cells: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=600) as client:
        for w in named:
            requests = [request(c) for c in w.calls]
            cell = cell_header(w)
            try:
                first = client.post(PATH, content=requests[0].body, headers=HEADERS)
                first.raise_for_status()
                if len(first.json()["data"]) != w.batch:
                    raise RuntimeError(f"{len(first.json()['data'])} vectors for {w.batch} items")
                before = server_stages(client.get("/metrics").text)
                cell["call"] = time_rounds(partial(_post, client, requests), w, budget)
                cell["server"] = stage_split(before, server_stages(client.get("/metrics").text))
            except Exception as e:
                cell["error"], _ = failure(e)
            cells[w.key] = cell
            progress(cell_line(w.key, cell))
    return cells


_STAGES = ("eg2_preprocess_seconds", "eg2_queue_seconds", "eg2_inference_seconds", "eg2_batch_size")


def graph_captures(url: str) -> tuple[float, float] | None:
    """/metrics' CUDA graph buckets captured so far and the seconds spent capturing (zeros on a CPU),
    or None where /metrics did not answer them (refused, unreadable, or a server without them)."""
    try:
        r = httpx.get(f"{url}/metrics", timeout=30)
        if r.status_code != 200:
            return None
        families = list(text_string_to_metric_families(r.text))
    except (httpx.HTTPError, ValueError):
        return None
    captured = seconds = None
    for family in families:
        for sample in family.samples:
            if sample.name == "eg2_cuda_graph_buckets" and sample.labels.get("state") == "captured":
                captured = sample.value
            elif sample.name == "eg2_cuda_graph_capture_seconds_total":
                seconds = sample.value
    return None if captured is None or seconds is None else (captured, seconds)


def _captured_between(
    before: tuple[float, float] | None, after: tuple[float, float] | None
) -> dict[str, Any]:
    """The graph captures (count, seconds) a window saw, from graph_captures before and after it."""
    if before is None or after is None:
        return {"captures": None, "capture_s": None}
    return {"captures": int(after[0] - before[0]), "capture_s": round(after[1] - before[1], 4)}


def server_stages(metrics_text: str) -> dict[tuple[str, str, str], float]:
    """/metrics' stage histograms: (family, modality, sum|count) -> value."""
    out: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name not in _STAGES:
            continue
        for sample in family.samples:
            end = sample.name.rsplit("_", 1)[-1]
            if end in ("sum", "count"):
                out[(family.name, sample.labels.get("modality", ""), end)] = sample.value
    return out


def stage_split(
    before: dict[tuple[str, str, str], float], after: dict[tuple[str, str, str], float]
) -> dict[str, dict[str, float]]:
    """Where the server spent a cell's calls, by modality, from the /metrics diff: the mean ms an item
    spent preparing and queueing, the mean ms of a GPU batch, and how many batches and items ran."""
    split: dict[str, dict[str, float]] = {}
    for family, modality, end in after:
        if end != "count":
            continue
        n = after[(family, modality, "count")] - before.get((family, modality, "count"), 0.0)
        if n <= 0:
            continue
        total = after[(family, modality, "sum")] - before.get((family, modality, "sum"), 0.0)
        row = split.setdefault(modality, {})
        stage = family.removeprefix("eg2_").removesuffix("_seconds")
        if stage == "batch_size":
            row["batches"], row["items"] = n, total
        else:
            row[f"{stage}_ms"] = round(1e3 * total / n, 3)
    return split


# ----------------------------------------------------------------------------------------- the sweep


async def burst(url: str, body: bytes, count: int, concurrency: int) -> list[float]:
    """`count` requests of `body`, `concurrency` at a time, from this process: their latencies in
    seconds, sorted. For the service-side scripts, which measure the server's CPU, not the client's."""
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with gate:
                start = time.perf_counter()
                r = await client.post(PATH, content=body, headers=HEADERS)
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(one() for _ in range(count)))
    return sorted(latencies)


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
    """`concurrency` clients spread over `processes` of the pool's processes. One merged row."""
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
    out |= stats(latencies, n * req.items, n * req.tokens, wall)
    for name in ("queue", "inference"):
        v = np.asarray([x for p in parts for x in p[f"{name}_ms"]])
        finite = bool(np.isfinite(v).any())
        out[f"server_{name}_p50_ms"] = float(np.nanpercentile(v, 50)) if finite else None
        out[f"server_{name}_p99_ms"] = float(np.nanpercentile(v, 99)) if finite else None
    return out


def sweep(
    pool: Executor,
    processes: int,
    url: str,
    rows: Sequence[tuple[str, Input, int]],
    budget: Budget,
    progress: Any,
) -> list[dict[str, Any]]:
    """Rows of (family, the item each request carries, concurrent clients): one merged row each."""
    out = []
    for family, x, c in rows:
        req = request([x])
        row: dict[str, Any] = {"family": family, "modality": x.kind, "tokens_per_item": x.tokens}
        try:
            # A window several times a cell's: every client must go round many times in it, or the
            # figure measures the ramp-up of c clients rather than the steady state.
            min_requests = max(budget.min_rounds + 1, c * budget.per_client)
            window = SWEEP_SCALE * budget.seconds
            start = graph_captures(url)
            if budget.warmup:
                # The same load untimed first: the batch sizes it forms capture their graph buckets
                # on first use, a stall a long-running server pays once per bucket, not per window.
                # Its figures stay in the row as `cold`: what the first seconds of such a load see.
                first = drive(pool, processes, url, req, c, window, min_requests)
                warm = graph_captures(url)
                row["cold"] = {k: first.get(k) for k in COLD_KEYS} | _captured_between(start, warm)
                start = warm
            row |= drive(pool, processes, url, req, c, window, min_requests)
            row |= _captured_between(start, graph_captures(url))  # captures inside the timed window
        except Exception as e:
            row |= {"concurrency": c, "error": failure(e)[0]}
        out.append(row)
        progress(sweep_line(row))
    return out


def sweep_line(row: dict[str, Any]) -> str:
    head = f"sweep {row['family']} x {row['concurrency']} clients: "
    if row["error"]:
        return head + f"FAILED {row['error']}"
    return head + (
        f"{row['items_per_s']:.1f} req/s, p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms "
        f"({row['requests']} requests, busiest client process at "
        f"{row['client_cpu_s'] / row['wall_s']:.0%} CPU)"
    )
