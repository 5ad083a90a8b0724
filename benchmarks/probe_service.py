"""Probe (GPU): `eg2 serve` as users run it, one process, over loopback HTTP with base64 bodies.

    python -m benchmarks.probe_service --model W4_DIR --out DIR [--modalities text,image,audio,video]
        [--budget-mib N]

Reports the server process's own GPU memory (NVML, by its PID) after /ready and after the calls,
and the median latency of: 1 query, 64 docs in one call, 1 image 641x479, 16 images in one call,
1 clip 9.3 s, 16 clips in one call, an 8-frame video; then single-item requests from 16 concurrent
clients (threads of this process) for images and clips. Writes service.json into DIR.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from benchmarks.server_process import running
from eg2_runtime import samples


def server_mib(pid: int) -> float | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == pid:
                return round(p.usedGpuMemory / 2**20, 1)
    except Exception:
        return None
    return None


def image_item(i: int) -> dict[str, Any]:
    png = base64.b64encode(samples.png(641, 479, i)).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}


def clip_item(i: int) -> dict[str, Any]:
    wav = base64.b64encode(samples.wav(9.3, hz=300 + i)).decode()
    return {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}


def video_item() -> dict[str, Any]:
    mp4 = base64.b64encode(samples.mp4(8, width=640, height=480)).decode()
    return {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{mp4}"}}


def median_ms(client: httpx.Client, url: str, body: bytes, rounds: int = 9) -> float:
    times = []
    for i in range(rounds + 2):
        t0 = time.perf_counter()
        r = client.post(url, content=body, headers={"content-type": "application/json"})
        r.raise_for_status()
        if i >= 2:  # two warm-up calls: a bucket's first use captures its graph
            times.append(1e3 * (time.perf_counter() - t0))
    return round(statistics.median(times), 2)


def concurrent_rate(url: str, bodies: list[bytes], clients: int, seconds: float) -> float:
    done = [0]
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def worker(k: int) -> None:
        with httpx.Client(timeout=60) as c:
            i = k
            while time.monotonic() < stop:
                c.post(url, content=bodies[i % len(bodies)], headers={"content-type": "application/json"})
                with lock:
                    done[0] += 1
                i += clients

    t0 = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(worker, range(clients)))
    return round(done[0] / (time.monotonic() - t0), 1)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--modalities", default="text,image,audio,video")
    parser.add_argument("--budget-mib", type=int)
    parser.add_argument("--port", type=int, default=8771)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "app.cli", "serve", "--model", str(args.model), "--port", str(args.port)]
    cmd += ["--modalities", args.modalities, "--log-level", "warning"]
    if args.budget_mib:
        cmd += ["--gpu-memory-mib", str(args.budget_mib)]
    enc = lambda items: json.dumps({"input": items, "encoding_format": "base64"}).encode()  # noqa: E731
    out: dict[str, Any] = {"command": " ".join(cmd)}
    media = set(args.modalities.split(","))
    t0 = time.monotonic()
    with running(cmd, dict(os.environ), url, ready_timeout=300) as proc:
        out["ready_s"] = round(time.monotonic() - t0, 1)
        out["mib_after_ready"] = server_mib(proc.pid)
        out["info_memory_plan"] = httpx.get(url + "/info").json().get("memory_plan")
        single: dict[str, bytes] = {
            "1 query": enc(["what is an embedding?"]),
            "64 docs": enc([f"document {i}: " + "words " * (10 + i % 30) for i in range(64)]),
            "2,200-token doc": enc(["embeddings map meaning " * 700]),
        }
        if "image" in media:
            single["1 image"] = enc([image_item(0)])
            single["16 images"] = enc([image_item(i) for i in range(16)])
        if "audio" in media:
            single["1 clip"] = enc([clip_item(0)])
            single["16 clips"] = enc([clip_item(i) for i in range(16)])
        if "video" in media:
            single["8-frame video"] = enc([video_item()])
        with httpx.Client(timeout=120) as client:
            out["ms"] = {k: median_ms(client, url + "/v1/embeddings", b) for k, b in single.items()}
            print(json.dumps(out["ms"]), flush=True)
        out["rps_16_clients"] = {}
        if "image" in media:
            bodies = [enc([image_item(i)]) for i in range(16)]
            out["rps_16_clients"]["images"] = concurrent_rate(url + "/v1/embeddings", bodies, 16, 6.0)
        if "audio" in media:
            bodies = [enc([clip_item(i)]) for i in range(16)]
            out["rps_16_clients"]["clips"] = concurrent_rate(url + "/v1/embeddings", bodies, 16, 6.0)
        out["mib_after_calls"] = server_mib(proc.pid)
        out["metrics_gpu"] = [
            line
            for line in httpx.get(url + "/metrics").text.splitlines()
            if line.startswith("eg2_gpu_memory")
        ]
    print(json.dumps(out, indent=1), flush=True)
    (args.out / "service.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
