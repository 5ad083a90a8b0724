"""The fast path of "per-head RMSNorm, then RoPE" on a projection's output (the vision tower's q and k:
vision.VisionAttention), one Triton kernel instead of about a dozen torch kernels.

The reference reads and writes the (tokens, heads, head_dim) tensor once for the norm, then slices,
negates, concatenates, multiplies and adds it for the rotation (vision.apply_axial_rope): ~10 full
passes in BF16. This reads it once (plus the (tokens, head_dim) cos/sin tables) and writes the
result once, in the input's own layout: (N, S, heads, hd), which SDPA takes as a transposed view,
and whose attention output then reshapes back to (N, S, heads * hd) without a copy.

Rotation: the head is cut into `sections` equal parts, each rotated by the half-split convention
(layers.rotate_half): 1 section is ordinary RoPE, 2 the vision tower's axial RoPE (channels
[0, hd/2) by the column, [hd/2, hd) by the row). cos/sin hold one angle per channel, as the
reference's tables do.

Rounding, the reference's exactly: the norm in fp32 rounded to the output dtype (transformers rounds
it before the rotation, and so does the unfused path), then x * cos, rotate_half(x) * sin and their
sum each rounded as torch's BF16 ops round them. Only the norm's mean adds in another order, so the
two paths agree bit for bit where the norm does (tests/runtime/test_rope_triton.py, in Triton's CPU
interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eg2_runtime.rmsnorm_triton import ROW_BLOCK_ELEMENTS, round_to_bf16


@triton.jit
def _norm_rope(
    x,
    xp,
    w_ptr,
    cols,
    partner,
    first,
    cos,
    sin,
    n,
    eps,
    HAS_WEIGHT: tl.constexpr,
    ROPE: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """(R, BLOCK) fp32 rows of n values (zero past n) and each value's rotate-half partner (column
    `partner`; `first`: in the first half of its section) -> rope(rms_norm(x)) rounded as the
    reference rounds it, or rms_norm(x) alone without ROPE (xp, cos and sin then unused)."""
    scale = tl.math.rsqrt(tl.sum(x * x, axis=1)[:, None] * (1.0 / n) + eps)
    x = x * scale
    if HAS_WEIGHT:
        x = x * tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
    if ROUND_BF16:
        x = round_to_bf16(x)
    if ROPE:
        xp = xp * scale
        if HAS_WEIGHT:
            xp = xp * tl.load(w_ptr + partner, mask=cols < n, other=0.0).to(tl.float32)
        if ROUND_BF16:
            xp = round_to_bf16(xp)
        a = x * cos
        b = tl.where(first, -xp, xp) * sin
        if ROUND_BF16:
            a, b = round_to_bf16(a), round_to_bf16(b)
        x = a + b
        if ROUND_BF16:
            x = round_to_bf16(x)
    return x


@triton.jit
def _rms_norm_rope_kernel(
    x_ptr,  # (rows, hd) contiguous, rows = tokens * heads
    w_ptr,  # (hd,) the norm weight, or a dummy when HAS_WEIGHT is false
    cos_ptr,  # (tokens, hd) contiguous
    sin_ptr,  # (tokens, hd) contiguous
    out_ptr,  # (rows, hd) contiguous
    rows,
    heads,
    hd,
    eps,
    SECTIONS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]  # (R, 1)
    cols = tl.arange(0, BLOCK)[None, :]  # (1, BLOCK)
    inside = (row < rows) & (cols < hd)
    # rotate_half within each section: the first half takes -(its partner in the second half), the
    # second half takes +(its partner in the first).
    half = hd // SECTIONS // 2
    first = (cols % (2 * half)) < half
    partner = tl.where(first, cols + half, cols - half)
    x = tl.load(x_ptr + row * hd + cols, mask=inside, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + row * hd + partner, mask=inside, other=0.0).to(tl.float32)  # cached: same row
    token = row // heads
    cos = tl.load(cos_ptr + token * hd + cols, mask=inside, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * hd + cols, mask=inside, other=0.0).to(tl.float32)
    out = _norm_rope(x, xp, w_ptr, cols, partner, first, cos, sin, hd, eps, HAS_WEIGHT, True, ROUND_BF16)
    tl.store(out_ptr + row * hd + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _qkv_norm_rope_kernel(
    qkv_ptr,  # (tokens, (heads + 2 kv_heads) * hd), unit column stride, rows `stride` apart
    qw_ptr,  # (hd,) q_norm's weight
    kw_ptr,  # (hd,) k_norm's weight
    cos_ptr,  # (tokens, hd) contiguous
    sin_ptr,  # (tokens, hd) contiguous
    q_ptr,  # (tokens, heads, hd) contiguous
    k_ptr,  # (tokens, kv_heads, hd) contiguous
    v_ptr,  # (tokens, kv_heads, hd) contiguous
    tokens,
    stride,
    heads,
    kv_heads,
    hd,
    q_eps,
    k_eps,
    v_eps,
    ROUND_BF16: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: BLOCK_T tokens of one head of the projection, q's heads first, then k's, then v's
    (the order of the merged weight's rows)."""
    token = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]  # (R, 1)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)[None, :]
    inside = (token < tokens) & (cols < hd)
    half = hd // 2
    first = cols < half
    partner = tl.where(first, cols + half, cols - half)
    src = qkv_ptr + token * stride + head * hd
    x = tl.load(src + cols, mask=inside, other=0.0).to(tl.float32)
    if head < heads + kv_heads:  # q and k: normalized with their weight, then rotated
        xp = tl.load(src + partner, mask=inside, other=0.0).to(tl.float32)
        cos = tl.load(cos_ptr + token * hd + cols, mask=inside, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + token * hd + cols, mask=inside, other=0.0).to(tl.float32)
        if head < heads:
            out = _norm_rope(x, xp, qw_ptr, cols, partner, first, cos, sin, hd, q_eps, True, True, ROUND_BF16)
            tl.store(q_ptr + (token * heads + head) * hd + cols, out.to(q_ptr.dtype.element_ty), mask=inside)
        else:
            out = _norm_rope(x, xp, kw_ptr, cols, partner, first, cos, sin, hd, k_eps, True, True, ROUND_BF16)
            at = (token * kv_heads + head - heads) * hd + cols
            tl.store(k_ptr + at, out.to(k_ptr.dtype.element_ty), mask=inside)
    else:  # v: normalized, no weight, not rotated
        out = _norm_rope(x, x, qw_ptr, cols, partner, first, x, x, hd, v_eps, False, False, ROUND_BF16)
        at = (token * kv_heads + head - heads - kv_heads) * hd + cols
        tl.store(v_ptr + at, out.to(v_ptr.dtype.element_ty), mask=inside)


def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    sections: int,
) -> torch.Tensor:
    """rope(rms_norm(x, weight)) of x (..., heads, hd) with cos/sin (..., hd) shared by the heads.

    Returns a contiguous tensor of x's shape and dtype. `sections`: 1 for RoPE, 2 for axial RoPE.
    """
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the fused kernels take float32 or bfloat16, not {x.dtype}")
    *lead, heads, hd = x.shape
    if hd % (2 * sections):
        raise ValueError(f"head_dim {hd} does not split into {sections} rotated sections")
    for table in (cos, sin):
        if table.shape != (*lead, hd) or table.dtype != x.dtype:
            raise ValueError(
                f"cos/sin must be {(*lead, hd)} {x.dtype}, got {tuple(table.shape)} {table.dtype}"
            )
    x2 = x.contiguous().view(-1, hd)
    out = torch.empty_like(x2)
    rows = x2.shape[0]
    block = triton.next_power_of_2(hd)
    block_rows = max(1, ROW_BLOCK_ELEMENTS // block)
    _rms_norm_rope_kernel[(triton.cdiv(rows, block_rows),)](
        x2,
        weight if weight is not None else x2,
        cos.contiguous(),
        sin.contiguous(),
        out,
        rows,
        heads,
        hd,
        eps,
        SECTIONS=sections,
        HAS_WEIGHT=weight is not None,
        ROUND_BF16=x.dtype == torch.bfloat16,
        BLOCK_ROWS=block_rows,
        BLOCK=block,
        num_warps=8,  # 16 values a thread: x, its partner, weights, cos and sin stay in registers
    )
    return out.view(x.shape)


# qkv_norm_rope's launch: (values of one head a program takes, a block of tokens; warps a program).
# Small programs win on the packed batches the service runs: (1024, 2) was the fastest of the 8 tiles
# benchmarks/text_kernels.py sweeps, on both layer kinds (docs/PERF.md). Each value's arithmetic does
# not depend on the tile (tests/runtime/test_rope_triton.py, in the interpreter).
QKV_TILE = (1024, 2)


def qkv_norm_rope(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: tuple[float, float, float],
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    tile: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The text attention's per-token half from one merged projection, in one launch.

    qkv: (N, (heads + 2 kv_heads) * hd), q's heads then k's then v's (a view of rows with unit
    column stride is read in place); cos/sin (N, hd). Returns q = rope(q_norm(q)) (N, heads, hd) and
    k = rope(k_norm(k)), v = v_norm(v) (N, kv_heads, hd), contiguous: what q_norm / k_norm / v_norm
    and apply_rope give, rounded as rms_norm_rope rounds. eps: q_norm's, k_norm's, v_norm's.
    tile: (values per program, warps), QKV_TILE by default. In Triton's CPU interpreter the result
    does not depend on it; on the GPU the warp count sets a head's reduction order, and another tile
    may differ in the last bits (tests/gpu/test_gpu_packed_text.py; benchmarks/text_kernels.py times
    the choices).
    """
    if qkv.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the fused kernels take float32 or bfloat16, not {qkv.dtype}")
    n, width = qkv.shape
    hd = width // (heads + 2 * kv_heads)
    if hd * (heads + 2 * kv_heads) != width or hd % 2:
        raise ValueError(f"a projection of {width} does not split into {heads} + 2 x {kv_heads} heads")
    for table in (cos, sin):
        if table.shape != (n, hd) or table.dtype != qkv.dtype:
            raise ValueError(f"cos/sin must be {(n, hd)} {qkv.dtype}, got {tuple(table.shape)} {table.dtype}")
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    q = torch.empty((n, heads, hd), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((n, kv_heads, hd), dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    elements, warps = tile or QKV_TILE
    block = triton.next_power_of_2(hd)
    block_t = max(1, elements // block)
    _qkv_norm_rope_kernel[(triton.cdiv(n, block_t), heads + 2 * kv_heads)](
        qkv,
        q_weight,
        k_weight,
        cos.contiguous(),
        sin.contiguous(),
        q,
        k,
        v,
        n,
        qkv.stride(0),
        heads,
        kv_heads,
        hd,
        eps[0],
        eps[1],
        eps[2],
        ROUND_BF16=qkv.dtype == torch.bfloat16,
        BLOCK_T=block_t,
        BLOCK=block,
        num_warps=warps,
    )
    return q, k, v
