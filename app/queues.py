"""What the batcher holds between a request's arrival and its rows: each call's state, its prepared items
in per-modality lines of requests that take turns, and the budget of media decoded ahead of the GPU.

    EmbedCall        one call to Batcher.embed: its rows land here, its futures and flags live here
    Work             one prepared item of a call, waiting for a GPU batch
    ModalityQueue    one modality's Work, as a line of calls taking turns; take() gives a batch
    MediaBudget      media soft tokens decoded and not yet embedded, held under a limit
    Embedded         what embed() returns
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eg2_runtime.api import PreparedItem, Span


@dataclass(frozen=True)
class Embedded:
    vectors: np.ndarray  # (N, D) float32 unit rows, in item order
    num_tokens: int  # sum of PreparedItem.num_tokens: what `usage` reports
    # Items with segments: item index -> its spans in order and their (S, D) rows.
    segments: dict[int, tuple[list[Span], np.ndarray]]
    queue_s: float  # longest wait of one of its items for the GPU
    inference_s: float  # summed time of the GPU batches that carried its items


class MediaBudget:
    """Media soft tokens being decoded or decoded and not yet embedded, across all requests, held under
    a limit: a media job starts only once its tokens fit, in arrival order.

    Why: a decoded image holds ~7 kB of patches per soft token until its batch runs (a 1120-token image:
    7.7 MB), and decoding runs ahead of the GPU; without a bound, memory grows with every image waiting
    in any request. A job larger than the whole budget runs when nothing else holds any.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def acquire(self, tokens: int) -> None:
        if not self._waiters and self._fits(tokens):
            self.used += tokens
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((tokens, granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release(tokens)  # granted, but its request ended meanwhile
            else:
                self._waiters = deque(w for w in self._waiters if w[1] is not granted)
                self._grant()
            raise

    def release(self, tokens: int) -> None:
        self.used -= tokens
        self._grant()

    def adjust(self, tokens: int) -> None:
        """Hold `tokens` more (fewer, when negative) than was acquired, at once: a stream's step turned
        out larger or smaller than its estimate. May pass the limit by one step's error."""
        self.used += tokens
        if tokens < 0:
            self._grant()

    def _fits(self, tokens: int) -> bool:
        return self.used == 0 or self.used + tokens <= self.limit

    def _grant(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            tokens, granted = self._waiters.popleft()
            if not granted.done():
                self.used += tokens
                granted.set_result(None)


class EmbedCall:
    """One call to embed(): its items' rows land here; done (any way) means dead."""

    def __init__(self, n: int, loop: asyncio.AbstractEventLoop) -> None:
        self.future: asyncio.Future[None] = loop.create_future()
        self.rows: list[np.ndarray | None] = [None] * n
        self.spans: dict[int, dict[int, tuple[Span, np.ndarray]]] = {}  # item -> span index -> row
        self.remaining = n  # rows not delivered yet, plus one per stream still preparing
        self.expected = n  # items it has (its spans counted as they are cut)
        self.segments = 0  # spans cut so far
        self.admitted = n  # what it holds of the admission limit
        self.num_tokens = 0
        self.queue_s = 0.0
        self.inference_s = 0.0
        self.last_batch = -1
        self.prep_futures: list[asyncio.Future[Any]] = []
        # Set when the request ends: its decoding stops (engine.prepare_many checks it per frame / block).
        self.cancel = threading.Event()
        self.queued = 0  # items that reached the GPU queues
        self.failed = 0  # items whose preparation failed (they fail the request; not "dropped")
        self.refused = False  # refused by the cost check before any work: nothing to drop
        self.held: dict[tuple[int, int], int] = {}  # (item, span or -1) -> its tokens in the media budget
        # Its items in preprocessing jobs, by modality, and their estimated tokens (media; text 0).
        self.preparing: Counter[str] = Counter()
        self.preparing_tokens: Counter[str] = Counter()

    @property
    def dead(self) -> bool:
        return self.future.done()

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)

    def deliver(self, work: Work, row: np.ndarray, batch_id: int, batch_s: float) -> None:
        span = work.item.span
        if span is None:
            self.rows[work.index] = row
        else:
            self.spans.setdefault(work.index, {})[span.index] = (span, row)
        self.num_tokens += work.item.num_tokens
        if batch_id != self.last_batch:
            self.last_batch = batch_id
            self.inference_s += batch_s
        self.settle(1)

    def settle(self, n: int) -> None:
        """`n` rows (or a finished stream) fewer to wait for; done at none."""
        self.remaining -= n
        if self.remaining == 0 and not self.future.done():
            self.future.set_result(None)

    def embedded(self) -> Embedded:
        rows = np.stack(self.rows)  # type: ignore[arg-type]  # every row was delivered
        segments = {}
        for index, spans in self.spans.items():
            ordered = [spans[k] for k in sorted(spans)]
            segments[index] = ([span for span, _ in ordered], np.stack([row for _, row in ordered]))
        return Embedded(rows, self.num_tokens, segments, self.queue_s, self.inference_s)


@dataclass(eq=False)
class Work:
    request: EmbedCall
    index: int
    item: PreparedItem
    enqueued: float = field(default_factory=time.monotonic)

    @property
    def key(self) -> tuple[int, int]:
        """Its slot in the request: (item, span index), -1 for the item itself."""
        return self.index, -1 if self.item.span is None else self.item.span.index


class Turn:
    """A request's items in one queue, oldest first, and when it joined the back of the line."""

    def __init__(self, since: float) -> None:
        self.items: deque[Work] = deque()
        self.since = since


class ModalityQueue:
    """Prepared items of one modality, as a line of requests that take turns.

    Each batch is the turn of the request at the front of the line: its items first (its first item
    plus those closest to it in cost, from its next `window`), then, while the batch has room, items
    of the requests behind it (the next `window` in line order) in rounds: every request's first
    item, closest in cost to the batch's first item first, then every request's second, and so on.
    After its turn a request with items left goes to the back of the line; one with none leaves,
    and its next item joins at the back (so does one emptied by a fill).

    - Single-item requests: first-in-first-out, grouped by cost within the window, as a plain
      queue would.
    - A request of many batches (a long file in segments, a bulk call) runs one batch as the front
      and then waits behind every request queued after it for its next turn; behind others it
      fills only what their rounds leave. A query behind 1.8 M tokens waits for about one batch
      per request ahead of it in line, not for all 1.8 M tokens.
    - Requests of several items each run within one batch where they fit one (two calls of 8
      images share a batch of 16), in the order they joined, rather than interleaved in the order
      their items finished decoding. The cost: where they do not fit together, batches are grouped
      by cost within each request's turn, so where batches are padded to their longest item
      (audio), several multi-clip requests of mixed lengths pad more than one cost-sorted stream of
      all their clips would.

    A batch costs O(window) whatever the depth of the queue (drop_dead, run when a request ends,
    walks the line)."""

    def __init__(self) -> None:
        self.line: OrderedDict[EmbedCall, Turn] = OrderedDict()  # front first
        self.tokens = 0  # summed cost of the queued items
        self._n = 0

    def __len__(self) -> int:
        return self._n

    @property
    def head(self) -> Work:
        """The item the next batch starts with: the front request's first."""
        return next(iter(self.line.values())).items[0]

    @property
    def since(self) -> float:
        """When the front request joined the line: its first item's arrival, or when its last turn
        was taken. The queue delay and the choice between modalities count from it."""
        return next(iter(self.line.values())).since

    def append(self, work: Work) -> None:
        turn = self.line.get(work.request)
        if turn is None:
            turn = self.line[work.request] = Turn(work.enqueued)
        turn.items.append(work)
        self.tokens += work.item.cost
        self._n += 1

    def drop_dead(self) -> int:
        dropped = 0
        for request in [r for r in self.line if r.dead]:
            turn = self.line.pop(request)
            dropped += len(turn.items)
            self.tokens -= sum(w.item.cost for w in turn.items)
        self._n -= dropped
        return dropped

    def take(self, max_tokens: int, max_items: int, window: int) -> list[Work]:
        """The front request's turn: a batch under both budgets, as the class says."""
        turns = iter(self.line.items())
        front, first = next(turns)
        seen = {front: list(itertools.islice(first.items, window + 1))}  # request -> its looked-at prefix
        head = seen[front][0]
        batch, tokens = [head], head.item.cost

        def fill(candidates: list[Work]) -> None:
            nonlocal tokens
            for work in sorted(candidates, key=lambda w: abs(w.item.cost - head.item.cost)):
                if len(batch) == max_items:
                    return
                if tokens + work.item.cost <= max_tokens:
                    batch.append(work)
                    tokens += work.item.cost

        fill(seen[front][1:])
        if len(batch) < max_items:  # the requests behind: round i holds each one's i-th item
            rounds: list[list[Work]] = [[]]
            looked = 0
            for request, turn in turns:
                if looked >= window:
                    break
                if len(turn.items) == 1:  # the common case, kept cheap
                    rounds[0].append(turn.items[0])
                    looked += 1
                    continue
                prefix = seen[request] = list(itertools.islice(turn.items, window - looked))
                looked += len(prefix)
                rounds += [[] for _ in range(len(prefix) - len(rounds))]
                for i, work in enumerate(prefix):
                    rounds[i].append(work)
            for candidates in rounds:
                if len(batch) == max_items:
                    break
                fill(candidates)

        taken = {id(w) for w in batch}
        for request in dict.fromkeys(w.request for w in batch):  # each prefix, less what was taken
            turn = self.line[request]
            prefix = seen.get(request) or [turn.items[0]]
            for _ in prefix:
                turn.items.popleft()
            turn.items.extendleft(reversed([w for w in prefix if id(w) not in taken]))
            if not turn.items and request is not front:
                del self.line[request]
        if first.items:  # its turn is over: to the back of the line
            self.line.move_to_end(front)
            first.since = time.monotonic()
        else:
            del self.line[front]
        self.tokens -= tokens
        self._n -= len(batch)
        return sorted(batch, key=lambda w: w.item.cost)
