"""The fused Triton RMSNorm on the rows where eps decides the result, in Triton's CPU interpreter:
all-zero rows (padding, a zeroed feature), and rows so small that mean(x^2) is below eps or
underflows to zero. The reference gives 0 for a zero row and x * eps^-1/2 for a vanishing one; a
kernel without eps gives NaN (0 * inf) or values ~1000x too large there, and agrees everywhere else.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.support.triton_interpreter import assert_ok_in_interpreter

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from eg2_runtime.layers import RMSNorm
    from eg2_runtime.rmsnorm_triton import rms_norm

    gen = torch.Generator().manual_seed(0)
    for n, scale in [(512, True), (768, False), (96, True)]:
        norm = RMSNorm(n, eps=1e-6, with_scale=scale)
        if scale:
            norm.weight.data = torch.randn(n, generator=gen)
        base = torch.randn(6, n, generator=gen)
        # (zero, below eps, at eps, underflowing in the sum of squares, normal, zero) in one call
        x = base * torch.tensor([0.0, 1e-4, 1e-3, 1e-22, 1.0, 0.0])[:, None]
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            ref, got = norm.reference(xd).float(), rms_norm(xd, norm.weight, norm.eps).float()
            assert torch.isfinite(got).all(), (dtype, n, "non-finite rows", (~torch.isfinite(got)).any(-1).tolist())
            assert (got[0] == 0).all() and (got[5] == 0).all(), (dtype, n, "a zero row is not zero")
            err = ((got - ref).abs() / ref.abs().clamp(min=1e-3)).max(-1).values
            bound = 1e-5 if dtype == torch.float32 else 2**-7  # float rounding; one BF16 step
            assert (err <= bound).all(), (str(dtype), n, "relative error per row", err.tolist())
    print("ok")
    """
)


def test_fused_rms_norm_on_zero_and_tiny_rows() -> None:
    assert_ok_in_interpreter(SCRIPT)
