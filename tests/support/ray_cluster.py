"""What the live Ray Serve tests share: requests to a cluster, the replicas seen, and one replica
killed under load (tests/service/test_ray_serve.py behind Ray's proxy, tests/service/test_ray_serve_haproxy.py behind
HAProxy). Each test asserts its own ingress's guarantees on what `kill_one_under_load` observed."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import numpy as np

from app.ray_serve import REPLICA_HEADER


def embed(client: httpx.Client, text: str = "the same words") -> httpx.Response:
    return client.post("/v1/embeddings", json={"input": [text]})


def replicas_seen(base: str, want: int, timeout_s: float = 30) -> dict[str, int]:
    """replica id -> pid, from /info, until `want` distinct replicas answered."""
    seen: dict[str, int] = {}
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=base, timeout=10) as client:
        while len(seen) < want and time.monotonic() < deadline:
            replica = client.get("/info").json()["replica"]
            seen[replica["id"]] = replica["pid"]
    return seen


def vectors_by_replica(
    base: str, want: int = 2, timeout_s: float = 60, threads: int = 8
) -> dict[str, list[np.ndarray]]:
    """The same text embedded by `threads` concurrent clients, round after round, until `want` replicas
    answered (or the timeout): its vectors, grouped by the replica that answered. Rounds, not one
    shot: a balancer may briefly keep a replica out (HAProxy marks a replica down after a slow
    health check on a loaded 2-core machine, then back up)."""
    from concurrent.futures import ThreadPoolExecutor

    by_replica: dict[str, list[np.ndarray]] = {}
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=base, timeout=30) as client, ThreadPoolExecutor(threads) as pool:
        while len(by_replica) < want and time.monotonic() < deadline:
            responses = list(pool.map(lambda _: embed(client), range(2 * threads)))
            bad = [r.text for r in responses if r.status_code != 200]
            assert not bad, bad
            for r in responses:
                vector = np.array(r.json()["data"][0]["embedding"])
                by_replica.setdefault(r.headers[REPLICA_HEADER], []).append(vector)
    return by_replica


@dataclass
class Killed:
    statuses: Counter[int]  # HTTP status -> responses, over the whole run
    failed: list[tuple[float, int, str]]  # (seconds after the kill, status, body) of each non-200
    dropped: list[str]  # requests that got no response at all (the exception's name)
    survivor: str
    new_ids: set[str]  # replicas that answered after the kill and were not there before
    after: Counter[str]  # replica id -> 200s after the kill
    recovered_s: float


def kill_one_under_load(base: str, clients: int = 4, timeout_s: float = 120) -> Killed:
    """SIGKILL one of 2 replicas while `clients` threads post requests; run until a replacement answers."""
    before = replicas_seen(base, 2)
    victim, survivor = sorted(before)
    results: list[tuple[float, int, str | None, str]] = []
    dropped: list[str] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=base, timeout=30) as client:
            while not stop.is_set():
                try:
                    r = embed(client)
                except httpx.TransportError as exc:
                    dropped.append(type(exc).__name__)
                    continue
                results.append((time.monotonic(), r.status_code, r.headers.get(REPLICA_HEADER), r.text))

    threads = [threading.Thread(target=load, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        killed_at = time.monotonic()
        os.kill(before[victim], signal.SIGKILL)
        # Ray notices the dead actor, starts a replacement, and routes to it once it warmed up.
        deadline = killed_at + timeout_s
        new_ids: set[str] = set()
        while time.monotonic() < deadline:
            recent = [rid for at, _, rid, _ in results[-40:] if at > killed_at]
            new_ids = {rid for rid in recent if rid not in (None, victim, survivor)}
            if new_ids and survivor in recent:
                break
            time.sleep(0.5)
        recovered_s = time.monotonic() - killed_at
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=35)
    return Killed(
        statuses=Counter(status for _, status, _, _ in results),
        failed=[(at - killed_at, status, text) for at, status, _, text in results if status != 200],
        dropped=dropped,
        survivor=survivor,
        new_ids=new_ids,
        after=Counter(
            rid for at, status, rid, _ in results if at > killed_at and rid is not None and status == 200
        ),
        recovered_s=recovered_s,
    )
