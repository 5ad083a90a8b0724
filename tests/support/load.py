"""A bounded async load generator for the embeddings API (N requests, C in flight, a timeout on each),
and `Serve`, the real `eg2 serve` in a subprocess to aim it at.

Each request is built by the caller from its index (`make(i) -> Request`) and each answer is handed to
the caller's `check(i, request, response) -> None | failure message`, so a run keeps counts, latencies
and failures, not thousands of response bodies. It is bounded in count (`total`), in time (a timeout
per request and a deadline for the run) and in place: it refuses any host but loopback.

Outcomes are counted by HTTP status; a request that got no answer (client timeout, reset, refused) is
counted by exception name in `errors`, which is how a hung connection shows.

`Serve` starts the installed console script on 127.0.0.1 and a port it binds itself (port 0), collects
its stderr (the JSON logs), and reads its RSS and open descriptors from /proc, so a test sees the
server as an operator does.

As a script, against a running server (text only, OpenAI-style bodies):
    python tests/support/load.py http://127.0.0.1:8000 -n 2000 -c 128 [--api-key KEY] [--items 4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import ssl
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

LOOPBACK = ("localhost", "::1")
EG2 = Path(sys.executable).with_name("eg2")  # the console script of this environment


@dataclass(frozen=True)
class Request:
    content: bytes  # the JSON body, serialised once by the caller
    path: str = "/v1/embeddings"
    tag: Any = None  # anything the check needs to judge the answer (e.g. what vectors to expect)

    @classmethod
    def json(cls, body: Any, *, path: str = "/v1/embeddings", tag: Any = None) -> Request:
        return cls(json.dumps(body, separators=(",", ":")).encode(), path, tag)


Check = Callable[[int, Request, httpx.Response], str | None]


@dataclass
class LoadResult:
    total: int
    concurrency: int
    wall_s: float = 0.0
    statuses: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)  # no HTTP answer: exception name -> count
    failures: list[str] = field(default_factory=list)  # check failures, the first `keep_failures`
    n_failures: int = 0
    unfinished: int = 0  # requests never sent or cut off by the run's deadline
    latencies: list[float] = field(default_factory=list)  # seconds, of answered requests

    @property
    def answered(self) -> int:
        return sum(self.statuses.values())

    def percentile(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.total,
            "concurrency": self.concurrency,
            "wall_s": round(self.wall_s, 2),
            "rps": round(self.answered / self.wall_s, 1) if self.wall_s else None,
            "statuses": dict(sorted(self.statuses.items())),
            "errors": dict(self.errors),
            "check_failures": self.n_failures,
            "unfinished": self.unfinished,
            "latency_ms": {
                "p50": round(self.percentile(0.5) * 1000, 1),
                "p99": round(self.percentile(0.99) * 1000, 1),
                "max": round(max(self.latencies, default=float("nan")) * 1000, 1),
            },
        }


def require_loopback(base_url: str) -> None:
    host = urlsplit(base_url).hostname or ""
    if not (host.startswith("127.") or host in LOOPBACK):
        raise ValueError(f"load is only ever sent to loopback, not to {host!r}")


async def run_load(
    base_url: str,
    make: Callable[[int], Request],
    *,
    total: int,
    concurrency: int,
    check: Check | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 30.0,
    connect_timeout_s: float | None = None,
    deadline_s: float = 600.0,
    keep_failures: int = 20,
) -> LoadResult:
    """Send `total` requests, at most `concurrency` at a time, and count what came back.

    `connect_timeout_s` (default: timeout_s) apart, so a test of clients that give up on a slow
    answer is not decided by how fast a loaded 2-core machine accepts 96 connections."""
    require_loopback(base_url)
    result = LoadResult(total, concurrency)
    indices = iter(range(total))
    done = 0
    # One client (one keep-alive connection) per worker: httpcore's pool scans every connection on each
    # request, which at 128 connections costs the client more CPU than the server spends answering.
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    tls = ssl.create_default_context()  # never used on plain http, but each client would load the CAs
    base_headers = {"content-type": "application/json", **(headers or {})}

    async def worker() -> None:
        async with httpx.AsyncClient(
            base_url=base_url,
            headers=base_headers,
            limits=limits,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s or timeout_s),
            verify=tls,
        ) as client:
            await work(client)

    async def work(client: httpx.AsyncClient) -> None:
        nonlocal done
        for i in indices:  # shared iterator: each index is taken by exactly one worker
            request = make(i)
            start = time.perf_counter()
            try:
                response = await client.post(request.path, content=request.content)
            except httpx.HTTPError as exc:
                result.errors[type(exc).__name__] += 1
                done += 1
                continue
            result.latencies.append(time.perf_counter() - start)
            result.statuses[response.status_code] += 1
            failure = check(i, request, response) if check is not None else None
            if failure is not None:
                result.n_failures += 1
                if len(result.failures) < keep_failures:
                    result.failures.append(f"request {i}: {failure}")
            done += 1

    start = time.perf_counter()
    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    try:
        async with asyncio.timeout(deadline_s):
            await asyncio.gather(*workers)
    except TimeoutError:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    result.wall_s = time.perf_counter() - start
    result.unfinished = total - done
    return result


def run(base_url: str, make: Callable[[int], Request], **kw: Any) -> LoadResult:
    """run_load on a fresh event loop (for synchronous tests)."""
    return asyncio.run(run_load(base_url, make, **kw))


def text_requests(items: int = 1, seed: int = 0) -> Callable[[int], Request]:
    """Request i: 1..items short texts (deterministic from seed and i), base64 vectors as the SDK asks."""

    def make(i: int) -> Request:
        rng = random.Random(seed * 1_000_003 + i)
        texts = [
            " ".join(
                rng.choice(("alpha", "beta", "gamma", "delta", "load")) for _ in range(rng.randint(1, 40))
            )
            for _ in range(rng.randint(1, items))
        ]
        return Request.json({"input": texts, "encoding_format": "base64"}, tag=len(texts))

    return make


def _count_rows(i: int, request: Request, response: httpx.Response) -> str | None:
    if response.status_code != 200:
        return None
    rows = len(response.json()["data"])
    return None if rows == request.tag else f"{rows} rows for {request.tag} items"


# --- the server under load: the real `eg2 serve` in a subprocess ----------------------------------


START_S = 120.0  # how long `Serve` waits for the bind when asked its port: a cold start imports torch


class Serve:
    """`eg2 serve` (the installed console script) in a subprocess on 127.0.0.1, its stderr collected.

    The caller's EG2_* variables are dropped; settings come from `args` and `env`. `rss_kb` and `fds`
    read /proc/PID, so a test can watch the server's memory and descriptors from outside.
    """

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None, *, prefix: Sequence[str] = ()):
        self._port: int | None = None
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("EG2_")}
        full_env.update({"HF_HUB_OFFLINE": "1", **(env or {})})
        command = [*prefix, str(EG2), "serve", "--host", "127.0.0.1", "--port", "0", *args]
        self.proc = subprocess.Popen(
            command, env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, name="eg2-serve-stderr", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            self.lines.append(raw.decode("utf-8", "replace"))

    @property
    def log(self) -> str:
        return "".join(self.lines)

    @property
    def port(self) -> int:
        """The port the server bound (it is started with port 0); waits for the bind."""
        return self.wait_port(START_S)

    def wait_port(self, timeout_s: float) -> int:
        # Imported here: as a script (`python tests/support/load.py URL`) this file needs no repo imports.
        from benchmarks.server_process import wait_listening

        if self._port is None:
            alive = lambda: self.proc.poll() is None  # noqa: E731
            self._port = wait_listening(self.proc.pid, alive, lambda: self.log, timeout_s)
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 60.0) -> Serve:
        deadline = time.monotonic() + timeout_s
        self.wait_port(timeout_s)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"eg2 serve exited with {self.proc.returncode}:\n{self.log[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"eg2 serve not ready after {timeout_s:g} s:\n{self.log[-3000:]}")
            time.sleep(0.05)

    def wait_exit(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=5)
        return code

    def rss_kb(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def settled_fds(self, timeout_s: float = 10.0, quiet_s: float = 0.5) -> int:
        """The descriptor count once it has not changed for `quiet_s` (closed connections reaped)."""
        deadline = time.monotonic() + timeout_s
        last, since = self.fds(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = self.fds()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                break
        return last

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()

    def __enter__(self) -> Serve:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("url", help="server base URL (loopback only)")
    parser.add_argument("-n", "--requests", type=int, default=2000)
    parser.add_argument("-c", "--concurrency", type=int, default=128)
    parser.add_argument("--items", type=int, default=1, help="most texts per request")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args(argv)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else None
    result = run(
        args.url,
        text_requests(args.items),
        total=args.requests,
        concurrency=args.concurrency,
        check=_count_rows,
        headers=headers,
        timeout_s=args.timeout,
    )
    print(json.dumps(result.summary(), indent=2))
    for failure in result.failures:
        print(failure, file=sys.stderr)
    bad = result.errors or result.n_failures or result.unfinished
    return 1 if bad or set(result.statuses) - {200, 429, 503} else 0


if __name__ == "__main__":
    sys.exit(main())
