"""The fused Triton RMSNorm against the reference RMSNorm, in Triton's CPU interpreter.

TRITON_INTERPRET=1 must be set before triton is imported, hence the subprocess. Tolerances: FP32
inputs agree to float rounding (the mean's additions run in a different order); BF16 outputs may
differ by one BF16 step where that reordering lands on a rounding boundary (the interpreter's own
float downcast also truncates rather than rounds). tests/test_gpu.py compares whole models on the GPU.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.triton_interpreter import assert_ok_in_interpreter

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from eg2_runtime.layers import RMSNorm
    from eg2_runtime.rmsnorm_triton import rms_norm

    gen = torch.Generator().manual_seed(0)
    # Widths of the three towers (text 512, head dims 256 / 512, vision 768, audio 1536) and a
    # non-power of two; with and without a weight; a transposed (non-contiguous) input.
    for n, scale in [(512, True), (256, True), (768, True), (1536, False), (96, True)]:
        norm = RMSNorm(n, eps=1e-6, with_scale=scale)
        if scale:
            norm.weight.data = torch.randn(n, generator=gen)
        x = torch.randn(3, 5, n, generator=gen) * 4
        ref, got = norm.reference(x), rms_norm(x, norm.weight, norm.eps)
        err = ((got - ref).abs() / ref.abs().clamp(min=1e-3)).max().item()
        assert err <= 1e-5, ("fp32", n, err)
        xb = x.to(torch.bfloat16)
        ref, got = norm.reference(xb).float(), rms_norm(xb, norm.weight, norm.eps).float()
        steps = ((got - ref).abs() / ref.abs().clamp(min=1e-3)).max().item()
        assert steps <= 2**-7, ("bf16", n, steps)  # one BF16 step (8 bits of mantissa)
        xt = x.transpose(0, 1)
        assert torch.allclose(rms_norm(xt, norm.weight, norm.eps), norm.reference(xt), rtol=1e-5, atol=1e-6)
    print("ok")
    """
)


def test_triton_rms_norm_matches_reference() -> None:
    assert_ok_in_interpreter(SCRIPT)
