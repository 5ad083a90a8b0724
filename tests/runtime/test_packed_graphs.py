"""The packed text graphs (packed_graphs.py) against the reference path, on the CPU with the tiny
checkpoint: each bucket's step runs eagerly here (the captured graphs are checked against the same
reference on the H200, tests/gpu/test_gpu.py). Buckets, runs of items, the pad tail and the pool's
refusals must not move a vector beyond float rounding."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
import torch

from eg2_runtime.graphs import GraphPool
from eg2_runtime.loader import load_model
from eg2_runtime.memory_plan import GRAPH_EXECUTABLE
from eg2_runtime.model import pool
from eg2_runtime.packed_graphs import FIRST_USE, MAX_ITEMS, TOKEN_LADDER, PackedTextGraphs, items_for, runs
from eg2_runtime.text import TextEncoder

TOL = 1e-5  # FP32


@pytest.fixture(scope="module")
def encoder(tiny_fp32: Path) -> TextEncoder:
    model, _ = load_model(tiny_fp32, "cpu")
    return model.language_model


def reference(encoder: TextEncoder, embeds: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The same items padded, through TextEncoder.forward and pool (the reference path)."""
    t = max(lengths)
    padded = torch.zeros(len(lengths), t, embeds.shape[-1])
    valid = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    padded[valid] = embeds
    return pool(encoder(padded, valid).float(), valid)


def check(graphs: PackedTextGraphs, lengths: list[int], seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    embeds = torch.randn(sum(lengths), graphs.encoder.cfg.hidden_size)
    with torch.inference_mode():
        expected = reference(graphs.encoder, embeds, lengths)
        got = graphs(embeds, lengths)
        again = graphs(embeds, lengths)  # the static buffers are reused: a second call still holds
    assert got.shape == expected.shape == (len(lengths), expected.shape[1])
    assert (got - expected).abs().max() < TOL
    assert torch.equal(got, again)
    return got


@pytest.mark.parametrize(
    ("lengths", "bucket"),
    [
        ([5], 32),  # one short item and a pad tail
        ([17, 3, 9], 32),  # three items, pad tail of 3
        ([40, 40], 128),  # longer than the tiny model's sliding window (8): the window inside items
        ([16, 16], 32),  # an exact bucket: no pad tail
        ([30, 30, 30, 30, 30], 192),  # 150 tokens: a pad tail of 42
    ],
)
def test_a_packed_bucket_equals_the_padded_reference(
    encoder: TextEncoder, lengths: list[int], bucket: int
) -> None:
    graphs = PackedTextGraphs(encoder, max_tokens=1024, capture=False)
    assert graphs.bucket(sum(lengths), len(lengths)) == bucket
    check(graphs, lengths)
    assert set(graphs.graphs) == {bucket}


def test_a_bucket_keeps_a_slot_for_its_pad_tail(encoder: TextEncoder) -> None:
    graphs = PackedTextGraphs(encoder, max_tokens=1024, capture=False)
    # 4 items of 7 tokens: 28 tokens fit 32, but 32 has items_for(32) = 4 slots, none left for the
    # pad tail of 4; the next rung has room.
    assert items_for(32) == 4
    assert graphs.bucket(28, 4) == 64
    assert graphs.bucket(32, 4) == 32  # exact: no pad tail
    check(graphs, [7, 7, 7, 7])


def test_runs_cut_by_items_and_tokens() -> None:
    assert list(runs([10] * 5, top=30)) == [(0, 3), (3, 5)]
    assert list(runs([50, 10, 10], top=30)) == [(0, 1), (1, 3)]  # too long alone: a run of its own
    assert list(runs([1] * (MAX_ITEMS + 3), top=10_000)) == [(0, MAX_ITEMS), (MAX_ITEMS, MAX_ITEMS + 3)]


def test_many_items_replay_in_runs_and_come_back_in_order(encoder: TextEncoder) -> None:
    graphs = PackedTextGraphs(encoder, max_tokens=256, capture=False)
    lengths = [(i * 7) % 23 + 1 for i in range(MAX_ITEMS + 20)]  # > MAX_ITEMS items, > 256 tokens
    check(graphs, lengths)
    assert len(graphs.graphs) >= 2


def eager_calls(graphs: PackedTextGraphs) -> list[list[int]]:
    """The item lengths of every eager forward `graphs` runs from now on (it still runs them)."""
    calls: list[list[int]] = []
    run = graphs.eager
    graphs.eager = lambda embeds, lengths: calls.append(list(lengths)) or run(embeds, lengths)  # type: ignore[method-assign]
    return calls


def test_an_item_past_every_bucket_runs_eagerly(encoder: TextEncoder) -> None:
    graphs = PackedTextGraphs(encoder, max_tokens=64, capture=False)
    calls = eager_calls(graphs)
    check(graphs, [100, 5, 3])  # the 100-token item alone, eagerly; the others in a bucket
    assert calls == [[100], [100]]  # once per call of check's two
    assert set(graphs.graphs) == {32}


def test_many_short_items_past_a_buckets_slots_are_halved_not_run_eagerly(encoder: TextEncoder) -> None:
    # 64 items of 3 tokens fit 256 tokens, but a 256-token bucket has items_for(256) = 32 slots.
    graphs = PackedTextGraphs(encoder, max_tokens=256, capture=False)
    calls = eager_calls(graphs)
    check(graphs, [3] * 64)
    assert calls == []
    assert max(graphs.graphs) <= 256


def test_with_no_bucket_at_all_the_batch_runs_in_one_eager_forward(encoder: TextEncoder) -> None:
    graphs = PackedTextGraphs(encoder, max_tokens=16, capture=False)  # below the first rung
    calls = eager_calls(graphs)
    check(graphs, [5, 9, 2])
    assert calls == [[5, 9, 2], [5, 9, 2]]


def test_rows_and_lengths_must_agree(encoder: TextEncoder) -> None:
    graphs = PackedTextGraphs(encoder, max_tokens=256, capture=False)
    with pytest.raises(ValueError, match="embedding rows"):
        graphs(torch.zeros(7, encoder.cfg.hidden_size), [3, 3])


def test_a_bucket_the_pool_refuses_hands_its_items_to_smaller_runs(encoder: TextEncoder) -> None:
    # 256 tokens cost 4 executables: after the 256-token bucket (5) the pool has room for three
    # more executables, not for a larger bucket's activations.
    pool = GraphPool(budget=8 * GRAPH_EXECUTABLE)
    token_bytes = GRAPH_EXECUTABLE // 64
    graphs = PackedTextGraphs(encoder, max_tokens=1024, pool=pool, token_bytes=token_bytes, capture=False)
    assert graphs.capture_buckets([256]) == 1
    lengths = [20] * 20  # 400 tokens: would take 512, then 384, both refused
    check(graphs, lengths)
    assert {384, 512} <= graphs.refused
    # Cut for 384 first (19 items and 1), then for 256: 12 items in 256, 7 in 192, the last in 32.
    assert set(graphs.graphs) == {256, 192, 32}


def test_the_ladder_is_sorted_and_its_top_rungs_hold_a_full_run_and_its_pad_tail() -> None:
    assert list(TOKEN_LADDER) == sorted(set(TOKEN_LADDER))
    assert all(items_for(n) == MAX_ITEMS + 1 for n in TOKEN_LADDER if n >= 8 * (MAX_ITEMS + 1))


def test_a_long_document_pads_by_at_most_an_eighth_and_the_start_up_set_skips_the_in_between_rungs(
    encoder: TextEncoder,
) -> None:
    """Between 2,048 and 4,096 tokens no rung is more than 1/8 above the one below it (a 2,200-token
    document runs 2,304, not 2,560); the in-between rungs are left to first use, so the start-up set
    holds none of them."""
    from eg2_runtime.engine import STARTUP_TOKEN_BUCKETS

    long = [n for n in TOKEN_LADDER if 2048 <= n <= 4096]
    assert all(b <= a * 9 / 8 for a, b in pairwise(long))
    assert PackedTextGraphs(encoder, max_tokens=4096, capture=False).bucket(2200, 1) == 2304
    assert not set(FIRST_USE) & set(STARTUP_TOKEN_BUCKETS)


def test_the_engine_packs_text_and_media_batches_as_the_padded_path_runs_them(tiny_fp32: Path) -> None:
    """Engine.forward with packed text (the valid ids end to end, media soft tokens scattered into
    that one row) against the same engine's padded path, on mixed batches."""
    from eg2_runtime import samples
    from eg2_runtime.engine import Engine
    from eg2_runtime.inputs import Item, MediaPart, PrepareOptions, TextPart

    engine = Engine.from_dir(tiny_fp32, device="cpu")
    batches = {
        "texts": [Item((TextPart("a short query"),)), Item((TextPart("a longer document " * 12),))],
        "images and text": [
            Item((MediaPart("image", samples.png(64, 48, 1)),)),
            Item((TextPart("between two images"),)),
            Item((TextPart("an image:"), MediaPart("image", samples.png(40, 70, 2)))),
        ],
        "clips": [Item((MediaPart("audio", samples.wav(s)),)) for s in (1.0, 0.4)],
    }
    for name, items in batches.items():
        prepared = [engine.prepare(x, PrepareOptions()) for x in items]
        padded = engine.embed(prepared)
        engine.packed = PackedTextGraphs(engine.model.language_model, max_tokens=512, capture=False)
        try:
            packed = engine.embed(prepared)
        finally:
            engine.packed = None
        assert packed.shape == padded.shape, name
        assert abs(packed - padded).max() < TOL, name


def test_the_warm_up_runs_packed_text_eagerly(tiny_fp32: Path) -> None:
    """Warm-up proves a full batch fits as a batch no bucket holds runs: the packed forward, eagerly."""
    from eg2_runtime.engine import Engine

    engine = Engine.from_dir(tiny_fp32, device="cpu", modalities={"text"})
    engine.packed = PackedTextGraphs(engine.model.language_model, max_tokens=512, capture=False)
    calls = eager_calls(engine.packed)
    engine.warm_up(2)
    assert calls and all(len(c) == 2 for c in calls)  # the costliest text, twice
    assert engine.packed.graphs == {}
