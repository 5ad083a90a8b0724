"""The fast paths of `layers.RMSNorm`: one Triton kernel per norm instead of nine torch kernels, and
one for a residual add around a norm (`x + norm(y)`, optionally normalized again).

Why: eight RMSNorms per text layer (and more per tower layer) are ~70% of the text encoder's ~100
kernels per layer. Each is a launch, and launches are what short inputs wait on, with or without
CUDA graphs (a graph still runs every node, ~2 us apiece). The vision tower's q/k/v norms run on rows
of only 64 (a head): one program per row left most of each program idle (29 us per norm, 8 images
on the H200), so a program now takes a block of rows, ~ROW_BLOCK_ELEMENTS values at a time.

The arithmetic is the reference's, in fp32: mean of squares, times (mean + eps)^-1/2, times the
weight, rounded once to the output dtype. Only the order of the additions in the mean differs (a
tree per row here), so results agree to float rounding, not bit for bit: a BF16 output now and then
lands one step away, which a random-weight model amplifies about as much as BF16 itself does
(test_gpu.py holds the fast path to the BF16 reference's own distance from FP32).
tests/runtime/test_rmsnorm_triton.py runs the kernels in Triton's CPU interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Values per program: rows of 64 go 64 to a program, rows of 768 four (a block of 1,024 each).
ROW_BLOCK_ELEMENTS = 4096


@triton.jit
def round_to_bf16(x):
    """fp32 -> the nearest BF16 value (ties to even), still held in fp32.

    By hand rather than with `.to(tl.bfloat16)`: the same bits on the GPU and in Triton's CPU
    interpreter, whose own downcast truncates. Where a fused kernel stands for several torch ops in
    BF16, it rounds after each one, as torch does, so the two paths agree bit for bit on the same
    inputs. (A NaN whose payload sits only in the low 16 bits would become inf; torch makes none.)
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _normalize(h, w_ptr, cols, n, eps, HAS_WEIGHT: tl.constexpr, ROUND_BF16: tl.constexpr):
    """(rows, BLOCK) fp32, zero past column n -> the rows normalized, weighted and rounded."""
    # As torch computes it: mean = sum * (1 / n), and pow(., -0.5) is torch's rsqrt special case.
    h = h * tl.math.rsqrt(tl.sum(h * h, axis=1)[:, None] * (1.0 / n) + eps)
    if HAS_WEIGHT:
        h = h * tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
    if ROUND_BF16:
        h = round_to_bf16(h)
    return h


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # (rows, n) contiguous
    w_ptr,  # (n,) or a dummy when HAS_WEIGHT is false
    out_ptr,  # (rows, n) contiguous, x's dtype
    rows,
    n,
    eps,
    HAS_WEIGHT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]  # (R, 1)
    cols = tl.arange(0, BLOCK)[None, :]  # (1, BLOCK)
    inside = (row < rows) & (cols < n)
    h = tl.load(x_ptr + row * n + cols, mask=inside, other=0.0).to(tl.float32)
    h = _normalize(h, w_ptr, cols, n, eps, HAS_WEIGHT, ROUND_BF16)
    tl.store(out_ptr + row * n + cols, h.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # (rows, n) contiguous: the residual stream
    y_ptr,  # (rows, n) contiguous: the branch output, normalized before the add
    wy_ptr,  # (n,) y's norm weight, or a dummy
    ws_ptr,  # (n,) the sum's norm weight, or a dummy
    scale_ptr,  # (1,) what the sum is multiplied by when HAS_SCALE, or a dummy
    sum_ptr,  # (rows, n) out: x + norm(y), times the scale
    normed_ptr,  # (rows, n) out: norm(x + norm(y)) when HAS_SUM_NORM, else a dummy
    rows,
    n,
    y_eps,
    sum_eps,
    HAS_Y_WEIGHT: tl.constexpr,
    HAS_SUM_NORM: tl.constexpr,
    HAS_SUM_WEIGHT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    inside = (row < rows) & (cols < n)
    at = row * n + cols
    y = tl.load(y_ptr + at, mask=inside, other=0.0).to(tl.float32)
    s = tl.load(x_ptr + at, mask=inside, other=0.0).to(tl.float32)
    s = s + _normalize(y, wy_ptr, cols, n, y_eps, HAS_Y_WEIGHT, ROUND_BF16)
    if ROUND_BF16:
        s = round_to_bf16(s)  # the sum is a BF16 tensor in the reference, then normalized
    if HAS_SCALE:
        s = s * tl.load(scale_ptr).to(tl.float32)
        if ROUND_BF16:
            s = round_to_bf16(s)  # the product is a BF16 tensor too
    tl.store(sum_ptr + at, s.to(sum_ptr.dtype.element_ty), mask=inside)
    if HAS_SUM_NORM:
        h = _normalize(s, ws_ptr, cols, n, sum_eps, HAS_SUM_WEIGHT, ROUND_BF16)
        tl.store(normed_ptr + at, h.to(normed_ptr.dtype.element_ty), mask=inside)


def _blocks(n: int) -> tuple[int, int, int]:
    """(BLOCK, BLOCK_ROWS, num_warps) for rows of n values."""
    block = triton.next_power_of_2(n)
    return block, max(1, ROW_BLOCK_ELEMENTS // block), 8 if block > 1024 else 4


def _check_dtype(x: torch.Tensor) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the fused kernels take float32 or bfloat16, not {x.dtype}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (any layout; the result is contiguous)."""
    _check_dtype(x)
    n = x.shape[-1]
    x2 = x.contiguous().view(-1, n)
    out = torch.empty_like(x2)
    rows = x2.shape[0]
    block, block_rows, warps = _blocks(n)
    _rms_norm_kernel[(triton.cdiv(rows, block_rows),)](
        x2,
        weight if weight is not None else x2,
        out,
        rows,
        n,
        eps,
        HAS_WEIGHT=weight is not None,
        ROUND_BF16=x.dtype == torch.bfloat16,
        BLOCK_ROWS=block_rows,
        BLOCK=block,
        num_warps=warps,
    )
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor,
    y: torch.Tensor,
    y_weight: torch.Tensor | None,
    y_eps: float,
    sum_weight: torch.Tensor | None = None,
    sum_eps: float | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`s = x + rms_norm(y, y_weight, y_eps)`, times the one-element `scale` where given, and, given
    `sum_eps`, `rms_norm(s, sum_weight, sum_eps)` in one pass: a residual add after a post-norm (a
    text layer's last add with its layer scalar), and the next block's pre-norm of the new stream.

    Reads x and y once, writes s (and its norm) once; the reference reads and writes each
    intermediate. Same rounding points as the reference: norm(y) rounded, the sum rounded, the
    product with the scale rounded, then normalized. Returns (s, norm(s) or None), contiguous, x's
    dtype and shape.
    """
    _check_dtype(x)
    if scale is not None and scale.numel() != 1:
        raise ValueError(f"scale must hold one value, not {tuple(scale.shape)}")
    if y.shape != x.shape or y.dtype != x.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and y {tuple(y.shape)} {y.dtype} must match")
    n = x.shape[-1]
    x2, y2 = x.contiguous().view(-1, n), y.contiguous().view(-1, n)
    total = torch.empty_like(x2)
    normed = torch.empty_like(x2) if sum_eps is not None else None
    rows = x2.shape[0]
    block, block_rows, warps = _blocks(n)
    _add_rms_norm_kernel[(triton.cdiv(rows, block_rows),)](
        x2,
        y2,
        y_weight if y_weight is not None else x2,
        sum_weight if sum_weight is not None else x2,
        scale if scale is not None else x2,
        total,
        normed if normed is not None else total,
        rows,
        n,
        y_eps,
        sum_eps if sum_eps is not None else y_eps,
        HAS_Y_WEIGHT=y_weight is not None,
        HAS_SUM_NORM=sum_eps is not None,
        HAS_SUM_WEIGHT=sum_weight is not None,
        HAS_SCALE=scale is not None,
        ROUND_BF16=x.dtype == torch.bfloat16,
        BLOCK_ROWS=block_rows,
        BLOCK=block,
        num_warps=warps,
    )
    return total.view(x.shape), None if normed is None else normed.view(x.shape)
