"""CUDA graphs over the text encoder and pooling: the fast path beside `TextEncoder` + `pool`.

Why: the text encoder is 24 layers of ~100 small kernels each. For short inputs the GPU finishes
each kernel before Python has launched the next, so a 1 x 17 forward costs ~30 ms of launches for
well under 1 ms of GPU work (H200 profile, docs/BENCH.md). A captured graph replays all ~2,400
launches with one call.

How: a batch of B items of T tokens is padded up to a bucket (Bb, Tb) from two ladders and copied
into static input buffers; each bucket's graph is captured on first use (or ahead of time with
`capture_buckets`) and replayed after that. A batch with more rows than the largest bucket of its length
holds runs as several replays, rows in order: the pool (memory_plan.py) bounds the buckets, not the
batches. Buckets the pool refuses hand their rows to smaller ones, or to a longer length's where
that costs less (`plan`); only what no bucket holds runs eagerly. Pad rows and columns are zero
embeddings marked invalid: the attention masks hide them as keys and pooling skips them, so valid rows see exactly what they would
unpadded. Padding changes only which attention kernel runs (masked instead of mask-free), which
moves BF16 results by rounding only (H200: cosine >= 0.9999998 against the same kernels run
eagerly); tests/runtime/test_engine_fast_paths.py and the GPU suite hold both paths together.

Assumes one caller thread (the engine's) and a CUDA device. Every graph shares one memory pool (with
the tower graphs, tower_graphs.py) and one set of input buffers; replays never overlap, and each
result is copied out before the next.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar

import torch

from eg2_runtime.memory_plan import GRAPH_EXECUTABLE, MIB
from eg2_runtime.model import pool
from eg2_runtime.streams import side_stream
from eg2_runtime.text import TextEncoder

log = logging.getLogger(__name__)

BATCH_LADDER = (1, 2, 4, 8, 16, 32, 64)
# How far past its budget the pool admits captures that add only their executable (GraphPool): eight
# of them, taken from the eager share's fragmentation margin (memory_plan.EAGER_MARGIN: ~130 MiB of
# the 2,000 MiB default's 454 MiB eager share).
OVERDRAFT = 8 * GRAPH_EXECUTABLE
# What a capture its estimate refuses may still add on first use, tried under an allocator cap
# (GraphPool.trial_room): a capture whose tensors the pool's free blocks hold adds little more than
# its executable (H100, 2026-12-06, `eg2 bench`: the 8-clip audio bucket, estimated at 208 MiB, added
# at most 16 MiB to the BF16 engine's pool), while one whose tensors no free block holds adds its
# whole estimate (the 4-image bucket: 216 MiB, when a trial was given the whole room).
TRIAL_ALLOWANCE = 32 * MIB
# What one replay costs beyond its own tokens, counted in padded tokens: a short bucket's replay is
# bound by its launches (H200, 2026-12-01, benchmarks/probe_boot.py: one query 4.1 ms, 32 texts padded
# to 4,096 tokens 10.5 ms: ~1.6 us a token, ~4 ms a replay), so a longer rung's one replay beats many
# 1-row replays of a shorter one.
REPLAY_TOKENS = 2048
# Finer steps where a step is cheap, coarser where the T^2 attention makes a step cost more to
# capture than the padding it saves. Tb >= T always; a batch longer than the last rung runs eagerly.
LENGTH_LADDER = (
    *(16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512),
    *range(640, 1025, 128),
    *range(1280, 2049, 256),
    *range(2560, 4097, 512),
)


def rung(ladder: Sequence[int], n: int) -> int | None:
    """The smallest rung of `ladder` that holds n, or None past its top."""
    return next((r for r in ladder if r >= n), None)


class GraphPool:
    """One CUDA graph memory pool, shared by the text and the tower graphs, with a byte budget.

    A capture adds its activations to the pool except where blocks freed by earlier captures fit
    them, and its graph's executable (kernel parameters: device memory outside the allocator). Graphs
    never run at once, so a capture no larger than the largest one of its kind (text, image, audio)
    the pool already holds reuses that one's blocks: it adds little more than its executable (H200,
    2026-12-01, benchmarks/probe_boot.py: captures after the start-up set added 1-5 MiB each). A
    larger capture, or the first of its kind, counts its whole estimate: counting idle blocks it
    might reuse as room admitted captures they did not hold, and the pool overran its budget. Blocks
    of another kind are shaped for other tensors (H200, 2026-12-01: 374 MiB of graph pools against a
    344 MiB share after a 4-image capture, and the 1,120-token image then ran out of memory; H200,
    2026-12-03: the 16-clip call's audio capture, estimated at 104 MiB and admitted for its
    executable beside a 162 MiB text graph, added 138 MiB, and the video frames' buckets were then
    refused). The start-up set is captured largest first (Engine.capture_graphs), so its first graph
    sets the blocks the others of its kind reuse.

    What each capture really added is measured, as the process's GPU memory where NVML can read it
    (else the allocator's reserved bytes), the warm-up's cache emptied around it; a bucket is
    captured while that total plus what it may add fits the budget (or, on first use, where a trial
    fits: below). Past it the bucket is refused, and batches take smaller buckets in more replays
    (or a longer rung's). `budget` None: no bound.

    A start-up capture (one with `then` smaller ones to follow) that leaves too little room for
    their executables is dropped again (what it left behind stays counted) and its bucket refused,
    so the next smaller one is tried: the estimates are models, and the start-up set must keep the
    small buckets short requests take (H200, 2026-12-02: the text-only engine's first bucket, 4,096
    tokens estimated at 170 MiB, added 298 to a 234 MiB pool and was kept, and every later bucket
    was refused: one-token queries replayed 4,096 tokens). One refused by its estimate alone, for
    the room of the captures to follow, is deferred instead (`deferrable`): its first use tries it
    again, with nothing to follow. A capture on first use is kept as
    measured: the traffic asked for it, and the eager share's margin absorbs an overshoot (the
    process peaks stayed under the 2,000 MiB budget with every capture kept).

    A capture on first use (nothing to follow) that its estimate refuses is tried instead: its
    buffers are made, then its warm-up runs under an allocator cap of what the process holds at that
    point plus TRIAL_ALLOWANCE (or the budget's room, if less; `trial_cap`, from the engine). The
    estimate is a forward's whole peak, and blocks freed by the pool's other graphs often hold most
    of it (H100, 2026-12-06, `eg2 bench`: the packed engine refused the 8-clip audio bucket by 4
    MiB, and the BF16 engine's slightly larger pool captured it for at most 16 MiB). The warm-up asks
    for the blocks the capture then takes, so a warm-up that fits is captured; one that runs out of
    memory stops there, outside any capture, and the bucket is refused for good. What a stopped
    trial left in the pool (up to the allowance) stays there and is counted, free to later
    captures. The allowance is small on purpose: a trial given the budget's whole room kept a
    4-image bucket whose tensors no free block held, which took 216 MiB and refused every audio
    bucket after it (H100, 2026-12-06, 0db7046).

    Past the budget, a capture that adds only its executable is still admitted within OVERDRAFT:
    measured captures overshoot their estimates, and one overshoot must not refuse every bucket after
    it, the small ones included (H200, 2026-12-03, text graphs capped at 2,560 tokens: the pool
    stood at 420 of 414 MiB after a 4-clip capture, and the 8-frame video's buckets, which the
    image graphs' blocks held, were refused: 97 against 44 ms).
    """

    def __init__(
        self,
        budget: int | None,
        read: Callable[[], int | None] | None = None,
        grew: Callable[[], None] | None = None,
        trial_cap: Callable[[int], Callable[[], AbstractContextManager[Any]]] | None = None,
    ) -> None:
        # A MemPool rather than a bare graph-pool handle: each capture's warm-up run allocates in it
        # too (capture_graph), so the capture reuses the warm-up's blocks instead of adding its own
        # beside them.
        self.handle = torch.cuda.MemPool() if torch.cuda.is_available() else None
        self.budget = budget
        self.read = read  # the process's GPU memory in bytes (NVML), or None
        # Called after every capture that ran (kept, dropped or stopped midway): its executable is
        # device memory outside the allocator, so the engine caps the allocator again from the
        # process's memory now (Engine._cap_allocator), and the process stays within its budget.
        self.grew = grew
        # Given a trial's room, a context that caps the allocator at what it holds at that moment
        # plus the room (Engine._trial_cap); None: no trials, a capture its estimate refuses is
        # refused.
        self.trial_cap = trial_cap
        self.used = 0  # bytes the captures added: measured, or as `need` models them
        self.largest: dict[str, int] = {}  # per kind, the largest estimate among its captures
        # Whether the last refusal only kept room for captures to follow (`then`), measuring
        # nothing: first use may try that bucket again. A capture dropped for what it measured, or
        # stopped by the allocator's cap, is refused for good.
        self.deferrable = False

    def reuses(self, estimate: int, kind: str = "text") -> bool:
        """Whether a capture of its kind at least as large already holds the blocks such a capture's
        activations need."""
        return kind in self.largest and estimate <= self.largest[kind]

    def need(self, estimate: int, kind: str = "text") -> int:
        """What a capture of `kind` estimated at `estimate` activation bytes may add to the pool: its
        executable, and its activations unless it `reuses` another's blocks."""
        return GRAPH_EXECUTABLE + (0 if self.reuses(estimate, kind) else estimate)

    def admits(self, estimate: int, then: int = 0, kind: str = "text") -> bool:
        """Whether such a capture fits the budget beside what the captures so far added, leaving
        room for the executables of `then` smaller captures to follow (a start-up set); one that
        adds only its executable may draw on the OVERDRAFT past the budget."""
        if self.budget is None:
            return True
        room = OVERDRAFT if self.reuses(estimate, kind) and not then else 0
        return self.used + self.need(estimate, kind) + then * GRAPH_EXECUTABLE <= self.budget + room

    def trial_room(self, then: int, spent: int = 0) -> int:
        """The bytes a capture its estimate refuses may still add in its warm-up when tried under a
        cap: for a capture on first use (`then` 0), TRIAL_ALLOWANCE, or the budget's room less an
        executable and the `spent` bytes its buffers already took if that is less; 0 where none is
        tried (a start-up capture, no cap, no bound, no room)."""
        if then or self.trial_cap is None or self.budget is None:
            return 0
        return max(0, min(TRIAL_ALLOWANCE, self.budget - self.used - GRAPH_EXECUTABLE - spent))

    def reserve(self, estimate: int, then: int = 0, kind: str = "text") -> bool:
        """Admit a capture that runs nothing (the CPU's padded eager steps stand in for graphs):
        `need` joins `used` as if measured. False: refused."""
        if not self.admits(estimate, then, kind):
            return False
        self._took(estimate, self.need(estimate, kind), kind)
        return True

    def _took(self, estimate: int, added: int, kind: str) -> None:
        self.used += added
        self.largest[kind] = max(self.largest.get(kind, 0), estimate)

    def warn_refused(self, graph: str) -> None:
        """Log a refused capture as a warning: batches of its shape take smaller buckets or run
        eagerly from now on, which an operator sees as slower calls."""
        budget = "no bound" if self.budget is None else f"{self.budget / 2**20:.0f} MiB"
        log.warning(
            "%s refused: the graph pool holds %.0f MiB of %s; smaller buckets (or an eager forward) "
            "take its batches, a larger gpu_memory_mib would keep it",
            graph,
            self.used / 2**20,
            budget,
        )

    def _now(self) -> int:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        process = self.read() if self.read is not None else None
        return process if process is not None else torch.cuda.memory_reserved()

    def capture(
        self,
        step: Callable[..., Any],
        inputs: Callable[[], Sequence[torch.Tensor]],
        estimate: int,
        around: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
        run: bool = True,
        then: int = 0,
        kind: str = "text",
    ) -> tuple[torch.cuda.CUDAGraph | None, Sequence[torch.Tensor], Any] | None:
        """`capture_graph` of `step` over the static buffers `inputs()` makes, into this pool, what it
        adds measured into `used`: (the graph, its buffers, its static output), or None when the
        budget refuses it (`admits(estimate)`), or the allocator's cap stops it midway (the bucket
        does not fit beside the pool's other graphs). The buffers are made after the allocator's
        cache is emptied: kept for good, they would otherwise pin whichever cached segment of an
        earlier eager forward they landed in, which no later forward could then return (H200,
        2026-12-01: 165 MiB cached but unusable when a 32-frame video ran out of memory).

        `run` False captures nothing (the CPU, where the padded step runs eagerly in the graph's
        stead): the bucket is admitted as its graph would be (`reserve`), and (None, the buffers,
        None) comes back. `then` and `kind`: see `admits` and `need`."""
        self.deferrable = False
        room = 0
        if not self.admits(estimate, then, kind):
            room = self.trial_room(then) if run else 0
            if not room:
                self.deferrable = bool(then)
                return None
        if not run:
            self._took(estimate, self.need(estimate, kind), kind)
            return None, inputs(), None
        try:
            got = self._capture(step, inputs, estimate, around, then, kind, room)
            if room:
                log.info(
                    "%s capture tried past its estimate (%.0f MiB): %s",
                    kind,
                    estimate / 2**20,
                    "kept" if got else "out of memory, refused",
                )
            return got
        finally:
            if self.grew is not None:
                self.grew()

    def _capture(
        self,
        step: Callable[..., Any],
        inputs: Callable[[], Sequence[torch.Tensor]],
        estimate: int,
        around: Callable[[], AbstractContextManager[Any]],
        then: int,
        kind: str,
        room: int = 0,
    ) -> tuple[torch.cuda.CUDAGraph | None, Sequence[torch.Tensor], Any] | None:
        """The capture, measured. `room` > 0: a trial. Its buffers are made first and measured (they
        live outside the pool, in a segment of their own, which the pool's free blocks cannot
        hold); then its warm-up runs under an allocator cap of `trial_room` more bytes, set after
        `_now` has emptied the cache (cached eager blocks would otherwise count as room)."""
        before = self._now()
        buffers: Sequence[torch.Tensor] = ()
        warm: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
        spent = 0  # a trial's buffers
        stopped = False
        try:
            buffers = inputs()
            if room and self.trial_cap is not None:
                spent = max(0, self._now() - before)
                room = self.trial_room(then, spent)
                if not room:
                    raise torch.OutOfMemoryError("no room left for the trial's warm-up")
                warm = self.trial_cap(room)
            graph, out = capture_graph(step, buffers, self.handle, around, warm=warm)
        except torch.OutOfMemoryError:
            stopped = True
        if stopped:
            buffers = ()  # freed before measuring: what the failed capture left in the pool stays
            self.used += max(0, self._now() - before)
            return None
        added = max(0, self._now() - before)
        if room and added > spent + room + GRAPH_EXECUTABLE:
            # The cap bounds the warm-up; the capture, run after it, asks for the same blocks.
            log.warning("%s capture tried past its estimate added %.0f MiB", kind, added / 2**20)
        if then and self.budget is not None and self.used + added + then * GRAPH_EXECUTABLE > self.budget:
            del graph, buffers, out  # no room left for the rest of the set: drop it again
            self.used += max(0, self._now() - before)
            return None
        # An executable at least: NVML may round a capture's growth down, and the allocator's
        # counters (without NVML) miss executables, which would leave OVERDRAFT unbounded. There the
        # first capture of a kind counts its activations only: its executable goes unseen.
        self._took(estimate, max(added, GRAPH_EXECUTABLE), kind)
        return graph, buffers, out


def capture_graph(
    step: Callable[..., Any],
    inputs: Sequence[torch.Tensor],
    pool: torch.cuda.MemPool | None,
    around: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    warm: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture `step(*inputs)` into a CUDA graph drawing on `pool`: (the graph, its static output).

    It runs once on a side stream first, as torch.cuda.graphs advises: kernel choice, cuBLAS
    workspaces, Triton compiles and lazy inits happen outside the capture. That run allocates in
    `pool` as well: its blocks, freed when it returns, are the ones the capture then takes, since it
    asks for the same sizes in the same order. Run outside the pool, its activations stayed cached
    beside the capture's until the next empty_cache, and the process's peak held both. `around`
    wraps both runs (the Unpacker's capture mode): the warm-up runs on another stream than the
    engine's eager forwards, and the Unpacker must order its unpacks after that stream, not the one
    it last saw. torch.cuda.graph synchronizes the device before the capture begins, so nothing the
    warm-up left in flight reaches into the capture. `warm` wraps the warm-up alone (GraphPool's
    trial cap): out of memory there is an eager forward's, with no capture under way.
    """
    device = inputs[0].device
    side = _warmup_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    allocating = torch.cuda.use_mem_pool(pool, device) if pool is not None else contextlib.nullcontext()
    with warm(), torch.cuda.stream(side), around(), allocating:
        step(*inputs)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Captured on the warm-up's stream too: each stream cuBLAS runs on keeps a workspace of its own.
    # The pool goes by its id: torch 2.11's torch.cuda.graph takes a handle, not a MemPool.
    handle: Any = None if pool is None else pool.id
    with torch.cuda.graph(graph, pool=handle, stream=side), around():
        out = step(*inputs)
    return graph, out


def _warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every capture's warm-up run. cuBLAS keeps a workspace (32 MiB
    on the H200) per stream it has run on, for the life of the process: a new stream per capture
    left 32 MiB behind each time (13 start-up captures: 416 MiB, benchmarks/probe_costs.py). Made by
    the CUDA runtime, not taken from torch's pools (streams.py)."""
    return side_stream(device, "capture")


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph | None  # None: the eager run of the same bucket-sized step (CPU, tests)
    out: torch.Tensor | None  # (rows, D) fp32, the graph's static output


def held_graphs(captures: Mapping[Any, Any]) -> int:
    """How many of a graph set's captures (`.graph`) hold a graph, not the eager stand-in of a step
    with capture off. list(): a copy taken in one step, as the engine's thread may capture a bucket
    while another thread counts."""
    return sum(1 for c in list(captures.values()) if c.graph is not None)


K = TypeVar("K", bound=Hashable)


class TextGraphs(Generic[K]):
    """What the text encoder's two kinds of graphs share: their buckets' captures in a GraphPool,
    admitted at `token_bytes` per token, and the buckets the pool refused. Keys are (rows, length)
    for GraphedTextEncoder, a token count for packed_graphs.PackedTextGraphs.

    `pool` None: one of its own, unbounded. `capture=False` (or a CPU) runs each bucket's step
    eagerly in its graph's stead, admitted as its graph would be: the CPU tests of the bucketing.
    """

    def __init__(
        self, encoder: TextEncoder, max_tokens: int, pool: GraphPool | None, token_bytes: int, capture: bool
    ) -> None:
        self.encoder = encoder
        self.max_tokens = max_tokens
        self.token_bytes = token_bytes
        self.device = encoder.embedding_projection.weight.device
        self.capture = capture and self.device.type == "cuda"
        self.pool = pool if pool is not None else GraphPool(None)
        self.graphs: dict[K, Captured] = {}
        # Buckets the pool's budget refused: batches take smaller ones, in more replays.
        self.refused: set[K] = set()
        # Buckets the start-up set passed over to keep room for its smaller ones: tried on first use.
        self.deferred: set[K] = set()
        self.capture_seconds = 0.0

    def captured(self) -> int:
        """Buckets held as graphs (held_graphs)."""
        return held_graphs(self.graphs)

    def tokens(self, key: K) -> int:
        """The tokens bucket `key` holds."""
        raise NotImplementedError

    def admissible(self, key: K) -> bool:
        """Whether `key` is a bucket this instance would use (within its bounds)."""
        raise NotImplementedError

    def _capture(self, key: K, then: int = 0) -> Captured | None:
        """Bucket `key`'s graph, captured now (`_take` with the class's step and buffers)."""
        raise NotImplementedError

    def capture_buckets(self, keys: Iterable[K], then: int = 0) -> int:
        """Capture these buckets now (service boot) rather than on first use, those within the
        bounds, largest first (see GraphPool), each leaving room for the executables of the ones
        after it and `then` more. Returns how many graphs there are."""
        todo = [k for k in sorted(keys, key=lambda k: -self.tokens(k)) if self.admissible(k)]
        for i, key in enumerate(todo):
            if key not in self.graphs and key not in self.refused and key not in self.deferred:
                self._capture(key, then=len(todo) - 1 - i + then)
        return len(self.graphs)

    def _take(
        self, key: K, step: Callable[..., Any], inputs: Callable[[], Sequence[torch.Tensor]], then: int = 0
    ) -> Captured | None:
        """Bucket `key`'s graph of `step` over the buffers `inputs()` makes, captured now; None when
        the pool's budget does not hold its tokens: the bucket is refused for good, or deferred to
        its first use where only the room for `then` captures to follow refused it."""
        t0 = time.perf_counter()
        estimate = self.token_bytes * self.tokens(key)
        try:
            got = self.pool.capture(step, inputs, estimate, run=self.capture, then=then)
        finally:  # a trial the pool then refused took its time too: a batch waited for it
            self.capture_seconds += time.perf_counter() - t0
        self.deferred.discard(key)
        if got is None:
            if self.pool.deferrable:  # only the start-up set's room refused it: first use tries again
                log.info("text graph %s left to first use: the start-up set needs the room", key)
                self.deferred.add(key)
                return None
            self.pool.warn_refused(f"text graph {key}")
            self.refused.add(key)
            return None
        graph, _, out = got
        self.graphs[key] = Captured(graph, out)
        log.debug("captured text graph %s in %.0f ms", key, 1e3 * (time.perf_counter() - t0))
        return self.graphs[key]


class GraphedTextEncoder(TextGraphs[tuple[int, int]]):
    """`(embeds (B, T, H), valid (B, T) bool) -> (B, D)` unit vectors, as `pool(encoder(...))`.

    `max_tokens` bounds Bb * Tb: a graph pool keeps its buckets' activations for good, so the memory
    plan sets it. `pool`: the GraphPool to draw on (shared with the tower graphs; None: one of its
    own, unbounded), admitting a bucket by `token_bytes` per padded token. `capture=False` runs the
    same padded step eagerly: the CPU test of the padding logic.
    """

    def __init__(
        self,
        encoder: TextEncoder,
        max_tokens: int,
        pool: GraphPool | None = None,
        token_bytes: int = 0,
        capture: bool = True,
    ) -> None:
        super().__init__(encoder, max_tokens, pool, token_bytes, capture)
        # Flat input buffers every bucket views its leading part of (only one bucket's inputs are
        # live at a time), allocated on first use like any activation.
        self.embeds: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None

    def bucket(self, batch: int, length: int) -> tuple[int, int] | None:
        """The smallest (Bb, Tb) that holds a (batch, length) input, or None if there is none."""
        bb, tb = rung(BATCH_LADDER, batch), rung(LENGTH_LADDER, length)
        if bb is None or tb is None or bb * tb > self.max_tokens:
            return None
        return bb, tb

    def _usable(self, rows: int, padded: int) -> bool:
        return rows * padded <= self.max_tokens and (rows, padded) not in self.refused

    def plan(self, batch: int, length: int) -> tuple[int, int] | None:
        """(rows per replay, padded length) for `batch` rows of `length` tokens: over the length rungs
        that hold it and still have a bucket the pool has not refused, the one whose replays cost the
        least (REPLAY_TOKENS each, plus their padded tokens). The shortest rung while its buckets
        stand; once the pool refused them, a longer rung's captured bucket rather than many 1-row
        replays. None: no rung has a bucket (the batch runs eagerly)."""
        best: tuple[int, int, int] | None = None
        for tb in (tb for tb in LENGTH_LADDER if tb >= length):
            rows = max((b for b in BATCH_LADDER if self._usable(b, tb)), default=0)
            if rows == 0:
                continue
            full, rest = divmod(batch, rows)
            cost = full * (REPLAY_TOKENS + rows * tb)
            if rest:  # the smallest open bucket of this length that holds the rest, as _replay takes
                cost += REPLAY_TOKENS + min(b for b in BATCH_LADDER if b >= rest and self._usable(b, tb)) * tb
            if best is None or cost < best[0]:
                best = (cost, rows, tb)
        return None if best is None else best[1:]

    def buckets(self) -> Iterator[tuple[int, int]]:
        """Every bucket within the bounds, largest first (the pool is then sized once)."""
        fits = [(b, t) for b in BATCH_LADDER for t in LENGTH_LADDER if self.bucket(b, t) == (b, t)]
        yield from sorted(fits, key=lambda k: (-k[0] * k[1], -k[1]))

    def __call__(self, embeds: torch.Tensor, valid: torch.Tensor) -> torch.Tensor | None:
        """(B, D) fp32 unit vectors, or None when no bucket holds rows of this length (run it eagerly).
        More rows than the largest bucket holds run as several replays, each planned (`plan`)."""
        b, t, _ = embeds.shape
        parts: list[torch.Tensor] = []
        i = 0
        while i < b:
            plan = self.plan(b - i, t)
            if plan is None:
                return None
            rows, tb = plan
            part = self._replay(embeds[i : i + rows], valid[i : i + rows], tb)
            if part is not None:
                parts.append(part)
                i += part.shape[0]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _replay(self, embeds: torch.Tensor, valid: torch.Tensor, tb: int) -> torch.Tensor | None:
        """The rows, padded to `tb`, through the smallest bucket of that length that holds them and
        the pool has not refused; None when its capture is refused now (the caller plans again)."""
        b, t, _ = embeds.shape
        key = next((r, tb) for r in BATCH_LADDER if r >= b and self._usable(r, tb))
        captured = self.graphs.get(key) or self._capture(key)
        if captured is None:
            return None
        x, v = self._inputs(key)
        x.zero_()
        v.zero_()
        x[:b, :t].copy_(embeds)
        v[:b, :t].copy_(valid)
        if captured.graph is None:
            return self._step(x, v)[:b]
        captured.graph.replay()
        assert captured.out is not None
        return captured.out[:b].clone()  # the static output is overwritten by the next replay

    def admissible(self, key: tuple[int, int]) -> bool:
        return self.bucket(*key) == key

    def _inputs(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        bb, tb = key
        hidden = self.encoder.cfg.hidden_size
        if self.embeds is None or self.valid is None:
            w = self.encoder.embedding_projection.weight
            self.embeds = torch.zeros(self.max_tokens * hidden, dtype=w.dtype, device=w.device)
            self.valid = torch.zeros(self.max_tokens, dtype=torch.bool, device=w.device)
        return self.embeds[: bb * tb * hidden].view(bb, tb, hidden), self.valid[: bb * tb].view(bb, tb)

    def _step(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return pool(self.encoder(x, v, static=True, lean=True).float(), v)

    def _capture(self, key: tuple[int, int], then: int = 0) -> Captured | None:
        """The padded bucket's graph, captured now (TextGraphs._take)."""
        return self._take(key, self._step, partial(self._inputs, key), then)

    def tokens(self, key: tuple[int, int]) -> int:
        return key[0] * key[1]
