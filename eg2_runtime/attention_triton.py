"""The full layers' attention over a packed text batch as one Triton kernel: bidirectional, each token
attending to every token of its own item, one kv head shared by every query head (the text encoder's
full layers: 4 query heads on 1 kv head of head_dim 512).

Why a kernel of our own: FlashAttention-2 as bundled in torch stops at head_dim 256, and the CUTLASS
memory-efficient kernel that takes 512 keeps its FP32 accumulator in global memory past head_dim
128 (its "gmem" variant): 356 us a layer for a 2,200-token document on the H100, 0.15 of the matmul
peak (docs/PERF.md, 2026-12-06). Here the accumulator stays in registers.

Layout. The query heads are folded into rows, as packed_attention._folded does for the CUTLASS
kernel: q (N, nh, hd) is read as N nh rows of one head, row r being token r // nh. With one kv head
and no positions in the mask, a row's attention depends only on its item, so any BLOCK_M rows can go
to one program: the program finds the items its rows belong to (the packing's doc_ids), walks the
keys from the first of those items' first token to the last one's end, and masks a key out where its
item is not the row's. A program's rows span a few short items, or lie inside one long item, or
straddle the boundary of two long ones (then it walks both items' keys, half of them masked). The
grid is ceil(N nh / BLOCK_M) programs, fixed by N, so a CUDA graph captures it and replays it for
any packing of the same N.

Online softmax in FP32 (scale 1.0: q_norm and k_norm fix the logit scale), P rounded to BF16 for the
P @ V product (as FlashAttention rounds it), the output written over q: a program reads its own q
rows once, before it writes them, and no other program reads them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, num_warps, num_stages) of the launch, by the inputs' dtype. At head_dim 512 a
# program's accumulator is BLOCK_M x 512 FP32, beside its q rows, logits and addresses. Compiled for
# sm_90a (Triton 3.8, tests/runtime/test_attention_triton.py): BF16 at (64, 16, 8, 2) uses wgmma,
# 253 registers a thread and 82 KB of shared memory, no spills; (64, 32, 8, 2) spilled 700 B a
# thread, every larger tile more. FP32 (the GPU tests' exact path) needs 4x the shared memory per
# element: (16, 16, 4, 1) takes 66 KB; (64, 32, 8, 2) would need 271 KB, past Hopper's 227.
TILE = (64, 16, 8, 2)
FP32_TILE = (16, 16, 4, 1)


@triton.jit
def _full_attention_kernel(
    q_ptr,  # (rows, HD) contiguous: the folded query rows; the output is written over them
    k_ptr,  # (N, HD) contiguous: the one kv head
    v_ptr,  # (N, HD) contiguous
    doc_ptr,  # (N,) int32: the item of each token
    cu_ptr,  # (S + 1,) int32: item s holds tokens cu[s]:cu[s + 1]
    rows,  # N * HEADS
    HEADS: tl.constexpr,
    HD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    first = tl.program_id(0) * BLOCK_M
    r = first + tl.arange(0, BLOCK_M)  # (BLOCK_M,) folded rows
    inside = r < rows
    token = tl.where(inside, r // HEADS, 0)
    doc_q = tl.load(doc_ptr + token, mask=inside, other=-1)
    last = tl.minimum(first + BLOCK_M, rows) - 1
    k_start = tl.load(cu_ptr + tl.load(doc_ptr + first // HEADS))
    k_end = tl.load(cu_ptr + tl.load(doc_ptr + last // HEADS) + 1)

    d = tl.arange(0, HD)
    q = tl.load(q_ptr + r[:, None].to(tl.int64) * HD + d[None, :], mask=inside[:, None], other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)  # running max of the logits, log2 units
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HD), tl.float32)
    for start in range(k_start, k_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        in_range = n < k_end
        k = tl.load(k_ptr + n[:, None].to(tl.int64) * HD + d[None, :], mask=in_range[:, None], other=0.0)
        if FP32_DOT:
            k = k.to(tl.float32)
        s = (
            tl.dot(q, tl.trans(k), input_precision=PRECISION) * 1.4426950408889634
        )  # (BLOCK_M, BLOCK_N) logits, x log2(e)
        doc_k = tl.load(doc_ptr + n, mask=in_range, other=-2)
        s = tl.where(doc_q[:, None] == doc_k[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # A row with no key of its item in this block (nor before it) keeps m = -inf: shift by 0.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - shift[:, None])
        alpha = tl.exp2(m - shift)
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + n[:, None].to(tl.int64) * HD + d[None, :], mask=in_range[:, None], other=0.0)
        p = p.to(v.dtype)  # rounded to the inputs' dtype, as FlashAttention rounds P
        if FP32_DOT:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new
    out = acc / tl.where(inside, total, 1.0)[:, None]  # a row's own token is among its keys: total > 0
    tl.store(
        q_ptr + r[:, None].to(tl.int64) * HD + d[None, :],
        out.to(q_ptr.dtype.element_ty),
        mask=inside[:, None],
    )


def full_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    tile: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Attention of q (N, nh, hd) over k, v (N, 1, hd) within each item; returns q, overwritten with
    the output (N, nh, hd). doc_ids (N,) and cu_seqlens (S + 1,) int32: the packing's. hd a power of
    two. tile: (BLOCK_M, BLOCK_N, num_warps, num_stages), by default TILE (FP32_TILE for FP32); BLOCK_M
    and BLOCK_N at least 16 (a GPU's dot takes no fewer)."""
    n, heads, hd = q.shape
    if k.shape != (n, 1, hd) or v.shape != k.shape:
        raise ValueError(f"k and v must be {(n, 1, hd)}: one kv head; got {tuple(k.shape)}, {tuple(v.shape)}")
    if hd & (hd - 1) or hd < 16:
        raise ValueError(f"head_dim must be a power of two of at least 16, not {hd}")
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        raise ValueError("q, k and v must be contiguous")
    block_m, block_n, warps, stages = tile or (FP32_TILE if q.dtype == torch.float32 else TILE)
    if min(block_m, block_n) < 16:
        raise ValueError(f"tile {tile}: BLOCK_M and BLOCK_N must be at least 16")
    rows = n * heads
    _full_attention_kernel[(triton.cdiv(rows, block_m),)](
        q,
        k,
        v,
        doc_ids,
        cu_seqlens,
        rows,
        HEADS=heads,
        HD=hd,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        # Triton's CPU interpreter (3.8) reads a BF16 tl.dot's operands as raw bits: there (the only
        # place a CPU tensor reaches this kernel) the operands go up to FP32 first, which is exact
        # (a BF16 product fits FP32's mantissa, and the GPU's BF16 dot sums in FP32 as well).
        FP32_DOT=not q.is_cuda,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # FP32 products, not TF32's 10 bits
        num_warps=warps,
        num_stages=stages,
    )
    return q
