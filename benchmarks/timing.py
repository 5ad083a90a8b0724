"""How a cell is timed: warm-up rounds, then timed rounds inside a time box, and the figures of one cell.

A cell is one workload on one configuration. A round runs every call of the workload once, in order;
a call is what a user makes, timed on the host with perf_counter from the client's bytes and strings
to vectors in host memory (so a CUDA call has finished when its clock stops). Torch-free: the HTTP
client processes time their requests with the same code.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from benchmarks.workloads import Workload

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Budget:
    """How long a cell runs. Warm-up stops early once it has outlasted `seconds`. Timed rounds stop
    once `min_rounds` ran and `seconds` passed, or once `cap_s` passed (one round at least), so a
    slow, GPU-bound call (whose rounds vary little) costs one warm-up and one or two rounds."""

    seconds: float  # the time box of the timed rounds
    warmup: int  # warm-up rounds at most
    min_rounds: int
    max_rounds: int
    cap_s: float  # timed rounds stop past this, whatever min_rounds says
    per_client: int = 2  # HTTP sweep: requests each concurrent client sends, at least

    def scaled(self, factor: float, warmup: int | None = None) -> Budget:
        return replace(
            self,
            seconds=self.seconds * factor,
            cap_s=self.cap_s * factor,
            warmup=self.warmup if warmup is None else warmup,
        )


def host_median_ms(fn: Callable[[], object], rounds: int, warmup: int = 1) -> float:
    """Median milliseconds of `rounds` calls of `fn` by the host clock, after `warmup` untimed ones
    (a CUDA call has finished only if `fn` waits for it)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return float(np.median(times))


def cell_header(w: Workload) -> dict[str, Any]:
    """What every result cell records about its workload, before any figure."""
    return {
        "family": w.family,
        "modality": w.modality,
        "batch": w.batch,
        "calls_per_round": len(w.calls),
        "items_per_round": w.items,
        "tokens_per_round": w.tokens,
        "error": None,
    }


def stats(latencies_s: Sequence[float], items: int, tokens: int, wall_s: float) -> dict[str, Any]:
    """Latency percentiles of the calls, and items and tokens per second over the wall time. With
    fewer than 100 calls p99 is close to the slowest call."""
    ms = np.asarray(latencies_s, dtype=np.float64) * 1000
    return {
        "calls": len(ms),
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
        "min_ms": float(ms.min()),
        "max_ms": float(ms.max()),
        "items_per_s": items / wall_s,
        "tokens_per_s": tokens / wall_s,
    }


def time_rounds(fn: Callable[[int], object], workload: Workload, budget: Budget) -> dict[str, Any]:
    """Run `fn(i)` for every call i of the workload, round after round, under `budget`. Besides the
    per-call figures, `round_p50_ms` is the median time of a whole round (the named workloads'
    figure: "256 docs in 4 calls" is the time of the 4 calls)."""
    n = len(workload.calls)
    start = time.perf_counter()
    warm = 0
    while warm < budget.warmup:
        for i in range(n):
            fn(i)
        warm += 1
        if time.perf_counter() - start >= budget.seconds:
            break
    latencies: list[float] = []
    rounds_s: list[float] = []
    t0 = time.perf_counter()
    while True:
        r0 = time.perf_counter()
        for i in range(n):
            s = time.perf_counter()
            fn(i)
            latencies.append(time.perf_counter() - s)
        rounds_s.append(time.perf_counter() - r0)
        elapsed = time.perf_counter() - t0
        if len(rounds_s) >= budget.max_rounds or elapsed >= budget.cap_s:
            break
        if len(rounds_s) >= budget.min_rounds and elapsed >= budget.seconds:
            break
    rounds = len(rounds_s)
    out = stats(latencies, rounds * workload.items, rounds * workload.tokens, elapsed)
    out.update(
        warmup_rounds=warm,
        rounds=rounds,
        round_p50_ms=float(np.percentile(np.asarray(rounds_s) * 1000, 50)),
    )
    return out


class Stopped(BaseException):
    """SIGTERM or SIGINT reached the orchestrator: the configuration running stops, keeps what it
    measured (carried in `args[0]` when there is any), and the outputs are written. A BaseException,
    so that no cell's `except Exception` takes it for the cell's own failure."""


def failure(e: BaseException) -> tuple[str, str]:
    """(one-line message, short traceback) of a failed cell."""
    return f"{type(e).__name__}: {e}"[:500], traceback.format_exc(limit=-8)[-3000:]


def cell_line(key: str, cell: dict[str, Any]) -> str:
    """One progress line for a finished cell."""
    if cell.get("error"):
        return f"{key}: FAILED {cell['error'][:200]}"
    c = cell["call"]
    text = (
        f"{key}: {c['items_per_s']:.1f} items/s, p50 {c['p50_ms']:.1f} ms, p99 {c['p99_ms']:.1f} ms "
        f"({c['rounds']} rounds)"
    )
    if "forward" in cell:
        text += f"; forward {cell['forward']['p50_ms']:.1f} ms"
    if cell.get("extras_error"):
        text += f"; embed / forward FAILED {cell['extras_error'][:200]}"
    return text
