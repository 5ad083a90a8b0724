"""`python -m benchmarks.scale`: does throughput scale with replicas? Short text over HTTP, one run.

    python -m benchmarks.scale --model DIR [--replicas 1,2] [--ingress proxy,haproxy] [--seconds 6] [--out DIR]

Phases, each against a fresh server on 127.0.0.1, each driven by client processes of their own (a
client in the server's interpreter would compete with it for the GIL):
    inprocess   Engine.embed on batches of 32 short texts (the ceiling a server can approach)
    serve       `eg2 serve`, one process on GPU 0
    ray-N       `eg2 serve-ray --replicas N`: N replicas behind Ray Serve's proxy
    haproxy-N   `eg2 serve-ray --replicas N --ingress haproxy`: behind HAProxy (with --ingress haproxy)
Two loads per server: single-text requests at concurrency 64, and 32-text requests at
concurrency 8 (less HTTP work per item: what the replicas themselves can do). Each load warms up
(connections opened, graphs captured) for 2 s before its timed window; the load generator is
benchmarks/http_load.py's `drive`, as in `eg2 bench`'s sweep. Results go to --out/scale.json after
every phase, so a run cut short keeps what it measured.

Assumes: run from the checkout's root (`python -m app.cli` must import); the ray phases need the
[ray] extra.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.http_load import Request, client_processes, drive
from benchmarks.server_process import free_port, running

WORDS = [
    "search",
    "results",
    "rank",
    "documents",
    "by",
    "meaning",
    "and",
    "queries",
    "find",
    "images",
    "audio",
    "video",
    "and",
    "text",
    "alike",
]
LOADS = {"single": (1, 64), "batch32": (32, 8)}  # items per request, concurrency


def _texts(n: int) -> list[str]:
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(3)) for i in range(n)]


def _request(items: int) -> Request:
    body = json.dumps({"model": "eg2", "input": _texts(items), "encoding_format": "base64"}).encode()
    return Request(body, items, 0)


def load(pool: Executor, url: str, items: int, concurrency: int, seconds: float) -> dict[str, Any]:
    """2 s untimed (connections open, graphs seen), then the timed window; http_load.drive does both."""
    req = _request(items)
    drive(pool, client_processes(), url, req, concurrency, 2.0, concurrency)
    row = drive(pool, client_processes(), url, req, concurrency, seconds, 2 * concurrency)
    row["items_per_request"] = items
    return row


def inprocess(model: Path, seconds: float) -> dict[str, Any]:
    """Engine.prepare_many + embed on batches of 32 short texts, as `eg2 bench` calls the engine."""
    from eg2_runtime.engine import Engine
    from eg2_runtime.inputs import Item, PrepareOptions, TextPart

    engine = Engine.from_dir(model, device="cuda", modalities={"text"})
    items = [Item((TextPart(t),)) for t in _texts(32)]
    opts = PrepareOptions()
    for _ in range(20):
        engine.embed(engine.prepare_many(items, opts))  # type: ignore[arg-type]
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        engine.embed(engine.prepare_many(items, opts))  # type: ignore[arg-type]
        n += 1
    return {"items_per_s": n * 32 / (time.perf_counter() - start), "batch": 32}


def server_phase(
    pool: Executor, cmd: list[str], env: dict[str, str], port: int, seconds: float
) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with running(cmd, env, url):
        out: dict[str, Any] = {"ready_s": time.monotonic() - t0}
        for name, (items, concurrency) in LOADS.items():
            out[name] = load(pool, url, items, concurrency, seconds)
            print(f"  {name}: {out[name]['items_per_s']:.0f} items/s, p99 {out[name]['p99_ms']} ms, "
                  f"replicas {out[name]['by_replica']}", flush=True)  # fmt: skip
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--replicas", default="1,2")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--out", type=Path, default=Path("out/scale"))
    parser.add_argument("--phases", default="inprocess,serve,ray")
    parser.add_argument(
        "--ingress", default="proxy", help="the ray phases' ingresses: proxy, haproxy or both"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    phases = args.phases.split(",")
    env = {**os.environ, "EG2_MODALITIES": "text", "EG2_LOG_LEVEL": "warning", "RAY_USAGE_STATS_ENABLED": "0"}
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv, "phases": {}}

    def save() -> None:
        (args.out / "scale.json").write_text(json.dumps(results, indent=1) + "\n")

    if "inprocess" in phases:
        results["phases"]["inprocess"] = inprocess(args.model, args.seconds)
        print("inprocess:", results["phases"]["inprocess"], flush=True)
        save()
    py = [sys.executable, "-m", "app.cli"]
    with ProcessPoolExecutor(client_processes(), mp_context=multiprocessing.get_context("spawn")) as pool:
        if "serve" in phases:
            print("serve:", flush=True)
            serve_env = {**env, "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
            port = free_port()
            cmd = [*py, "serve", "--model", str(args.model), "--port", str(port)]
            results["phases"]["serve"] = server_phase(pool, cmd, serve_env, port, args.seconds)
            save()
        if "ray" in phases:
            for ingress in args.ingress.split(","):
                for n in (int(r) for r in args.replicas.split(",")):
                    name = f"{'ray' if ingress == 'proxy' else ingress}-{n}"
                    print(f"{name}:", flush=True)
                    port = free_port()  # a port per phase: nothing left of the previous phase can answer
                    cmd = [*py, "serve-ray", "--model", str(args.model), "--port", str(port)]
                    cmd += ["--replicas", str(n), "--ingress", ingress]
                    results["phases"][name] = server_phase(pool, cmd, env, port, args.seconds)
                    save()
    results["scaling"] = {}
    for prefix in ("ray", "haproxy"):
        runs = {int(k.split("-")[1]): v for k, v in results["phases"].items() if k.startswith(f"{prefix}-")}
        if 1 in runs and len(runs) > 1:
            top = max(runs)
            results["scaling"][f"{prefix}-{top} / {prefix}-1"] = {
                name: runs[top][name]["items_per_s"] / runs[1][name]["items_per_s"] for name in LOADS
            }
    print("scaling:", results["scaling"], flush=True)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
