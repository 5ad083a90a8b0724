"""The garbage collector's pauses inside `eg2 serve` (the real engine, a CPU checkpoint such as the
tiny one) under single-text load at 32 clients, with the startup heap frozen (the service's default,
app/service.py freeze_startup_heap) or thawed again for the measured phase. gc.callbacks in the
server time every pass; at the end the server times one full collection.

    python -m benchmarks.gc_pauses {frozen|unfrozen} MODEL_DIR [REQUESTS]     (from the repository root)

The server is this module run with --serve: `eg2 serve`'s own code, with the GC probe installed
before the app starts. SIGUSR2 starts the measured phase, SIGUSR1 writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.http_load import burst
from benchmarks.server_process import free_port, running

BODY = json.dumps({"model": "eg2", "input": "what is the capital of france", "encoding_format": "base64"})


class GcProbe:
    """Times every collector pass per generation, from the moment `measure` is called."""

    def __init__(self, thaw: bool, out: Path) -> None:
        self.thaw, self.out = thaw, out
        self.passes: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._began = 0.0
        gc.callbacks.append(self._timer)

    def _timer(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.passes[info["generation"]].append(time.perf_counter() - self._began)

    def measure(self, *_: object) -> None:
        if self.thaw:
            gc.unfreeze()
        for v in self.passes.values():
            v.clear()

    def dump(self, *_: object) -> None:
        gc.callbacks.remove(self._timer)
        start = time.perf_counter()
        gc.collect()
        full = time.perf_counter() - start
        figures = {
            "passes": self.passes,
            "frozen": gc.get_freeze_count(),
            "tracked": len(gc.get_objects()),
            "full_collect_s": full,
        }
        self.out.write_text(json.dumps(figures))


def serve(port: int, mode: str, out: Path, model: str) -> int:
    from app.server import serve as serve_app
    from app.settings import Settings

    probe = GcProbe(mode == "unfrozen", out)
    signal.signal(signal.SIGUSR2, probe.measure)
    signal.signal(signal.SIGUSR1, probe.dump)
    return serve_app(
        Settings(host="127.0.0.1", port=port, log_level="warning", model=Path(model), api_key=None)
    )


def measure(mode: str, model: str, count: int) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out = Path(tempfile.mkdtemp()) / f"gc_pauses_{mode}.json"
    cmd = [sys.executable, "-m", "benchmarks.gc_pauses", mode, model, "--serve", str(port), "--out", str(out)]
    with running(cmd, dict(os.environ), url) as server:
        asyncio.run(burst(url, BODY.encode(), 300, 8))  # warm
        os.kill(server.pid, signal.SIGUSR2)  # the measured phase begins (unfrozen: the heap thawed)
        time.sleep(1)
        start = time.perf_counter()
        latencies = asyncio.run(burst(url, BODY.encode(), count, 32))
        wall = time.perf_counter() - start
        os.kill(server.pid, signal.SIGUSR1)  # the figures to `out`
        time.sleep(2)
    s = json.loads(out.read_text())

    def ms(x: float) -> str:
        return f"{1e3 * x:.1f}"

    n = len(latencies)
    print(
        f"{mode}: {count} requests, {count / wall:.0f} req/s, client p50 {ms(latencies[n // 2])} ms, "
        f"p99 {ms(latencies[int(n * 0.99)])} ms, max {ms(latencies[-1])} ms; frozen objects {s['frozen']}, "
        f"tracked {s['tracked']}; one full collection at the end {ms(s['full_collect_s'])} ms"
    )
    for generation, times in s["passes"].items():
        if times:
            print(
                f"  generation {generation}: {len(times)} passes, {ms(sum(times))} ms, longest {ms(max(times))} ms"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("mode", choices=("frozen", "unfrozen"))
    parser.add_argument("model", help="checkpoint directory")
    parser.add_argument("requests", nargs="?", type=int, default=20_000)
    parser.add_argument("--serve", type=int, metavar="PORT", help="(internal) be the probed server")
    parser.add_argument("--out", type=Path, help="(internal) where the server writes its figures")
    args = parser.parse_args()
    if args.serve is not None:
        return serve(args.serve, args.mode, args.out, args.model)
    measure(args.mode, args.model, args.requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
