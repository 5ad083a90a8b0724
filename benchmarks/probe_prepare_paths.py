"""Probe (CPU; meant for the GPU host's cores): where preparing media goes on the path the server runs,
and what two changes not yet made would buy there.

    python -m benchmarks.probe_prepare_paths [--processes 8] [--rounds 15] [--out FILE]

The server's workers report their own time per item (eg2_preprocess_seconds), and the H200 host's
came out about twice the dev machine's (docs/PERF.md): this probe splits a call's preparing on the
host itself. Three parts, from the tiny demo checkpoint (its preprocessing is the full model's):

1. `one`: each named medium (the 641x479 PNG, the 9.3 s WAV clip, the 8-frame 640x480 MP4) through
   the server's PrepareProcesses, one at a time: the round trip (submit to result), the worker's own
   seconds (what the server's histogram gets), and the result's way back, timed apart in this process:
   pickling it and writing its bytes to /dev/shm (the worker's side), reading them back (the server's).
2. `images16`: the bench's 16-image call, 16 copies of the PNG submitted at once to --processes
   workers. The server reads the results one after another on the pool's result thread; the same
   with the reads on --processes threads of their own (the change in question), alternated.
3. `video_loop`: the 8-frame video's decode loop as `preprocess.video.decode_video` runs it (decode,
   rgb24, resize each frame to its patch size) with torch on one thread, as in a worker: FFmpeg's
   decoder threads (1, 2, 4, its default) and threading kind (slice, frame), with each frame's rgb24
   and resize by the product's `_Converter`, inline or on its helper thread; and `decode_video` itself
   both ways (the helper is its default, the server's path), alternated. Every variant's frames are
   checked equal to `decode_video(helper=False)`'s, the reference. It runs alone on an idle host, as
   one video request does; under load the workers share the cores and extra threads buy less.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.workloads import NAMED_IMAGE_SIZE
from eg2_runtime import prepare_processes as pp
from eg2_runtime import samples
from eg2_runtime.engine import Engine, wrap_prepared
from eg2_runtime.inputs import Item, MediaKind, MediaPart, PrepareOptions
from eg2_runtime.preprocess.image import target_size
from eg2_runtime.preprocess.video import _Converter, decode_video

VIDEO = (8, 640, 480)  # frames at 1 fps, width, height: the bench's named video
WAIT_S = 60.0  # a result later than this is a stuck worker: fail, not hang the host's session


def median_ms(values: list[float]) -> float:
    return round(1e3 * statistics.median(values), 3)


def one_at_a_time(
    procs: pp.PrepareProcesses, engine: Engine, media: dict[MediaKind, bytes], rounds: int
) -> dict[str, Any]:
    """Round trip, worker seconds, and the result's write and read, per medium."""
    options, out = PrepareOptions(), dict[str, Any]()
    for kind, data in media.items():
        item = Item((MediaPart(kind, data),))
        trips, worker = [], []
        for _ in range(rounds + 2):
            start = time.perf_counter()
            job = procs.submit([item], options)
            job.future.result(timeout=WAIT_S)
            trips.append(time.perf_counter() - start)
            worker.append(job.seconds)
        batch = engine.preprocessor.prepare_batch([item], options, raise_errors=True)
        prepared = [wrap_prepared(p) for p in batch]  # type: ignore[arg-type]  # raised, not returned
        writes, reads, size = [], [], 0
        for _ in range(rounds):
            start = time.perf_counter()
            shipped = pp._ship(prepared)
            middle = time.perf_counter()
            pp._receive(*shipped)
            writes.append(middle - start)
            reads.append(time.perf_counter() - middle)
            size = sum(shipped[2])
        out[kind] = {
            "round_trip_ms": median_ms(trips[2:]),
            "worker_ms": median_ms(worker[2:]),
            "result_mb": round(size / 1e6, 2),
            "write_ms": median_ms(writes),
            "read_ms": median_ms(reads),
        }
        print(kind, json.dumps(out[kind]), flush=True)
    return out


def sixteen_images(procs: pp.PrepareProcesses, rounds: int) -> dict[str, Any]:
    """16 PNGs at once: results read on the pool's result thread (as served), or on reader threads."""
    items = [Item((MediaPart("image", samples.png(*NAMED_IMAGE_SIZE)),))] * 16
    served = pp.PrepareProcesses._done
    readers = ThreadPoolExecutor(procs.n, thread_name_prefix="reader")

    def read_apart(self: pp.PrepareProcesses, pool: Any, job: pp.PrepareJob, task: Any) -> None:
        readers.submit(served, self, pool, job, task)  # the server's own callback, on a reader thread

    walls: dict[str, list[float]] = {"served": [], "readers": []}
    try:
        for r in range(rounds + 1):
            order = (("served", served), ("readers", read_apart))
            for name, done in order if r % 2 else reversed(order):
                pp.PrepareProcesses._done = done  # type: ignore[method-assign]
                start = time.perf_counter()
                jobs = [procs.submit([item], PrepareOptions()) for item in items]
                _, late = wait([j.future for j in jobs], timeout=WAIT_S)
                assert not late and all(j.future.exception() is None for j in jobs)
                if r:
                    walls[name].append(time.perf_counter() - start)
    finally:
        pp.PrepareProcesses._done = served  # type: ignore[method-assign]
        readers.shutdown()
    out = {f"{name}_wall_ms": median_ms(v) for name, v in walls.items()}
    out["readers_over_served"] = round(
        statistics.median(b / a for a, b in zip(walls["served"], walls["readers"], strict=True)), 3
    )
    print("images16", json.dumps(out), flush=True)
    return out


def decode_loop(
    data: bytes, size: tuple[int, int], threads: int | None, kind: str, helper: bool
) -> np.ndarray:
    """decode_video's loop on a 1-fps clip (every frame sampled), the decoder's threads exposed."""
    import av

    container: Any
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        stream.thread_type = kind
        if threads is not None:
            stream.codec_context.thread_count = threads
        width, height = stream.codec_context.width, stream.codec_context.height
        with _Converter(width, height, size, helper=helper) as converter:
            for i, frame in enumerate(container.decode(stream)):
                converter.submit(i, frame)
    return np.stack(list(converter.frames.values()))


def video_loop(data: bytes, engine: Engine, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # as in a worker
    frames, width, height = VIDEO
    pre = engine.preprocessor
    size = target_size(height, width, pre.video_config.budget, pre.geometry)
    variants: dict[str, Callable[[], np.ndarray]] = {}
    for threads in (1, 2, 4, None):
        for kind in ("SLICE", "FRAME"):
            for helper in (False, True):
                name = f"{kind.lower()} threads={threads or 'default'}{' helper' if helper else ''}"
                variants[name] = functools.partial(decode_loop, data, size, threads, kind, helper)

    def served(helper: bool) -> np.ndarray:
        return decode_video(data, pre.video_config, pre.limits, geometry=pre.geometry, helper=helper).frames

    variants["decode_video"] = functools.partial(served, False)
    variants["decode_video helper"] = functools.partial(served, True)
    reference = served(False)
    assert len(reference) == frames
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds + 1):
        for name, run in variants.items() if r % 2 else reversed(variants.items()):
            start = time.perf_counter()
            got = run()
            if r:
                times[name].append(time.perf_counter() - start)
            else:
                assert np.array_equal(got, reference), name
    out = {name: median_ms(v) for name, v in times.items()}
    for name, ms in sorted(out.items(), key=lambda kv: kv[1]):
        print(f"video loop {ms:7.2f} ms  {name}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--processes", type=int, default=8, help="workers, as the server's default on 16 cores"
    )
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from app.service import ensure_demo_model

    model = ensure_demo_model(Path.home() / ".cache/eg2")
    engine = Engine.from_dir(model, device="cpu")
    media: dict[MediaKind, bytes] = {
        "image": samples.png(*NAMED_IMAGE_SIZE),
        "audio": samples.wav(9.3),
        "video": samples.mp4(VIDEO[0], 1, *VIDEO[1:]),
    }
    procs = engine.prepare_processes(args.processes)
    procs.start()
    try:
        result = {
            "processes": args.processes,
            "one": one_at_a_time(procs, engine, media, args.rounds),
            "images16": sixteen_images(procs, args.rounds),
        }
    finally:
        procs.close()
    result["video_loop"] = video_loop(media["video"], engine, args.rounds)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
