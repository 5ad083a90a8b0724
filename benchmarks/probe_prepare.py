"""Probe (CPU): what preparing the named media costs on this host's threads, as the service runs it.

    python -m benchmarks.probe_prepare [--torch-threads N] [--out FILE]

engine.prepare of the bench's named media (the 641x479 PNG, the 9.3 s WAV clip, the 8-frame MP4),
from the tiny demo checkpoint (the preprocessing is the full model's: same processor config), timed
three ways: on the main thread; one at a time on a worker of an 8-thread pool (the service's
preprocessing pool); and 16 at once on that pool (a 16-item request). `--torch-threads` sets torch's
intra-op threads first (the resize and the mel run torch CPU ops); default: torch's own choice.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from eg2_runtime import samples
from eg2_runtime.engine import Engine
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    from app.service import ensure_demo_model

    engine = Engine.from_dir(ensure_demo_model(Path.home() / ".cache/eg2"), device="cpu")
    media = {
        "image": Item((MediaPart("image", samples.png(641, 479)),)),
        "clip": Item((MediaPart("audio", samples.wav(9.3)),)),
        "video": Item((MediaPart("video", samples.mp4(8, width=640, height=480)),)),
    }
    options = PrepareOptions()
    out: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    with ThreadPoolExecutor(8) as pool:
        for name, item in media.items():

            def once(item: Item = item) -> float:
                t = time.perf_counter()
                engine.prepare(item, options)
                return 1e3 * (time.perf_counter() - t)

            once()
            main_ms = statistics.median(once() for _ in range(15))
            worker_ms = statistics.median(pool.submit(once).result() for _ in range(15))
            t = time.perf_counter()
            each = [f.result() for f in [pool.submit(once) for _ in range(16)]]
            out[name] = {
                "main_thread_ms": round(main_ms, 2),
                "one_worker_ms": round(worker_ms, 2),
                "16_on_8_workers_wall_ms": round(1e3 * (time.perf_counter() - t), 2),
                "16_on_8_workers_item_ms": round(statistics.median(each), 2),
            }
            print(name, json.dumps(out[name]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
