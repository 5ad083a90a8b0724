"""Load: a bounded mixed run against the real `eg2 serve` and the real engine on the tiny checkpoint.

The server is the installed CLI in a subprocess (so its memory and descriptors can be read from
/proc), the load comes from tests/support/load.py over loopback. Every answer is checked: a 200 carries, in
order, the vectors and token counts that an in-process Engine on the same checkpoint computes one item
at a time; anything else must be a documented 429 or 503. A first phase warms the allocator and the
caches; the second is measured: its RSS and open descriptors must end within 5% of their level after
the first, and the queue must drain to zero. RSS is read after each phase once the idle server has
trimmed its heap (app/malloc.py): before the trim it holds what the largest batches so far freed,
which jumps at random points of later phases (`python -m benchmarks.rss_drift`, docs/RELIABILITY.md).
"""

from __future__ import annotations

import base64
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from eg2_runtime import samples
from eg2_runtime.api import matryoshka
from eg2_runtime.engine import Engine
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions, TextPart
from tests.support.load import LoadResult, Request, Serve, run

CONCURRENCY = 128
WARM_REQUESTS = 1000
MEASURED_REQUESTS = 2000
ATOL = 1e-4  # batched (padded, mixed lengths) vs one item per batch, FP32 on CPU: ~1e-6 in practice
IMAGE_TOKENS = 70
OPTIONS = PrepareOptions(image_tokens=IMAGE_TOKENS)

WORDS = [
    "the",
    "a",
    "search",
    "vector",
    "embedding",
    "query",
    "document",
    "image",
    "sound",
    "river",
    "stone",
    "light",
    "north",
    "quiet",
]


def _texts(n: int) -> list[str]:
    rng = random.Random(5)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) + f" #{i}" for i in range(n)]


TEXTS = _texts(160)
CONTENT_ITEMS = 12  # interleaved text + image items: the first 12 texts, each with an image
IMAGES = [samples.png(48 + 8 * i, 40 + 4 * i, seed=i) for i in range(6)]
AUDIO = [
    samples.wav(0.4 + 0.3 * i, rate=(16_000, 22_050, 8_000, 44_100)[i], hz=220.0 * (i + 1)) for i in range(4)
]


@dataclass(frozen=True)
class Expect:
    keys: tuple[tuple[str, int], ...]  # what each item is, in order: ("text", 3), ("image", 1), ...
    dims: int | None
    base64: bool


def _part(key: tuple[str, int]) -> Any:
    kind, i = key
    if kind == "text":
        return TEXTS[i]
    if kind == "image":
        return {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(IMAGES[i]).decode()},
        }
    if kind == "audio":
        return {
            "type": "input_audio",
            "input_audio": {"data": base64.b64encode(AUDIO[i]).decode(), "format": "wav"},
        }
    # an interleaved item: one text and one image, one embedding
    return {"content": [{"type": "text", "text": TEXTS[i]}, _part(("image", i % len(IMAGES)))]}


def _item(key: tuple[str, int]) -> Item:
    kind, i = key
    if kind == "text":
        return Item((TextPart(TEXTS[i]),))
    if kind == "image":
        return Item((MediaPart("image", IMAGES[i]),))
    if kind == "audio":
        return Item((MediaPart("audio", AUDIO[i]),))
    return Item((TextPart(TEXTS[i]), MediaPart("image", IMAGES[i % len(IMAGES)])))


def make_request(i: int) -> Request:
    """Request i of the mix: ~80% text (1-3 items), the rest image, audio, interleaved or mixed."""
    rng = random.Random(i)
    roll = rng.random()
    texts = [("text", rng.randrange(len(TEXTS))) for _ in range(rng.randint(1, 3))]
    if roll < 0.80:
        keys = texts
    elif roll < 0.88:
        keys = [("image", rng.randrange(len(IMAGES)))] + texts[:1] * rng.randint(0, 1)
    elif roll < 0.95:
        keys = [("audio", rng.randrange(len(AUDIO)))]
    else:
        keys = [("content", rng.randrange(CONTENT_ITEMS))]
    dims = rng.choice((None, None, None, 256, 512))
    b64 = rng.random() < 0.8  # the OpenAI SDK's default
    body: dict[str, Any] = {"input": [_part(k) for k in keys], "image_tokens": IMAGE_TOKENS, "model": "eg2"}
    body["encoding_format"] = "base64" if b64 else "float"
    if dims is not None:
        body["dimensions"] = dims
    return Request.json(body, tag=Expect(tuple(keys), dims, b64))


class Reference:
    """Vectors and token counts of the mix's items from an in-process Engine, one item per batch."""

    def __init__(self, model_dir: Path) -> None:
        self.engine = Engine.from_dir(model_dir, device="cpu")
        self._cache: dict[tuple[str, int], tuple[np.ndarray, int]] = {}

    def embed_every_item(self) -> Reference:
        """Every item of the mix, computed now: the check runs on the load generator's event loop, and
        a forward pass there would stall every client (and idle their keep-alive connections)."""
        for kind, n in (
            ("text", len(TEXTS)),
            ("image", len(IMAGES)),
            ("audio", len(AUDIO)),
            ("content", CONTENT_ITEMS),
        ):
            for i in range(n):
                self[kind, i]
        return self

    def __getitem__(self, key: tuple[str, int]) -> tuple[np.ndarray, int]:
        if key not in self._cache:
            prepared = self.engine.prepare(_item(key), OPTIONS)
            self._cache[key] = (self.engine.embed([prepared])[0], prepared.num_tokens)
        return self._cache[key]

    def check(self, i: int, request: Request, response: httpx.Response) -> str | None:
        if response.status_code in (429, 503):
            error = response.json().get("error", {})
            if error.get("type") not in ("overloaded", "unavailable"):
                return f"{response.status_code} with body {response.text[:200]}"
            if response.status_code == 429 and not response.headers.get("retry-after"):
                return "429 without Retry-After"
            return None
        if response.status_code != 200:
            return f"status {response.status_code}: {response.text[:300]}"
        expect: Expect = request.tag
        body = response.json()
        data = body["data"]
        if [d["index"] for d in data] != list(range(len(expect.keys))):
            return f"indices {[d['index'] for d in data]} for {len(expect.keys)} items"
        rows = [
            np.frombuffer(base64.b64decode(d["embedding"]), "<f4")
            if expect.base64
            else np.asarray(d["embedding"])
            for d in data
        ]
        want = np.stack([self[k][0] for k in expect.keys])
        if expect.dims is not None:
            want = matryoshka(want, expect.dims)
        got = np.stack(rows).astype(np.float32)
        if got.shape != want.shape:
            return f"shape {got.shape}, expected {want.shape}"
        err = float(np.abs(got - want).max())
        if err > ATOL:
            return f"vectors differ from the in-process engine by {err:.2e} > {ATOL:g} ({expect.keys})"
        tokens = sum(self[k][1] for k in expect.keys)
        if body["usage"] != {"prompt_tokens": tokens, "total_tokens": tokens}:
            return f"usage {body['usage']}, expected {tokens} tokens"
        return None


Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Metrics:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples_: Metrics, name: str, **labels: str) -> float:
    return sum(
        v for (n, ls), v in samples_.items() if n == name and all((k, w) in ls for k, w in labels.items())
    )


@pytest.fixture(scope="module")
def server(tiny_bf16: Path) -> Iterator[Serve]:
    """Default settings but the device and a 1 s idle trim: the CPU token budget, 64 items, 2 ms delay,
    admission 4096."""
    args = [
        "--model",
        str(tiny_bf16),
        "--device",
        "cpu",
        "--log-level",
        "warning",
        "--malloc-trim-idle-s",
        "1",
    ]
    with Serve(args) as s:
        yield s.wait_ready()


@pytest.fixture(scope="module")
def reference(tiny_bf16: Path) -> Reference:
    return Reference(tiny_bf16).embed_every_item()


def phase(server: Serve, reference: Reference, first: int, n: int) -> LoadResult:
    result = run(
        server.url,
        lambda i: make_request(first + i),
        total=n,
        concurrency=CONCURRENCY,
        check=reference.check,
        timeout_s=60,
        deadline_s=240,
    )
    print(f"\nload phase of {n} from {first}: {result.summary()}")
    assert not result.errors, f"requests without an answer (hung or dropped connections): {result.errors}"
    assert result.unfinished == 0
    assert set(result.statuses) <= {200, 429, 503}, result.statuses
    assert result.n_failures == 0, "\n".join(result.failures)
    assert result.statuses[200] >= 0.9 * n, f"mostly refused: {result.statuses}"
    return result


def trims(server: Serve) -> float:
    return total(scrape(server.url), "eg2_malloc_trim_seconds_count")


def trimmed_rss_kb(server: Serve, trims_before: float, timeout_s: float = 15.0) -> int:
    """The RSS once the idle server has trimmed its heap since `trims_before` was read (before the
    phase: under load the server is never idle long enough to trim)."""
    deadline = time.monotonic() + timeout_s
    while trims(server) <= trims_before:
        assert time.monotonic() < deadline, "the idle server never trimmed its heap"
        time.sleep(0.1)
    return server.rss_kb()


def drained(server: Serve) -> Metrics:
    metrics = scrape(server.url)
    assert total(metrics, "eg2_queue_depth") == 0, "items left in the queues"
    assert total(metrics, "eg2_admitted_items") == 0, "items still admitted after every answer"
    assert total(metrics, "eg2_requests_total", status="500") == 0
    return metrics


@pytest.mark.slow
def test_mixed_load_is_answered_correctly_and_leaks_nothing(server: Serve, reference: Reference) -> None:
    before = trims(server)
    warm = phase(server, reference, 0, WARM_REQUESTS)
    after_warm = drained(server)
    rss0, fds0 = trimmed_rss_kb(server, before), server.settled_fds()

    before = trims(server)
    measured = phase(server, reference, WARM_REQUESTS, MEASURED_REQUESTS)
    after = drained(server)
    rss1, fds1 = trimmed_rss_kb(server, before), server.settled_fds()
    print(f"RSS {rss0} -> {rss1} kB ({(rss1 - rss0) / rss0:+.2%}); open fds {fds0} -> {fds1}")

    # Nothing lost: the server counted exactly the answers the clients received.
    for status in (200, 429, 503):
        served = total(after, "eg2_requests_total", route="/v1/embeddings", status=str(status))
        assert served == warm.statuses[status] + measured.statuses[status], (status, served)
    items = total(after, "eg2_batch_size_sum") - total(after_warm, "eg2_batch_size_sum")
    assert items >= measured.statuses[200], "fewer items through the GPU than answered requests"
    assert total(after, "eg2_batch_size_count") < total(after, "eg2_batch_size_sum") / 2, "no batching"

    assert abs(rss1 - rss0) <= 0.05 * rss0, f"RSS moved {(rss1 - rss0) / rss0:+.2%} over the measured phase"
    assert abs(fds1 - fds0) <= max(1, 0.05 * fds0), f"open descriptors {fds0} -> {fds1}"
    assert server.proc.poll() is None
    assert '"level": "error"' not in server.log, server.log[-2000:]


@pytest.mark.slow
def test_overload_is_refused_with_429_then_recovers(tiny_bf16: Path, reference: Reference) -> None:
    """An admission limit (64 items) far under the offered load (128 clients): the excess gets 429 with
    Retry-After at once, everything admitted is answered right, and the server recovers when it eases."""
    args = [
        "--model",
        str(tiny_bf16),
        "--device",
        "cpu",
        "--log-level",
        "warning",
        "--max-queued-items",
        "64",
        "--max-request-items",
        "16",
    ]
    with Serve(args) as server:
        server.wait_ready()
        burst = run(
            server.url, make_request, total=600, concurrency=CONCURRENCY, check=reference.check, timeout_s=60
        )
        print(f"\noverload burst: {burst.summary()}")
        assert not burst.errors and burst.unfinished == 0, burst.summary()
        assert burst.n_failures == 0, "\n".join(burst.failures)
        assert set(burst.statuses) <= {200, 429}, burst.statuses
        assert burst.statuses[429] > 0 and burst.statuses[200] > 0, burst.statuses
        drained(server)
        calm = run(server.url, make_request, total=200, concurrency=8, check=reference.check, timeout_s=60)
        assert calm.statuses == {200: 200}, calm.summary()
        assert calm.n_failures == 0, "\n".join(calm.failures)


def test_the_load_script_runs_on_its_own(server: Serve) -> None:
    """The documented command (docs/RELIABILITY.md): the file as a script, from the repository root,
    with nothing of the repository on its path but itself; exit 0 and its JSON summary."""
    script = Path(__file__).parents[1] / "support" / "load.py"
    done = subprocess.run(
        [sys.executable, str(script), server.url, "-n", "40", "-c", "4"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["requests"] == 40 and summary["statuses"] == {"200": 40}, summary
