"""The tower graphs' padding (tower_graphs.py) against the towers unpadded, on the CPU with the tiny
FP32 checkpoint: the padded steps run eagerly here (`capture=False`); the capture itself needs a GPU.

Each case pads the item count up the ladder and, for audio, the frame count too; the soft tokens of
the real items must be those of the model's own functions, within float rounding.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from eg2_runtime import samples
from eg2_runtime.engine import Engine, EngineOptions
from eg2_runtime.graphs import GraphPool
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions, TextPart
from eg2_runtime.memory_plan import GRAPH_EXECUTABLE
from eg2_runtime.packed_graphs import PackedTextGraphs
from eg2_runtime.tower_graphs import FRAME_LADDER, GraphedTowers, _chunked

TOL = 1e-5  # FP32: padding must not move a real item's soft tokens beyond float rounding


@pytest.fixture(scope="module")
def engine(tiny_fp32: Path) -> Engine:
    return Engine.from_dir(tiny_fp32, device="cpu", options=EngineOptions(graph_max_tokens=0))


def _inputs(engine: Engine, items: list[Item]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    prepared = engine.prepare_many(items, PrepareOptions())
    return engine.device_batch([p.inputs for p in prepared])  # type: ignore[union-attr]


UNBOUNDED = {"vision_slots": 1 << 30, "audio_tokens": 1 << 30, "tower_slots": 1 << 30}


def _towers_and(
    engine: Engine, items: list[Item], *keys: str, **bounds: int
) -> tuple[GraphedTowers, list[torch.Tensor]]:
    """Fresh tower graphs run eagerly (bounds as the memory plan would set them, unbounded unless
    given), and the items' collated model inputs named `keys`."""
    _, inputs = _inputs(engine, items)
    return GraphedTowers(engine.model, capture=False, **(UNBOUNDED | bounds)), [inputs[k] for k in keys]


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape, (got.shape, expected.shape)
    err = (got - expected).abs().max().item()
    assert err <= TOL, f"max abs diff {err:.2e} > {TOL}"


# Each case runs both selections of the used rows: by the count the caller knows (no device sync),
# and by a boolean index (count None).
COUNTED = pytest.mark.parametrize("counted", [True, False], ids=["count", "no-count"])


@COUNTED
@pytest.mark.parametrize(
    "images",
    [
        [(64, 48)],  # one image: bucket 1, padding patches of its own (an aspect ratio off the grid)
        [(64, 48), (48, 64), (96, 96)],  # 3 -> bucket 4: a fully padded image
    ],
)
def test_image_buckets_equal_the_tower(engine: Engine, images: list[tuple[int, int]], counted: bool) -> None:
    items = [Item((MediaPart("image", samples.png(w, h, i)),)) for i, (w, h) in enumerate(images)]
    towers, (pixels, positions) = _towers_and(engine, items, "pixel_values", "image_position_ids")
    with torch.inference_mode():
        expected = engine.model.image_soft_tokens(pixels, positions)
        count = expected.shape[0] if counted else None
        got = towers.image_soft_tokens(pixels, positions, count)
        again = towers.image_soft_tokens(pixels, positions, count)  # static buffers reused
    _close(got, expected)
    assert torch.equal(got, again)
    towers.check_counts()
    assert [key[:2] for key in towers.graphs] == [("image", 1 if len(images) == 1 else 4)]  # padded to a rung


@COUNTED
@pytest.mark.parametrize(
    "seconds",
    [
        [1.0],  # one clip: frames padded up the ladder
        [2.5, 0.4, 1.3],  # 3 clips of different lengths -> bucket 4, each padded to the longest rung
    ],
)
def test_audio_buckets_equal_the_tower(engine: Engine, seconds: list[float], counted: bool) -> None:
    items = [Item((MediaPart("audio", samples.wav(s, hz=300 + 100 * i)),)) for i, s in enumerate(seconds)]
    towers, (features, mask) = _towers_and(engine, items, "input_features", "input_features_mask")
    with torch.inference_mode():
        expected = engine.model.audio_soft_tokens(features, mask)
        alone = engine.model.audio_soft_tokens(features[:1, :50], mask[:1, :50])
        got = towers.audio_soft_tokens(features, mask, expected.shape[0] if counted else None)
        smaller = towers.audio_soft_tokens(  # same bucket, shorter input
            features[:1, :50], mask[:1, :50], alone.shape[0] if counted else None
        )
    _close(got, expected)
    _close(smaller, alone)  # a buffer left holding a longer input is re-padded, not read
    towers.check_counts()
    (key,) = [k for k in towers.graphs if k[1] == (1 if len(seconds) == 1 else 4)]
    assert key[2] > features.shape[1]  # frames padded up the ladder too


@pytest.mark.parametrize("off", [-1, 1])
@pytest.mark.parametrize("kind", ["image", "audio"])
def test_a_count_other_than_the_towers_is_caught_after_the_batch(engine: Engine, off: int, kind: str) -> None:
    """A count the tower's used rows do not match (preprocessing and the tower disagreeing) still
    gives `count` rows, with no sync, and check_counts raises once for it; the flag is then gone. A
    count past every row there is raises at once (its padding index would be out of range)."""
    if kind == "image":
        items = [Item((MediaPart("image", samples.png(64 + 16 * i, 48, i)),)) for i in range(2)]
        towers, inputs = _towers_and(engine, items, "pixel_values", "image_position_ids")
        soft_tokens, reference = towers.image_soft_tokens, engine.model.image_soft_tokens
    else:
        items = [Item((MediaPart("audio", samples.wav(0.5 + i, hz=300 + 50 * i)),)) for i in range(2)]
        towers, inputs = _towers_and(engine, items, "input_features", "input_features_mask")
        soft_tokens, reference = towers.audio_soft_tokens, engine.model.audio_soft_tokens
    with torch.inference_mode():
        n = reference(*inputs).shape[0]
        assert soft_tokens(*inputs, n + off).shape[0] == n + off
        soft_tokens(*inputs, n)  # a right one after does not clear it
        with pytest.raises(ValueError, match="more soft tokens than"):
            soft_tokens(*inputs, 1 << 20)
    with pytest.raises(ValueError, match="placeholders ask for"):
        towers.check_counts()
    towers.check_counts()


def test_the_engine_checks_the_towers_count_after_each_batch(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine.embed through graphed towers whose tower uses one slot fewer than the placeholders ask
    for: the batch fails with the count's error instead of returning a vector built on a wrong row;
    the next batch, with the tower right again, succeeds."""
    towers = GraphedTowers(engine.model, capture=False, **UNBOUNDED)
    step = towers._image_step

    def one_short(pixels: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        soft, used = step(pixels, positions)
        used = used.clone()
        used[0, used[0].nonzero()[-1]] = False  # the first image's last used slot
        return soft, used

    monkeypatch.setattr(engine, "towers", towers)
    prepared = engine.prepare_many([Item((MediaPart("image", samples.png(64, 48)),))], PrepareOptions())
    with monkeypatch.context() as m:
        m.setattr(towers, "_image_step", one_short)
        with pytest.raises(ValueError, match="placeholders ask for"):
            engine.embed(prepared)  # type: ignore[arg-type]
    assert engine.embed(prepared).shape == (1, 768)  # type: ignore[arg-type]
    # A batch that fails after its towers ran leaves their flag unchecked: the next batch must not
    # inherit it.
    scatter = engine.model.input_embeddings

    def then_fails(*args: object, **kwargs: object) -> torch.Tensor:
        scatter(*args, **kwargs)  # type: ignore[arg-type]
        raise RuntimeError("the text encoder failed")

    with monkeypatch.context() as m:
        m.setattr(towers, "_image_step", one_short)
        m.setattr(engine.model, "input_embeddings", then_fails)
        with pytest.raises(RuntimeError, match="text encoder failed"):
            engine.embed(prepared)  # type: ignore[arg-type]
    assert towers.miscount is not None, "the failed batch left its flag"
    assert engine.embed(prepared).shape == (1, 768)  # type: ignore[arg-type]


def test_input_embeddings_through_the_towers(engine: Engine) -> None:
    """Interleaved text, image, audio and video: the text encoder's input is the same either way."""
    item = Item(
        (
            TextPart("a photo and a sound"),
            MediaPart("image", samples.png(64, 48)),
            MediaPart("audio", samples.wav(0.8)),
            MediaPart("video", samples.mp4(2)),
        )
    )
    ids, inputs = _inputs(engine, [item, Item((TextPart("only text"),))])
    inputs.pop("attention_mask")
    towers = GraphedTowers(engine.model, capture=False, **UNBOUNDED)
    counts: list[int | None] = []  # what each selection was given: the placeholders' count
    select = towers._select

    def counting(parts: list[tuple[torch.Tensor, torch.Tensor]], count: int | None) -> torch.Tensor:
        counts.append(count)
        return select(parts, count)

    with torch.inference_mode():
        expected = engine.model.input_embeddings(ids, **inputs)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(towers, "_select", counting)
            got = engine.model.input_embeddings(ids, **inputs, towers=towers)
    _close(got, expected)
    towers.check_counts()
    cfg = engine.model.config
    placeholders = [
        int((ids == t).sum()) for t in (cfg.image_token_id, cfg.video_token_id, cfg.audio_token_id)
    ]
    assert counts == placeholders, "each tower is given its placeholders' count (image, video, audio)"


@COUNTED
def test_batches_past_the_largest_bucket_run_as_several(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, counted: bool
) -> None:
    """The memory plan bounds the buckets, not the batches: 5 images whose bound fits 2 run as
    buckets of 2, 2 and 1; clips likewise; and an image no bucket holds runs eagerly in chunks of at
    most `tower_slots` patch slots. Every way gives the tower's own soft tokens, in order."""
    images = [Item((MediaPart("image", samples.png(64 + 16 * i, 48, i)),)) for i in range(5)]
    towers, (pixels, positions) = _towers_and(engine, images, "pixel_values", "image_position_ids")
    s = pixels.shape[1]
    towers.vision_slots = 2 * s
    bounds = UNBOUNDED | {"vision_slots": s - 1, "tower_slots": 2 * s}
    eager = GraphedTowers(engine.model, capture=False, **bounds)
    clips = [Item((MediaPart("audio", samples.wav(0.3 + 0.4 * i, hz=300 + 50 * i)),)) for i in range(3)]
    audio, (features, mask) = _towers_and(engine, clips, "input_features", "input_features_mask")
    frames = min(f for f in FRAME_LADDER if f >= features.shape[1])
    audio.audio_tokens = frames // 4  # one clip per bucket
    calls: list[int] = []  # images per eager tower call
    tower = engine.model.image_soft_tokens

    def count_calls(p: torch.Tensor, q: torch.Tensor, count: int | None = None) -> torch.Tensor:
        calls.append(p.shape[0])
        return tower(p, q)

    with torch.inference_mode():
        expected = tower(pixels, positions)
        clips = engine.model.audio_soft_tokens(features, mask)
        # With a count, the parts are selected after the last replay: each earlier part must have
        # been copied out of its bucket's outputs, which the next replay of that bucket overwrites.
        n, n_clips = (expected.shape[0], clips.shape[0]) if counted else (None, None)
        _close(towers.image_soft_tokens(pixels, positions, n), expected)
        monkeypatch.setattr(engine.model, "image_soft_tokens", count_calls)
        _close(eager.image_soft_tokens(pixels, positions, n), expected)
        _close(audio.audio_soft_tokens(features, mask, n_clips), clips)
    for t in (towers, eager, audio):
        t.check_counts()
    assert calls == [2, 2, 1], "eager tower calls of at most tower_slots patch slots"
    assert sorted(k[1] for k in towers.graphs) == [1, 2], "5 images run as 2 + 2 + 1"
    assert not eager.graphs, "no bucket holds an image: the tower runs eagerly"
    assert [k[1] for k in audio.graphs] == [1], "one clip per bucket"


def test_a_bucket_the_pool_refuses_hands_its_items_to_smaller_ones(engine: Engine) -> None:
    """A pool whose budget holds 2 images' patch slots and two graphs' executables: 5 images the plan's bound allows in one
    bucket of 8 run as buckets of 2, 2 and 1 (not as a refused bucket of 8 padded and run eagerly);
    a clip bucket the pool refuses at every size leaves the clips to the eager tower, unpadded."""
    images = [Item((MediaPart("image", samples.png(64 + 16 * i, 48, i)),)) for i in range(5)]
    _, (pixels, positions) = _towers_and(engine, images, "pixel_values", "image_position_ids")
    s = pixels.shape[1]
    slot = GRAPH_EXECUTABLE // s + 1  # a patch slot's bytes: an image's slots outweigh an executable
    towers = GraphedTowers(
        engine.model,
        capture=False,
        pool=GraphPool(2 * GRAPH_EXECUTABLE + 2 * s * slot),
        slot_bytes=slot,
        **UNBOUNDED,
    )
    clips = [Item((MediaPart("audio", samples.wav(0.3 + 0.4 * i, hz=300 + 50 * i)),)) for i in range(3)]
    _, (features, mask) = _towers_and(engine, clips, "input_features", "input_features_mask")
    audio = GraphedTowers(engine.model, capture=False, pool=GraphPool(0), audio_token_bytes=1000, **UNBOUNDED)
    with torch.inference_mode():
        _close(towers.image_soft_tokens(pixels, positions), engine.model.image_soft_tokens(pixels, positions))
        _close(audio.audio_soft_tokens(features, mask), engine.model.audio_soft_tokens(features, mask))
    assert sorted(k[1] for k in towers.graphs) == [1, 2], "5 images run as 2 + 2 + 1"
    assert {("image", 8, s), ("image", 4, s)} <= towers.refused
    assert not audio.graphs and audio.refused, "every clip bucket refused: the tower runs eagerly"
    gap = GraphedTowers(engine.model, capture=False, **UNBOUNDED)
    gap.refused.add(("image", 4, s))  # 3 images' own rung refused, 8 still open
    with torch.inference_mode():
        _close(
            gap.image_soft_tokens(pixels[:3], positions[:3]),
            engine.model.image_soft_tokens(pixels[:3], positions[:3]),
        )
    assert sorted(k[1] for k in gap.graphs) == [1, 2], "2 + 1, not 3 padded to 8"


def test_an_eager_chunk_out_of_memory_runs_again_in_halves(engine: Engine) -> None:
    """The eager tower's chunks of a video's frames: a chunk the allocator refuses runs again in
    halves (the frames are independent), with the same soft tokens; one frame that does not fit
    raises, and so does any chunk when retrying is off (the warm-up)."""
    images = [Item((MediaPart("image", samples.png(64, 48, i)),)) for i in range(5)]
    _, (pixels, positions) = _towers_and(engine, images, "pixel_values", "image_position_ids")
    sizes: list[int] = []

    def tight(p: torch.Tensor, q: torch.Tensor, most: int = 2) -> torch.Tensor:  # room for 2 images
        sizes.append(p.shape[0])
        if p.shape[0] > most:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return engine.model.image_soft_tokens(p, q)

    with torch.inference_mode():
        _close(_chunked(tight, 5, 4, pixels, positions), engine.model.image_soft_tokens(pixels, positions))
        assert sizes == [4, 2, 2, 1], "4 refused, then halves: 2 + 2 + 1"
        with pytest.raises(torch.OutOfMemoryError):
            _chunked(partial(tight, most=0), 5, 4, pixels, positions)
        with pytest.raises(torch.OutOfMemoryError):  # the warm-up proves the planned chunk: no retry
            _chunked(tight, 5, 4, pixels, positions, retry=False)


def test_start_up_captures_count_by_kind_and_defer_what_leaves_no_room(engine: Engine) -> None:
    """The towers' start-up graphs count their whole estimates under their own kinds (a text graph's
    blocks do not hold them). One that would leave no room for the executables of the captures after
    it is deferred to its first use, not refused for good, and no other bucket stands in for it."""
    slot, token = 1 << 10, 1 << 12
    pool = GraphPool(None)
    towers = GraphedTowers(
        engine.model, capture=False, pool=pool, slot_bytes=slot, audio_token_bytes=token, **UNBOUNDED
    )
    towers.capture_startup(70, audio=True, then=4)
    assert set(pool.largest) == {"image", "audio"} and not towers.refused
    image = next(k for k in towers.graphs if k[0] == "image")
    # A pool with room for the image graph, but not beside four executables to follow.
    tight = GraphPool(image[1] * image[2] * slot + 2 * GRAPH_EXECUTABLE)
    towers = GraphedTowers(engine.model, capture=False, pool=tight, slot_bytes=slot, **UNBOUNDED)
    towers.capture_startup(70, audio=False, then=4)
    assert not towers.graphs and not towers.refused and towers.deferred == {image}, "passed over"
    towers.capture_startup(70, audio=False)
    assert set(towers.graphs) == {image} and not towers.deferred, "with nothing to follow it fits"


def test_graph_stats_count_the_buckets_and_the_pool(engine: Engine) -> None:
    """Engine.graph_stats over real text and tower graph sets on one pool: the buckets the pool refused,
    those deferred (a deferred bucket later taken leaves the count), the pool counted once with its
    budget; stand-ins (capture off) count as no bucket captured."""
    images = [Item((MediaPart("image", samples.png(64 + 16 * i, 48, i)),)) for i in range(5)]
    _, (pixels, positions) = _towers_and(engine, images, "pixel_values", "image_position_ids")
    s = pixels.shape[1]
    slot = GRAPH_EXECUTABLE // s + 1
    budget = 2 * GRAPH_EXECUTABLE + 2 * s * slot  # holds buckets of 1 and 2 images, not 4 or 8
    pool = GraphPool(budget)
    towers = GraphedTowers(engine.model, capture=False, pool=pool, slot_bytes=slot, **UNBOUNDED)
    text = PackedTextGraphs(engine.model.language_model, 256, pool=pool, token_bytes=1)
    assert engine.towers is None and engine.graphs is None and engine.packed is None  # a CPU engine
    empty = engine.graph_stats()
    assert isinstance(empty["capture_seconds"], float), "a JSON number with a point in /info"
    assert empty == {
        "captured": 0,
        "refused": 0,
        "deferred": 0,
        "capture_seconds": 0.0,
        "pool_used_bytes": 0,
        "pool_budget_bytes": 0,
    }
    engine.towers, engine.packed = towers, text
    try:
        towers.deferred |= {("image", 1, s), ("image", 16, s)}  # left to first use by a start-up set
        with torch.inference_mode():
            towers.image_soft_tokens(pixels, positions)  # 2 + 2 + 1: the bucket of 1 is taken now
        text.deferred.add(64)
        stats = engine.graph_stats()
    finally:
        engine.towers = engine.packed = None
    assert stats["captured"] == 0, "stand-ins (capture off) are no graphs"
    assert len(towers.graphs) == 2 and stats["refused"] == len(towers.refused) >= 2, (stats, towers.refused)
    assert stats["deferred"] == 2, "the 16-image bucket and the text one; the bucket of 1 was taken"
    assert stats["pool_budget_bytes"] == budget, "one pool, shared: counted once"
    assert stats["pool_used_bytes"] == pool.used > 0, stats
    assert stats["capture_seconds"] == towers.capture_seconds + text.capture_seconds > 0, stats
