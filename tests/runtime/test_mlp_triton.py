"""The fused gelu_tanh(gate) * up kernel (mlp_triton.py) against GatedMLP's torch reference, in
Triton's CPU interpreter.

Tolerances (tests/support/triton_interpreter.py): FP32 within 1e-6 of each row's scale; BF16 within one
BF16 step and at most 1% of outputs different, counting values down to a thousandth of their row's
scale: below that, torch's 1 + tanh(u) cancels (to exactly 0 far enough out) where the kernel's
logistic form keeps the tail. Gates up to ~30 reach deep into both tails; the element count is no
multiple of the block.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.support.triton_interpreter import assert_ok_in_interpreter

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from eg2_runtime.mlp_triton import gelu_tanh_mul
    from tests.support.triton_interpreter import assert_kernel_matches, fp32_error

    gen = torch.Generator().manual_seed(0)
    for shape, spread in [((3, 7, 3072), 1.0), ((5, 301), 3.0), ((2, 9, 128), 10.0)]:
        gate = torch.randn(*shape, generator=gen) * spread
        up = torch.randn(*shape, generator=gen)
        gate[0, 0] = 0  # zero rows, as padding tokens give
        up[0, 0] = 0
        for dtype in (torch.float32, torch.bfloat16):
            g, u = gate.to(dtype), up.to(dtype)
            assert_kernel_matches((shape, dtype), gelu_tanh_mul(g, u), F.gelu(g, approximate="tanh") * u)
    # A transposed (non-contiguous) pair: the kernel reads contiguous copies.
    g, u = gate.transpose(0, 1), up.transpose(0, 1)
    assert fp32_error(gelu_tanh_mul(g, u), F.gelu(g, approximate="tanh") * u) <= 1e-6
    # The halves of a merged gate/up projection, and a slice of wider rows: read in place, each
    # with its own row stride.
    merged = torch.randn(4, 6, 2 * 301, generator=gen) * 3
    wide = torch.randn(4 * 6, 3 * 301, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        g, u = merged.to(dtype).split(301, dim=-1)
        u2 = wide.to(dtype)[:, 7 : 7 + 301].view(4, 6, 301)
        for up_ in (u, u2):
            assert not g.is_contiguous() and not up_.is_contiguous()
            got = gelu_tanh_mul(g, up_)
            assert got.is_contiguous()
            assert_kernel_matches(("strided", dtype), got, F.gelu(g, approximate="tanh") * up_)
    # Edges the model never passes, kept working: a 0-dim pair, an empty batch.
    g0, u0 = torch.tensor(1.5), torch.tensor(-2.0)
    assert fp32_error(gelu_tanh_mul(g0, u0)[None], (F.gelu(g0, approximate="tanh") * u0)[None]) <= 1e-6
    assert gelu_tanh_mul(torch.empty(0, 7), torch.empty(0, 7)).shape == (0, 7)
    print("ok")
    """
)


def test_triton_gelu_tanh_mul_matches_reference() -> None:
    assert_ok_in_interpreter(SCRIPT)
