"""A fake engine with the real Engine's surface, and a live-server harness, for the service tests.

FakeEngine is for what a real model cannot do on demand: fail one item, run out of memory over N
items, stall, or block its warm-up. Its vectors are deterministic (a hash of the item and prompt), so
a test can check that each row came back to the right request, in order. Everything else (HTTP
contract, batching, lifecycle) runs the real app code on a real uvicorn on 127.0.0.1.

Run as a script, it serves the fake engine in a subprocess (for signal and descriptor-limit tests):
    python tests/support/fake_engine.py [--embed-delay S] [--torch-busy S] [--nofile N]   (settings: EG2_* variables)
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import hashlib
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, when run as a script

from app.server import Server, build_server
from app.service import State
from app.settings import Settings
from eg2_runtime.api import (
    EngineGraphs,
    EngineMemory,
    Estimate,
    PreparedItem,
    SegmentStream,
    Span,
    TokenCount,
)
from eg2_runtime.errors import (
    Cancelled,
    EG2Error,
    EngineOutOfMemory,
    InputError,
    InputTooLargeError,
    InputTooLongError,
    MediaDecodeError,
    ModalityNotLoadedError,
)
from eg2_runtime.inputs import Item, MediaPart, Modality, PrepareOptions, TextPart

DIM = 768
AUDIO_TOKENS = 100
VIDEO_TOKENS = 300

# Markers a test puts in a text (or in media bytes) to make that one item fail.
BAD_MEDIA = "CORRUPT-MEDIA"  # prepare raises MediaDecodeError (400)
TOO_LARGE = "TOO-MANY-PIXELS"  # prepare raises InputTooLargeError (413)
PREPARE_BUG = "PREPARE-BUG"  # prepare raises RuntimeError (500)
FORWARD_BUG = "FORWARD-BUG"  # embed raises RuntimeError for any batch holding this item (500 for it alone)
STALL_HERE = "STALL-HERE"  # embed blocks on a batch holding this item until release()
TORCH_BUSY = "TORCH-BUSY"  # embed runs torch ops for torch_busy_s on a batch holding this item


def _text_of(item: Item) -> str:
    return " ".join(p.text for p in item.parts if isinstance(p, TextPart))


def media_bytes(item: Item) -> bytes:
    """An item's media bytes, end to end: what the fakes read their instructions from."""
    return b"".join(p.data for p in item.parts if isinstance(p, MediaPart))


class FakeEngine:
    def __init__(
        self,
        *,
        modalities: Sequence[str] = ("text", "image", "audio", "video"),
        prompts: dict[str, str] | None = None,
        max_text_tokens: int = 8192,
        prepare_delay_s: float = 0.0,
        embed_delay_s: float = 0.0,
        oom_over_items: int | None = None,
        torch_busy_s: float = 0.0,
        record: bool = True,
    ) -> None:
        """`record`: keep every call's items (batches, texts, prepare jobs) for the test that reads
        them. A fake served for a benchmark keeps none: a record of every item grows the heap the
        garbage collector walks, and its full passes stall the server longer and longer (64-text
        requests on the dev machine, 2026-12-03: 148,160 PreparedItems held after 6 s, a full pass
        then 150-230 ms), which the benchmark would count as the service's own cost."""
        self.record = record
        self.modalities = frozenset(modalities)
        self.prompts = (
            prompts if prompts is not None else {"query": "task: search | query: ", "document": "text: "}
        )
        self.default_prompt_name: str | None = None
        self.max_text_tokens = max_text_tokens
        self.prepare_delay_s = prepare_delay_s
        self.embed_delay_s = embed_delay_s
        self.oom_over_items = oom_over_items  # embed raises EngineOutOfMemory on larger batches
        self.torch_busy_s = torch_busy_s
        self.warmup_gate = threading.Event()  # warm-up blocks until set
        self.warmup_gate.set()
        self._running = threading.Event()  # the stall switch: embed blocks while cleared
        self._running.set()
        self._unstick = threading.Event()  # releases batches holding STALL_HERE
        self._lock = threading.Lock()
        self.batches: list[list[PreparedItem]] = []  # every embed call, including failed ones
        self.embedded_texts: list[str] = []  # texts of items in successful calls
        self.embed_threads: set[int] = set()
        self.prepare_calls = 0
        self.estimate_calls = 0
        self.prepare_cancelled = 0  # prepare_many calls stopped by their cancel flag
        self.prepare_jobs: list[list[str]] = []  # modality of each item, per prepare_many call
        self.prepare_threads: list[int] = []  # the thread of each prepare_many call
        self.warmups = 0
        # capture_new_sizes: report a CUDA graph capture for each batch size first seen, as a GPU
        # engine's first-use captures would (graph_stats); 0.1 s each.
        self.capture_new_sizes = False
        self.sizes_seen: set[int] = set()

    # --- switches ------------------------------------------------------------------------------

    def stall(self) -> None:
        self._running.clear()

    def release(self) -> None:
        self._running.set()
        self._unstick.set()

    # --- the Engine surface --------------------------------------------------------------------

    @staticmethod
    def seed_of(item: Item, prompt: str | None) -> bytes:
        h = hashlib.sha256((prompt or "").encode())
        for part in item.parts:
            h.update(
                b"T" + part.text.encode() if isinstance(part, TextPart) else part.kind.encode() + part.data
            )
        return h.digest()

    @staticmethod
    @functools.lru_cache(maxsize=4096)  # the service benchmarks send one body over and over: no engine time
    def vector(seed: bytes) -> np.ndarray:
        v = np.random.default_rng(int.from_bytes(seed[:8], "little")).standard_normal(DIM).astype(np.float32)
        v /= np.linalg.norm(v)
        v.flags.writeable = False  # shared by every caller of this seed
        return v

    @classmethod
    def expected(cls, item: Item | str, options: PrepareOptions | None = None) -> np.ndarray:
        """The vector this engine gives `item` (a str is one text part)."""
        item = Item((TextPart(item),)) if isinstance(item, str) else item
        return cls.vector(cls.seed_of(item, (options or PrepareOptions()).prompt))

    def tokens(self, item: Item, options: PrepareOptions) -> int:
        n = 2 + (len(options.prompt.split()) if options.prompt else 0)  # BOS and EOS
        for part in item.parts:
            if isinstance(part, TextPart):
                n += len(part.text.split())
            elif part.kind == "image":
                n += options.image_tokens + 2  # soft tokens and the two markers
            else:
                n += AUDIO_TOKENS if part.kind == "audio" else VIDEO_TOKENS
        return n

    def prepare(self, item: Item, options: PrepareOptions) -> PreparedItem:
        if self.prepare_delay_s:
            time.sleep(self.prepare_delay_s)
        return self._prepare(item, options)

    def _prepare(self, item: Item, options: PrepareOptions) -> PreparedItem:
        with self._lock:
            self.prepare_calls += 1
        text, blob = _text_of(item), media_bytes(item)
        for part in item.parts:
            if isinstance(part, MediaPart) and part.kind not in self.modalities:
                raise ModalityNotLoadedError(f"{part.kind} tower not loaded")
        if BAD_MEDIA in text or BAD_MEDIA.encode() in blob:
            raise MediaDecodeError("cannot decode the media: corrupt data")
        if TOO_LARGE in text or TOO_LARGE.encode() in blob:
            raise InputTooLargeError("image over the pixel limit")
        if PREPARE_BUG in text:
            raise RuntimeError(f"a bug in preprocessing at {__file__}")
        n = self.tokens(item, options)
        if n > self.max_text_tokens:
            if not options.truncate:
                raise InputTooLongError(f"input is {n} tokens, over the {self.max_text_tokens}-token limit")
            n = self.max_text_tokens
        return PreparedItem(item.modality, n, n, inputs=(self.seed_of(item, options.prompt), text))

    def estimate_many(self, items: Sequence[Item], options: PrepareOptions) -> list[Estimate | EG2Error]:
        """As Engine.estimate_many: what prepare (and prepare_segments) will count, before it runs."""
        with self._lock:
            self.estimate_calls += 1
        out: list[Estimate | EG2Error] = []
        for item in items:
            whole = min(self.tokens(item, options), self.max_text_tokens)
            spans = [self.tokens(span, options) for span in self._spans(item)]
            out.append(Estimate(whole, len(spans), sum(spans)))
        return out

    @staticmethod
    def _spans(item: Item) -> list[Item]:
        """A text item's spans: `tokens` words each (the fake counts a token per word)."""
        if item.span_unit is None or not isinstance(item.parts[0], TextPart):
            return []
        words = item.parts[0].text.split()
        size = int(item.span_unit)
        return [Item((TextPart(" ".join(words[i : i + size])),)) for i in range(0, max(len(words), 1), size)]

    def prepare_segments(
        self, item: Item, options: PrepareOptions, cancel: threading.Event | None = None
    ) -> SegmentStream:
        """As Engine.prepare_segments, for text (spans of `tokens` words; offsets are word indices):
        one step per span, then the item itself. Media items with segments are refused."""
        if not isinstance(item.parts[0], TextPart):
            raise InputError("the fake engine cuts text only")

        def steps() -> Iterator[list[PreparedItem]]:
            for i, span in enumerate(self._spans(item)):
                if cancel is not None and cancel.wait(self.prepare_delay_s):
                    raise Cancelled
                p = self._prepare(span, options)
                size = int(item.span_unit or 1)
                yield [replace(p, span=Span(i, i * size, i * size + len(_text_of(span).split())))]
            yield [self._prepare(Item(item.parts), options)]

        return SegmentStream(steps())

    def tokenize_many(
        self, items: Sequence[Item], options: PrepareOptions, cancel: threading.Event | None = None
    ) -> list[TokenCount | EG2Error]:
        """As Engine.tokenize_many: the tokens prepare counts (spans included), no model."""
        out: list[TokenCount | EG2Error] = []
        for item in items:
            try:
                prepared = [self._prepare(x, options) for x in [Item(item.parts), *self._spans(item)]]
            except EG2Error as e:
                out.append(e)
                continue
            out.append(TokenCount(tokens=sum(p.num_tokens for p in prepared), truncated=False))
        return out

    def init_prepare_thread(self) -> None:
        """As Engine.init_prepare_thread: the fake runs no torch, so nothing to set."""

    def prepare_processes(self, n: int) -> Any:
        """The fake prepares on threads only: its services run with prepare_processes=0."""
        raise NotImplementedError("FakeEngine has no preparing processes")

    def prepare_many(
        self, items: Sequence[Item], options: PrepareOptions, cancel: threading.Event | None = None
    ) -> list[PreparedItem | EG2Error]:
        """As Engine.prepare_many: an input error in its item's slot; a bug raises; Cancelled once
        `cancel` is set (checked per item and through the prepare delay)."""
        if self.record:
            with self._lock:
                self.prepare_jobs.append([item.modality for item in items])
                self.prepare_threads.append(threading.get_ident())
        out: list[PreparedItem | EG2Error] = []
        for item in items:
            if cancel is None:
                if self.prepare_delay_s:
                    time.sleep(self.prepare_delay_s)
            elif cancel.wait(self.prepare_delay_s):  # the delay stands for decoding: it stops when told
                with self._lock:
                    self.prepare_cancelled += 1
                raise Cancelled
            try:
                out.append(self._prepare(item, options))
            except EG2Error as e:
                out.append(e)
        return out

    def embed(self, batch: Sequence[PreparedItem]) -> np.ndarray:
        with self._lock:
            self.embed_threads.add(threading.get_ident())
            if self.capture_new_sizes and batch and batch[0].inputs[1] != "warm-up":
                self.sizes_seen.add(len(batch))
            if self.record:
                self.batches.append(list(batch))
        self._running.wait(timeout=120)
        if any(STALL_HERE in p.inputs[1] for p in batch):
            self._unstick.wait(timeout=120)
        if any(TORCH_BUSY in p.inputs[1] for p in batch):
            _torch_for(self.torch_busy_s)
        if self.oom_over_items is not None and len(batch) > self.oom_over_items:
            raise EngineOutOfMemory(f"CUDA out of memory on {len(batch)} items")
        if any(FORWARD_BUG in p.inputs[1] for p in batch):
            raise RuntimeError("a bug in the forward pass")
        if self.embed_delay_s:
            time.sleep(self.embed_delay_s)
        if self.record:
            with self._lock:
                self.embedded_texts.extend(p.inputs[1] for p in batch)
        return np.stack([self.vector(p.inputs[0]) for p in batch])

    def capture_graphs(self) -> int:
        return 0

    def warm_up(self, max_batch_items: int, max_batch_tokens: int) -> dict[str, int]:
        """A full batch per modality through embed (an OOM there fails the boot); no limits of its own."""
        self.warmup_gate.wait(timeout=120)
        self.warmups += 1
        cost = max(1, max_batch_tokens // max_batch_items)
        for m in sorted(self.modalities):
            self.embed(
                [
                    PreparedItem(cast(Modality, m), cost, cost, inputs=(bytes(32), "warm-up"))
                    for _ in range(max_batch_items)
                ]
            )
        return {}

    def info(self) -> dict[str, Any]:
        return {"version": "fake", "weights": {"sha256": "0" * 64}, "quantization": {"packed_layers": {}}}

    def memory(self) -> EngineMemory:
        return {"weight_bytes_resident": 1000, "weight_bytes_bf16_equivalent": 4000}

    def graph_stats(self) -> EngineGraphs:  # a CPU engine's (no graphs), unless capture_new_sizes
        captured = len(self.sizes_seen)
        return {
            "captured": captured,
            "refused": 0,
            "deferred": 0,
            "capture_seconds": 0.1 * captured,
            "pool_used_bytes": 0,
            "pool_budget_bytes": 0,
        }

    # --- test helpers --------------------------------------------------------------------------

    def batch_sizes(self) -> list[int]:
        return [len(b) for b in self.batches if b and b[0].inputs[1] != "warm-up"]


def _torch_for(seconds: float) -> None:
    """A forward pass as the GPU thread sees it, without a model: many short torch ops, each of which
    lets go of the GIL and takes it back inside torch's C++ (pybind11's release guard)."""
    import torch

    x = torch.full((64, 64), 1 / 64)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        x = torch.mm(x, x).clamp_(-1, 1)


# --- a real uvicorn on loopback -------------------------------------------------------------------


def make_settings(**overrides: Any) -> Settings:
    """Settings for a test server: loopback, a free port, small limits, ignoring the caller's EG2_*."""
    base: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "max_batch_tokens": 4096,
        "max_batch_items": 16,
        "max_queue_delay_ms": 2.0,
        "preprocess_workers": 2,
        "preprocess_processes": 0,  # the fake prepares on threads; real-engine tests ask for processes
        "log_json": True,
    }
    base.update(overrides)
    return Settings(**base)


class LiveServer:
    """create_app(settings, engine) under a real uvicorn, in a thread of this process."""

    def __init__(
        self,
        settings: Settings,
        engine: Any | None = None,
        *,
        wait_ready: bool = True,
        ready_timeout: float = 10,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self._wait_ready = wait_ready
        self._ready_timeout = ready_timeout  # a real engine's warm-up takes seconds on a CPU
        self.server: Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.port}"

    @property
    def service(self) -> Any:
        assert self.server is not None
        return self.server.service

    @property
    def app(self) -> Any:
        assert self.server is not None
        return self.server.config.app

    def __enter__(self) -> LiveServer:
        self.server = build_server(self.settings, self.engine)
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        if self._wait_ready:
            self.wait_state(State.READY, self._ready_timeout)
        return self

    def wait_state(self, state: State, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while self.service.state is not state:
            assert time.monotonic() < deadline, f"state {self.service.state} != {state}"
            time.sleep(0.01)

    def __exit__(self, *exc: object) -> None:
        assert self.server is not None and self._thread is not None
        if self.engine is not None and hasattr(self.engine, "release"):
            self.engine.release()
            self.engine.warmup_gate.set()
        self.server.should_exit = True
        self._thread.join(timeout=15)
        assert not self._thread.is_alive(), "server thread did not stop"


@contextlib.contextmanager
def live(settings: Settings | None = None, engine: Any | None = None, **kw: Any) -> Iterator[LiveServer]:
    with LiveServer(
        settings or make_settings(), engine if engine is not None else FakeEngine(), **kw
    ) as server:
        yield server


# --- request and response helpers -----------------------------------------------------------------

PNG = b"\x89PNG\r\n\x1a\n fake image bytes"
WAV = b"RIFF\x00\x00\x00\x00WAVE fake audio bytes"
MP4 = b"\x00\x00\x00\x18ftypmp42 fake video bytes"


def data_uri(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(data: bytes = PNG, mime: str = "image/png") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_uri(mime, data)}}


def audio_part(data: bytes = WAV, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def video_part(data: bytes = MP4, mime: str = "video/mp4") -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": data_uri(mime, data)}}


_NO_PARAM = object()


def assert_error(response: Any, status: int, name: str, param: Any = _NO_PARAM) -> dict[str, Any]:
    """The documented error: status, OpenAI body with exactly these keys, a request id; returns `error`."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == name and error["code"] == name, error
    assert isinstance(error["message"], str) and error["message"], error
    assert "Traceback" not in response.text and "/work/" not in response.text and ".py" not in response.text
    if param is not _NO_PARAM:
        assert error["param"] == param, error
    assert response.headers.get("x-request-id"), dict(response.headers)
    return dict(error)


def main(argv: Sequence[str] | None = None) -> int:
    from app.logs import setup_logging
    from app.server import serve

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--embed-delay", type=float, default=0.0)
    parser.add_argument(
        "--torch-busy", type=float, default=0.0, help=f"seconds of torch ops for {TORCH_BUSY}"
    )
    parser.add_argument(
        "--nofile", type=int, help="file-descriptor limit (soft and hard) of the server process"
    )
    parser.add_argument(
        "--capture-new-sizes", action="store_true", help="report a graph capture per batch size first seen"
    )
    parser.add_argument(
        "--load-torch-busy",
        type=float,
        default=0.0,
        help="load the engine through the service (its GPU thread), torch ops for this many seconds first",
    )
    args = parser.parse_args(argv)
    if args.nofile is not None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, args.nofile))
    settings = Settings()
    setup_logging(settings.log_level, settings.log_json)
    engine = FakeEngine(embed_delay_s=args.embed_delay, torch_busy_s=args.torch_busy, record=False)
    engine.capture_new_sizes = args.capture_new_sizes
    if args.load_torch_busy:
        import app.service

        def slow_load(_: Settings) -> FakeEngine:  # a model load: native torch code for a while
            _torch_for(args.load_torch_busy)
            return engine

        app.service.load_engine = slow_load  # type: ignore[assignment]
        return serve(settings)
    return serve(settings, engine)


if __name__ == "__main__":
    sys.exit(main())
