"""The fused Triton unpack kernel equals the reference dequantization bit for bit.

The kernel runs in Triton's CPU interpreter here (TRITON_INTERPRET=1 must be set before triton is
imported, hence the subprocess); tests/gpu/test_gpu.py repeats the check on every layer on the GPU.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.support.triton_interpreter import assert_ok_in_interpreter

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from eg2_runtime.quant import dequantize, quantize
    from eg2_runtime.quant import end_to_end_flat
    from eg2_runtime.unpack_triton import dequantize_into, dequantize_run

    gen = torch.Generator().manual_seed(0)
    # Each group size; (33, 256, 64) ends in a partial block of the kernel's 512 words.
    for rows, cols, group in [(64, 768, 32), (48, 1536, 128), (16, 4096, 128), (33, 256, 64)]:
        w = torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen) * 3
        packed, scale = quantize(w, group)
        out = torch.full((rows, cols), float("nan"), dtype=torch.bfloat16)
        dequantize_into(packed, scale, out)
        ref = dequantize(packed, scale)
        assert torch.equal(out, ref), (rows, cols, group, (out.float() - ref.float()).abs().max())
    # One launch over a group laid end to end (rows of different lengths, one group size): each
    # layer's weight lands at its place in the run, equal to its own reference.
    layers = [quantize(torch.randn(r, c, generator=gen), 32) for r, c in [(64, 96), (96, 64), (8, 256)]]
    words, _ = end_to_end_flat([p for p, _ in layers], "cpu")
    scales, _ = end_to_end_flat([s for _, s in layers], "cpu")
    out = torch.full((words.numel() * 8,), float("nan"), dtype=torch.bfloat16)
    dequantize_run(words, scales, out)
    ref = torch.cat([dequantize(p, s).view(-1) for p, s in layers])
    assert torch.equal(out, ref), (out.float() - ref.float()).abs().max()
    # The kernel reads words and scales as flat runs: a strided input is refused, not misread.
    packed, scale = quantize(torch.randn(16, 256, generator=gen), 64)
    out = torch.empty(16, 256, dtype=torch.bfloat16)
    for bad in (packed.t().contiguous().t(), torch.cat([packed, packed], dim=1)[:, ::2]):
        try:
            dequantize_into(bad, scale, out)
        except ValueError:
            pass
        else:
            raise AssertionError(f"a strided packed {bad.stride()} was accepted")
    print("ok")
    """
)


def test_triton_kernel_is_bit_identical_to_reference() -> None:
    assert_ok_in_interpreter(SCRIPT)
