"""The dynamic batcher: token budget, grouping, one GPU thread, OOM splitting, fault isolation, dropping
the dead, admission. Unit tests drive `Batcher` directly on an event loop; the HTTP ones use a live
uvicorn and read the evidence from /metrics, as an operator would."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.batcher import INLINE_MAX_ITEMS, STREAM_STEP_SPANS, Batcher, step_size
from app.errors import Overloaded, classify
from app.metrics import Metrics
from app.queues import Embedded
from eg2_runtime.api import Estimate
from eg2_runtime.errors import EngineOutOfMemory, InputTooLargeError
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions, Segments, TextPart
from tests.support.fake_engine import (
    FORWARD_BUG,
    PREPARE_BUG,
    FakeEngine,
    assert_error,
    live,
    make_settings,
    media_bytes,
)

T = TypeVar("T")
OPTS = PrepareOptions()


def items(*texts: str) -> list[Item]:
    return [Item((TextPart(t),)) for t in texts]


def words(n: int, tag: str) -> str:
    """A text of n + 2 tokens for the FakeEngine (BOS/EOS), unique by tag."""
    return " ".join([tag] + ["w"] * (n - 1))


def run(
    engine: FakeEngine, body: Callable[[Batcher], Coroutine[Any, Any, T]], timeout: float = 20, **kw: Any
) -> T:
    """Run body(batcher) on a fresh loop, with a started batcher, bounded in time."""
    args: dict[str, Any] = {
        "max_batch_tokens": 1000,
        "max_batch_items": 8,
        "max_queue_delay_s": 0.002,
        "max_request_gather_s": 0.05,  # the setting's default
        "max_queued_items": 1000,
        "preprocess_workers": 2,
        "stall_timeout_s": 60,
        "inline_prepare_chars": 0,
        "max_request_tokens": 1_000_000,
        "max_prepared_media_tokens": 1_000_000,
    }
    args.update(kw)

    async def main() -> T:
        batcher = Batcher(engine, Metrics(), **args)
        batcher.start()
        try:
            result = await asyncio.wait_for(body(batcher), timeout)
            # Whatever happened to the requests, nothing is left counted as admitted or in preprocessing.
            await until(lambda: batcher.admitted == 0 and not +batcher._preparing)
            return result
        finally:
            engine.release()
            await batcher.close()

    return asyncio.run(main())


async def until(predicate: Callable[[], bool], timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def hold_the_gpu(b: Batcher, engine: FakeEngine) -> asyncio.Task[Embedded]:
    """Stall the engine on a first batch: the scheduler waits on it, so whatever is sent next is
    queued before any of its batches forms, whatever the timing of the preprocess threads."""
    engine.stall()
    busy = asyncio.create_task(b.embed(items("occupies the gpu"), OPTS))
    await until(lambda: len(engine.batches) == 1)
    return busy


async def queue_then_run(
    b: Batcher, engine: FakeEngine, *requests: list[Item], one_by_one: bool = True
) -> None:
    """With the GPU held, send `requests`: one by one, each wholly queued before the next is sent (so
    they join the line in this order), or all at once; then let the GPU go and wait for every answer."""
    busy = await hold_the_gpu(b, engine)
    tasks = []
    for request in requests:
        n = b.queued() + len(request)
        tasks.append(asyncio.create_task(b.embed(request, OPTS)))
        if one_by_one:
            await until(lambda n=n: b.queued() == n)  # type: ignore[misc]
    total = sum(map(len, requests))
    await until(lambda: b.queued() == total)
    engine.release()
    await asyncio.gather(busy, *tasks)


def settled(b: Batcher, engine: FakeEngine, n: int) -> Callable[[], bool]:
    """All n items prepared and either queued or handed to the (stalled) engine."""
    return lambda: b.queued() + sum(len(x) for x in engine.batches) == n


def check_rows(result: Embedded, texts: list[str]) -> None:
    np.testing.assert_array_equal(result.vectors, np.stack([FakeEngine.expected(t) for t in texts]))


# --- batch formation -------------------------------------------------------------------------------


def test_token_budget_and_item_cap() -> None:
    engine = FakeEngine()
    texts = [
        words(n, f"t{i}") for i, n in enumerate([300, 10, 250, 40, 700, 5, 120, 90, 60, 999, 3, 1500] * 3)
    ]

    async def body(b: Batcher) -> list[Embedded]:
        engine.stall()  # let everything queue up, so batches are formed from a full queue
        tasks = [asyncio.create_task(b.embed(items(t), OPTS)) for t in texts]
        await until(settled(b, engine, len(texts)))
        engine.release()
        return await asyncio.gather(*tasks)

    results = run(engine, body, max_batch_tokens=1000, max_batch_items=8)
    for text, result in zip(texts, results, strict=True):
        check_rows(result, [text])
    for batch in engine.batches:
        cost = sum(p.cost for p in batch)
        assert len(batch) <= 8
        assert cost <= 1000 or len(batch) == 1, f"batch of {len(batch)} items costs {cost}"
    assert sorted(t for b in engine.batches for t in (p.inputs[1] for p in b)) == sorted(texts)
    assert max(len(b) for b in engine.batches) > 1, "items were never batched together"


def test_groups_items_of_similar_cost() -> None:
    engine = FakeEngine()
    short = [words(5, f"s{i}") for i in range(8)]
    long = [words(200, f"l{i}") for i in range(8)]
    interleaved = [t for pair in zip(short, long, strict=True) for t in pair]

    async def body(b: Batcher) -> None:
        await queue_then_run(b, engine, *(items(t) for t in interleaved), one_by_one=False)

    run(engine, body, max_batch_tokens=5000, max_batch_items=8)
    batches = engine.batches[1:]
    mixed = [b for b in batches if len({p.cost > 100 for p in b}) > 1]
    assert not mixed, f"short and long items batched together: {[[p.cost for p in b] for b in mixed]}"
    assert sorted(len(b) for b in batches) == [8, 8], [[p.cost for p in b] for b in batches]


def test_a_request_of_many_batches_takes_turns_with_the_ones_behind_it() -> None:
    """40 texts of 100 tokens, 8 to a batch (5 batches), then a one-line query: the query runs in the
    batch after the big request's first, not behind all five (plain first-in-first-out)."""
    engine = FakeEngine()
    big = [words(100, f"b{i}") for i in range(40)]

    async def body(b: Batcher) -> None:
        await queue_then_run(b, engine, items(*big), items("a short query"))

    run(engine, body, max_batch_tokens=1000, max_batch_items=8)
    texts = [[p.inputs[1] for p in batch] for batch in engine.batches[1:]]
    assert sorted(len(t) for t in texts) == [1, 8, 8, 8, 8, 8], texts
    at = next(i for i, t in enumerate(texts) if "a short query" in t)
    assert at == 1, f"the query ran in batch {at + 1} of {len(texts)}: {texts}"


def test_the_request_in_front_runs_its_turn_and_the_others_fill_what_is_left() -> None:
    """A bulk request (40 texts), then a request of 8 texts of other lengths, then a query, 8 to a
    batch. Each batch is one request's turn: bulk, then the 8 (not bulk items closer in cost to its
    first), then the query with bulk items filling the rest of its batch."""
    engine = FakeEngine()
    bulk = [words(100, f"b{i}") for i in range(40)]
    eight = [words(n, f"e{i}") for i, n in enumerate([3, 200, 7, 150, 5, 90, 120, 60])]

    async def body(b: Batcher) -> None:
        await queue_then_run(b, engine, items(*bulk), items(*eight), items("a short query"))

    run(engine, body, max_batch_tokens=100_000, max_batch_items=8)
    batches = [[p.inputs[1] for p in batch] for batch in engine.batches[1:]]
    assert [len(x) for x in batches] == [8, 8, 8, 8, 8, 8, 1], batches
    assert all(t.startswith("b") for t in batches[0]), batches[0]
    assert sorted(batches[1]) == sorted(eight), batches[1]
    assert "a short query" in batches[2], batches[2]


def test_a_request_of_many_batches_does_not_hold_another_modality_behind_it() -> None:
    """40 texts (5 batches) queued before an image: the image runs after the texts' first batch, not
    after all five."""
    engine = FakeEngine()
    bulk = [words(100, f"b{i}") for i in range(40)]

    async def body(b: Batcher) -> None:
        await queue_then_run(b, engine, items(*bulk), [image(0.0)])

    run(engine, body, max_batch_tokens=1000, max_batch_items=8)
    kinds = [batch[0].modality for batch in engine.batches[1:]]
    assert kinds.index("image") == 1, kinds


def test_requests_behind_the_front_fill_its_batch_in_rounds() -> None:
    """A query, then a bulk request (40 texts of the query's length), then three short queries, 8 to a
    batch: the short ones fill the first batch beside the bulk request's first items (one item of
    each request a round), though the bulk items are closer in cost to the query."""
    engine = FakeEngine()
    bulk = [words(100, f"b{i}") for i in range(40)]
    short = [words(3, f"s{i}") for i in range(3)]

    async def body(b: Batcher) -> None:
        await queue_then_run(b, engine, items(words(100, "q")), items(*bulk), *(items(t) for t in short))

    run(engine, body, max_batch_tokens=100_000, max_batch_items=8)
    first = {p.inputs[1] for p in engine.batches[1]}
    assert set(short) <= first, sorted(t.split()[0] for t in first)


def test_two_requests_that_fit_one_batch_together_share_it() -> None:
    """Two requests of 4 images, 8 to a batch: one batch of 8, not a batch each."""
    engine = SlowMedia()

    async def body(b: Batcher) -> None:
        await queue_then_run(b, engine, *([image(0.01 * (i + 1))] * 4 for i in range(2)), one_by_one=False)

    run(engine, body, preprocess_workers=8, max_batch_items=8, max_batch_tokens=8 * 284)
    assert image_batches(engine) == [8]


def test_requests_that_fit_a_batch_each_run_in_arrival_order_not_interleaved() -> None:
    """Two requests of 4 images whose decodes finish alternately (A B A B ...), 4 to a batch: each
    request runs as one batch, rather than both waiting for two mixed batches."""
    engine = SlowMedia()
    first = [image(0.02 + 0.04 * i) for i in range(4)]
    second = [image(0.04 + 0.04 * i) for i in range(4)]

    async def body(b: Batcher) -> None:
        await queue_then_run(b, engine, first, second, one_by_one=False)

    run(engine, body, preprocess_workers=8, max_batch_items=4, max_batch_tokens=4 * 284)
    seeds = [{engine.seed_of(x, OPTS.prompt) for x in request} for request in (first, second)]
    batches = [{p.inputs[0] for p in batch} for batch in engine.batches if batch[0].modality == "image"]
    assert sorted(map(sorted, batches)) == sorted(map(sorted, seeds)), "the requests' images were mixed"


def test_queue_delay_waits_for_companions_in_preprocessing() -> None:
    # One preprocessing thread, 50 ms per item: the second request's item is still being prepared
    # when the first one's is queued, so the first waits for it and both share a batch.
    engine = FakeEngine(prepare_delay_s=0.05)

    async def body(b: Batcher) -> None:
        await asyncio.gather(b.embed(items("first"), OPTS), b.embed(items("second"), OPTS))

    run(engine, body, max_queue_delay_s=0.3, preprocess_workers=1)
    assert engine.batch_sizes() == [2]


def test_a_lone_request_does_not_wait_out_the_queue_delay() -> None:
    engine = FakeEngine()

    async def body(b: Batcher) -> float:
        start = time.monotonic()
        await b.embed(items("alone"), OPTS)
        return time.monotonic() - start

    elapsed = run(engine, body, max_queue_delay_s=1.0)
    assert elapsed < 0.5, f"a lone request waited {elapsed:.2f} s for companions that were not coming"
    assert engine.batch_sizes() == [1]


class SlowMedia(FakeEngine):
    """Each media item decodes for as many seconds as its bytes say (b"0.1": 100 ms)."""

    def prepare_many(self, items: Any, options: PrepareOptions, cancel: Any = None) -> Any:
        for item in items:
            if item.modality != "text":
                time.sleep(float(media_bytes(item)))
        return super().prepare_many(items, options, cancel)


def image(seconds: float) -> Item:
    return Item((MediaPart("image", str(seconds).encode()),))


def image_batches(engine: FakeEngine) -> list[int]:
    return [len(b) for b in engine.batches if b[0].modality == "image"]


@pytest.mark.parametrize("gather_s", [1.0, 0.0])
def test_a_requests_images_wait_for_each_other_in_one_batch(gather_s: float) -> None:
    """12 images of one call on 4 threads, 30 ms each, arrive in three waves: the request gather runs
    them as one batch; without it the batcher runs each wave as it comes."""
    engine = SlowMedia()

    async def body(b: Batcher) -> tuple[Embedded, float]:
        start = time.monotonic()
        return await b.embed([image(0.03)] * 12, OPTS), time.monotonic() - start

    result, elapsed = run(
        engine,
        body,
        max_request_gather_s=gather_s,
        preprocess_workers=4,
        max_batch_items=16,
        max_batch_tokens=16 * 284,
    )
    assert result.vectors.shape == (12, 768)
    if gather_s:
        assert image_batches(engine) == [12]
        assert elapsed < 0.6, f"{elapsed:.2f} s: the batch waited past its last image"
    else:
        assert len(image_batches(engine)) >= 3, image_batches(engine)


def test_a_gathered_batch_runs_once_its_own_requests_items_are_in() -> None:
    """Another request's image still decoding (500 ms) does not hold back a batch whose request has all
    its items queued."""
    engine = SlowMedia()

    async def body(b: Batcher) -> float:
        start = time.monotonic()
        other = asyncio.create_task(b.embed([image(0.5)], OPTS))
        await b.embed([image(0.03)] * 4, OPTS)
        waited = time.monotonic() - start
        await other
        return waited

    waited = run(engine, body, max_request_gather_s=1.0, preprocess_workers=5, max_batch_tokens=8 * 284)
    assert image_batches(engine) == [4, 1]
    assert waited < 0.3, f"the four images waited {waited:.2f} s"


@pytest.mark.parametrize("limit", [{"max_batch_tokens": 13 * 284}, {"max_batch_items": 13}])
def test_a_request_that_needs_two_batches_does_not_hold_its_first(limit: dict[str, int]) -> None:
    """16 images in two waves of 8 (the second 1 s later), 13 to a batch by tokens or by count: the
    first wave runs at once rather than waiting to fill its batch from the second; the second wave,
    which fits one batch, runs as one."""
    starts: list[float] = []

    class Timed(SlowMedia):
        def embed(self, batch: Any) -> Any:
            starts.append(time.monotonic())
            return super().embed(batch)

    engine = Timed()

    async def body(b: Batcher) -> float:
        start = time.monotonic()
        await b.embed([image(0.0)] * 8 + [image(1.0)] * 8, OPTS)
        return start

    start = run(
        engine,
        body,
        **({"max_batch_tokens": 64 * 284, "max_batch_items": 64} | limit),
        max_request_gather_s=2.0,
        preprocess_workers=16,
        max_queue_delay_s=0.1,
    )
    assert image_batches(engine) == [8, 8]
    assert starts[0] - start < 0.5, f"the first batch started after {starts[0] - start:.2f} s"


def test_a_request_decoding_one_item_at_a_time_gathers_an_even_share_per_batch() -> None:
    """16 images done 40 ms apart, 13 to a batch: two batches of 8, neither single items as they come
    nor 13 held for the rest and then 3."""
    engine = SlowMedia()

    async def body(b: Batcher) -> Embedded:
        return await b.embed([image(0.04 * i) for i in range(16)], OPTS)

    result = run(
        engine,
        body,
        max_request_gather_s=2.0,
        preprocess_workers=16,
        max_batch_items=13,
        max_batch_tokens=64 * 284,
    )
    assert result.vectors.shape == (16, 768)
    assert image_batches(engine) == [8, 8]


def test_a_batch_that_can_take_no_more_does_not_gather() -> None:
    """One image to a batch (284 of 500 tokens): the first runs at once, not after the second
    decodes (300 ms), which could not join it."""
    engine = SlowMedia()

    async def body(b: Batcher) -> Embedded:
        return await b.embed([image(0.0), image(0.3), image(0.3)], OPTS)

    result = run(engine, body, max_request_gather_s=1.0, preprocess_workers=3, max_batch_tokens=500)
    assert image_batches(engine) == [1, 1, 1]
    assert result.queue_s < 0.15, f"an image waited {result.queue_s:.2f} s for one that could not join it"


def test_the_request_gather_stops_at_its_limit() -> None:
    """One thread, 100 ms an image: each image waits 50 ms for the next, then runs without it."""
    engine = SlowMedia()

    async def body(b: Batcher) -> Embedded:
        return await b.embed([image(0.1)] * 3, OPTS)

    result = run(engine, body, max_request_gather_s=0.05, preprocess_workers=1)
    assert image_batches(engine) == [1, 1, 1]
    assert result.queue_s >= 0.04, f"the images waited {result.queue_s:.3f} s: no gather"


def test_another_modality_runs_while_a_request_gathers() -> None:
    """An image waits for its request's second (400 ms to decode); a text queued meanwhile runs at
    once, and the two images still share one batch."""
    engine = SlowMedia()

    async def body(b: Batcher) -> float:
        slow = asyncio.create_task(b.embed([image(0.0), image(0.4)], OPTS))
        await until(lambda: b.queued() == 1)  # the first image, waiting for the second
        start = time.monotonic()
        await b.embed(items("meanwhile"), OPTS)
        waited = time.monotonic() - start
        await slow
        return waited

    waited = run(engine, body, max_request_gather_s=1.0, inline_prepare_chars=100)
    assert [(b[0].modality, len(b)) for b in engine.batches] == [("text", 1), ("image", 2)]
    assert waited < 0.3, f"the text waited {waited:.2f} s behind the image's gather"


def test_a_request_ending_mid_gather_frees_the_items_behind_it() -> None:
    """Another request's image waits in the gathering batch; when the gathering request is cancelled,
    that image runs at once rather than at the gather's end."""
    engine = SlowMedia()

    async def body(b: Batcher) -> float:
        gathering = asyncio.create_task(b.embed([image(0.0), image(0.5)], OPTS))
        await until(lambda: b.queued() == 1)
        behind = asyncio.create_task(b.embed([image(0.01)], OPTS))
        await until(lambda: b.queued() == 2)
        start = time.monotonic()
        gathering.cancel()
        await behind
        return time.monotonic() - start

    waited = run(engine, body, max_request_gather_s=2.0)
    assert waited < 0.3, f"the image behind waited {waited:.2f} s after the gathering request ended"
    assert image_batches(engine) == [1]


def test_a_request_larger_than_the_media_budget_is_not_held_by_the_gather() -> None:
    """Four images with room for two decoded at once (284 tokens each): the others cannot start
    until the first two are embedded, so the first batch goes without them, not after the gather."""
    engine = SlowMedia()

    async def body(b: Batcher) -> float:
        start = time.monotonic()
        await b.embed([image(0.01)] * 4, OPTS)
        return time.monotonic() - start

    elapsed = run(engine, body, max_request_gather_s=2.0, max_prepared_media_tokens=2 * 284)
    assert image_batches(engine) == [2, 2]
    assert elapsed < 1.0, f"{elapsed:.2f} s: a batch waited out the gather for items not yet started"


def test_exactly_one_gpu_thread_and_preprocessing_overlaps() -> None:
    engine = FakeEngine(prepare_delay_s=0.002)

    async def body(b: Batcher) -> None:
        engine.stall()
        first = asyncio.create_task(b.embed(items("gpu busy"), OPTS))
        await until(lambda: len(engine.batches) == 1)
        # The GPU is busy: preprocessing of later requests still runs meanwhile.
        rest = [
            asyncio.create_task(b.embed(items(*(f"r{i}-{j}" for j in range(4))), OPTS)) for i in range(10)
        ]
        await until(lambda: engine.prepare_calls == 41)
        assert len(engine.batches) == 1
        engine.release()
        await asyncio.gather(first, *rest)
        assert engine.embed_threads == b.gpu_thread_ids - {None}
        assert threading.get_ident() not in engine.embed_threads

    run(engine, body, preprocess_workers=4)
    assert len(engine.embed_threads) == 1


def test_a_requests_text_is_prepared_in_one_call_and_each_media_item_alone() -> None:
    """One tokenizer call and one thread hop for all of a request's text; media decode in parallel."""
    engine = FakeEngine()
    image = Item((MediaPart("image", b"png bytes"),))
    request = [*items("a", "b"), image, *items("c"), image]

    async def body(b: Batcher) -> Embedded:
        return await b.embed(request, OPTS)

    result = run(engine, body)
    assert sorted(engine.prepare_jobs) == [["image"], ["image"], ["text", "text", "text"]]
    expected = [FakeEngine.expected(item) for item in request]
    np.testing.assert_array_equal(result.vectors, np.stack(expected))  # rows back in request order


def test_every_preparing_thread_is_set_up_by_the_engine_before_its_first_job() -> None:
    """The engine's per-thread set-up (Engine.init_prepare_thread: torch on one CPU thread there)
    runs once on each preprocessing thread, before that thread prepares anything."""
    calls: list[str] = []

    class Recording(FakeEngine):
        def init_prepare_thread(self) -> None:
            calls.append(threading.current_thread().name)

        def prepare_many(self, *args: Any, **kw: Any) -> Any:
            assert threading.current_thread().name in calls, "prepared on a thread never set up"
            return super().prepare_many(*args, **kw)

    engine = Recording()
    image = Item((MediaPart("image", b"png bytes"),))

    async def body(b: Batcher) -> Embedded:
        return await b.embed([image] * 6, OPTS)

    run(engine, body, preprocess_workers=3)
    assert sorted(calls) == [f"eg2-prepare-{i}" for i in range(3)]


def test_a_requests_short_text_is_tokenized_on_the_event_loop() -> None:
    """Up to inline_prepare_chars (a request's text items together) there is no thread hop; longer text
    and media go to the pool, and the rows are the same either way."""
    engine = FakeEngine()
    image = Item((MediaPart("image", b"png bytes"),))
    prompted = PrepareOptions(prompt="p")  # the prompt counts once per item: 2 x (1 + 2) = 6
    requests = [
        (items("ab", "cde"), OPTS),  # 5 characters: inline
        (items("abc", "def"), OPTS),  # 6: the pool
        (items("ab", "cd"), prompted),  # 6 with the prompt: the pool
        (items(*[""] * (INLINE_MAX_ITEMS + 1)), OPTS),  # no characters, too many items: the pool
        ([*items("e"), image], OPTS),  # the text inline, the image on the pool
    ]

    async def body(b: Batcher) -> tuple[int, list[Embedded]]:
        return threading.get_ident(), [await b.embed(r, o) for r, o in requests]

    loop_thread, results = run(engine, body, inline_prepare_chars=5)
    on_loop = [thread == loop_thread for thread in engine.prepare_threads]
    jobs = [
        (len(modalities), inline) for modalities, inline in zip(engine.prepare_jobs, on_loop, strict=True)
    ]
    assert jobs[:4] == [(2, True), (2, False), (2, False), (INLINE_MAX_ITEMS + 1, False)]
    assert sorted(zip(engine.prepare_jobs[4:], on_loop[4:], strict=True)) == [
        (["image"], False),
        (["text"], True),
    ]
    for (request, options), result in zip(requests, results, strict=True):
        want = [FakeEngine.expected(x, options) for x in request]
        np.testing.assert_array_equal(result.vectors, np.stack(want))


# --- faults ----------------------------------------------------------------------------------------


def test_oom_splits_the_batch_and_recovers() -> None:
    engine = FakeEngine(oom_over_items=2)
    texts = [f"item {i}" for i in range(8)]
    metrics = Metrics()

    async def body(b: Batcher) -> Embedded:
        b._metrics = metrics
        return await b.embed(items(*texts), OPTS)

    check_rows(run(engine, body, max_queue_delay_s=0.2), texts)  # the delay gathers all 8 in one batch
    sizes = [len(batch) for batch in engine.batches]
    assert sizes[0] == 8 and max(sizes) == 8 and sorted(sizes).count(2) == 4, sizes
    assert metrics.batch_splits.labels("oom")._value.get() == 3  # 8 -> 4+4 -> 2+2+2+2


def test_single_item_oom_fails_only_that_request_with_503() -> None:
    engine = FakeEngine()

    async def body(b: Batcher) -> tuple[BaseException | Embedded, ...]:
        engine.oom_over_items = 0
        failing = asyncio.create_task(b.embed(items("too big"), OPTS))
        with pytest.raises(EngineOutOfMemory) as info:
            await failing
        engine.oom_over_items = None
        fine = await b.embed(items("small"), OPTS)
        return info.value, fine

    error, fine = run(engine, body)
    assert classify(error) == (503, "unavailable")
    assert isinstance(fine, Embedded)
    check_rows(fine, ["small"])


@pytest.mark.parametrize("inline", [0, 10_000], ids=["pool", "inline"])
@pytest.mark.parametrize("marker", [FORWARD_BUG, PREPARE_BUG])
def test_one_bad_item_fails_only_its_request(marker: str, inline: int) -> None:
    engine = FakeEngine()
    good = [[f"a{i}", f"b{i}"] for i in range(5)]

    async def body(b: Batcher) -> list[Any]:
        engine.stall()
        tasks = [asyncio.create_task(b.embed(items(*g), OPTS)) for g in good[:2]]
        tasks.append(asyncio.create_task(b.embed(items("ok", f"x {marker}", "ok too"), OPTS)))
        tasks += [asyncio.create_task(b.embed(items(*g), OPTS)) for g in good[2:]]
        # A prepare bug fails its request at once, which cancels that request's third item when
        # its preparation has not started yet (CI once saw that): 12 or 13 preparations then.
        await until(lambda: engine.prepare_calls >= (13 if marker == FORWARD_BUG else 12))
        engine.release()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = run(engine, body, max_batch_items=16, inline_prepare_chars=inline)
    bad = results.pop(2)
    assert isinstance(bad, RuntimeError) and classify(bad) is None  # a bug: 500 for that request only
    for texts, result in zip(good, results, strict=True):
        assert isinstance(result, Embedded), result
        check_rows(result, texts)
    if marker == FORWARD_BUG:
        assert max(len(b) for b in engine.batches) > 1, "the poisoned item was never batched with others"


def test_dead_requests_are_dropped_before_the_gpu() -> None:
    engine = FakeEngine()
    metrics = Metrics()

    async def body(b: Batcher) -> None:
        b._metrics = metrics
        busy = await hold_the_gpu(b, engine)
        doomed = asyncio.create_task(b.embed(items("doomed 1", "doomed 2", "doomed 3"), OPTS))
        kept = asyncio.create_task(b.embed(items("kept"), OPTS))
        await until(lambda: b.queued() == 4)
        doomed.cancel()  # what a disconnect or a timeout does
        await asyncio.sleep(0)
        assert b.admitted == 2
        engine.release()
        check_rows(await kept, ["kept"])
        await busy

    run(engine, body)
    assert not [t for t in engine.embedded_texts if t.startswith("doomed")]
    assert metrics.dropped_items.labels("gpu_queue")._value.get() == 3
    assert metrics.dropped_items.labels("preprocessing")._value.get() == 0


def test_an_ended_request_stops_its_preparation_and_counts_it_dropped() -> None:
    """Cancelled (a disconnect, a timeout) while its images are being prepared: the two being prepared
    stop at once (the engine's cancel flag), the one still waiting for a thread never runs, and all three
    count as dropped in preprocessing."""
    engine = FakeEngine(prepare_delay_s=30)  # "decoding" that takes 30 s unless cancelled
    metrics = Metrics()
    images = [Item((MediaPart("image", bytes([i]) * 8),)) for i in range(3)]

    async def body(b: Batcher) -> None:
        b._metrics = metrics
        task = asyncio.create_task(b.embed(images, OPTS))
        await until(lambda: len(engine.prepare_jobs) == 2)  # two threads busy, the third job queued
        task.cancel()
        await until(lambda: engine.prepare_cancelled == 2, timeout=2)

    run(engine, body, preprocess_workers=2)
    assert len(engine.prepare_jobs) == 2, "the queued job ran after its request had ended"
    assert metrics.dropped_items.labels("preprocessing")._value.get() == 3
    assert metrics.dropped_items.labels("gpu_queue")._value.get() == 0


def test_media_decoded_ahead_of_the_gpu_stays_under_its_budget() -> None:
    """The GPU is stuck: of two requests' 10 images (284 tokens each for the FakeEngine), only three fit
    the 852-token budget, so only three are decoded; the rest start as batches complete. A request
    cancelled while waiting gives back what it held; the budget ends empty."""
    engine = FakeEngine()
    images = [Item((MediaPart("image", bytes([i]) * 8),)) for i in range(10)]

    async def body(b: Batcher) -> None:
        engine.stall()
        first = asyncio.create_task(b.embed(images[:6], OPTS))
        second = asyncio.create_task(b.embed(images[6:], OPTS))
        await until(lambda: len(engine.prepare_jobs) == 3)
        await asyncio.sleep(0.2)
        assert len(engine.prepare_jobs) == 3 and b.media_budget.used == 852, b.media_budget.used
        second.cancel()
        await asyncio.sleep(0.05)
        assert b.media_budget.used <= 852
        engine.release()
        result = await first
        assert result.vectors.shape == (6, 768)
        assert b.media_budget.used == 0

    run(engine, body, max_prepared_media_tokens=3 * 284, preprocess_workers=4)
    # The six of the first request, and at most what the second had decoded before it was cancelled.
    assert 6 <= len(engine.prepare_jobs) <= 8


def test_an_item_larger_than_the_media_budget_is_decoded_alone() -> None:
    engine = FakeEngine()

    async def body(b: Batcher) -> Embedded:
        return await b.embed([Item((MediaPart("image", b"x"),)), Item((MediaPart("image", b"y"),))], OPTS)

    assert run(engine, body, max_prepared_media_tokens=100).vectors.shape == (2, 768)


def test_a_request_over_the_token_limit_is_refused_before_any_work() -> None:
    engine = FakeEngine()

    async def body(b: Batcher) -> BaseException | None:
        try:
            await b.embed(items(words(600, "a"), words(600, "b")), OPTS)
        except Exception as e:
            return e
        return None

    error = run(engine, body, max_request_tokens=1000)
    assert error is not None and classify(error) == (413, "request_too_large"), error
    assert "about 1204 tokens" in str(error) and not engine.prepare_jobs and engine.estimate_calls == 1


def test_admission_counts_items_and_refuses_at_once() -> None:
    engine = FakeEngine()

    async def body(b: Batcher) -> Overloaded:
        engine.stall()
        held = asyncio.create_task(b.embed(items(*(f"h{i}" for i in range(8))), OPTS))
        await until(lambda: b.admitted == 8)
        fits = asyncio.create_task(b.embed(items("one", "two"), OPTS))
        await asyncio.sleep(0)
        start = time.monotonic()
        with pytest.raises(Overloaded) as info:
            await b.embed(items("one more"), OPTS)
        assert time.monotonic() - start < 0.05, "429 must not wait"
        engine.release()
        await asyncio.gather(held, fits)
        assert b.admitted == 0
        await b.embed(items("after"), OPTS)
        return info.value

    error = run(engine, body, max_queued_items=10)
    assert classify(error) == (429, "overloaded")
    assert 1 <= int(error.headers["retry-after"]) <= 30


def test_health_reports_a_wedged_gpu_call() -> None:
    engine = FakeEngine()

    async def body(b: Batcher) -> None:
        engine.stall()
        task = asyncio.create_task(b.embed(items("stuck"), OPTS))
        await until(lambda: len(engine.batches) == 1)
        assert b.problem() is None
        await asyncio.sleep(0.25)
        assert "GPU call" in (b.problem() or "")
        engine.release()
        await task
        assert b.problem() is None

    run(engine, body, stall_timeout_s=0.2)


# --- through HTTP ----------------------------------------------------------------------------------


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics").text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def in_threads(n: int, fn: Callable[[int], T]) -> list[T]:
    results: list[Any] = [None] * n

    def work(i: int) -> None:
        results[i] = fn(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_concurrent_requests_are_batched_together() -> None:
    engine = FakeEngine(embed_delay_s=0.05)
    with live(make_settings(max_queue_delay_ms=20, max_batch_items=32), engine) as s:
        responses = in_threads(
            16, lambda i: httpx.post(s.url + "/v1/embeddings", json={"input": f"c{i}"}, timeout=10)
        )
        assert all(r.status_code == 200 for r in responses)
        for i, r in enumerate(responses):
            np.testing.assert_allclose(
                r.json()["data"][0]["embedding"], FakeEngine.expected(f"c{i}"), atol=1e-7
            )
        batches = metric(s.url, "eg2_batch_size_count", modality="text")
        items_done = metric(s.url, "eg2_batch_size_sum", modality="text")
        assert items_done == 16
        assert batches < 16, f"{batches} batches for 16 concurrent requests"


def test_disconnected_client_items_never_reach_the_gpu() -> None:
    engine = FakeEngine()
    with live(make_settings(), engine) as s:
        engine.stall()
        busy = threading.Thread(
            target=lambda: httpx.post(s.url + "/v1/embeddings", json={"input": "busy"}, timeout=20)
        )
        busy.start()
        deadline = time.monotonic() + 5
        while len(engine.batch_sizes()) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        body = b'{"input": ["gone-1", "gone-2"]}'
        with socket.create_connection(("127.0.0.1", s.server.port)) as sock:  # type: ignore[union-attr]
            sock.sendall(
                b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(body)}\r\n\r\n".encode()
                + body
            )
            while s.service.batcher.queued() < 2:
                assert time.monotonic() < deadline
                time.sleep(0.005)
        # the socket is closed: the server notices, and drops both items (only "busy" stays admitted)
        while s.service.batcher.admitted != 1:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        engine.release()
        busy.join(timeout=10)
        assert httpx.post(s.url + "/v1/embeddings", json={"input": "after"}).status_code == 200
        assert not [t for t in engine.embedded_texts if t.startswith("gone")]
        assert metric(s.url, "eg2_dropped_items_total") == 2


def test_admission_overflow_gives_429_with_retry_after() -> None:
    engine = FakeEngine()
    with live(make_settings(max_queued_items=4, max_request_items=4), engine) as s:
        engine.stall()
        holder = threading.Thread(
            target=lambda: httpx.post(s.url + "/v1/embeddings", json={"input": ["a", "b", "c"]}, timeout=20)
        )
        holder.start()
        deadline = time.monotonic() + 5
        while s.service.batcher.admitted < 3:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        r = httpx.post(s.url + "/v1/embeddings", json={"input": ["d", "e"]})
        assert_error(r, 429, "overloaded")
        assert int(r.headers["retry-after"]) >= 1
        engine.release()
        holder.join(timeout=10)
        assert httpx.post(s.url + "/v1/embeddings", json={"input": ["d", "e"]}).status_code == 200
        assert metric(s.url, "eg2_requests_total", status="429") == 1


def test_request_timeout_gives_503_and_drops_items() -> None:
    engine = FakeEngine()
    with live(make_settings(request_timeout_s=0.3), engine) as s:
        engine.stall()
        first = threading.Thread(
            target=lambda: httpx.post(s.url + "/v1/embeddings", json={"input": "x"}, timeout=20)
        )
        first.start()
        time.sleep(0.05)
        start = time.monotonic()
        r = httpx.post(s.url + "/v1/embeddings", json={"input": "late"}, timeout=10)
        assert "timed out" in assert_error(r, 503, "unavailable")["message"]
        assert time.monotonic() - start < 2
        engine.release()
        first.join(timeout=10)
        assert "late" not in engine.embedded_texts


def test_oom_split_and_bad_item_isolation_over_http() -> None:
    """Concurrent requests share batches; the engine OOMs over 2 items and one item raises: every other
    request still gets its own right vectors, the poisoned one alone gets 500."""
    engine = FakeEngine(embed_delay_s=0.01)
    with live(make_settings(max_queue_delay_ms=30, max_batch_items=16), engine) as s:
        engine.oom_over_items = 2  # after warm-up: traffic must recover by splitting
        texts = [[f"r{i} a", f"r{i} b"] for i in range(6)]
        texts[3] = ["fine", f"x {FORWARD_BUG}"]
        responses = in_threads(
            6, lambda i: httpx.post(s.url + "/v1/embeddings", json={"input": texts[i]}, timeout=20)
        )
        for i, r in enumerate(responses):
            if i == 3:
                assert_error(r, 500, "internal_error")
                continue
            assert r.status_code == 200, r.text
            got = [d["embedding"] for d in r.json()["data"]]
            np.testing.assert_allclose(got, np.stack([FakeEngine.expected(t) for t in texts[i]]), atol=1e-7)
        assert metric(s.url, "eg2_batch_splits_total", reason="oom") >= 1
        assert max(engine.batch_sizes()) > 2, "requests were never batched together"


# --- items with segments: streams through the batcher ----------------------------------------------

SEG = Segments(tokens=64)  # the FakeEngine cuts text into spans of `tokens` words


def test_segments_join_the_batches_as_ordinary_items() -> None:
    """A text of 150 words in spans of 64: three spans and the item itself come back in order, each the
    vector of its span alone; while the GPU is busy they queue, and the next batch carries them beside
    another request's item."""
    engine = FakeEngine()
    text = " ".join(f"w{i}" for i in range(150))

    async def body(b: Batcher) -> tuple[Embedded, Embedded]:
        busy = await hold_the_gpu(b, engine)
        long = asyncio.create_task(b.embed([Item((TextPart(text),), SEG)], OPTS))
        other = asyncio.create_task(b.embed(items("another request"), OPTS))
        await until(lambda: b.queued() == 5)
        assert b.admitted == 1 + 1 + 3 + 1, "each span is an item in flight"
        engine.release()
        await busy
        return await long, await other

    long, other = run(engine, body)
    check_rows(other, ["another request"])
    spans, rows = long.segments[0]
    assert [(s.start, s.end) for s in spans] == [(0, 64), (64, 128), (128, 150)]
    words_ = text.split()
    for span, row in zip(spans, rows, strict=True):
        np.testing.assert_allclose(
            row, FakeEngine.expected(" ".join(words_[int(span.start) : int(span.end)]))
        )
    np.testing.assert_allclose(long.vectors[0], FakeEngine.expected(text))
    assert long.num_tokens == sum(
        FakeEngine().tokens(Item((TextPart(t),)), OPTS)
        for t in [text, *(" ".join(words_[a : a + 64]) for a in (0, 64, 128))]
    )
    shared = [
        batch
        for batch in engine.batches
        if {p.inputs[1] for p in batch} >= {"another request"} and any(p.span for p in batch)
    ]
    assert shared, f"no batch held spans beside another request's item: {engine.batch_sizes()}"


def test_an_ended_request_stops_its_stream() -> None:
    """Cancelled while a span is being prepared: the step stops at once (the cancel flag), no later
    step starts, and nothing stays admitted."""
    engine = FakeEngine(prepare_delay_s=30)
    text = " ".join(f"w{i}" for i in range(300))

    async def body(b: Batcher) -> None:
        task = asyncio.create_task(b.embed([Item((TextPart(text),), SEG)], OPTS))
        await until(lambda: b._preparing["text"] == 1)
        task.cancel()
        await until(lambda: b.admitted == 0 and not +b._preparing, timeout=2)

    start = time.monotonic()
    run(engine, body)
    assert time.monotonic() - start < 10 and engine.prepare_calls == 0


def test_a_lone_stream_fills_gpu_batches() -> None:
    """A text of 300 words in spans of 64, each span 20 ms to prepare, the GPU idle: the 5 spans and
    the item reach it as one step, one batch (a span per step would run each alone at once)."""
    engine = FakeEngine(prepare_delay_s=0.02)
    text = " ".join(f"w{i}" for i in range(300))

    async def body(b: Batcher) -> Embedded:
        return await b.embed([Item((TextPart(text),), SEG)], OPTS)

    result = run(engine, body)
    assert len(result.segments[0][0]) == 5
    assert engine.batch_sizes() == [6], engine.batch_sizes()


def test_a_stream_step_stays_within_the_media_budget() -> None:
    """A step gathers up to STREAM_STEP_SPANS spans, but for media never more than the media budget
    holds (one span at least): 20 audio spans of 300 tokens under a 1,000-token budget take 3 a step."""
    audio = Estimate(tokens=750, spans=20, span_tokens=20 * 300)
    assert step_size(audio, 1_000_000) == (STREAM_STEP_SPANS, STREAM_STEP_SPANS * 300)
    assert step_size(audio, 1000) == (3, 900)
    assert step_size(audio, 100) == (1, 300), "a span over the whole budget still goes, alone"
    assert step_size(Estimate(tokens=10, spans=2, span_tokens=12), 1_000_000) == (2, 12)
    assert step_size(Estimate(tokens=500, spans=40, span_tokens=600), None) == (STREAM_STEP_SPANS, 0)


def test_too_many_segments_are_refused_before_any_work() -> None:
    engine = FakeEngine()
    text = " ".join(f"w{i}" for i in range(300))  # 5 spans of 64 words

    async def body(b: Batcher) -> None:
        with pytest.raises(InputTooLargeError, match=r"5 segments.*max_request_segments"):
            await b.embed([Item((TextPart(text),), SEG)], OPTS)

    run(engine, body, max_request_segments=4)
    assert engine.prepare_calls == 0 and not engine.prepare_jobs
