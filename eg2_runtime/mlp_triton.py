"""The fast path of the gated MLP's activation (layers.GatedMLP): gelu_tanh(gate) * up in one Triton
kernel instead of two torch kernels.

The (tokens, intermediate) tensors are the widest activations of a layer (3,072 per vision token):
the reference reads gate, writes gelu(gate), reads it back with up and writes the product (four
passes); this reads gate and up once and writes the product once.

Arithmetic: torch's tanh-approximate GELU, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in fp32,
written as x / (1 + exp(-2u)) (the same function: 0.5 (1 + tanh u) is the logistic of 2u). Triton has
no tanh that runs in its CPU interpreter, and this form does not cancel in the negative tail, where
torch's 1 + tanh(u) does. Rounded as the reference rounds in BF16: gelu(gate), then the product.
The two agree to a few fp32 ulps, so a BF16 output now and then lands one step away
(tests/runtime/test_mlp_triton.py, in Triton's CPU interpreter).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from eg2_runtime.rmsnorm_triton import round_to_bf16

BLOCK = 2048  # values per program
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@triton.jit
def _gelu_tanh_mul_kernel(
    gate_ptr,  # (rows, width), unit column stride, rows gate_stride apart
    up_ptr,  # (rows, width), unit column stride, rows up_stride apart
    out_ptr,  # (rows, width) contiguous
    numel,
    width,
    gate_stride,
    up_stride,
    K_BETA: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    CONTIGUOUS: tl.constexpr,  # both inputs are rows `width` apart: flat offsets, no division
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < numel
    if CONTIGUOUS:
        g_at, u_at = i, i
    else:
        row, col = i // width, i % width
        g_at, u_at = row * gate_stride + col, row * up_stride + col
    g = tl.load(gate_ptr + g_at, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + u_at, mask=inside, other=0.0).to(tl.float32)
    inner = K_BETA * (g + 0.044715 * (g * g * g))
    y = g / (1.0 + tl.exp(-2.0 * inner))
    if ROUND_BF16:
        y = round_to_bf16(y)
    y = y * u
    if ROUND_BF16:
        y = round_to_bf16(y)
    tl.store(out_ptr + i, y.to(out_ptr.dtype.element_ty), mask=inside)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up, contiguous, of gate's shape and dtype.

    gate and up are read in place where each is rows of unit stride (the two halves of a merged
    gate/up projection, one layer's slice of the per-layer embeddings); anything else is copied first.
    """
    if gate.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the fused kernels take float32 or bfloat16, not {gate.dtype}")
    if up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    g, u = _rows(gate), _rows(up)
    numel, width = out.numel(), g.shape[-1]
    _gelu_tanh_mul_kernel[(triton.cdiv(numel, BLOCK),)](
        g,
        u,
        out,
        numel,
        width,
        g.stride(0),
        u.stride(0),
        K_BETA=SQRT_2_OVER_PI,
        ROUND_BF16=gate.dtype == torch.bfloat16,
        CONTIGUOUS=g.stride(0) == width and u.stride(0) == width,
        BLOCK=BLOCK,
        num_warps=4,
    )
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(..., width) -> a (rows, width) view with unit column stride, or a contiguous copy where the
    leading dims do not flatten to one stride; a 0-dim tensor is one row of one."""
    x = x.reshape(1) if x.dim() == 0 else x
    width = x.shape[-1]
    try:
        rows = x.view(-1, width)
    except RuntimeError:
        return x.contiguous().view(-1, width)
    return rows if rows.stride(-1) == 1 or width == 1 else rows.contiguous()
