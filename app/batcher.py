"""The dynamic batcher: requests in, GPU batches out, each row back to its request.

    embed(items) ── admission (items in flight <= limit, else 429 at once)
       └─► cost check: engine.estimate_many (media headers on a thread, text counted on the loop);
           413 over max_request_tokens or max_request_segments, before anything is decoded or tokenized
       └─► preprocess pool: N threads run engine.prepare_many, overlapping with the GPU (a request's
             text in one job, each of its media items in a job of its own, started only while the
             media tokens decoded ahead of the GPU stay under their budget); a request's short text
             is tokenized on the event loop instead, where the thread hop would cost more
             └─► per-modality queues of prepared items
                   └─► scheduler (event loop): each queue is a line of requests taking turns
                       (app/queues.py). Longest-waiting front request first, the first modality whose
                       batch is ready: full, or nothing of its modality in preprocessing, or its
                       front request waited max_queue_delay (plus max_request_gather while it
                       still has media in preprocessing, up to its share); take the front
                       request's items, then fill from the requests behind it, closest in cost
                       first, under max_batch_tokens and max_batch_items. A request of many
                       batches runs one and goes to the back, behind those queued after it
                         └─► GPU thread (exactly one): engine.embed(batch) -> (B, D) rows

An item with segments is a stream (engine.prepare_segments): its file is decoded once, a step of up
to STREAM_STEP_SPANS spans at a time on the preprocess threads, each step started once its estimated
tokens fit the media budget; each span and the item itself join the queues as ordinary items, so an
hour of audio in 10 s spans is ~360 items that fill GPU batches, alone or beside other requests'
items, admitted and budgeted as they go.

A request whose future is done (answered, failed, cancelled on disconnect or timeout) is dead: its
items are skipped before preprocessing, their decoding stops within a frame (a cancel flag the
engine's decoders check), and what was prepared is dropped before the GPU; eg2_dropped_items_total
counts them by stage. A failing batch is split in halves
and retried, so an out-of-memory batch still completes in smaller pieces and one poisoned item fails
only its own request. Assumes the engine contract of eg2_runtime.engine: prepare_many is thread-safe,
embed runs on one thread and returns unit rows in batch order.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from app.errors import Overloaded, Unavailable
from app.metrics import Metrics
from app.queues import EmbedCall, Embedded, MediaBudget, ModalityQueue, Work
from app.threads import JOIN_TIMEOUT_S, Threads, run_here
from eg2_runtime.api import EngineAPI, Estimate, PreparedItem, SegmentStream, TokenCount
from eg2_runtime.errors import EG2Error, EngineError, EngineOutOfMemory, InputTooLargeError
from eg2_runtime.inputs import Item, PrepareOptions, TextPart

log = logging.getLogger("eg2.batcher")
T = TypeVar("T")
# A request's text is tokenized on the event loop only with at most this many items: each costs 6-10 us
# of preprocessing even when empty, so 8 items stay near the cost of 512 characters (78 vs 69 us, dev
# machine, benchmarks/prepare_text_cost.py).
INLINE_MAX_ITEMS = 8
# Spans one step of a segment stream gathers before they join the queues, so one long file still fills
# GPU batches: decoding is sequential, and a span at a time ran each alone (H200, 2026-12-01, a
# 10-minute file in 10 s segments: 61 batches of one, 2.07 s to vectors). The cost: a step's spans
# held decoded at once, within the media budget.
STREAM_STEP_SPANS = 8


def step_size(estimate: Estimate, media_limit: int | None) -> tuple[int, int]:
    """(spans, estimated tokens) of one step of a stream: up to STREAM_STEP_SPANS spans, and for media
    no more than the media budget (`media_limit` tokens) holds, one span at least. Text: 0 tokens (the
    budget counts media only)."""
    per_span = -(-estimate.span_tokens // max(estimate.spans, 1))
    spans = min(STREAM_STEP_SPANS, max(estimate.spans, 1))
    if media_limit is None:
        return spans, 0
    spans = max(1, min(spans, media_limit // max(per_span, 1)))
    return spans, spans * per_span


def _at_item(error: BaseException, index: int) -> BaseException:
    """An item's error with its `param` narrowed from the whole input to that item (`input[2]`): the
    runtime knows the part it failed on, not where the item sits in the request."""
    if isinstance(error, EG2Error) and error.param == "input":
        error.param = f"input[{index}]"
    return error


def _text_chars(items: Sequence[Item], options: PrepareOptions) -> int:
    """Characters the tokenizer will see for these items: each item's text, and the prompt (which
    the preprocessor puts before every item)."""
    prompt = len(options.prompt or "")
    return sum(prompt + sum(len(p.text) for p in item.parts if isinstance(p, TextPart)) for item in items)


def _prepare_groups(items: Sequence[Item]) -> list[list[int]]:
    """Indices of a request's items, grouped into preprocessing jobs: its text-only items in one job
    (one tokenizer call, one thread hop and one callback for all of them: per item, those cost the
    event loop more than the tokenizing), each media item in a job of its own (decoding takes
    milliseconds, so several threads share a request's images, clips and videos)."""
    plain = [i for i, item in enumerate(items) if item.span_unit is None]  # the others are streams
    text = [i for i in plain if items[i].modality == "text"]
    media = [[i] for i in plain if items[i].modality != "text"]
    return ([text] if text else []) + media


class Batcher:
    def __init__(
        self,
        engine: EngineAPI,
        metrics: Metrics,
        *,
        max_batch_tokens: int,
        max_batch_items: int,
        max_queue_delay_s: float,
        max_queued_items: int,
        preprocess_workers: int,
        stall_timeout_s: float,
        inline_prepare_chars: int,
        max_request_tokens: int,
        max_prepared_media_tokens: int,
        max_request_gather_s: float,
        max_request_segments: int = 512,
        gpu_thread: Threads | None = None,
        prepare_processes: int = 0,
    ) -> None:
        """`gpu_thread`: the thread the engine was loaded on, to run its accelerator calls too (CUDA
        keeps per-thread state, e.g. cuBLAS handles and their workspaces: one thread holds one set).
        `prepare_processes`: worker processes that prepare each media item instead of the threads
        (engine.prepare_processes); 0 keeps every job on the threads. `max_request_gather_s`: how
        much longer than the queue delay a batch waits for its oldest item's own request's items still
        in preprocessing (_deadline)."""
        self._engine = engine
        self._metrics = metrics
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_items = max_batch_items
        self._delay_s = max_queue_delay_s
        self._gather_s = max_request_gather_s
        self._limit = max_queued_items
        self._stall_timeout_s = stall_timeout_s
        self._inline_chars = inline_prepare_chars  # a request's text up to this size skips the pool
        self._max_request_tokens = max_request_tokens
        self._max_request_segments = max_request_segments
        self.media_budget = MediaBudget(max_prepared_media_tokens)
        self._window = 8 * max_batch_items  # items looked at when grouping by cost
        self._prep = Threads(preprocess_workers, "eg2-prepare", engine.init_prepare_thread)
        self._procs = engine.prepare_processes(prepare_processes) if prepare_processes > 0 else None
        self._gpu = gpu_thread or Threads(1, "eg2-gpu")  # the one thread that ever calls engine.embed
        self._queues: dict[str, ModalityQueue] = {}
        # Items of admitted requests still in preprocessing, by modality: the companions worth waiting
        # for. With none on the way a batch runs at once (a lone request pays no queue delay).
        self._preparing: Counter[str] = Counter()
        self._dead_queued = False  # a request ended with items still queued: sweep before the next batch
        self._wakeup = asyncio.Event()
        self._live: set[EmbedCall] = set()
        self._batch_ids = itertools.count()
        self._scheduler: asyncio.Task[None] | None = None
        self.admitted = 0
        self._busy_since: float | None = None
        self._items_per_s = 0.0  # EWMA of GPU throughput, for Retry-After
        self._modality_tokens: dict[str, int] = {}  # the engine's per-modality limits (warmup)

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._scheduler = asyncio.create_task(self._schedule(), name="eg2-scheduler")

    async def warmup(self) -> None:
        """The engine's warm-up on the GPU thread: a full-size batch per modality, so an OOM fails the
        boot. The per-modality batch token limits it returns (the GPU memory plan's, proven to fit)
        bound batches from then on, under max_batch_tokens."""
        start = time.monotonic()
        # The preparing processes start (each imports torch: seconds) while the GPU warms up.
        procs = asyncio.ensure_future(asyncio.to_thread(self._procs.start)) if self._procs else None
        try:
            limits = await self.on_gpu_thread(
                self._engine.warm_up, self.max_batch_items, self.max_batch_tokens
            )
        except EngineOutOfMemory as exc:
            raise EngineOutOfMemory(
                f"warm-up ran out of memory on a full batch: lower max_batch_tokens or max_batch_items, or "
                f"raise gpu_memory_mib ({exc.message})"
            ) from exc
        if procs is not None:  # only after a warm-up that worked: its error is the one to report
            await procs
        self._modality_tokens = {m: min(v, self.max_batch_tokens) for m, v in limits.items()}
        log.info(
            "warm-up done",
            extra={"batch_tokens": self._modality_tokens, "seconds": time.monotonic() - start},
        )

    async def on_gpu_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the one thread that runs the engine's accelerator calls (boot steps)."""
        return await self._gpu.submit(fn, *args)

    def batch_tokens(self, modality: str) -> int:
        """The token budget of one batch of `modality`."""
        return self._modality_tokens.get(modality, self.max_batch_tokens)

    async def close(self) -> list[str]:
        """Stop scheduling, fail what is in flight, stop the threads; the names of the thread pools
        still busy after JOIN_TIMEOUT_S (a call into the engine that has not returned)."""
        if self._scheduler is not None:
            self._scheduler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scheduler
        self.abort(Unavailable("the server is shutting down"))
        self._prep.close()
        if self._procs is not None:
            self._procs.close()
        self._gpu.close()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        busy = []
        for threads in (self._prep, self._gpu):
            if not await threads.join(deadline - time.monotonic()):  # a long or wedged engine call
                log.warning("a worker thread is still busy at shutdown", extra={"threads": threads.name})
                busy.append(threads.name)
        return busy

    def abort(self, exc: BaseException) -> None:
        """Fail every request in flight with `exc` (drain deadline, shutdown)."""
        for request in list(self._live):
            request.fail(exc)

    # --- health --------------------------------------------------------------------------------

    @property
    def gpu_thread_ids(self) -> set[int | None]:
        return self._gpu.idents

    def stalled_for(self) -> float:
        """Seconds the current GPU call has been running; 0 when idle."""
        busy = self._busy_since
        return 0.0 if busy is None else time.monotonic() - busy

    def problem(self) -> str | None:
        """Why the worker is not making progress, or None while it is."""
        if self._scheduler is not None and self._scheduler.done():
            return "the batch scheduler stopped"
        stalled = self.stalled_for()
        if stalled > self._stall_timeout_s:
            return f"a GPU call has been running for {stalled:.0f} s (limit {self._stall_timeout_s:g} s)"
        return None

    def queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    # --- requests ------------------------------------------------------------------------------

    async def embed(self, items: Sequence[Item], options: PrepareOptions) -> Embedded:
        """Vectors of `items` (and of their segments), in order. Cancel the caller to drop its items
        (disconnect, timeout)."""
        n = len(items)
        self._admit(n)
        request = EmbedCall(n, asyncio.get_running_loop())
        self._live.add(request)
        feeders: list[asyncio.Task[None]] = []
        try:
            try:
                estimates = await self._check_cost(request, items, options)
                spans = sum(e.spans for e in estimates)
                self._admit(spans)  # each segment is an item in flight
                request.admitted += spans
            except (EG2Error, Overloaded):
                request.refused = True
                raise
            groups = _prepare_groups(items)
            media = [g for g in groups if items[g[0]].modality != "text"]
            for group in groups:
                if items[group[0]].modality == "text":
                    self._submit(request, items, group, options, tokens=0)  # text: no estimate used
            costs = [e.tokens for e in estimates]
            if media:  # each as the media budget allows: decoding waits for the GPU to catch up
                feeders.append(asyncio.create_task(self._feed(request, items, media, costs, options)))
            for i, item in enumerate(items):
                if item.span_unit is not None:
                    request.remaining += 1  # until its stream ends
                    feeders.append(asyncio.create_task(self._stream(request, i, item, estimates[i], options)))
            await request.future
            return request.embedded()
        finally:
            for feeder in feeders:
                feeder.cancel()
            for tokens in request.held.values():  # what its items still hold (dropped or never run)
                self.media_budget.release(tokens)
            request.held.clear()
            request.cancel.set()  # stops whatever of its decoding is still running
            future = request.future
            if not (future.done() and not future.cancelled() and future.exception() is None):
                self._dead_queued = True  # it may have left items in the queues
                if not request.refused:
                    # Never reached the GPU queues: waiting for a preprocessing thread, being decoded
                    # (stopped now), or prepared after the end. Queued ones are counted when swept.
                    lost = request.expected - request.queued - request.failed
                    self._metrics.dropped_items.labels("preprocessing").inc(lost)
            future.cancel()  # no-op when answered; otherwise marks its leftovers dead
            for prep in request.prep_futures:
                prep.cancel()
            self._live.discard(request)
            self.admitted -= request.admitted
            self._metrics.admitted_items.set(self.admitted)

    def _admit(self, n: int) -> None:
        """Take `n` items of the admission limit, or refuse (429) at once."""
        if self.admitted + n > self._limit:
            raise Overloaded(
                f"server is at its admission limit ({self._limit} items in flight); retry later",
                retry_after_s=self._retry_after(),
            )
        self.admitted += n
        self._metrics.admitted_items.set(self.admitted)

    async def tokenize(self, items: Sequence[Item], options: PrepareOptions) -> list[TokenCount]:
        """What each item costs (engine.tokenize_many: the preparing `embed` runs, no model), after the
        same admission and cost check; on a preprocess thread."""
        n = len(items)
        self._admit(n)
        request = EmbedCall(n, asyncio.get_running_loop())
        try:
            await self._check_cost(request, items, options)
            job = self._prep.submit(self._engine.tokenize_many, items, options, request.cancel)
            request.prep_futures.append(job)
            counts = await job
            if (error := next((c for c in counts if isinstance(c, EG2Error)), None)) is not None:
                raise error
            return [c for c in counts if isinstance(c, TokenCount)]
        finally:
            request.cancel.set()
            for prep in request.prep_futures:
                prep.cancel()
            self.admitted -= n
            self._metrics.admitted_items.set(self.admitted)

    def _submit(
        self,
        request: EmbedCall,
        items: Sequence[Item],
        group: list[int],
        options: PrepareOptions,
        tokens: int,
    ) -> None:
        """One preprocessing job for these items of the request (its text, or one media item of
        `tokens` estimated tokens)."""
        modality = items[group[0]].modality  # a group is one modality (text, or one media item)
        job = [items[i] for i in group]
        if modality == "text" and self._inline(job, options):
            prep = run_here(self._prepare, job, options, None)  # a hop costs more than tokenizing
        elif modality != "text" and self._procs is not None:
            prep = self._in_process(job, options)
        else:
            prep = self._prep.submit(self._prepare, job, options, request.cancel)
        # Counted before the callback is attached; it runs from the loop, so never before this.
        self._preparing[modality] += len(group)
        request.preparing[modality] += len(group)
        request.preparing_tokens[modality] += tokens
        prep.add_done_callback(functools.partial(self._prepared, request, group, modality, tokens))
        request.prep_futures.append(prep)

    def _in_process(self, job: list[Item], options: PrepareOptions) -> asyncio.Future[list[Any]]:
        """One preparing job on a worker process; cancelling the future stops the worker's decoding."""
        assert self._procs is not None
        work = self._procs.submit(job, options)
        prep = asyncio.wrap_future(work.future)

        def done(f: asyncio.Future[list[Any]]) -> None:
            if f.cancelled():
                work.cancel()
            elif f.exception() is None:
                self._observe_prepared(f.result(), work.seconds / len(job))

        prep.add_done_callback(done)
        return prep

    async def _feed(
        self,
        request: EmbedCall,
        items: Sequence[Item],
        groups: list[list[int]],
        costs: list[int],
        options: PrepareOptions,
    ) -> None:
        """Submit the request's media jobs one by one, each once its estimated tokens fit the media
        budget; they stay held until the item is embedded or its request ends."""
        for group in groups:
            tokens = sum(costs[i] for i in group)
            await self.media_budget.acquire(tokens)
            request.held[group[0], -1] = tokens
            if request.dead:
                return
            self._submit(request, items, group, options, tokens=tokens)

    async def _stream(
        self, request: EmbedCall, index: int, item: Item, estimate: Estimate, options: PrepareOptions
    ) -> None:
        """Feed one item with segments: a step of up to STREAM_STEP_SPANS spans at a time on a
        preprocess thread, each started once its estimated tokens fit the media budget; what a step
        gives joins the queues at once. The stream (its open file) is closed however this ends."""
        modality = item.modality
        media = modality != "text"
        spans, per_step = step_size(estimate, self.media_budget.limit if media else None)
        try:
            stream = self._engine.prepare_segments(item, options, request.cancel)
        except Exception as exc:
            request.failed += 1
            request.fail(exc)
            return
        try:
            while not request.dead:
                if media:
                    await self.media_budget.acquire(per_step)
                held = per_step
                self._preparing[modality] += 1
                try:
                    job = self._prep.submit(self._step, stream, spans)
                    request.prep_futures.append(job)
                    step = await job
                except BaseException:
                    self.media_budget.release(held)
                    raise
                finally:
                    self._preparing[modality] -= 1
                    self._wakeup.set()
                if step is None or request.dead:
                    self.media_budget.release(held)
                    break
                if media:
                    self.media_budget.adjust(sum(p.cost for p in step) - held)
                cut = sum(p.span is not None for p in step)
                request.segments += cut
                request.expected += cut
                request.remaining += cut
                if request.segments > self._max_request_segments:
                    self.media_budget.release(sum(p.cost for p in step) if media else 0)
                    request.fail(self._too_many_segments(request.segments))
                    return
                self._enqueue(request, [(index, p) for p in step], hold=media)
            request.settle(1)  # the stream is done; its rows may still be on the way
        except Exception as exc:  # an input error, Cancelled once the request ended, or a bug (500)
            request.failed += 1
            request.fail(exc)
        finally:
            self._prep.submit(stream.close)  # after a running step: the cancel flag stops it first

    def _step(self, stream: SegmentStream, spans: int) -> list[PreparedItem] | None:
        """The stream's next `spans` spans (fewer at its end), on a preprocess thread (the histogram
        gets each item's share); None once it is done."""
        start = time.monotonic()
        step: list[PreparedItem] = []
        while sum(p.span is not None for p in step) < spans:
            more = stream.next()
            if more is None:
                break
            step.extend(more)
        if step:
            share = (time.monotonic() - start) / len(step)
            for p in step:
                self._metrics.preprocess_seconds.labels(p.modality).observe(share)
        return step or None

    def _too_many_segments(self, n: int) -> InputTooLargeError:
        return InputTooLargeError(
            f"this request asks for {n} segments, more than this server's limit of "
            f"{self._max_request_segments} per request (max_request_segments); send longer spans "
            "or fewer items",
            param="segments",
        )

    async def _check_cost(
        self, request: EmbedCall, items: Sequence[Item], options: PrepareOptions
    ) -> list[Estimate]:
        """Refuse the request before any decoding or tokenizing when its estimated cost (headers, durations,
        characters: engine.estimate_many) is over the per-request limits (tokens, segments), or an item's
        headers already prove it will fail. Media headers are read on a preprocessing thread, text is
        counted here."""
        if all(item.modality == "text" for item in items):
            estimate = run_here(self._engine.estimate_many, items, options)
        else:
            estimate = self._prep.submit(self._engine.estimate_many, items, options)
            request.prep_futures.append(estimate)  # skipped if the client leaves before it runs
        results = await estimate
        for i, result in enumerate(results):
            if isinstance(result, EG2Error):
                raise _at_item(result, i)
        estimates = [r for r in results if isinstance(r, Estimate)]
        total = sum(e.total for e in estimates)
        if total > self._max_request_tokens:
            raise InputTooLargeError(
                f"this request would cost about {total} tokens (text counted at one token per character, "
                f"media from their headers), more than this server's limit of {self._max_request_tokens} "
                "per request (max_request_tokens); send fewer or shorter items per request",
                param="input",
            )
        if (spans := sum(e.spans for e in estimates)) > self._max_request_segments:
            raise self._too_many_segments(spans)
        return estimates

    def _inline(self, job: list[Item], options: PrepareOptions) -> bool:
        """Whether a request's text job is small enough to tokenize on the event loop."""
        limit = self._inline_chars
        return limit > 0 and len(job) <= INLINE_MAX_ITEMS and _text_chars(job, options) <= limit

    def _prepare(
        self, items: list[Item], options: PrepareOptions, cancel: threading.Event | None
    ) -> list[PreparedItem | EG2Error]:
        """On a preprocess thread, or on the event loop for short text. The histogram gets each
        item's share of the call. Raises eg2_runtime.errors.Cancelled once `cancel` is set."""
        start = time.monotonic()
        prepared = self._engine.prepare_many(items, options, cancel)
        self._observe_prepared(prepared, (time.monotonic() - start) / len(items))
        return prepared

    def _observe_prepared(self, prepared: list[PreparedItem | EG2Error], share: float) -> None:
        """Each prepared item's share of its job's time, into the preprocess histogram."""
        histograms: dict[str, Any] = {}  # one label lookup a modality, not an item
        for p in prepared:
            if isinstance(p, PreparedItem):
                if (h := histograms.get(p.modality)) is None:
                    h = histograms[p.modality] = self._metrics.preprocess_seconds.labels(p.modality)
                h.observe(share)

    def _prepared(
        self,
        request: EmbedCall,
        indices: list[int],
        modality: str,
        tokens: int,
        prep: asyncio.Future[list[Any]],
    ) -> None:
        self._preparing[modality] -= len(indices)  # done, failed or cancelled: no longer on the way
        request.preparing[modality] -= len(indices)
        request.preparing_tokens[modality] -= tokens
        self._wakeup.set()  # the scheduler may be waiting for these, or now has them queued
        if prep.cancelled():
            return
        if (exc := prep.exception()) is not None:
            request.failed += len(indices)
            request.fail(_at_item(exc, indices[0]) if len(indices) == 1 else exc)  # its own request only
            return
        results = prep.result()
        if errors := [(i, r) for i, r in zip(indices, results, strict=True) if isinstance(r, EG2Error)]:
            request.failed += len(errors)
            index, error = errors[0]
            request.fail(_at_item(error, index))
            return
        if request.dead:
            return  # counted as dropped where the request ended
        self._enqueue(request, list(zip(indices, results, strict=True)))

    def _enqueue(self, request: EmbedCall, items: list[tuple[int, PreparedItem]], hold: bool = False) -> None:
        """Prepared items of a request into their modality's queue. `hold`: each keeps its cost in the
        media budget until embedded (a stream's steps acquired it)."""
        request.queued += len(items)
        for index, item in items:
            work = Work(request, index, item)
            if hold:
                request.held[work.key] = item.cost
            self._queues.setdefault(item.modality, ModalityQueue()).append(work)
        for kind in {item.modality for _, item in items}:  # the queues these items joined
            self._metrics.queue_depth.labels(kind).set(len(self._queues[kind]))

    def _retry_after(self) -> int:
        rate = max(self._items_per_s, 1.0)
        return max(1, min(30, math.ceil(self.admitted / rate)))

    # --- scheduling ----------------------------------------------------------------------------

    async def _schedule(self) -> None:
        while True:
            batch = await self._next_batch()
            try:
                await self._run(batch)
            except Exception as exc:  # a bug here must not stop the scheduler: fail the batch, go on
                log.exception("batch scheduling failed")
                for work in batch:
                    work.request.fail(exc)

    def _sweep(self) -> None:
        """Drop queued items of dead requests, before they cost a GPU pass."""
        self._dead_queued = False
        for modality, q in self._queues.items():
            if dropped := q.drop_dead():
                self._metrics.dropped_items.labels("gpu_queue").inc(dropped)
                self._metrics.queue_depth.labels(modality).set(len(q))

    async def _next_batch(self) -> list[Work]:
        """The next batch: the modalities with queued items are looked at in the order their front
        requests joined their lines (ModalityQueue.since), and the first whose batch is ready (full, nothing
        more of its modality in preprocessing, or its deadline passed) runs; else wait for the nearest
        deadline or a change. A request of many batches rejoins the back after each turn, so it does not hold
        another modality's older items behind all of its batches. A modality waiting for its items
        in preprocessing never holds up another's ready batch."""
        while True:
            if self._dead_queued:
                self._sweep()
            heads = sorted((q.since, m) for m, q in self._queues.items() if q)
            if not heads:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            now = time.monotonic()
            waits = []
            for _, modality in heads:
                q = self._queues[modality]
                tokens = self.batch_tokens(modality)
                full = len(q) >= self.max_batch_items or q.tokens >= tokens
                wait_s = self._deadline(q, tokens) - now
                if full or wait_s <= 0 or self._preparing[modality] <= 0:
                    batch = q.take(tokens, self.max_batch_items, self._window)
                    self._metrics.queue_depth.labels(modality).set(len(q))
                    return batch
                waits.append(wait_s)
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), min(waits))

    def _deadline(self, q: ModalityQueue, tokens: int) -> float:
        """When the batch that the queue's front request starts closes, unless it fills first or
        nothing more of its modality is in preprocessing: max_queue_delay after the front request
        joined the line or had its last turn (ModalityQueue.since), and the request gather past that while
        that request still has media of its modality in preprocessing (a stream's steps are not
        counted), until the batch holds its share (_share) of the queue and those items.

        A request is answered when its last row is. Its items split over batches as they finish
        decoding cost it a GPU pass each (16 images as ~3 batches of ~6); one batch that waits for
        them costs one pass. A request that needs several batches anyway gathers an even share for
        each (16 clips, 13 to a batch: 8 + 8 as the two decoding waves come, not 13 held for the
        second wave + 3; items decoding one by one: 8 + 8, not 1 + 1 + ...). The gather runs from
        each turn's start, so a request whose items trickle in (a slow decode, a full media budget)
        can cost it once per batch. Other requests' items of the modality wait with it; other
        modalities' ready batches run meanwhile (_next_batch)."""
        head = q.head
        deadline = q.since + self._delay_s
        request, modality = head.request, head.item.modality
        pending = request.preparing[modality]
        if pending > 0 and len(q) < self._share(q, pending, request.preparing_tokens[modality], tokens):
            deadline += self._gather_s
        return deadline

    def _share(self, q: ModalityQueue, pending: int, pending_tokens: int, tokens: int) -> int:
        """How many items a batch should hold of the queue plus `pending` items still decoding
        (`pending_tokens` by their header estimates: text at one token per character, so an item
        with much text may look larger than it is): all of them when they fit one batch, else an
        even share of the batches they need, at their mean cost under `tokens` and max_batch_items
        (never more than one batch takes: three items of which one fits a batch share 1, not 2)."""
        items = len(q) + pending
        cost = max(1, (q.tokens + pending_tokens) // items)  # an item's mean cost
        per_batch = max(1, min(self.max_batch_items, tokens // cost))
        return math.ceil(items / math.ceil(items / per_batch))

    async def _gpu_call(self, batch: Sequence[PreparedItem]) -> np.ndarray:
        self._busy_since = time.monotonic()
        try:
            vectors = await self._gpu.submit(self._engine.embed, batch)
        finally:
            self._busy_since = None
        if not isinstance(vectors, np.ndarray) or vectors.ndim != 2 or vectors.shape[0] != len(batch):
            shape = getattr(vectors, "shape", type(vectors).__name__)
            raise EngineError(f"engine returned {shape} for a batch of {len(batch)}")
        return vectors

    async def _run(self, batch: list[Work]) -> None:
        live = [w for w in batch if not w.request.dead]
        if len(live) < len(batch):
            self._metrics.dropped_items.labels("gpu_queue").inc(len(batch) - len(live))
        if not live:
            return
        modality = live[0].item.modality
        start = time.monotonic()
        queue_seconds = self._metrics.queue_seconds.labels(modality)  # one lookup a batch, not an item
        for work in live:
            waited = start - work.enqueued
            work.request.queue_s = max(work.request.queue_s, waited)
            queue_seconds.observe(waited)
        try:
            vectors = await self._gpu_call([w.item for w in live])
        except Exception as exc:
            if len(live) == 1:
                live[0].request.fail(exc)
                return
            # Out of memory: smaller batches may fit. Anything else: isolate the item that raises.
            reason = "oom" if isinstance(exc, EngineOutOfMemory) else "error"
            log.warning(
                "GPU batch failed; splitting it in halves",
                extra={
                    "modality": modality,
                    "items": len(live),
                    "reason": reason,
                    "error": type(exc).__name__,
                },
            )
            self._metrics.batch_splits.labels(reason).inc()
            half = len(live) // 2
            await self._run(live[:half])
            await self._run(live[half:])
            return
        elapsed = time.monotonic() - start
        batch_id = next(self._batch_ids)
        tokens = sum(w.item.cost for w in live)
        self._metrics.batch_size.labels(modality).observe(len(live))
        self._metrics.batch_tokens.labels(modality).observe(tokens)
        self._metrics.inference_seconds.labels(modality).observe(elapsed)
        self._metrics.tokens.labels(modality).inc(sum(w.item.num_tokens for w in live))
        rate = len(live) / max(elapsed, 1e-6)
        self._items_per_s = rate if self._items_per_s == 0 else 0.8 * self._items_per_s + 0.2 * rate
        for work, row in zip(live, vectors, strict=True):
            if tokens := work.request.held.pop(work.key, 0):
                self.media_budget.release(tokens)
            work.request.deliver(work, row, batch_id, elapsed)
