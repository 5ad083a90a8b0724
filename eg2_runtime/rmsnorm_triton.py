"""The fast path of `layers.RMSNorm`: one Triton kernel per norm instead of nine torch kernels.

Why: eight RMSNorms per text layer (and more per tower layer) are ~70% of the text encoder's ~100
kernels per layer. They cost next to nothing on the GPU, but each is a launch, and launches are what
short inputs wait on, with or without CUDA graphs (a graph still runs every node, ~2 us apiece).

The arithmetic is the reference's, in fp32: mean of squares, times (mean + eps)^-1/2, times the
weight, rounded once to the input dtype. Only the order of the additions in the mean differs (a
tree per row here), so results agree to float rounding, not bit for bit: a BF16 output now and then
lands one step away, which a random-weight model amplifies about as much as BF16 itself does
(test_gpu.py holds the fast path to the BF16 reference's own distance from FP32); tests/test_rmsnorm_triton.py
runs the kernel in Triton's CPU interpreter, test_gpu.py compares whole models on the H200.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # (rows, n) contiguous
    w_ptr,  # (n,) or a dummy when HAS_WEIGHT is false
    out_ptr,  # (rows, n) contiguous, x's dtype
    n,
    eps,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    h = tl.load(x_ptr + row * n + cols, mask=inside, other=0.0).to(tl.float32)
    # As torch computes it: mean = sum * (1 / n), and pow(., -0.5) is torch's rsqrt special case.
    h = h * tl.math.rsqrt(tl.sum(h * h, axis=0) * (1.0 / n) + eps)
    if HAS_WEIGHT:
        h = h * tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, h.to(out_ptr.dtype.element_ty), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (any layout; the result is contiguous)."""
    n = x.shape[-1]
    x2 = x.contiguous().view(-1, n)
    out = torch.empty_like(x2)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        weight if weight is not None else x2,
        out,
        n,
        eps,
        HAS_WEIGHT=weight is not None,
        BLOCK=block,
        num_warps=8 if block > 1024 else 4,
    )
    return out.view(x.shape)
