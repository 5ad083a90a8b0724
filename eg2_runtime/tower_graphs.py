"""CUDA graphs over the vision and audio towers: the fast path beside EG2Model.image_soft_tokens and
audio_soft_tokens.

Why: at small batches the towers are bound by kernel launches, and a packed tower more so: each of
its 247 packed Linears runs two Python hooks (events, a stream switch, the Triton launcher). On the
H200 (2026-12-01, benchmarks/probe_memory_media.py) one image took 82 ms eagerly and 12 ms graphed,
one 9.3 s clip 122 ms and 8.4 ms. A captured graph replays the tower, the side-stream unpacks
included, with one call.

How: as graphs.py does for text. A batch is padded up to a bucket and copied into static buffers:
- vision (and video frames): N images of S patch slots (S is fixed by the image-token budget) pad
  to Nb with fully padded images; the key-padding mask is always on (a graph cannot branch on
  whether an image has padding). Pixels stay uint8 codes into the graph.
- audio: B clips of F mel frames pad to (Bb, Fb) with invalid frames; the tower masks padded frames
  before its convolutions, hides them as attention keys and its time convolution is causal, so
  valid steps see exactly what they would unpadded.
The graphs return every slot / step and which are used; the used ones are selected outside. Given
the count the caller expects (the placeholders it counted on the host), the selection has a static
shape (nonzero_static) and the host queues the text encoder's work behind the tower's without waiting
for it: the alternative, a boolean index, waits for the tower to finish (its count), and the GPU then
idles while the host scatters the soft tokens and launches the text graphs (~2.7 ms a batch of clips
on the H100, 2026-12-07, docs/PERF.md). The count the tower actually used is checked after the
engine's own sync at the end of the batch (`check_counts`). The media embedders run inside the graphs.

Memory: the buckets are bounded by the memory plan (memory_plan.py): Nb x S patch slots and Bb x Fb
frames at most, drawing on the pool the text graphs use. A batch with more items than the largest
bucket of its shape holds runs as several replays, items in order, and a bucket the pool refuses hands
its items to smaller ones; a shape no bucket holds runs eagerly, unpadded, in chunks of at most
`tower_slots` patch slots (a video's frames are independent images).

Assumes one caller thread (the engine's).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch

from eg2_runtime.graphs import BATCH_LADDER, GraphPool, held_graphs, rung
from eg2_runtime.model import EG2Model

log = logging.getLogger(__name__)

# Items a tower bucket holds: the text graphs' rows, powers of two. A batch pads up to the next rung
# with fully padded items, which cost the tower as much as real ones, so a finer ladder pads less;
# but each rung a batch uses is one more graph, captured on first use and kept in the pool, which a
# co-located model would rather have (docs/PERF.md; benchmarks/probe_ladder.py compares the two).
ITEM_LADDER: tuple[int, ...] = BATCH_LADDER
FRAME_LADDER = (256, 512, 768, 1024, 1536, 2048, 2560, 3072)  # log-mel frames, 10 ms each: 30 s = 3,001
FRAMES_PER_TOKEN = 4  # the audio tower halves the time axis twice
# A tower's padded step: static inputs -> (soft tokens (Nb, M, H), used (Nb, M)).
Step = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None  # None: the eager run of the same padded step (CPU, tests)
    inputs: tuple[torch.Tensor, ...]  # static, padded
    fills: tuple[float, ...]  # each input's padding value: 0 for pixels and features, -1 for positions
    outputs: tuple[torch.Tensor, torch.Tensor] | None  # (soft (Nb, M, H), used (Nb, M)) of the graph


class GraphedTowers:
    """`image_soft_tokens` / `audio_soft_tokens` of `model` through captured graphs (model.SoftTokens).

    `vision_slots` and `audio_tokens` bound the buckets (Nb x S, and Bb x Fb / 4); `tower_slots`
    bounds an eager vision call. `pool`: the GraphPool shared with the text graphs (None: one of its
    own, unbounded), admitting a bucket by its estimated bytes. `capture=False` runs the padded
    steps eagerly: the CPU test of the padding logic.
    """

    def __init__(
        self,
        model: EG2Model,
        *,
        vision_slots: int,
        audio_tokens: int,
        tower_slots: int,
        pool: GraphPool | None = None,
        slot_bytes: int = 0,
        audio_token_bytes: int = 0,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.vision_slots, self.audio_tokens, self.tower_slots = vision_slots, audio_tokens, tower_slots
        # What a bucket is estimated to add to the pool: per patch slot, per audio soft token.
        self.slot_bytes, self.audio_token_bytes = slot_bytes, audio_token_bytes
        device = model.language_model.embedding_projection.weight.device
        self.capture = capture and device.type == "cuda"
        self.unpacker = model.unpacker  # on packed towers: its side-stream unpacks join the graphs
        self.pool = pool if pool is not None else GraphPool(None)
        self.graphs: dict[tuple[str, int, int], _Captured] = {}
        # Buckets the pool's budget refused: a batch takes the next smaller one, in more replays.
        self.refused: set[tuple[str, int, int]] = set()
        self.capture_seconds = 0.0
        self.graphing = True  # False inside eager(): every call runs the towers eagerly, chunked
        # Buckets the start-up set passed over to keep room for the captures after them: tried on
        # first use.
        self.deferred: set[tuple[str, int, int]] = set()
        # On the device: whether a selection given a count found another number used (_select).
        self.miscount: torch.Tensor | None = None

    def captured(self) -> int:
        """Buckets held as graphs (graphs.held_graphs)."""
        return held_graphs(self.graphs)

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Calls inside run eagerly (in chunks of at most `tower_slots` patch slots) and capture
        nothing: the engine's warm-up, which proves the eager share fits."""
        self.graphing = False
        try:
            yield
        finally:
            self.graphing = True

    # ---- the two entry points (EG2Model's signatures) -------------------------------------------

    def image_soft_tokens(
        self, pixels: torch.Tensor, positions: torch.Tensor, count: int | None = None
    ) -> torch.Tensor:
        """(N, S, C) pixels, (N, S, 2) positions -> (n_soft, H), images in order. `count`: the n_soft
        expected, which spares a device sync where every chunk runs in a graph (module docstring);
        None selects after a sync."""
        _, s, _ = pixels.shape

        def eager(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # within the tower bound
            step = max(1, self.tower_slots // s)
            return _chunked(self.model.image_soft_tokens, p.shape[0], step, p, q, retry=self.graphing)

        def buffers(nb: int) -> tuple[torch.Tensor, ...]:
            return (
                torch.zeros((nb, *pixels.shape[1:]), dtype=pixels.dtype, device=pixels.device),
                torch.full((nb, *positions.shape[1:]), -1, dtype=positions.dtype, device=positions.device),
            )

        return self._buckets(
            "image", s, lambda r: r * s <= self.vision_slots, buffers, (0.0, -1.0), self._image_step,
            (pixels, positions), eager, count,
        )  # fmt: skip

    def audio_soft_tokens(
        self, features: torch.Tensor, mask: torch.Tensor, count: int | None = None
    ) -> torch.Tensor:
        """(B, F, bins) log-mel, (B, F) mask -> (n_soft, H): each clip's valid steps, clips in order.
        `count` as for image_soft_tokens."""
        _, f, bins = features.shape
        fb = rung(FRAME_LADDER, f)
        if fb is None:
            return self.model.audio_soft_tokens(features, mask)
        dtype = self.model.dtype

        def buffers(bb: int) -> tuple[torch.Tensor, ...]:
            return (
                torch.zeros((bb, fb, bins), dtype=dtype, device=features.device),
                torch.zeros((bb, fb), dtype=torch.bool, device=features.device),
            )

        return self._buckets(
            "audio", fb, lambda r: r * fb <= FRAMES_PER_TOKEN * self.audio_tokens, buffers, (0.0, 0.0),
            self._audio_step, (features.to(dtype), mask.bool()), self.model.audio_soft_tokens, count,
        )  # fmt: skip

    def _buckets(
        self,
        kind: str,
        size: int,
        fits: Callable[[int], bool],
        buffers: Callable[[int], tuple[torch.Tensor, ...]],
        fills: tuple[float, ...],
        step: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        inputs: tuple[torch.Tensor, torch.Tensor],
        eager: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        count: int | None,
    ) -> torch.Tensor:
        """The items of `inputs` through buckets (kind, rows, size): as many rows per replay as the
        largest bucket that `fits` and the pool has not refused holds, each chunk in the smallest
        such bucket that holds it; `eager` (unpadded) for what no bucket holds. Then the used rows,
        in order (`_select`)."""
        n, i = inputs[0].shape[0], 0
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, H) and which of them are used
        while i < n:
            usable = [r for r in ITEM_LADDER if fits(r) and (kind, r, size) not in self.refused]
            if not usable or not self.graphing:
                soft = eager(*(x[i:] for x in inputs))  # its used rows only: every row is used
                parts.append((soft, torch.ones(soft.shape[0], dtype=torch.bool, device=soft.device)))
                break
            rows = min(max(usable), n - i)
            nb = min(r for r in usable if r >= rows)
            if nb != rung(ITEM_LADDER, rows) and (fitting := [r for r in usable if r <= rows]):
                rows = nb = max(fitting)  # the natural rung refused: no padding into a larger one
            part = self._run(
                (kind, nb, size), partial(buffers, nb), fills, step, tuple(x[i : i + rows] for x in inputs)
            )
            if part is not None:
                i += rows
                # Views of the graph's static outputs: a later replay of the same bucket would
                # overwrite them before the selection reads them, so a part with more to come is
                # copied (in stream order, before that replay).
                parts.append(part if i >= n else (part[0].clone(), part[1].clone()))
        return self._select(parts, count)

    def _select(self, parts: list[tuple[torch.Tensor, torch.Tensor]], count: int | None) -> torch.Tensor:
        """The used rows of the parts' (rows, H) soft tokens, in order: (count, H) with no device sync
        when `count` is given (a mismatch is flagged for check_counts), else after one."""
        soft = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        used = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        if count is None:
            return soft[used]
        if count > soft.shape[0]:
            # More than the rows there are (known on the host): the padding index below would be out
            # of range, a device-side assert that ends the process's CUDA context, not a 4xx.
            raise ValueError(
                f"{count} placeholders ask for more soft tokens than the towers' {soft.shape[0]} rows"
            )
        # Row indices of the used rows, ascending, padded with row 0 past what the tower used: a
        # static shape. A wrong count is flagged for check_counts (Engine.embed calls it): a caller
        # of the forward that does not check reads row 0 where the tower had none.
        rows = torch.nonzero_static(used, size=count, fill_value=0).squeeze(1)
        wrong = used.sum() != count
        self.miscount = wrong if self.miscount is None else self.miscount | wrong
        return soft.index_select(0, rows)

    def check_counts(self) -> None:
        """Raise if a selection since the last check got a count other than the tower's used rows.
        Reads one flag from the device: call it after a sync (the engine's, at the end of a batch)."""
        wrong, self.miscount = self.miscount, None
        if wrong is not None and bool(wrong):
            raise ValueError("the media gave another number of soft tokens than the placeholders ask for")

    def capture_startup(self, image_tokens: int | None, audio: bool, then: int = 0) -> None:
        """Capture the one-item buckets short requests take: an image of `image_tokens` soft tokens,
        a clip of up to ~10 s (fully padded inputs: a capture needs the shapes, not the values). Each
        leaves room for the executables of the ones after it and `then` more (the text start-up
        set); one refused only for that room is deferred to its first use."""
        model = self.model
        device = model.language_model.embedding_projection.weight.device
        wanted: list[
            tuple[tuple[str, int, int], Callable[[], tuple[torch.Tensor, ...]], tuple[float, ...], Step]
        ] = []
        if image_tokens is not None and model.vision_tower is not None:
            cfg = model.vision_tower.cfg
            s = image_tokens * cfg.pooling_kernel_size**2

            def image() -> tuple[torch.Tensor, ...]:
                return (
                    torch.zeros(1, s, 3 * cfg.patch_size**2, dtype=torch.uint8, device=device),
                    torch.full((1, s, 2), -1, dtype=torch.long, device=device),
                )

            wanted.append((("image", 1, s), image, (0.0, -1.0), self._image_step))
        if audio and model.audio_tower is not None:
            frames = FRAME_LADDER[3]
            # The mel bins: the reference sizes the tower's projection from c0 as if they were equal.
            bins = model.audio_tower.cfg.subsampling_conv_channels[0]

            def clip() -> tuple[torch.Tensor, ...]:
                return (
                    torch.zeros(1, frames, bins, dtype=model.dtype, device=device),
                    torch.zeros(1, frames, dtype=torch.bool, device=device),
                )

            wanted.append((("audio", 1, frames), clip, (0.0, 0.0), self._audio_step))
        for i, (key, buffers, fills, step) in enumerate(wanted):
            if key not in self.graphs and key not in self.refused:
                self._capture(key, buffers, fills, step, then=then + len(wanted) - 1 - i)

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
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The inputs' items through bucket `key`: views of the graph's outputs, (n M, H) soft tokens
        and (n M,) which are used; None when its capture is refused now."""
        captured = self.graphs.get(key) or self._capture(key, buffers, fills, step)
        if captured is None:
            return None
        n = inputs[0].shape[0]
        for static, fill, x in zip(captured.inputs, captured.fills, inputs, strict=True):
            if x.shape != static.shape:
                static.fill_(fill)  # what the rows and columns past the input hold
            static[tuple(slice(0, d) for d in x.shape)].copy_(x)
        if captured.graph is None:
            soft, used = step(*captured.inputs)
            # Into the same output tensors each run, as a replay writes its static ones.
            if captured.outputs is None:
                captured.outputs = (soft, used)
            else:
                captured.outputs[0].copy_(soft)
                captured.outputs[1].copy_(used)
            soft, used = captured.outputs
        else:
            if self.unpacker is not None:
                self.unpacker.join()  # an eager forward's prefetch may still be writing a scratch slot
            captured.graph.replay()
            assert captured.outputs is not None
            soft, used = captured.outputs
        # Only the caller's items: the padded ones (whose slot 0 may count as used) are dropped.
        return soft[:n].flatten(0, 1), used[:n].flatten()

    def _capture(
        self,
        key: tuple[str, int, int],
        buffers: Callable[[], tuple[torch.Tensor, ...]],
        fills: tuple[float, ...],
        step: Step,
        then: int = 0,
    ) -> _Captured | None:
        """The bucket's graph, captured now; None when the pool's budget does not hold it: the bucket
        is refused for good, or deferred to its first use where only the room for `then` captures to
        follow refused it. Without `capture`, the padded step runs eagerly each time, admitted as its
        graph would be."""
        kind, n, size = key
        estimate = (
            n * size * (self.slot_bytes if kind == "image" else self.audio_token_bytes // FRAMES_PER_TOKEN)
        )
        t0 = time.perf_counter()
        around = self.unpacker.capturing if self.unpacker is not None else contextlib.nullcontext
        try:
            got = self.pool.capture(step, buffers, estimate, around, run=self.capture, then=then, kind=kind)
        finally:  # a trial the pool then refused took its time too: a batch waited for it
            self.capture_seconds += time.perf_counter() - t0
        self.deferred.discard(key)
        if got is None:
            if self.pool.deferrable:
                log.info("tower graph %s left to first use: the start-up set needs the room", key)
                self.deferred.add(key)
            else:
                self.pool.warn_refused(f"tower graph {key}")
                self.refused.add(key)
            return None
        graph, inputs, outputs = got
        self.graphs[key] = _Captured(graph, tuple(inputs), fills, outputs)
        log.info("captured %s tower graph %s in %.0f ms", key[0], key[1:], 1e3 * (time.perf_counter() - t0))
        return self.graphs[key]


def _chunked(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    n: int,
    step: int,
    a: torch.Tensor,
    b: torch.Tensor,
    retry: bool = True,
) -> torch.Tensor:
    """fn over consecutive chunks of at most `step` items of (a, b), results concatenated in order.

    With `retry`, a chunk that runs out of memory is run again in halves, down to one item (which then
    raises): the items are independent (a video's frames), and beside a full graph pool the eager
    share can be too fragmented for the planned chunk (H200, 2026-12-01: a 32-frame video after four
    30 s clips, 165 MiB cached but unusable). Without it (the engine's warm-up, which proves the
    planned chunk fits) the error is raised."""
    parts, i = [], 0
    while i < n:
        try:
            parts.append(fn(a[i : i + step], b[i : i + step]))
            i += step
            continue
        except torch.OutOfMemoryError:
            if step == 1 or not retry:
                raise
        step = max(1, step // 2)  # outside the handler: the failed chunk's tensors are freed by now
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return parts[0] if len(parts) == 1 else torch.cat(parts)
