"""CUDA graphs over the packed text forward: the fast path beside `TextEncoder.forward` + `pool`.

Why: a padded batch runs every item at its longest item's length (64 docs of 20-60 tokens: 4,096
padded tokens for ~2,600 real ones), and a (rows x length) grid of graph buckets needs a graph per
pair. Packed, the items lie end to end (packing.py) and only their tokens run, plus the rounding of
one ladder of token buckets; attention keeps each item to itself with varlen kernels that compute
nothing across items or outside the window (packed_attention.py). A captured graph replays the ~2,400
launches of the 24 layers with one call, as graphs.py does for padded buckets.

How: a batch's items are cut into runs of at most MAX_ITEMS items whose tokens fit the largest
bucket the pool holds (`runs`); each run is laid end to end into a bucket of N tokens
(TOKEN_LADDER) and S = `items_for(N)` item slots, copied into static buffers, and its bucket's graph
replayed (captured on first use, or at boot with `capture_buckets`). The bucket's tokens past the
run's form one more item, the pad tail, of zero embeddings; the item slots after it are empty; both
are dropped from the output. A run no bucket holds (a bucket the pool refused, or one item past the
ladder) runs the same packed forward eagerly, at its exact size.

Assumes one caller thread (the engine's). Every graph shares the GraphPool with the tower graphs
and one set of static buffers; replays never overlap, and each result is copied out before the next.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from functools import partial

import torch

from eg2_runtime.graphs import Captured, GraphPool, TextGraphs
from eg2_runtime.packing import Packing
from eg2_runtime.text import TextEncoder

# Finer rungs where most batches land; each rung is one graph (~4 MiB of executable beside the
# activations the pool's largest graph already holds, memory_plan.GRAPH_EXECUTABLE). Between 2,048
# and 4,096 tokens the rungs are 256 apart, so a long document pads by at most 1/8 (a 2,200-token
# one to 2,304, not 2,560); the start-up set leaves out the in-between ones (FIRST_USE).
TOKEN_LADDER = (
    *(32, 64, 128, 192, 256, 384, 512, 768),
    *(1024, 1536, *range(2048, 4096, 256), 4096, 5120, 6144, 8192, 10240, 12288, 16384),
)
FIRST_USE = (2304, 2816, 3328, 3584, 3840)  # captured when a batch first needs one, never at boot
MAX_ITEMS = 64  # real items per replay; a larger batch replays in runs


def items_for(tokens: int) -> int:
    """Item slots of the N-token bucket: room for MAX_ITEMS items and the pad tail, fewer on small
    buckets (8 tokens an item), whose varlen kernels then launch fewer empty blocks."""
    return min(MAX_ITEMS + 1, max(2, tokens // 8))


def runs(lengths: Sequence[int], top: int) -> Iterator[tuple[int, int]]:
    """Consecutive [start, stop) runs of items, each at most MAX_ITEMS items and `top` tokens (an item
    longer than `top` alone in its run)."""
    start, total = 0, 0
    for i, n in enumerate(lengths):
        if i > start and (total + n > top or i - start >= MAX_ITEMS):
            yield start, i
            start, total = i, 0
        total += n
    yield start, len(lengths)


class PackedTextGraphs(TextGraphs[int]):
    """`(embeds (N, H) of items end to end, lengths) -> (len(lengths), D)` unit vectors, as
    `pool(encoder(...))` of the same items padded.

    `max_tokens` bounds a bucket's N (the memory plan sets it). `pool`: the GraphPool to draw on,
    admitting a bucket by `token_bytes` per token. `backends`: the attention kernel per layer kind
    (packed_attention.py; None: the device's default, varlen kernels on CUDA, the dense reference
    elsewhere). `capture=False` runs each bucket's step eagerly: the CPU test of the packing and
    bucketing.
    """

    def __init__(
        self,
        encoder: TextEncoder,
        max_tokens: int,
        pool: GraphPool | None = None,
        token_bytes: int = 0,
        backends: Mapping[str, str] | None = None,
        capture: bool = True,
    ) -> None:
        super().__init__(encoder, max_tokens, pool, token_bytes, capture)
        self.backends = backends
        # Flat static inputs every bucket views the leading part of: embeddings (max_tokens, H), and
        # the packing's cu_seqlens, doc ids and positions side by side (one host-to-device copy).
        self.embeds: torch.Tensor | None = None
        self.layout: torch.Tensor | None = None

    def ladder(self) -> list[int]:
        """The rungs within max_tokens the pool has not refused."""
        return [n for n in TOKEN_LADDER if n <= self.max_tokens and n not in self.refused]

    def bucket(self, tokens: int, items: int) -> int | None:
        """The smallest open rung that holds `items` items of `tokens` tokens in all (the pad tail
        needs a slot of its own where the rung is longer), or None."""
        for n in self.ladder():
            if n >= tokens and items_for(n) >= items + (n > tokens):
                return n
        return None

    def __call__(self, embeds: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """(N, H) embeddings of items end to end, their lengths (each >= 1) -> (S, D) fp32 unit
        vectors, each run through its bucket's graph, or eagerly where no bucket holds it.

        A run that no bucket holds is halved until one does (a run of many short items may fit a
        bucket's tokens but not its item slots); a single item no bucket holds runs eagerly, and
        with no bucket at all the whole batch does, in one forward."""
        if embeds.shape[0] != sum(lengths):
            raise ValueError(f"{embeds.shape[0]} embedding rows for items of {sum(lengths)} tokens")
        if not self.ladder():
            return self.eager(embeds, lengths)
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length)
        parts: list[torch.Tensor] = []
        todo = [(0, len(lengths))]
        while todo:
            a, b = todo.pop(0)
            pieces = list(runs(lengths[a:b], max(self.ladder(), default=0)))
            if len(pieces) > 1:
                todo[:0] = [(a + x, a + y) for x, y in pieces]
                continue
            rows = embeds[starts[a] : starts[b]]
            bucket = self.bucket(starts[b] - starts[a], b - a)
            if bucket is None and b - a > 1:
                todo[:0] = [(a, (a + b) // 2), ((a + b) // 2, b)]
                continue
            if bucket is None:
                parts.append(self.eager(rows, lengths[a:b]))
                continue
            part = self._replay(bucket, rows, lengths[a:b])
            if part is None:  # the pool refused the bucket just now: cut the run again
                todo.insert(0, (a, b))
                continue
            parts.append(part)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def eager(self, embeds: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """The same packed forward with no graph, at the items' exact size (the engine's warm-up
        measures with it what a batch no bucket holds takes)."""
        return self._step(embeds, Packing.from_lengths(lengths, self.device))[: len(lengths)]

    def _step(self, x: torch.Tensor, packing: Packing) -> torch.Tensor:
        return packing.pool(self.encoder.forward_packed(x, packing, self.backends).float())

    def _inputs(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The n-token bucket's static (n, H) embeddings and its flat packing layout."""
        if self.embeds is None or self.layout is None:
            w = self.encoder.embedding_projection.weight
            hidden = self.encoder.cfg.hidden_size
            self.embeds = torch.zeros(self.max_tokens, hidden, dtype=w.dtype, device=w.device)
            self.layout = torch.zeros(MAX_ITEMS + 2 + 2 * self.max_tokens, dtype=torch.int32, device=w.device)
        return self.embeds[:n], self.layout[: items_for(n) + 1 + 2 * n]

    def _bucket_step(self, n: int, x: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
        return self._step(x, Packing.from_layout(layout, items_for(n), max_len=n))

    def _replay(self, n: int, rows: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor | None:
        """The run through bucket n's graph; None when its capture is refused now."""
        captured = self.graphs.get(n) or self._capture(n)
        if captured is None:
            return None
        x, layout = self._inputs(n)
        real = rows.shape[0]
        x[:real].copy_(rows)
        x[real:].zero_()
        host = Packing.layout(lengths, tokens=n, items=items_for(n))
        layout.copy_(host.pin_memory() if self.capture else host, non_blocking=True)
        if captured.graph is None:
            return self._bucket_step(n, x, layout)[: len(lengths)]
        captured.graph.replay()
        assert captured.out is not None
        return captured.out[: len(lengths)].clone()  # the static output is overwritten next replay

    def admissible(self, key: int) -> bool:
        return key <= self.max_tokens

    def _capture(self, n: int, then: int = 0) -> Captured | None:
        """Bucket n's graph, captured now (TextGraphs._take)."""

        def inputs() -> Sequence[torch.Tensor]:
            x, layout = self._inputs(n)
            layout.copy_(Packing.layout([n], tokens=n, items=items_for(n)))  # any valid layout
            return x, layout

        return self._take(n, partial(self._bucket_step, n), inputs, then)

    def tokens(self, key: int) -> int:
        return key
