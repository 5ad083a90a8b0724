"""The contract between the service (app/) and the runtime: plain data and one protocol, no torch.

    the app builds Items and PrepareOptions from requests (eg2_runtime.inputs)
    Engine.estimate_many(items, options) -> [Estimate | EG2Error]     CPU, any thread: from headers
    Engine.prepare_many(items, options, cancel) -> [PreparedItem | EG2Error]   CPU, any thread
    Engine.prepare_segments(item, options, cancel) -> SegmentStream   an item with spans: its whole
        and each span as PreparedItems, step by step, from one pass over its media
    Engine.tokenize_many(items, options, cancel) -> [TokenCount | EG2Error]    CPU: no model
    Engine.embed([PreparedItem, ...]) -> (B, D) float32 unit rows       the accelerator, one thread
    matryoshka(rows, dim) -> (B, dim) unit rows                          numpy
    quantize(rows, embedding_type) -> (values, scales)                   numpy

The service sees only a PreparedItem's `modality`, `num_tokens`, `cost` and `span`; the model inputs it
carries are opaque to it. Importing this module (and so the whole app) needs neither torch nor the
media libraries: the engine that implements the protocol is imported only when a model loads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from threading import Event
from typing import Any, Literal, Protocol, TypedDict

import numpy as np

from eg2_runtime.errors import EG2Error
from eg2_runtime.inputs import MATRYOSHKA_DIMS, Item, MediaKind, Modality, PrepareOptions


@dataclass(frozen=True)
class Span:
    """Where a segment lies in its item: seconds for audio and video, character offsets (Python code
    points, `text[start:end]`) for text."""

    index: int  # its place among the item's spans, from 0
    start: float
    end: float


@dataclass
class PreparedItem:
    modality: Modality  # batch key: items of one modality are batched together
    num_tokens: int  # tokens the text encoder sees, soft tokens and markers included (usage)
    cost: int  # what this item spends of a batch's token budget
    inputs: Any = field(repr=False, default=None)  # model inputs (tensors); opaque to the service
    span: Span | None = None  # a segment of its item; None: the item itself


@dataclass(frozen=True)
class Estimate:
    """An item's cost in tokens, from headers and characters, before anything is decoded."""

    tokens: int  # the item itself
    spans: int = 0  # how many segments it will have (an upper bound for text)
    span_tokens: int = 0  # their tokens together

    @property
    def total(self) -> int:
        return self.tokens + self.span_tokens


@dataclass(frozen=True)
class TokenCount:
    """What one item costs, as /v1/embeddings would count it in `usage`."""

    tokens: int  # the item and its segments: the sum of their PreparedItem.num_tokens
    truncated: bool  # text was cut at the model's context, or audio at 30 s
    ids: tuple[int, ...] | None = None  # a text item's input ids, BOS and EOS included
    parts: tuple[tuple[MediaKind, int], ...] = ()  # per media part: its soft tokens and markers
    spans: tuple[tuple[Span, int], ...] = ()  # per segment: its tokens


class SegmentStream:
    """The PreparedItems of one item with segments, a step at a time: each `next()` decodes on to the
    next span (its item itself comes with the step that completes it) and returns what is ready, or None
    once all was returned. Holds its decoder between steps; `next` and `close` may be called from any
    thread, one at a time (a lock). An error ends the stream."""

    def __init__(self, steps: Iterator[list[PreparedItem]]) -> None:
        self._steps: Iterator[list[PreparedItem]] | None = steps
        self._lock = threading.Lock()

    def next(self) -> list[PreparedItem] | None:
        with self._lock:
            if self._steps is None:
                return None
            try:
                return next(self._steps)
            except StopIteration:
                self._steps = None
                return None
            except BaseException:
                self._steps = None
                raise

    def close(self) -> None:
        """Release the decoder (a step in progress finishes first; set its cancel flag to stop it)."""
        with self._lock:
            steps, self._steps = self._steps, None
        if steps is not None and hasattr(steps, "close"):
            steps.close()


class EngineMemory(TypedDict, total=False):
    """Bytes. The gpu_* keys exist only on a GPU."""

    weight_bytes_resident: int
    weight_bytes_bf16_equivalent: int
    process_gpu_bytes: int  # this process's own GPU memory (NVML): what a co-located model loses
    gpu_budget_bytes: int  # the memory plan's budget
    gpu_allocated_bytes: int  # torch's allocator counters
    gpu_reserved_bytes: int


class EngineGraphs(TypedDict):
    """The CUDA graph buckets, text and towers together (all zero where there are none: a CPU)."""

    captured: int  # held in the graph pool, each captured at start-up or on its first use
    refused: int  # the pool's budget did not hold them: their batches take smaller buckets, or run eagerly
    deferred: int  # left by the start-up set to their first use
    capture_seconds: float  # spent capturing since start; a rise while serving is a first use's stall
    pool_used_bytes: int  # the shared graph pool as it counts itself (its captures, measured)
    pool_budget_bytes: int  # 0: no bound


class PrepareWork(Protocol):
    """One job on the preparing processes (eg2_runtime.prepare_processes.PrepareJob)."""

    @property
    def future(self) -> Future[list[PreparedItem | EG2Error]]: ...
    @property
    def seconds(self) -> float: ...  # how long the worker prepared, once done
    def cancel(self) -> None: ...


class PrepareWorkers(Protocol):
    """Worker processes that prepare items outside the serving process (Engine.prepare_processes)."""

    def start(self, timeout_s: float = ...) -> None: ...
    def submit(self, items: Sequence[Item], options: PrepareOptions) -> PrepareWork: ...
    def close(self) -> None: ...


class EngineAPI(Protocol):
    """What the service uses of eg2_runtime.engine.Engine (and of tests/fake_engine.FakeEngine)."""

    @property
    def modalities(self) -> frozenset[str]: ...
    @property
    def prompts(self) -> dict[str, str]: ...
    @property
    def default_prompt_name(self) -> str | None: ...
    @property
    def max_text_tokens(self) -> int: ...
    def estimate_many(self, items: Sequence[Item], options: PrepareOptions) -> list[Estimate | EG2Error]: ...
    def init_prepare_thread(self) -> None: ...
    def prepare_many(
        self, items: Sequence[Item], options: PrepareOptions, cancel: Event | None = None
    ) -> list[PreparedItem | EG2Error]: ...
    def prepare_segments(
        self, item: Item, options: PrepareOptions, cancel: Event | None = None
    ) -> SegmentStream: ...
    def tokenize_many(
        self, items: Sequence[Item], options: PrepareOptions, cancel: Event | None = None
    ) -> list[TokenCount | EG2Error]: ...
    def prepare_processes(self, n: int) -> PrepareWorkers: ...
    def embed(self, batch: Sequence[PreparedItem]) -> np.ndarray: ...
    def warm_up(self, max_batch_items: int, max_batch_tokens: int) -> dict[str, int]: ...
    def capture_graphs(self) -> int: ...
    def info(self) -> dict[str, Any]: ...
    def memory(self) -> EngineMemory: ...
    def graph_stats(self) -> EngineGraphs: ...


def matryoshka(vectors: np.ndarray, dim: int) -> np.ndarray:
    """Keep the leading `dim` dimensions of (B, 768) unit vectors and L2-renormalize them."""
    if dim not in MATRYOSHKA_DIMS:
        raise ValueError(f"dimensions must be one of {MATRYOSHKA_DIMS}, got {dim}")
    cut = vectors[:, :dim].astype(np.float32, copy=True)
    cut /= np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
    return cut


EmbeddingType = Literal["float", "float16", "int8", "binary", "ubinary"]
EMBEDDING_TYPES: tuple[EmbeddingType, ...] = ("float", "float16", "int8", "binary", "ubinary")


def quantize(vectors: np.ndarray, embedding_type: EmbeddingType) -> tuple[np.ndarray, np.ndarray | None]:
    """(B, D) float32 unit rows -> (values, per-row scales or None) in `embedding_type`:

        float     (B, D) float32
        float16   (B, D) float16
        int8      (B, D) int8, q = round(127 v / max|v|), and (B,) float32 scales max|v| / 127: q * scale
                  is within scale / 2 of v
        ubinary   (B, ceil(D / 8)) uint8: the bits of v > 0, 8 per byte, the first dimension highest
        binary    (B, ceil(D / 8)) int8: ubinary - 128

    binary and ubinary are sentence-transformers' `quantize_embeddings(..., precision=...)`; its int8
    calibrates ranges over a corpus, so int8 here is the per-row symmetric scale instead.
    """
    if embedding_type == "float":
        return vectors.astype(np.float32, copy=False), None
    if embedding_type == "float16":
        return vectors.astype(np.float16), None
    if embedding_type == "int8":
        peak = np.abs(vectors).max(axis=1).astype(np.float32)  # (B,)
        peak = np.where(peak > 0, peak, np.float32(1.0))  # a zero row stays zeros
        q = np.rint(vectors * (127.0 / peak)[:, None]).clip(-127, 127).astype(np.int8)
        return q, (peak / 127.0).astype(np.float32)
    bits = np.packbits(vectors > 0, axis=-1)  # (B, ceil(D / 8)) uint8, big-endian bit order
    if embedding_type == "ubinary":
        return bits, None
    if embedding_type == "binary":
        return (bits.astype(np.int16) - 128).astype(np.int8), None
    raise ValueError(f"embedding_type must be one of {EMBEDDING_TYPES}, got {embedding_type!r}")
