"""Probe (GPU): what Python threads busy beside the engine cost its batches: the GIL.

    python -m benchmarks.probe_gil_batch --out DIR [--rounds 20]

Under 128 HTTP clients the server's text batches took 36 ms against ~4 ms in-process (`eg2 bench`,
H200, 2026-12-01, commit bb2ac50). The event loop parsing requests holds the GIL; the engine's thread
gives it up inside torch calls that wait or work long enough, and waits to get it back. This boots
the engine as `eg2 serve` does, then times `Engine.embed` of one query and of 64 short texts while
0, 1 or 2 threads run pure-Python work (JSON encoding and decoding, as an event loop under load
does), at several GIL switch intervals (`sys.setswitchinterval`). Writes gil_batch.json into DIR.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from app.service import GPU_BATCH_TOKENS
from benchmarks.probe_boot import text
from benchmarks.workloads import checkpoints
from eg2_runtime.engine import Engine
from eg2_runtime.inputs import PrepareOptions


def busy(stop: threading.Event) -> None:
    """An event loop's kind of work: small JSON documents encoded and decoded, no C call that waits."""
    doc = {"input": ["a short query about vectors"] * 4, "model": "eg2", "encoding_format": "base64"}
    while not stop.is_set():
        json.loads(json.dumps(doc))


def timed(engine: Engine, prepared: list[Any], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        engine.embed(prepared)
        times.append(1e3 * (time.perf_counter() - t))
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with checkpoints(None, Path.home() / ".cache/eg2/bench", "full", print) as (_, w4):
        engine = Engine.from_dir(w4, device="cuda", modalities={"text"})
    engine.warm_up(64, GPU_BATCH_TOKENS)
    engine.capture_graphs()
    shapes = {
        "1 query": [text(14, 0)],
        "64 short texts": [text(12 + i % 8, i) for i in range(64)],
    }
    prepared = {k: list(engine.prepare_many(v, PrepareOptions())) for k, v in shapes.items()}
    rows: list[dict[str, Any]] = []
    for interval_ms in (5.0, 0.5, 0.1):
        sys.setswitchinterval(interval_ms / 1000)
        for threads in (0, 1, 2):
            stop = threading.Event()
            workers = [threading.Thread(target=busy, args=(stop,), daemon=True) for _ in range(threads)]
            for w in workers:
                w.start()
            try:
                for name, items in prepared.items():
                    timed(engine, items, 3)  # warm
                    ms = timed(engine, items, args.rounds)
                    row = {
                        "switch_interval_ms": interval_ms,
                        "busy_threads": threads,
                        "shape": name,
                        "ms": ms,
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                stop.set()
                for w in workers:
                    w.join()
    (args.out / "gil_batch.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
