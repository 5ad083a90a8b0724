"""Packed text batches: the items of a batch laid end to end, with no padding between them.

Shapes: N tokens in all, S items, D embedding dim. Item s holds tokens cu_seqlens[s]:cu_seqlens[s+1]
and RoPE positions 0..len-1, exactly as if it ran alone; attention keeps each item to itself
(packed_attention.py), everything else in the text encoder works per token.

A static bucket (a CUDA graph needs fixed shapes) may round N and S up: the extra tokens form one more
item, the pad tail, of zero embeddings; the extra items after it are empty. The pad tail is an item
like any other, so every kernel computes finite values for every row, and pooling drops its vector.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Packing:
    cu_seqlens: torch.Tensor  # (S + 1,) int32, 0 first, N last
    doc_ids: torch.Tensor  # (N,) int32: the item of each token
    positions: torch.Tensor  # (N,) int32: the token's position within its item
    max_len: int  # a bound on any item's length: varlen kernels size their grids by it

    @property
    def num_tokens(self) -> int:
        return self.doc_ids.shape[0]

    @classmethod
    def from_lengths(
        cls,
        lengths: Sequence[int],
        device: torch.device | str = "cpu",
        tokens: int | None = None,
        items: int | None = None,
        max_len: int | None = None,
    ) -> Packing:
        """Items of these lengths (each >= 1) end to end.

        `tokens` and `items` round N and S up to a bucket: tokens past sum(lengths) form the pad
        tail, items past it are empty. `max_len` overrides the bound on an item's length, the
        longest item's by default, the pad tail's included (a graph bakes it in: pass the bucket's
        `tokens`). Built on the host and copied over in one transfer.
        """
        flat = cls.layout(lengths, tokens, items)
        n = sum(lengths) if tokens is None else tokens
        longest = max(max(lengths), n - sum(lengths))  # the pad tail is an item too
        if max_len is not None and max_len < longest:
            raise ValueError(f"max_len {max_len} is below the longest item, {longest} tokens")
        return cls.from_layout(
            flat.to(device), flat.shape[0] - 1 - 2 * n, longest if max_len is None else max_len
        )

    @staticmethod
    def layout(lengths: Sequence[int], tokens: int | None = None, items: int | None = None) -> torch.Tensor:
        """The packing's tensors side by side on the host, int32: cu_seqlens (S + 1), doc ids (N),
        positions (N): what `from_layout` reads, one copy to the device. `tokens`, `items`: as
        `from_lengths`.

        Built with numpy: torch's CPU ops on these few hundred values cost more in their thread pool's
        start-up than in work (H200 host, 16 threads: ~1.8 ms a repeat_interleave under the profiler).
        """
        if not lengths or min(lengths) < 1:
            raise ValueError(f"every item needs at least one token, got lengths {list(lengths)[:8]}")
        real = sum(lengths)
        n = real if tokens is None else tokens
        sizes = list(lengths) + ([n - real] if n > real else [])
        s = len(sizes) if items is None else items
        if n < real or s < len(sizes):
            raise ValueError(
                f"{len(lengths)} items of {real} tokens do not fit a bucket of {s} items, {n} tokens"
            )
        size = np.zeros(s, dtype=np.int32)
        size[: len(sizes)] = sizes
        flat = np.empty(s + 1 + 2 * n, dtype=np.int32)
        cu = flat[: s + 1]
        cu[0] = 0
        np.cumsum(size, out=cu[1:])
        doc = flat[s + 1 : s + 1 + n]
        doc[:] = np.repeat(np.arange(s, dtype=np.int32), size)
        flat[s + 1 + n :] = np.arange(n, dtype=np.int32) - cu[doc]
        return torch.from_numpy(flat)

    @classmethod
    def from_layout(cls, flat: torch.Tensor, items: int, max_len: int) -> Packing:
        """The Packing whose tensors are views of `flat` (`layout`'s order) for S = `items`: a graph's
        static buffer, which a new layout is copied into before each replay."""
        n = (flat.shape[0] - items - 1) // 2
        return cls(flat[: items + 1], flat[items + 1 : items + 1 + n], flat[items + 1 + n :], max_len)

    def copy_(self, other: Packing) -> None:
        """Take `other`'s layout into these tensors in place (a captured graph reads them)."""
        same = other.cu_seqlens.shape == self.cu_seqlens.shape and other.num_tokens == self.num_tokens
        if not same or other.max_len > self.max_len:
            raise ValueError("a packing is copied only into one of the same bucket")
        self.cu_seqlens.copy_(other.cu_seqlens, non_blocking=True)
        self.doc_ids.copy_(other.doc_ids, non_blocking=True)
        self.positions.copy_(other.positions, non_blocking=True)

    def pool(self, tokens: torch.Tensor) -> torch.Tensor:
        """(N, D) per-token embeddings -> (S, D) unit vectors: each item's mean over all its tokens,
        then L2, as `model.pool` does on a padded batch. Rows past the real items (the pad tail, empty
        items as zero vectors) are the caller's to drop.

        A matmul with per-item weights 1/len rather than a scatter-add: cuBLAS sums in a fixed order,
        so two runs (or two replays of one graph) give the same bits, where atomics would not.
        """
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).clamp(min=1).to(tokens.dtype)  # (S,)
        items = torch.arange(lengths.shape[0], dtype=self.doc_ids.dtype, device=tokens.device)
        weights = (self.doc_ids[None, :] == items[:, None]).to(tokens.dtype) / lengths[:, None]  # (S, N)
        return F.normalize(weights @ tokens, p=2, dim=-1)
