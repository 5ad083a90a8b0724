"""The fused Triton RMSNorm kernels against the reference RMSNorm, in Triton's CPU interpreter.

TRITON_INTERPRET=1 must be set before triton is imported, hence the subprocess. Tolerances
(tests/support/triton_interpreter.py): FP32 within 1e-6 of each row's scale (the mean's additions run in
another order); BF16 within one BF16 step, and at most 1% of outputs different at all (the kernels
round to nearest-even by hand, as torch does, so most outputs are bit-identical; a reordered sum now
and then lands on the other side of a rounding boundary). tests/gpu/test_gpu.py and tests/gpu/test_gpu_kernels.py compare whole towers on the GPU.

Each check also holds rows the blocks cut through (row counts that are no multiple of the rows a
program takes), all-zero padding rows (which only eps keeps finite) and rows small enough that eps
weighs on them.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.support.triton_interpreter import assert_ok_in_interpreter

pytest.importorskip("triton")

PRELUDE = """
import torch
from eg2_runtime.layers import RMSNorm
from eg2_runtime.rmsnorm_triton import add_rms_norm, rms_norm
from tests.support.triton_interpreter import assert_kernel_matches as check

gen = torch.Generator().manual_seed(0)

def rows_of(*shape):
    x = torch.randn(*shape, generator=gen) * 4
    x[0, -1] = 0  # padding rows
    x[-1, 0] *= 1e-3  # eps is a third of their mean square
    return x

def norm(n, scale):
    m = RMSNorm(n, eps=1e-6, with_scale=scale)
    if scale:
        m.weight.data = torch.randn(n, generator=gen)
    return m
"""

RMS_NORM = PRELUDE + textwrap.dedent(
    """
    # Per-head norms (rows of 16, 64 and 128: many rows to a program; 3 x 37 x 5 rows is no multiple
    # of a block), the towers' widths (vision 768, audio 1536, text 512 / 256) and a non-power of two.
    for shape, scale in [
        ((3, 37, 5, 64), True), ((3, 37, 5, 128), True), ((2, 41, 4, 16), True), ((3, 37, 5, 64), False),
        ((3, 5, 768), True), ((2, 7, 1536), False), ((3, 5, 512), True), ((3, 5, 256), True),
        ((3, 5, 96), True),
    ]:
        m, x = norm(shape[-1], scale), rows_of(*shape)
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            check((shape, scale, dtype), rms_norm(xd, m.weight, m.eps), m.reference(xd))
        xt = x.transpose(0, 1)  # any layout in, contiguous out
        check((shape, "transposed"), rms_norm(xt, m.weight, m.eps), m.reference(xt))

    # The rounding to BF16 itself, bit for bit against torch's: rows of ones (scale exactly 1 with
    # eps 0) times FP32 weights put the weights through the kernel's rounding unchanged otherwise.
    # Positive normal floats (subnormals never reach a BF16 activation), ties and their neighbours,
    # exact values, and the largest finite float (-> inf); then their negatives.
    bits = torch.randint(2**23, 2**31 - 2**23, (4000,), generator=gen, dtype=torch.int64)
    low = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF])
    bits = torch.cat((bits, (bits[:400, None] & ~0xFFFF | low).reshape(-1), torch.tensor([0x7F7FFFFF])))
    w = bits.to(torch.int32).view(torch.float32)
    w = torch.cat((w, -w))
    got = rms_norm(torch.ones(3, w.numel(), dtype=torch.bfloat16), w, 0.0)
    assert torch.equal(got, w.to(torch.bfloat16).expand(3, -1)), "round_to_bf16 differs from torch"
    print("ok")
    """
)

ADD_RMS_NORM = PRELUDE + textwrap.dedent(
    """
    # x + norm(y), alone and followed by the sum's own norm (a layer's post- and next pre-norm).
    for shape in [(3, 37, 768), (5, 3, 64), (2, 9, 1536)]:
        x, y = rows_of(*shape), rows_of(*shape) * 3
        post, pre, bare = norm(shape[-1], True), norm(shape[-1], True), norm(shape[-1], False)
        for dtype in (torch.float32, torch.bfloat16):
            xd, yd = x.to(dtype), y.to(dtype)
            ref_sum = xd + post.reference(yd)
            total, normed = add_rms_norm(xd, yd, post.weight, post.eps, pre.weight, pre.eps)
            check((shape, dtype, "sum"), total, ref_sum)
            check((shape, dtype, "norm of sum"), normed, pre.reference(ref_sum))
            total, none = add_rms_norm(xd, yd, post.weight, post.eps)
            assert none is None
            check((shape, dtype, "sum alone"), total, ref_sum)
            total, normed = add_rms_norm(xd, yd, None, 1e-6, None, 1e-6)  # parameter-free norms
            check((shape, dtype, "bare sum"), total, xd + bare.reference(yd))
            check((shape, dtype, "bare norm of sum"), normed, bare.reference(xd + bare.reference(yd)))
            # A text layer's last add: the sum times its layer scalar, then the next layer's norm.
            scalar = torch.tensor([0.73], dtype=dtype)
            ref_scaled = ref_sum * scalar
            total, normed = add_rms_norm(xd, yd, post.weight, post.eps, pre.weight, pre.eps, scale=scalar)
            check((shape, dtype, "scaled sum"), total, ref_scaled)
            check((shape, dtype, "norm of scaled sum"), normed, pre.reference(ref_scaled))
            total, none = add_rms_norm(xd, yd, post.weight, post.eps, scale=scalar)
            assert none is None
            check((shape, dtype, "scaled sum alone"), total, ref_scaled)
    print("ok")
    """
)


def test_triton_rms_norm_matches_reference() -> None:
    assert_ok_in_interpreter(RMS_NORM)


def test_triton_add_rms_norm_matches_reference() -> None:
    assert_ok_in_interpreter(ADD_RMS_NORM)
