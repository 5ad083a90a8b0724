"""Probe (GPU): where `eg2 serve`'s own CPU time goes under load, with py-spy on the server process.

    python -m benchmarks.profile_server --out DIR [--py-spy PATH] [--seconds 12] [--loads 128,8,16] [--wall]
        [--prime]

Boots `eg2 serve` on the generated full-size hybrid-w4 checkpoint (as `eg2 bench` does), then, for
each load below, records the server with `py-spy record --gil --threads` (a sample only when a
thread holds the GIL, so the samples say which thread holds the interpreter and doing what) while
this process's clients send it requests over loopback HTTP:
- 128 clients, single short texts (the #15 sweep's point);
- 8 clients, 64-text requests;
- 16 clients, single 9.3 s clips (the #12 sweep's point);
- 1 client, 64-text requests one after another (where one call's latency goes).
--loads picks some of them by their first word (128, 8, 16, 1). --wall samples every thread whether
or not it holds the GIL, waits included, and summarizes the GPU thread, the event loop and one
preprocessing thread, each alone: where their wall time goes.
Writes, per load, the raw samples (`<load>.txt`) and a summary (`profile.json`): requests/s, the
server's own stage split from /metrics (batches, items, mean ms preparing, queueing, a batch on the
GPU), the share of samples per thread, and the top functions by self and by inclusive samples.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.http_load import burst, server_stages, stage_split
from benchmarks.server_process import free_port, running
from benchmarks.workloads import DEFAULT_CACHE, checkpoints
from eg2_runtime import samples

SHORT = json.dumps({"model": "eg2", "input": "what is the capital of france", "encoding_format": "base64"})
DOCS = json.dumps(
    {
        "model": "eg2",
        "input": [" ".join(["document", "about", "vectors", str(i)] * (5 + i % 10)) for i in range(64)],
        "encoding_format": "base64",
    }
)
CLIP = json.dumps(
    {
        "model": "eg2",
        "input": [
            {
                "type": "input_audio",
                "input_audio": {"data": base64.b64encode(samples.wav(9.3)).decode(), "format": "wav"},
            }
        ],
        "encoding_format": "base64",
    }
)


def _media_calls() -> list[bytes]:
    """The bench's named media calls (benchmarks/workloads.py): 16 images of 641x479 in one call, an
    8-frame video, 16 clips of 9.3 s in one call. --prime sends each once before the loads, as the
    bench's named phase does before its sweep: the tower graphs they capture share one pool."""
    png = base64.b64encode(samples.png(641, 479)).decode()
    mp4 = base64.b64encode(samples.mp4(8, 1, 640, 480)).decode()
    wav = base64.b64encode(samples.wav(9.3)).decode()
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}
    video = {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{mp4}"}}
    clip = {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}
    inputs: list[list[Any]] = [[image] * 16, [video], [clip] * 16]
    return [json.dumps({"model": "eg2", "input": x, "encoding_format": "base64"}).encode() for x in inputs]


GPU_THREAD = "eg2-gpu-0"  # app.batcher's one GPU thread
# --wall summarizes these one by one: the GPU thread, the event loop's, a preprocessing thread.
WALL_THREADS = (GPU_THREAD, "MainThread", "eg2-prepare-0")
LOADS = (
    ("128 clients, short texts", SHORT, 128),
    ("8 clients, 64 texts", DOCS, 8),
    ("16 clients, single clips", CLIP, 16),
    ("1 client, 64 texts", DOCS, 1),
)


def summarize(raw: Path, top: int = 25, thread: str | None = None) -> dict[str, Any]:
    """py-spy's raw (collapsed) stacks -> samples per thread, and the top frames by self and inclusive
    samples over all threads, or over `thread`'s samples alone."""
    threads: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        name = frames[0].split(":")[-1].strip()
        threads[name] += n
        if thread is not None and name != thread:
            continue
        total += n
        own[frames[-1]] += n
        for frame in set(frames[1:]):
            inclusive[frame] += n
    share = lambda c, t: [(k[:160], round(v / max(t, 1), 4)) for k, v in c.most_common(top)]  # noqa: E731
    return {
        "samples": total,
        "threads": share(threads, sum(threads.values())),
        "self": share(own, total),
        "inclusive": share(inclusive, total),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--size", choices=("full", "tiny"), default="full", help="tiny: a CPU smoke run")
    parser.add_argument("--loads", default="128,8,16", help="the loads to run, by their client counts")
    parser.add_argument(
        "--wall",
        action="store_true",
        help="sample every thread all the time (waits included) instead of the GIL's holder, and summarize "
        "the GPU thread, the event loop and one preprocessing thread each on its own: where their wall "
        "time goes",
    )
    parser.add_argument(
        "--prime",
        action="store_true",
        help="first send the bench's named media calls once (16 images, a video, 16 clips), as its named "
        "phase does before its sweep",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with checkpoints(None, DEFAULT_CACHE, args.size, print) as (_, w4):
        model = w4  # generated once under the cache directory: it outlives the context
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "app.cli", "serve", "--model", str(model), "--port", str(port)]
    cmd += ["--log-level", "warning"]
    result: dict[str, Any] = {"command": " ".join(cmd), "wall": args.wall}
    mode = ["--idle"] if args.wall else ["--gil"]
    result["primed"] = args.prime
    with running(cmd, dict(os.environ), url, ready_timeout=300) as server:
        for call in _media_calls() if args.prime else []:
            asyncio.run(burst(url, call, 1, 1))
        for name, body, clients in [x for x in LOADS if str(x[2]) in args.loads.split(",")]:
            t0 = time.perf_counter()
            asyncio.run(burst(url, body.encode(), 5 * clients, clients))  # warm: captures, workers
            count = max(clients, int(5 * clients / (time.perf_counter() - t0) * args.seconds))
            raw = args.out / (name.split(",")[0].replace(" ", "-") + ".txt")
            record = ["record", "-p", str(server.pid), "-o", str(raw), "-f", "raw", "-r", "250"]
            spy = subprocess.Popen(
                [args.py_spy, *record, "-d", str(int(args.seconds)), *mode, "--threads", "--nonblocking"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
            time.sleep(1.0)  # py-spy attaches
            before = server_stages(httpx.get(f"{url}/metrics").text)
            t0 = time.perf_counter()
            asyncio.run(burst(url, body.encode(), count, clients))  # about as long as the recording
            rate = count / (time.perf_counter() - t0)
            stages = stage_split(before, server_stages(httpx.get(f"{url}/metrics").text))
            spy.wait(timeout=args.seconds + 60)
            if not raw.exists():
                row: dict[str, Any] = {"error": "py-spy wrote nothing"}
            elif args.wall:
                row = {thread: summarize(raw, thread=thread) for thread in WALL_THREADS}
            else:
                row = summarize(raw)
            result[name] = {"requests_per_s": round(rate, 1), "server": stages, **row}
            print(name, json.dumps(result[name])[:2000], flush=True)
    (args.out / "profile.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
