"""Attention over a packed text batch (packing.py): a token sees only the tokens of its own item, and
on sliding layers only those within the window of it (|q - k| <= window, a radius).

Shapes: q (N, nh, hd), k and v (N, kv, hd) -> (N, nh, hd); nh a multiple of kv (grouped-query heads).
Scale 1.0: q_norm and k_norm already fix the logit scale.

Backends, chosen per layer kind:
- "dense": SDPA under the element mask spelled out from the block mask below. The reference and the
  CPU path; it holds (N, N) masks and scores, so it is for tests and small batches, not for serving.
- "flex": FlexAttention under the block mask, compiled on CUDA (eager elsewhere, for tests). Blocks
  the mask hides are never computed; full blocks skip the mask function.
- "flash": FlashAttention-2 varlen as bundled in torch, the window given as (left, right) radii: each
  item is its own sequence, so nothing across items or outside the window is computed. CUDA, BF16,
  head_dim <= 256: the sliding layers only.
- "efficient": the CUTLASS memory-efficient kernel, varlen, for any head_dim (512 on the full
  layers, where FlashAttention stops at 256); no window.

The block mask cuts the N x N pairs into blocks of `block_size`: a (query block, key block) pair is
empty (skipped), full (every pair allowed) or partial (the mask function decides per element). It is
built from the packing with tensor ops only, no host sync, so a CUDA graph can capture it and replay
it after the packing's tensors change in place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from eg2_runtime.config import FULL, SLIDING, TextConfig
from eg2_runtime.memory_plan import MIN_GRAPH_TEXT_TOKENS
from eg2_runtime.packing import Packing

BACKENDS = ("dense", "flex", "flash", "efficient")
# Per layer kind on CUDA, what the engine serves: FlashAttention-2 varlen with the window on the
# sliding layers (head_dim 256), the CUTLASS varlen kernel on the full layers (head_dim 512, past
# FlashAttention's 256). Both take the packing's tensors without a host sync, so CUDA graphs capture
# them. FlexAttention's compiled kernel recompiled per graph bucket under capture (H200, 2026-12-01:
# dynamo's recompile limit, each bucket's block mask closing over new tensors).
CUDA_BACKENDS = {SLIDING: "flash", FULL: "efficient"}
CPU_BACKENDS = {SLIDING: "dense", FULL: "dense"}
FLASH_MAX_HEAD_DIM = 256
# The full layers' kernel takes a long batch's queries this many tokens at a time (_efficient): its
# FP32 accumulator, 8 kB a token at head_dim 512, was the largest part of an 8,192-token forward's
# peak (24 kB a token, H200, benchmarks/probe_costs.py). At or below it, one call: cut at 1,024 the
# 2,200-token document's batch took 8.84 ms (ca521ee) against 7.50 uncut (a8e7985), two runs on the
# H200 the same day (docs/PERF.md), so every start-up bucket (up to memory_plan.MIN_GRAPH_TEXT_TOKENS)
# runs as before and only longer batches are cut. text.MLP_ROWS is the same number, for the same
# reason. Each chunk's output overwrites its own rows of q, which no other chunk reads: an
# 8,192-token forward no longer holds a whole output beside q (32 MiB; its allocator peak 176 MiB,
# H200, 2026-12-03, benchmarks/probe_live_sets.py; 144 measured with 2,048-token chunks, where the
# merged q, k, v product beside q, k and v is the peak, which 4,096-token chunks reach too).
QUERY_ROWS = MIN_GRAPH_TEXT_TOKENS

# FlexAttention tile sizes by (dtype, head_dim); inductor's defaults elsewhere. At 512 in BF16 a
# 64-row query tile is 64 KiB and each 32-row key or value tile 32 KiB, so two pipeline stages fit
# the H200's 227 KiB of shared memory per block; inductor's default there asks for three.
FLEX_KERNEL_OPTIONS: dict[tuple[torch.dtype, int], dict[str, Any]] = {
    (torch.bfloat16, 512): {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 2, "num_warps": 4},
}


class PackedAttention:
    """The attention of every layer kind for one packing: `attention(kind, q, k, v)`.

    Block masks are built on first use per kind and kept: all layers of a kind share one.
    """

    def __init__(
        self,
        packing: Packing,
        cfg: TextConfig,
        backends: Mapping[str, str] | None = None,
        block_size: int = 128,
    ) -> None:
        on_cuda = packing.doc_ids.is_cuda
        self.backends = dict(backends or (CUDA_BACKENDS if on_cuda else CPU_BACKENDS))
        for kind in set(cfg.layer_types):
            backend = self.backends.get(kind)
            if backend not in BACKENDS:
                raise ValueError(f"attention backend {backend!r} for {kind}: choose from {BACKENDS}")
            head_dim = max(d for d, k in zip(cfg.head_dims, cfg.layer_types, strict=True) if k == kind)
            if backend == "flash" and head_dim > FLASH_MAX_HEAD_DIM:
                raise ValueError(f"'flash' takes head_dim <= {FLASH_MAX_HEAD_DIM}; {kind} has {head_dim}")
            if backend == "efficient" and kind == SLIDING:
                raise ValueError(f"{backend!r} has no bidirectional window: it serves full layers only")
            if backend in ("flash", "efficient") and not on_cuda:
                raise ValueError(f"the {backend!r} attention backend needs CUDA")
        self.packing = packing
        self.windows: dict[str, int | None] = {SLIDING: cfg.sliding_window, FULL: None}
        self.block_size = block_size
        self._masks: dict[str, BlockMask] = {}
        self._dense: dict[str, torch.Tensor] = {}

    def block_mask(self, kind: str) -> BlockMask:
        if kind not in self._masks:
            self._masks[kind] = block_mask(self.packing, self.windows[kind], self.block_size)
        return self._masks[kind]

    def __call__(self, kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        backend = self.backends[kind]
        if backend == "flash":
            return _flash(q, k, v, self.packing, self.windows[kind])
        if backend == "efficient":
            return _efficient(q, k, v, self.packing)
        if backend == "flex":
            return _flex(q, k, v, self.block_mask(kind))
        if kind not in self._dense:
            self._dense[kind] = element_mask(self.block_mask(kind))
        return _dense(q, k, v, self._dense[kind])


# ---- the block mask ----------------------------------------------------------------------------


def block_mask(packing: Packing, window: int | None, block_size: int = 128) -> BlockMask:
    """The packing's BlockMask: same item, and |q - k| <= window where `window` is not None.

    Items are contiguous, so two blocks share an item only if the item at the end of the earlier
    block runs into the later one; the nearest pair of tokens is then the last of the earlier block
    and the first of the later, both in that item. A block pair is full when one item covers both
    blocks and their farthest pair is within the window. (Positions restart per item, but within an
    item |q - k| in the packing equals the distance of their positions.)
    """
    n, doc = packing.num_tokens, packing.doc_ids
    reach = n if window is None else window
    first = torch.arange(0, n, block_size, device=doc.device)  # (nb,) first token of each block
    last = (first + block_size - 1).clamp(max=n - 1)
    d_first, d_last = doc[first], doc[last]
    later = first[None, :] > first[:, None]  # (nb_q, nb_kv): the key block comes after the query block
    gap = torch.where(later, first[None, :] - last[:, None], first[:, None] - last[None, :])
    shared = torch.where(later, d_last[:, None] == d_first[None, :], d_first[:, None] == d_last[None, :])
    diagonal = first[None, :] == first[:, None]
    any_pair = diagonal | (shared & (gap <= reach))
    one_item = d_first == d_last
    farthest = torch.maximum(last[None, :] - first[:, None], last[:, None] - first[None, :])
    full = (
        one_item[:, None] & one_item[None, :] & (d_first[:, None] == d_first[None, :]) & (farthest <= reach)
    )
    partial = any_pair & ~full
    return BlockMask.from_kv_blocks(
        *_ordered(partial),
        *_ordered(full),
        BLOCK_SIZE=block_size,
        mask_mod=_mask_mod(doc, window),
        seq_lengths=(n, n),
        compute_q_blocks=False,  # only the backward pass walks the mask by key block
    )


def _mask_mod(doc: torch.Tensor, window: int | None) -> Callable[..., torch.Tensor]:
    if window is None:

        def same_item(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return doc[q] == doc[kv]

        return same_item

    def same_item_in_window(
        b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return (doc[q] == doc[kv]) & (q - kv <= window) & (kv - q <= window)

    return same_item_in_window


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(nb_q, nb_kv) bool -> BlockMask's (1, 1, nb_q) counts and (1, 1, nb_q, nb_kv) key-block
    indices, each row's set blocks first."""
    counts = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts[None, None], order.to(torch.int32)[None, None]


def element_mask(mask: BlockMask) -> torch.Tensor:
    """(N, N) bool: what a BlockMask lets through, element by element: every pair of its full blocks,
    and the pairs of its partial blocks that the mask function allows. What flex computes."""
    n_q, n_kv = mask.seq_lengths
    size_q, size_kv = mask.BLOCK_SIZE
    device = mask.kv_indices.device

    def blocks(counts: torch.Tensor | None, indices: torch.Tensor | None) -> torch.Tensor:
        nb_q, nb_kv = mask.kv_indices.shape[-2:]
        dense = torch.zeros(nb_q, nb_kv + 1, dtype=torch.bool, device=device)
        if counts is not None and indices is not None:
            listed = torch.arange(indices.shape[-1], device=device)[None, :] < counts[0, 0][:, None]
            dense.scatter_(1, torch.where(listed, indices[0, 0].long(), nb_kv), True)
        cells = dense[:, :nb_kv].repeat_interleave(size_q, 0).repeat_interleave(size_kv, 1)
        return cells[:n_q, :n_kv]

    q = torch.arange(n_q, device=device)[:, None]
    kv = torch.arange(n_kv, device=device)[None, :]
    zero = torch.zeros((), dtype=torch.long, device=device)
    allowed = mask.mask_mod(zero, zero, q, kv)
    partial = blocks(mask.kv_num_blocks, mask.kv_indices)
    return blocks(mask.full_kv_num_blocks, mask.full_kv_indices) | (partial & allowed)


# ---- the backends ------------------------------------------------------------------------------


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1)[None]  # (N, heads, hd) -> (1, heads, N, hd)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        _heads_first(q), _heads_first(k), _heads_first(v), attn_mask=mask, scale=1.0, enable_gqa=True
    )
    return out[0].transpose(0, 1)


@functools.cache
def _compiled_flex() -> Callable[..., Any]:
    # Without compile, flex_attention spells out the whole score matrix; compiled, it is one fused
    # Triton kernel that walks only the blocks the BlockMask lists.
    return torch.compile(flex_attention, fullgraph=True)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask) -> torch.Tensor:
    attend = _compiled_flex() if q.is_cuda else cast(Callable[..., Any], flex_attention)
    out = attend(
        _heads_first(q),
        _heads_first(k),
        _heads_first(v),
        block_mask=mask,
        scale=1.0,
        enable_gqa=True,
        kernel_options=FLEX_KERNEL_OPTIONS.get((q.dtype, q.shape[-1])),
    )
    return out[0].transpose(0, 1)


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing, window: int | None
) -> torch.Tensor:
    radius = -1 if window is None else window
    cu, longest = packing.cu_seqlens, packing.max_len
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, longest, longest, 0.0, False, False,
        scale=1.0, window_size_left=radius, window_size_right=radius,
    )  # fmt: skip
    return out[0]


def _efficient(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing, rows: int = QUERY_ROWS
) -> torch.Tensor:
    """The kernel takes as many kv heads as query heads. With one kv head (the full layers), a token's
    query heads are rather folded into its item's query rows: (N, nh, hd) viewed as (N nh, 1, hd),
    item i's queries nh times as many rows against its own keys. Full attention has no positions in
    its mask, and each query row's softmax runs over the same keys, so nothing is copied or repeated
    (_efficient_repeated, the general path, copies k and v nh times: 8 kB a token in BF16 at head_dim 512).

    Past `rows` tokens the queries go `rows` at a time, each call against every key: the kernel's
    FP32 accumulator (past head_dim 128: 8 kB a token here) then lives for one chunk, not the batch,
    and the chunk's output overwrites its rows of q (**q is the output then**: callers drop q after).
    A chunk's items are the packing's items cut to it (cu_seqlens clamped to the chunk; items outside
    it get no queries), computed on the device, so a CUDA graph captures the chunks too.
    """
    if k.shape[1] != 1:
        return _efficient_repeated(q, k, v, packing)
    n, heads = q.shape[:2]
    cu, longest = packing.cu_seqlens, packing.max_len
    if n <= rows:
        return _folded(q, k, v, cu * heads, cu, longest * heads, longest)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        cu_q = (cu.clamp(start, stop) - start) * heads
        longest_q = min(stop - start, longest) * heads
        q[start:stop] = _folded(q[start:stop], k, v, cu_q, cu, longest_q, longest)
    return q


def _folded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    longest_q: int,
    longest_k: int,
) -> torch.Tensor:
    """q (n, nh, hd) as n nh query rows of one head; k, v (N, 1, hd) -> (n, nh, hd)."""
    n, heads, hd = q.shape
    out = torch.ops.aten._efficient_attention_forward(
        q.reshape(1, n * heads, 1, hd), k[None], v[None], None, cu_q, cu_k,
        longest_q, longest_k, 0.0, 0, False, scale=1.0,
    )  # fmt: skip
    return out[0].view(n, heads, hd)


def _efficient_repeated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing) -> torch.Tensor:
    """The varlen kernel on the kv heads shared out to every query head: any group size."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    cu, longest = packing.cu_seqlens, packing.max_len
    out = torch.ops.aten._efficient_attention_forward(
        q[None], k[None], v[None], None, cu, cu, longest, longest, 0.0, 0, False, scale=1.0
    )
    return out[0][0]
