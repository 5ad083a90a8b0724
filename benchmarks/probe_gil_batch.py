"""Probe (GPU): what Python threads busy beside the engine cost its batches: the GIL.

    python -m benchmarks.probe_gil_batch --out DIR [--rounds 10]

Under 128 HTTP clients the server's text batches took 36 ms against ~4 ms in-process (`eg2 bench`,
H200, 2026-12-01, commit bb2ac50). The event loop parsing requests holds the GIL; the engine's thread
gives it up inside torch calls that wait or work long enough, and waits to get it back. This boots
the engine as `eg2 serve` does, then times `Engine.embed` of one query and of 64 docs (eg2 bench's) while
0, 1 or 2 threads run pure-Python work (JSON encoding and decoding, as an event loop under load
does), at several GIL switch intervals (`sys.setswitchinterval`). Then, at a 5 ms interval, each
step of one text batch alone, with and without a busy thread, the device synchronized after each
(`steps`): how many hand-offs each step costs, to know which calls to cut. Writes gil_batch.json
into DIR.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from app.service import GPU_BATCH_TOKENS
from benchmarks.probe_boot import shapes as boot_shapes
from benchmarks.timing import host_median_ms
from benchmarks.workloads import DEFAULT_CACHE, Factory, checkpoints
from eg2_runtime.engine import Engine
from eg2_runtime.inputs import PrepareOptions


def busy(stop: threading.Event) -> None:
    """An event loop's kind of work: small JSON documents encoded and decoded, no C call that waits."""
    doc = {"input": ["a short query about vectors"] * 4, "model": "eg2", "encoding_format": "base64"}
    while not stop.is_set():
        json.loads(json.dumps(doc))


def steps(engine: Engine, prepared: list[Any]) -> dict[str, Callable[[], object]]:
    """One text batch's steps on the engine's thread, as Engine.embed runs them, each ending with a
    device sync (itself a step, to subtract)."""
    import numpy as np
    import torch

    items = [p.inputs for p in prepared]
    assert engine.packed is not None, "the probe times the packed text path"
    lengths = [p.num_tokens for p in items]
    ids = torch.from_numpy(np.concatenate([p.input_ids.numpy() for p in items]))[None]
    flat = engine.model.input_embeddings(ids)[0]
    out = engine.packed(flat, lengths)
    cuda = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def then_sync(step: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            result = step()
            sync()
            return result

        return run

    return {
        "synchronize alone": sync,
        "padded batch (media batches only)": then_sync(lambda: engine.device_batch(items)),
        "input embeddings": then_sync(lambda: engine.model.input_embeddings(ids)),
        "packed graphs": then_sync(lambda: engine.packed(flat, lengths)),  # type: ignore[misc]
        "copy out": then_sync(lambda: out.cpu().numpy()),
        "Engine.embed": lambda: engine.embed(prepared),
    }


def step_handoffs(engine: Engine, prepared: list[Any], rounds: int) -> dict[str, Any]:
    """Each step's median ms alone and beside one busy thread at a 5 ms switch interval, and the
    hand-offs that difference amounts to."""
    interval_ms = 5.0
    sys.setswitchinterval(interval_ms / 1000)
    table = steps(engine, prepared)

    alone = {k: host_median_ms(f, rounds) for k, f in table.items()}
    stop = threading.Event()
    worker = threading.Thread(target=busy, args=(stop,), daemon=True)
    worker.start()
    try:
        beside = {k: host_median_ms(f, rounds) for k, f in table.items()}
    finally:
        stop.set()
        worker.join()
    return {
        k: {"alone_ms": alone[k], "busy_ms": beside[k], "handoffs": (beside[k] - alone[k]) / interval_ms}
        for k in table
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with checkpoints(None, DEFAULT_CACHE, "full", print) as (_, w4):
        engine = Engine.from_dir(w4, device="cuda", modalities={"text"})
    engine.warm_up(64, GPU_BATCH_TOKENS)
    engine.capture_graphs()
    boot = boot_shapes(Factory(engine.preprocessor))  # eg2 bench's query and 64 docs
    shapes = {"1 query": boot["query"][0], "64 docs": boot["64 docs"][0]}
    prepared: dict[str, list[Any]] = {
        k: list(engine.prepare_many(v, PrepareOptions())) for k, v in shapes.items()
    }
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
                    ms = host_median_ms(partial(engine.embed, items), args.rounds, warmup=3)
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
    import torch

    with torch.inference_mode():  # as Engine.embed runs: the static buffers are inference tensors
        split = step_handoffs(engine, prepared["64 docs"], max(5, args.rounds // 2))
    for name, row in split.items():
        print(json.dumps({"step": name, **row}), flush=True)
    out = {"rows": rows, "steps_64_short_texts": split}
    (args.out / "gil_batch.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
