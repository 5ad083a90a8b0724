"""The contract between the service (app/) and the runtime: plain data and one protocol, no torch.

    the app builds Items and PrepareOptions from requests (eg2_runtime.inputs)
    Engine.estimate_many(items, options) -> [int | EG2Error]          CPU, any thread: from headers
    Engine.prepare_many(items, options, cancel) -> [PreparedItem | EG2Error]   CPU, any thread
    Engine.embed([PreparedItem, ...]) -> (B, D) float32 unit rows       the accelerator, one thread
    matryoshka(rows, dim) -> (B, dim) unit rows                          numpy

The service sees only a PreparedItem's `modality`, `num_tokens` and `cost`; the model inputs it
carries are opaque to it. Importing this module (and so the whole app) needs neither torch nor the
media libraries: the engine that implements the protocol is imported only when a model loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from threading import Event
from typing import Any, Protocol, TypedDict

import numpy as np

from eg2_runtime.errors import EG2Error
from eg2_runtime.inputs import MATRYOSHKA_DIMS, Item, Modality, PrepareOptions


@dataclass
class PreparedItem:
    modality: Modality  # batch key: items of one modality are batched together
    num_tokens: int  # tokens the text encoder sees, soft tokens and markers included (usage)
    cost: int  # what this item spends of a batch's token budget
    inputs: Any = field(repr=False, default=None)  # model inputs (tensors); opaque to the service


class EngineMemory(TypedDict, total=False):
    """Bytes. The gpu_* keys exist only on a GPU."""

    weight_bytes_resident: int
    weight_bytes_bf16_equivalent: int
    process_gpu_bytes: int  # this process's own GPU memory (NVML): what a co-located model loses
    gpu_budget_bytes: int  # the memory plan's budget
    gpu_allocated_bytes: int  # torch's allocator counters
    gpu_reserved_bytes: int


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
    def estimate_many(self, items: Sequence[Item], options: PrepareOptions) -> list[int | EG2Error]: ...
    def prepare_many(
        self, items: Sequence[Item], options: PrepareOptions, cancel: Event | None = None
    ) -> list[PreparedItem | EG2Error]: ...
    def embed(self, batch: Sequence[PreparedItem]) -> np.ndarray: ...
    def warm_up(self, max_batch_items: int, max_batch_tokens: int) -> dict[str, int]: ...
    def capture_graphs(self) -> int: ...
    def info(self) -> dict[str, Any]: ...
    def memory(self) -> EngineMemory: ...


def matryoshka(vectors: np.ndarray, dim: int) -> np.ndarray:
    """Keep the leading `dim` dimensions of (B, 768) unit vectors and L2-renormalize them."""
    if dim not in MATRYOSHKA_DIMS:
        raise ValueError(f"dimensions must be one of {MATRYOSHKA_DIMS}, got {dim}")
    cut = vectors[:, :dim].astype(np.float32, copy=True)
    cut /= np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
    return cut
