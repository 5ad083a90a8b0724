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
    scale = tl.math.rsqrt(tl.sum(x * x, axis=1)[:, None] * (1.0 / hd) + eps)
    x, xp = x * scale, xp * scale
    if HAS_WEIGHT:
        x = x * tl.load(w_ptr + cols, mask=cols < hd, other=0.0).to(tl.float32)
        xp = xp * tl.load(w_ptr + partner, mask=cols < hd, other=0.0).to(tl.float32)
    if ROUND_BF16:
        x, xp = round_to_bf16(x), round_to_bf16(xp)
    token = row // heads
    cos = tl.load(cos_ptr + token * hd + cols, mask=inside, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * hd + cols, mask=inside, other=0.0).to(tl.float32)
    a = x * cos
    b = tl.where(first, -xp, xp) * sin
    if ROUND_BF16:
        a, b = round_to_bf16(a), round_to_bf16(b)
    out = a + b
    if ROUND_BF16:
        out = round_to_bf16(out)
    tl.store(out_ptr + row * hd + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


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
