"""The engine's fast paths against their reference paths, on the CPU with the tiny checkpoint:

- the graphed text encoder's bucket padding (graphs.py, run eagerly here; the captured graphs are
  checked against the same reference on the H200 in test_gpu.py), and smaller buckets taking the
  rows of one the graph pool's budget refuses;
- splitting a large call into several forwards (max_forward_tokens);
- prepare_many (threads + one tokenizer call) against prepare one by one.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from eg2_runtime import graphs as graphs_module
from eg2_runtime import samples
from eg2_runtime.engine import (
    STARTUP_TEXT_BUCKETS,
    STARTUP_TOKEN_BUCKETS,
    Engine,
    EngineOptions,
    startup_graph_count,
)
from eg2_runtime.errors import EG2Error
from eg2_runtime.graphs import (
    BATCH_LADDER,
    LENGTH_LADDER,
    OVERDRAFT,
    TRIAL_ALLOWANCE,
    GraphedTextEncoder,
    GraphPool,
)
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions, TextPart
from eg2_runtime.loader import load_model
from eg2_runtime.memory_plan import GRAPH_EXECUTABLE, STARTUP_AUDIO_TOKENS
from eg2_runtime.model import pool
from eg2_runtime.packed_graphs import PackedTextGraphs
from eg2_runtime.tower_graphs import FRAME_LADDER, FRAMES_PER_TOKEN

TOL = 1e-5  # FP32 on the CPU: padding must not move a valid row beyond float rounding


@pytest.fixture(scope="module")
def encoder(tiny_fp32: Path) -> GraphedTextEncoder:
    model, _ = load_model(tiny_fp32, "cpu")
    return GraphedTextEncoder(model.language_model, max_tokens=1024, capture=False)


@pytest.mark.parametrize(
    ("lengths", "bucket"),
    [
        ([5], (1, 16)),  # one short item, no padding of its own
        ([17, 3, 9], (4, 32)),  # padded rows and columns, and a pad row (B 3 -> 4)
        ([40, 40], (2, 48)),  # longer than the tiny model's sliding window (8)
        ([16] * 8, (8, 16)),  # an exact bucket
    ],
)
def test_bucket_padding_equals_reference(
    encoder: GraphedTextEncoder, lengths: list[int], bucket: tuple[int, int]
) -> None:
    torch.manual_seed(0)
    b, t = len(lengths), max(lengths)
    hidden = encoder.encoder.cfg.hidden_size
    embeds = torch.randn(b, t, hidden)
    valid = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    assert encoder.bucket(b, t) == bucket
    with torch.inference_mode():
        expected = pool(encoder.encoder(embeds, valid).float(), valid)
        got = encoder(embeds, valid)
        again = encoder(embeds, valid)  # the static buffers are reused: a second call still holds
    assert got is not None and got.shape == expected.shape
    err = (got - expected).abs().max().item()
    assert err <= TOL, f"bucket {bucket}: max abs diff {err:.2e} > {TOL}"
    assert again is not None and torch.equal(got, again)


def test_buckets_stay_within_max_tokens(encoder: GraphedTextEncoder) -> None:
    keys = list(encoder.buckets())
    assert keys and all(b * t <= encoder.max_tokens for b, t in keys)
    assert len(set(keys)) == len(keys)
    assert encoder.bucket(1, LENGTH_LADDER[-1] + 1) is None  # longer than the ladder
    assert encoder.bucket(BATCH_LADDER[-1] + 1, 4) is None  # more items than the ladder
    assert encoder.bucket(64, 32) is None  # 2048 padded tokens > max_tokens 1024
    assert encoder.bucket(32, 32) == (32, 32)


def test_rows_past_the_largest_bucket_replay_in_chunks(encoder: GraphedTextEncoder) -> None:
    """70 rows of 20 tokens (bucket (32, 32) at most under 1,024 tokens): replays of 32, 32 and 6
    rows, in order, equal the reference; a length past every rung has no bucket at all."""
    torch.manual_seed(1)
    lengths = [1 + (7 * i) % 20 for i in range(70)]
    embeds = torch.randn(70, 20, encoder.encoder.cfg.hidden_size)
    valid = torch.arange(20)[None, :] < torch.tensor(lengths)[:, None]
    assert encoder.plan(70, 20) == (32, 32) and encoder.plan(1, LENGTH_LADDER[-1] + 1) is None
    with torch.inference_mode():
        expected = pool(encoder.encoder(embeds, valid).float(), valid)
        got = encoder(embeds, valid)
    assert got is not None and got.shape == expected.shape
    err = (got - expected).abs().max().item()
    assert err <= TOL, f"chunked replays: max abs diff {err:.2e} > {TOL}"
    assert {(32, 32), (8, 32)} <= set(encoder.graphs), "32 + 32 + 6 rows"


def test_a_capture_no_larger_than_the_pools_largest_adds_only_its_executable() -> None:
    """Graphs never run at once, so a capture no larger than one the pool holds reuses its blocks and
    adds its executable; a larger one counts its whole estimate (the rule that kept the H200's pool
    within its budget)."""
    big, small = 100 << 20, 60 << 20
    graphs = GraphPool(big + 3 * GRAPH_EXECUTABLE)
    assert graphs.reserve(big)
    assert graphs.reserve(small), "fits the first capture's blocks: only its executable is new"
    assert graphs.used == big + 2 * GRAPH_EXECUTABLE and graphs.largest == {"text": big}
    assert not graphs.reserve(big + 1), "larger than any held: counted in full, past the budget"
    assert graphs.reserve(big)
    assert graphs.used == big + 3 * GRAPH_EXECUTABLE


def test_past_its_budget_the_pool_admits_executables_within_the_overdraft() -> None:
    """A full pool (or one a measured capture pushed past its budget) still admits captures that add
    only their executable, OVERDRAFT's worth, and nothing that adds activations; a start-up capture
    (`then`) gets no overdraft."""
    big = 100 << 20
    graphs = GraphPool(big + GRAPH_EXECUTABLE)
    assert graphs.reserve(big)
    assert not graphs.reserve(big + 1), "adds activations: refused at the budget"
    assert not graphs.admits(1, then=1), "a start-up capture draws on no overdraft"
    assert not graphs.reserve(1, kind="audio"), "the first of its kind adds activations: no overdraft"
    n = 0
    while graphs.reserve(1):
        n += 1
    assert n == OVERDRAFT // GRAPH_EXECUTABLE
    assert graphs.used == big + GRAPH_EXECUTABLE + OVERDRAFT


def _no_cap(room: int) -> Callable[[], contextlib.AbstractContextManager[None]]:
    return contextlib.nullcontext


def test_on_first_use_a_capture_its_estimate_refuses_is_tried_within_the_allowance() -> None:
    """On first use a capture the estimate refuses may still be tried, under a cap of TRIAL_ALLOWANCE
    or the budget's room less an executable where that is less; a start-up capture (`then`), a pool
    without a cap, an unbounded one and a full one never try, and where nothing is captured (the
    CPU) the estimate alone rules."""
    mib = 1 << 20
    rooms: list[int] = []
    graphs = GraphPool(
        200 * mib,
        trial_cap=lambda room: rooms.append(room) or contextlib.nullcontext,  # type: ignore[func-returns-value]
    )
    assert graphs.reserve(40 * mib)
    assert graphs.trial_room(then=0) == TRIAL_ALLOWANCE, "the allowance, not the whole room"
    assert graphs.trial_room(then=2) == 0, "the start-up set keeps its rule"
    assert GraphPool(200 * mib).trial_room(then=0) == 0, "no cap, no trial"
    assert GraphPool(None, trial_cap=_no_cap).trial_room(then=0) == 0, "no bound, nothing refused"
    near = GraphPool(100 * mib, trial_cap=_no_cap)
    assert near.reserve(100 * mib - 2 * GRAPH_EXECUTABLE - 10 * mib)
    assert near.trial_room(then=0) == 10 * mib, "the room, where less than the allowance"
    full = GraphPool(100 * mib, trial_cap=_no_cap)
    assert full.reserve(100 * mib - GRAPH_EXECUTABLE)
    assert full.trial_room(then=0) == 0
    assert graphs.capture(lambda: None, lambda: [], 500 * mib, run=False, kind="audio") is None
    assert rooms == [] and graphs.used == 40 * mib + GRAPH_EXECUTABLE


def test_a_trial_caps_its_warm_up_but_not_its_buffers_or_its_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trial's order, with the CUDA primitives stood in for (the GPU suite runs the real ones):
    the pool's reading empties the cache first, the buffers are made and measured, the cap is made
    from that moment's holdings with the allowance (or the room less the buffers, where less), the
    warm-up runs inside it and the capture after it; the growth is measured and `grew` re-caps the
    allocator. A warm-up out of memory is refused for good, not deferred, and what it left is counted
    with the buffers freed first; buffers that leave no room stop the trial before its warm-up;
    another error is raised; a capture within its estimate takes no cap."""
    mib = 1 << 20
    events: list[str] = []
    level = [0]
    oom = [False]
    alive: list[weakref.ref[Any]] = []

    class Buffer:
        pass

    def trial_cap(room: int) -> Callable[[], contextlib.AbstractContextManager[None]]:
        events.append(f"cap {room // mib}")

        @contextlib.contextmanager
        def capped() -> Iterator[None]:
            events.append("capped")
            try:
                yield
            finally:
                events.append("uncapped")

        return capped

    def now() -> int:
        events.append("now" if not any(r() for r in alive) else "now, buffers alive")
        return level[0]

    def capture_graph(
        step: object,
        buffers: object,
        handle: object,
        around: object,
        warm: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> tuple[str, str]:
        with warm():
            events.append("warm-up")
            level[0] += 10 * mib
            if oom[0]:
                raise torch.OutOfMemoryError("the cap")
        events.append("capture")
        return "graph", "out"

    def buffers() -> list[Buffer]:
        events.append("buffers")
        level[0] += 2 * mib
        b = Buffer()
        alive.append(weakref.ref(b))
        return [b]

    monkeypatch.setattr(graphs_module, "capture_graph", capture_graph)
    pool = GraphPool(100 * mib, grew=lambda: events.append("grew"), trial_cap=trial_cap)
    monkeypatch.setattr(pool, "_now", now)
    got = pool.capture(lambda: None, buffers, 200 * mib, kind="audio")  # refused by its estimate
    assert got is not None and got[0] == "graph"
    del got
    room = TRIAL_ALLOWANCE // mib
    assert events == [
        *("now", "buffers", "now, buffers alive", f"cap {room}"),
        *("capped", "warm-up", "uncapped", "capture", "now, buffers alive", "grew"),
    ]
    assert pool.used == 12 * mib and pool.largest == {"audio": 200 * mib}

    events.clear()
    oom[0] = True
    assert pool.capture(lambda: None, buffers, 200 * mib, kind="image") is None
    assert not pool.deferrable, "stopped by what it measured: refused for good"
    assert pool.used == 24 * mib, "what it left is counted"
    assert events[-4:] == ["warm-up", "uncapped", "now", "grew"], "measured with the buffers freed"

    events.clear()
    pool.used = 100 * mib - GRAPH_EXECUTABLE - mib  # 1 MiB of room: the buffers take it
    assert pool.capture(lambda: None, buffers, 200 * mib, kind="video") is None
    assert "warm-up" not in events and events[-2:] == ["now", "grew"]

    events.clear()
    oom[0] = False
    pool.used = 0
    monkeypatch.setattr(
        graphs_module, "capture_graph", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("x"))
    )
    with pytest.raises(RuntimeError):
        pool.capture(lambda: None, buffers, 200 * mib, kind="text")
    events.clear()
    monkeypatch.setattr(graphs_module, "capture_graph", capture_graph)
    assert pool.capture(lambda: None, buffers, 1 * mib, kind="text") is not None  # within its estimate
    assert "capped" not in events and not any(e.startswith("cap ") for e in events)


def test_the_engines_trial_cap_stays_under_the_budgets_cap_and_restores_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Engine._trial_cap with torch's CUDA calls stood in for: the cap is what the allocator holds
    when the context is made plus the room (later growth does not move it), never past the budget's
    cap, and the budget's cap is set back on exit, an out-of-memory error included."""
    gib = 1 << 30
    fractions: list[float] = []
    reserved = [2 * gib]
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=100 * gib)
    )
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: reserved[0])
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: fractions.append(f))
    engine = SimpleNamespace(device="cuda:0", _cap_fraction=0.05)
    capped = Engine._trial_cap(engine, 1 * gib)  # type: ignore[arg-type]
    reserved[0] = 50 * gib  # later growth does not move the limit
    with pytest.raises(torch.OutOfMemoryError), capped():
        raise torch.OutOfMemoryError("warm-up")
    assert fractions == [0.03, 0.05]
    fractions.clear()
    loose = Engine._trial_cap(engine, 10 * gib)  # type: ignore[arg-type]
    with loose():
        pass
    assert fractions == [0.05, 0.05], "never past the budget's cap"


def test_a_capture_of_another_kind_counts_its_whole_estimate() -> None:
    """The blocks a text graph left are shaped for text's tensors: a tower capture smaller than it
    counts its activations in full until a capture of its own kind holds blocks as large (H200,
    2026-12-03: an audio capture admitted for its executable beside a larger text graph added 138
    MiB and pushed the pool past its budget)."""
    big, small = 100 << 20, 60 << 20
    graphs = GraphPool(big + small + 2 * GRAPH_EXECUTABLE - 1)
    assert graphs.reserve(big, kind="text")
    assert graphs.admits(small, kind="text"), "text's own blocks hold it"
    assert not graphs.reserve(small, kind="audio"), "its whole estimate is past the budget"
    assert graphs.reserve(small // 2, kind="audio")
    assert graphs.reserve(small // 2, kind="audio"), "now audio's own blocks hold it"
    assert graphs.used == big + small // 2 + 3 * GRAPH_EXECUTABLE
    assert graphs.largest == {"text": big, "audio": small // 2}


def test_a_start_up_bucket_leaves_room_for_the_executables_of_the_smaller_ones(tiny_fp32: Path) -> None:
    """The largest start-up bucket is captured only if the smaller ones' executables fit after it:
    else it is passed over and the small buckets, which short queries take, all get their graphs.
    A bucket passed over is tried again on its first use, with nothing to follow."""
    model, _ = load_model(tiny_fp32, "cpu")
    token_bytes = 1 << 20
    rungs = (32, 64, 128, 256)
    # Room for the 256-token bucket and one executable, not four.
    pool = GraphPool(256 * token_bytes + 2 * GRAPH_EXECUTABLE)
    packed = PackedTextGraphs(model.language_model, 1024, pool=pool, token_bytes=token_bytes, capture=False)
    packed.capture_buckets(rungs)
    assert sorted(packed.graphs) == [32, 64, 128] and packed.deferred == {256} and not packed.refused
    tried: list[int] = []
    capture = packed._capture
    packed._capture = lambda n, then=0: tried.append(n) or capture(n, then)  # type: ignore[method-assign]
    packed.capture_buckets(rungs)
    assert not tried, "the start-up set tries a bucket once"
    assert packed._capture(256) is None and packed.refused == {256}, "first use: tried, then refused"


def _scripted(monkeypatch: pytest.MonkeyPatch, pool: GraphPool, readings: Iterator[int]) -> None:
    """The pool's GPU readings from `readings`, one per `_now`, and a capture that runs nothing: the
    pool's arithmetic on the CPU."""
    monkeypatch.setattr(pool, "_now", lambda: next(readings))
    monkeypatch.setattr(
        graphs_module, "capture_graph", lambda step, inputs, handle, around, **_: (object(), None)
    )


def test_a_start_up_capture_that_leaves_no_room_for_the_rest_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A start-up capture whose measured growth leaves no room for the executables of the captures to
    follow is dropped again (what it left behind still counted) and refused; a smaller one then fits.
    A capture on first use (nothing to follow) is kept as measured. The GPU readings are scripted:
    this checks the pool's arithmetic."""
    mib = 1 << 20
    readings = iter([0, 300 * mib, 10 * mib, 10 * mib, 150 * mib, 150 * mib, 260 * mib])  # around each
    pool = GraphPool(234 * mib)
    _scripted(monkeypatch, pool, readings)
    step, inputs = (lambda: None), (lambda: [])
    assert pool.capture(step, inputs, 170 * mib, then=2) is None, "300 MiB measured, 234 MiB of budget"
    assert pool.used == 10 * mib and not pool.largest  # what the dropped capture left (a workspace)
    got = pool.capture(step, inputs, 130 * mib, then=2)
    assert got is not None and pool.used == 150 * mib and pool.largest == {"text": 130 * mib}
    got = pool.capture(step, inputs, 0)  # on first use: 110 MiB measured is kept, past the budget
    assert got is not None and pool.used == 260 * mib


def test_the_pool_reports_every_capture_that_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """`grew` follows every capture that ran, kept or dropped, so the engine caps its allocator
    again (a graph's executable is memory outside the allocator); a refusal by estimate ran none."""
    mib = 1 << 20
    calls: list[int] = []
    pool = GraphPool(234 * mib, grew=lambda: calls.append(pool.used))
    readings = iter([0, 300 * mib, 10 * mib, 10 * mib, 150 * mib])
    _scripted(monkeypatch, pool, readings)
    step, inputs = (lambda: None), (lambda: [])
    assert pool.capture(step, inputs, 170 * mib, then=2) is None  # ran, dropped
    assert pool.capture(step, inputs, 130 * mib, then=2) is not None  # ran, kept
    assert pool.capture(step, inputs, 300 * mib) is None  # refused by its estimate: nothing ran
    assert calls == [10 * mib, 150 * mib]


def test_a_start_up_bucket_dropped_for_what_it_measured_is_refused_not_deferred(
    monkeypatch: pytest.MonkeyPatch, tiny_fp32: Path
) -> None:
    """Deferral is for a bucket only the start-up set's room refused (by its estimate); one captured,
    measured past that room and dropped would measure the same on first use: refused for good."""
    mib = 1 << 20
    model, _ = load_model(tiny_fp32, "cpu")
    pool = GraphPool(234 * mib)
    readings = iter([0, 300 * mib, 10 * mib])  # before, after the capture, after dropping it
    _scripted(monkeypatch, pool, readings)
    packed = PackedTextGraphs(model.language_model, 1024, pool=pool, token_bytes=mib, capture=False)
    packed.capture = True  # the scripted capture_graph stands in for the GPU
    assert packed._capture(128, then=2) is None
    assert packed.refused == {128} and not packed.deferred and not pool.deferrable


def test_the_memory_plan_counts_the_start_up_graphs_the_engine_captures() -> None:
    """The minimum pool holds the executables of the graphs capture_graphs takes for the modalities
    served: the text path's start-up buckets, and a tower's graph only where that tower starts one
    (video frames take theirs on first use)."""
    packed, padded = len(STARTUP_TOKEN_BUCKETS), len(STARTUP_TEXT_BUCKETS)
    assert startup_graph_count({"text"}, packed_text=True) == packed
    assert startup_graph_count({"text", "video"}, packed_text=True) == packed
    assert startup_graph_count({"text", "image", "audio", "video"}, packed_text=False) == padded + 2
    assert startup_graph_count({"text", "audio"}, packed_text=True) == packed + 1
    assert startup_graph_count({"text", "image"}, packed_text=True, towers=False) == packed
    assert startup_graph_count({"text", "image"}, packed_text=True, max_tokens=0) == 0, "graphs off"
    small = sum(n <= 512 for n in STARTUP_TOKEN_BUCKETS)
    assert startup_graph_count({"text"}, packed_text=True, max_tokens=512) == small
    # The padded buckets are bounded by rows x length, not by length alone.
    padded_small = sum(b * t <= 512 for b, t in STARTUP_TEXT_BUCKETS)
    assert padded_small < sum(t <= 512 for _, t in STARTUP_TEXT_BUCKETS)
    assert startup_graph_count({"text"}, packed_text=False, max_tokens=512) == padded_small
    assert FRAME_LADDER[3] // FRAMES_PER_TOKEN == STARTUP_AUDIO_TOKENS, "the audio start-up bucket"


def test_a_bucket_the_pool_refuses_hands_its_rows_to_smaller_ones(tiny_fp32: Path) -> None:
    """A pool whose budget holds buckets of up to 4 x 32 tokens: 11 rows of 20 tokens, allowed
    (16, 32) by max_tokens, take (4, 32) replays (4 + 4 + 3) instead of one refused (16, 32) run
    eagerly at its padded size; the result is the reference's, and the refusals are remembered."""
    model, _ = load_model(tiny_fp32, "cpu")
    token_bytes = 1000
    budget = GraphPool(GRAPH_EXECUTABLE + 4 * 32 * token_bytes)  # one graph of at most 4 x 32 tokens
    encoder = GraphedTextEncoder(
        model.language_model, 1024, pool=budget, token_bytes=token_bytes, capture=False
    )
    torch.manual_seed(2)
    lengths = [1 + (5 * i) % 20 for i in range(11)]
    embeds = torch.randn(11, 20, encoder.encoder.cfg.hidden_size)
    valid = torch.arange(20)[None, :] < torch.tensor(lengths)[:, None]
    with torch.inference_mode():
        expected = pool(encoder.encoder(embeds, valid).float(), valid)
        got = encoder(embeds, valid)
    assert got is not None and got.shape == expected.shape
    err = (got - expected).abs().max().item()
    assert err <= TOL, f"replays of smaller buckets: max abs diff {err:.2e} > {TOL}"
    assert (4, 32) in encoder.graphs, "4 + 4 + 3 rows, the last padded to the same bucket"
    assert all(b * t <= 4 * 32 for b, t in encoder.graphs), "only buckets the budget holds"
    assert {(32, 32), (16, 32), (8, 32)} <= encoder.refused
    assert encoder.plan(11, 20) == (4, 32)


def test_a_length_whose_buckets_are_all_refused_pads_to_a_longer_one(encoder: GraphedTextEncoder) -> None:
    """Every bucket of length 32 refused: 5 rows of 20 tokens pad to 48 (a graph, more padding),
    with the reference's result; every bucket of every length refused leaves the batch to eager."""
    torch.manual_seed(3)
    lengths = [20, 3, 17, 9, 20]
    embeds = torch.randn(5, 20, encoder.encoder.cfg.hidden_size)
    valid = torch.arange(20)[None, :] < torch.tensor(lengths)[:, None]
    refused = set(encoder.refused)
    encoder.refused |= {(b, 32) for b in BATCH_LADDER}
    try:
        assert encoder.plan(5, 20) == (16, 48)  # up to 16 rows a replay; 5 take the (8, 48) bucket
        with torch.inference_mode():
            expected = pool(encoder.encoder(embeds, valid).float(), valid)
            got = encoder(embeds, valid)
        assert got is not None
        assert (got - expected).abs().max().item() <= TOL
        assert (8, 48) in encoder.graphs
        encoder.refused |= {(b, t) for b in BATCH_LADDER for t in LENGTH_LADDER}
        assert encoder.plan(5, 20) is None and encoder(embeds, valid) is None
    finally:
        encoder.refused = refused


def test_a_full_pool_takes_a_longer_captured_bucket_over_many_one_row_replays(tiny_fp32: Path) -> None:
    """(64, 64) and (1, 32) captured, the pool then too full for another graph: 64 rows of 20 tokens run
    as one replay of (64, 64), not as 64 of (1, 32)."""
    model, _ = load_model(tiny_fp32, "cpu")
    budget = GraphPool(1 << 30)
    encoder = GraphedTextEncoder(model.language_model, 4096, pool=budget, token_bytes=1000, capture=False)
    encoder.capture_buckets([(64, 64), (1, 32)])
    # No room for another graph's executable, the overdraft spent too.
    budget.used = budget.budget + OVERDRAFT - GRAPH_EXECUTABLE + 1
    steps: list[tuple[int, int]] = []
    step = encoder._step
    encoder._step = lambda x, v: steps.append(tuple(x.shape[:2])) or step(x, v)  # type: ignore[method-assign]
    torch.manual_seed(4)
    embeds = torch.randn(64, 20, encoder.encoder.cfg.hidden_size)
    valid = torch.ones(64, 20, dtype=torch.bool)
    with torch.inference_mode():
        got = encoder(embeds, valid)
        expected = pool(encoder.encoder(embeds, valid).float(), valid)
    assert got is not None and (got - expected).abs().max().item() <= TOL
    assert steps == [(64, 64)], steps
    # A fresh pool, every bucket of 2 to 32 rows at length 32 refused: 3 rows take (4, 48), not the
    # captured (64, 32) they would be padded into (the rest is priced at the bucket it really takes).
    fresh = GraphedTextEncoder(
        model.language_model, 4096, pool=GraphPool(1 << 30), token_bytes=1000, capture=False
    )
    fresh.capture_buckets([(64, 32), (1, 32)])
    fresh.refused |= {(b, 32) for b in (2, 4, 8, 16, 32)}
    assert fresh.plan(3, 20) == (64, 48)
    with torch.inference_mode():
        fresh(embeds[:3], valid[:3])
    assert set(fresh.graphs) == {(64, 32), (1, 32), (4, 48)}


def _texts(n: int) -> list[Item]:
    return [Item((TextPart("word " * (3 + 7 * i % 50)),)) for i in range(n)]


def test_split_forwards_equal_one_forward(tiny_fp32: Path) -> None:
    whole = Engine.from_dir(tiny_fp32, device="cpu", options=EngineOptions(max_forward_tokens=None))
    split = Engine.from_dir(tiny_fp32, device="cpu", options=EngineOptions(max_forward_tokens=64))
    items = [whole.prepare(x, PrepareOptions()) for x in _texts(9)]
    assert len(list(split._chunks(items))) > 1
    a, b = whole.embed(items), split.embed(items)
    assert a.shape == b.shape == (9, 768)
    err = float(np.abs(a - b).max())
    assert err <= TOL, f"split vs one forward: max abs diff {err:.2e} > {TOL}"


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: torch uses one thread anyway")
def test_preparing_threads_run_torch_on_one_thread_and_the_model_thread_keeps_its_own(
    tiny_fp32: Path,
) -> None:
    """Items are prepared on many threads at once: each runs torch's CPU ops on one thread, while
    the threads that run the model keep the count the engine was built with."""
    engine = Engine.from_dir(tiny_fp32, device="cpu")
    before = torch.get_num_threads()
    with ThreadPoolExecutor(1, initializer=engine.init_prepare_thread) as pool:
        assert pool.submit(torch.get_num_threads).result() == 1
    assert engine._executor().submit(torch.get_num_threads).result() == 1, "the engine's own pool"
    assert torch.get_num_threads() == before > 1

    def embed_on_a_new_thread() -> int:  # it starts with one thread, as threads now do
        engine.embed([engine.prepare(_texts(1)[0], PrepareOptions())])
        return torch.get_num_threads()

    with ThreadPoolExecutor(1) as fresh:
        assert fresh.submit(embed_on_a_new_thread).result() == before, "the model's thread keeps its count"


def test_prepare_many_equals_prepare(tiny_fp32: Path) -> None:
    engine = Engine.from_dir(tiny_fp32, device="cpu")
    opts = PrepareOptions()
    items = [
        *_texts(3),
        Item((MediaPart("image", samples.png(64, 48)),)),
        Item((MediaPart("audio", b"not audio"),)),  # fails in its own slot
        Item((TextPart("a caption"), MediaPart("audio", samples.wav(1.0)))),
    ]
    many = engine.prepare_many(items, opts)
    assert isinstance(many[4], EG2Error)
    for i, got in enumerate(many):
        if i == 4:
            continue
        one = engine.prepare(items[i], opts)
        assert not isinstance(got, EG2Error)
        assert (got.modality, got.num_tokens) == (one.modality, one.num_tokens)
        assert torch.equal(got.inputs.input_ids, one.inputs.input_ids)
        for name in ("pixel_values", "input_features"):
            x, y = getattr(got.inputs, name), getattr(one.inputs, name)
            assert (x is None and y is None) or torch.equal(x, y)


def test_text_only_warmup_needs_no_media_libraries(tiny_fp32: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A text-only server boots where PyAV is not installed (found on the 2-GPU machine)."""
    import sys

    monkeypatch.setitem(sys.modules, "av", None)  # `import av` now raises ImportError
    engine = Engine.from_dir(tiny_fp32, device="cpu", modalities={"text"})
    assert list(engine._warmup_items()) == ["text"]
    assert engine.warm_up(max_batch_items=8, max_batch_tokens=4096) == {}  # no limits of its own on a CPU


def test_numpy_blas_is_single_threaded_and_torch_is_not(tiny_fp32: Path) -> None:
    """Preprocessing threads each get one BLAS thread (else 16 items x 16 BLAS threads thrash);
    torch's own thread pools, which run CPU inference, keep theirs."""
    from threadpoolctl import threadpool_info

    torch_threads = torch.get_num_threads()
    Engine.from_dir(tiny_fp32, device="cpu")
    numpy_blas = [i for i in threadpool_info() if "numpy" in i["filepath"] and i["user_api"] == "blas"]
    assert numpy_blas and all(i["num_threads"] == 1 for i in numpy_blas), numpy_blas
    assert torch.get_num_threads() == torch_threads


def test_the_model_thread_takes_the_cpu_threads_the_options_give(tiny_fp32: Path) -> None:
    """EngineOptions.cpu_threads sets the embedding thread's count (on a GPU it defaults to one:
    that thread only collates and copies there); unset on a CPU, every core stays the model's."""
    engine = Engine.from_dir(tiny_fp32, device="cpu", options=EngineOptions(cpu_threads=1))
    assert Engine.from_dir(tiny_fp32, device="cpu").cpu_threads == torch.get_num_threads()

    def embed_here() -> int:
        torch.set_num_threads(3)  # whatever the thread had before
        engine.embed([engine.prepare(_texts(1)[0], PrepareOptions())])
        return torch.get_num_threads()

    with ThreadPoolExecutor(1) as fresh:
        assert fresh.submit(embed_here).result() == 1


def test_the_fast_log_mel_gives_the_reference_paths_vectors(tiny_fp32: Path) -> None:
    """preprocess/audio.LogMel: torch's FFT (what serves) against the reference extractor's numpy
    arithmetic, through the whole model: a loud chirp and a tone, whose floor-level bins differ most."""
    engine = Engine.from_dir(tiny_fp32, device="cpu")
    t = np.arange(int(9.3 * 16_000)) / 16_000
    chirp = (0.9 * np.sin(2 * np.pi * (100 + 2000 * t) * t)).astype(np.float32)
    items = [Item((MediaPart("audio", wav, "wav"),)) for wav in (samples.wav(9.3), _wav(chirp))]

    def vectors() -> np.ndarray:
        prepared = engine.prepare_many(items, PrepareOptions())
        assert not any(isinstance(p, EG2Error) for p in prepared)
        return engine.embed(prepared)  # type: ignore[arg-type]

    fast = vectors()
    engine.preprocessor.log_mel.fast = False
    ref = vectors()
    assert not np.array_equal(fast, ref)  # FP32 on the CPU is deterministic: the paths did differ
    assert ((fast * ref).sum(axis=1) >= 0.99999).all(), (fast * ref).sum(axis=1)


def _wav(wave: np.ndarray) -> bytes:
    import io

    import soundfile as sf

    out = io.BytesIO()
    sf.write(out, wave, 16_000, format="WAV", subtype="FLOAT")
    return out.getvalue()
