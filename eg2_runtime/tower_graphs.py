"""CUDA graphs over the vision and audio towers: the fast path beside EG2Model.image_soft_tokens and
audio_soft_tokens.

Why: at small batches the towers are bound by kernel launches, and a packed tower more so: each of
its 247 packed Linears runs two Python hooks (events, a stream switch, the Triton launcher), ~0.2 ms
each. One image at batch 1 spent 69.0 ms in the packed forward against 33.4 in BF16 (H200 bench,
2026-11-30), for a few ms of GPU work. A captured graph replays the tower, the side-stream unpacks
included, with one call.

How: as graphs.py does for text. A batch is padded up to a bucket and copied into static buffers:
- vision (and video frames): N images of S patch slots (S is fixed by the image-token budget) pad
  to Nb with fully padded images; the key-padding mask is always on (a graph cannot branch on
  whether an image has padding), and it is (Nb, 1, S, S) bool, so Nb * S^2 is bounded.
- audio: B clips of F mel frames pad to (Bb, Fb) with invalid frames; the tower masks padded frames
  before its convolutions, hides them as attention keys and its time convolution is causal, so
  valid steps see exactly what they would unpadded.
The graphs return every slot / step and which are used; the used ones are selected outside (a
data-dependent shape). The media embedders run inside the graphs.

Status: written and tested on the CPU (the padded steps run eagerly there, `capture=False`); the
capture itself (with the Unpacker's side stream, see Unpacker.capturing) has not run on a GPU yet,
so EngineOptions.tower_graphs is off by default until it has.

Assumes one caller thread (the engine's). Every tower graph shares one memory pool, apart from the
text graphs' one.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from eg2_runtime.graphs import BATCH_LADDER as ITEM_LADDER
from eg2_runtime.graphs import capture_graph, rung
from eg2_runtime.model import EG2Model

log = logging.getLogger(__name__)

FRAME_LADDER = (256, 512, 768, 1024, 1536, 2048, 2560, 3072)  # log-mel frames, 10 ms each: 30 s = 3,001
# Bounds, to tune on the H200: the graph pool keeps its largest bucket's activations for good.
MAX_MASK_BYTES = 1 << 26  # vision: Nb * S^2 bool mask bytes (S = 2,520 at 280 tokens: Nb <= 8)
MAX_AUDIO_FRAMES = 8 * 3072  # audio: Bb * Fb


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None: the eager run of the same padded step (CPU, tests)
    inputs: tuple[torch.Tensor, ...]  # static, padded
    fills: tuple[float, ...]  # each input's padding value: 0 for pixels and features, -1 for positions
    outputs: tuple[torch.Tensor, torch.Tensor] | None  # (soft (Nb, M, H), used (Nb, M)) of the graph


class GraphedTowers:
    """`image_soft_tokens` / `audio_soft_tokens` of `model` through captured graphs (model.SoftTokens).

    A batch that fits no bucket runs the model's own eager function. `capture=False` runs the padded
    steps eagerly: the CPU test of the padding logic.
    """

    def __init__(self, model: EG2Model, capture: bool = True) -> None:
        self.model = model
        device = model.language_model.embedding_projection.weight.device
        self.capture = capture and device.type == "cuda"
        self.unpacker = model.unpacker  # on packed towers: its side-stream unpacks join the graphs
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.graphs: dict[tuple[str, int, int], _Captured] = {}
        self.capture_seconds = 0.0

    # ---- the two entry points (EG2Model's signatures) -------------------------------------------

    def image_soft_tokens(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(N, S, C) pixels, (N, S, 2) positions -> (n_soft, H), images in order."""
        n, s, _ = pixels.shape
        nb = rung(ITEM_LADDER, n)
        if nb is None or nb * s * s > MAX_MASK_BYTES:
            return self.model.image_soft_tokens(pixels, positions)

        def buffers() -> tuple[torch.Tensor, ...]:
            return (
                torch.zeros((nb, *pixels.shape[1:]), dtype=pixels.dtype, device=pixels.device),
                torch.full((nb, *positions.shape[1:]), -1, dtype=positions.dtype, device=positions.device),
            )

        key = ("image", nb, s)
        return self._run(key, buffers, (0.0, -1.0), self._image_step, (pixels, positions), n)

    def audio_soft_tokens(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, F, bins) log-mel, (B, F) mask -> (n_soft, H): each clip's valid steps, clips in order."""
        b, f, _ = features.shape
        bb, fb = rung(ITEM_LADDER, b), rung(FRAME_LADDER, f)
        if bb is None or fb is None or bb * fb > MAX_AUDIO_FRAMES:
            return self.model.audio_soft_tokens(features, mask)
        dtype = self.model.dtype

        def buffers() -> tuple[torch.Tensor, ...]:
            return (
                torch.zeros((bb, fb, features.shape[2]), dtype=dtype, device=features.device),
                torch.zeros((bb, fb), dtype=torch.bool, device=features.device),
            )

        key = ("audio", bb, fb)
        return self._run(key, buffers, (0.0, 0.0), self._audio_step, (features.to(dtype), mask.bool()), b)

    # ---- the padded steps: static shapes, no host sync ------------------------------------------

    def _image_step(self, pixels: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.model.vision_tower is not None and self.model.embed_vision is not None
        padding = (positions == -1).all(dim=-1)
        soft, used = self.model.vision_tower.slots(pixels, positions, padding, masked=True)
        return self.model.embed_vision(soft), used

    def _audio_step(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.model.audio_tower is not None and self.model.embed_audio is not None
        states, valid = self.model.audio_tower(features, mask)
        return self.model.embed_audio(states), valid

    # ---- buckets --------------------------------------------------------------------------------

    def _run(
        self,
        key: tuple[str, int, int],
        buffers: Callable[[], tuple[torch.Tensor, ...]],
        fills: tuple[float, ...],
        step: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        inputs: tuple[torch.Tensor, ...],
        n: int,
    ) -> torch.Tensor:
        captured = self.graphs.get(key) or self._capture(key, buffers(), fills, step)
        for static, fill, x in zip(captured.inputs, captured.fills, inputs, strict=True):
            if x.shape != static.shape:
                static.fill_(fill)  # what the rows and columns past the input hold
            static[tuple(slice(0, d) for d in x.shape)].copy_(x)
        if captured.graph is None:
            soft, used = step(*captured.inputs)
        else:
            if self.unpacker is not None:
                self.unpacker.join()  # an eager forward's prefetch may still be writing a scratch slot
            captured.graph.replay()
            assert captured.outputs is not None
            soft, used = captured.outputs
        # Only the caller's items; the padded ones (whose slot 0 may count as used) are dropped.
        # Selecting reads the graph's static output before the next replay can overwrite it.
        return soft[:n][used[:n]]

    def _capture(
        self,
        key: tuple[str, int, int],
        inputs: tuple[torch.Tensor, ...],
        fills: tuple[float, ...],
        step: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    ) -> _Captured:
        if not self.capture:
            self.graphs[key] = _Captured(None, inputs, fills, None)
            return self.graphs[key]
        t0 = time.perf_counter()
        around = self.unpacker.capturing if self.unpacker is not None else contextlib.nullcontext
        graph, outputs = capture_graph(step, inputs, self.pool, around)
        self.graphs[key] = _Captured(graph, inputs, fills, outputs)
        self.capture_seconds += time.perf_counter() - t0
        log.info("captured %s tower graph %s in %.0f ms", key[0], key[1:], 1e3 * (time.perf_counter() - t0))
        return self.graphs[key]
