"""The quantizer (`eg2_runtime.quant.quantize`, what `eg2 quantize` runs per Linear) against
compressed-tensors' own quantization of the same weight: the library's scale (calculate_qparams over
the group's min and max, rounded to the stored bf16) and its codes (`PackedQuantizationCompressor.compress`),
bit for bit.

The library divides in the weight's dtype; it is given the weight in fp32 with the bf16 scale, the
arithmetic ours documents (codes rounded against the scale a reader multiplies by).
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams

from eg2_runtime.quant import quantize


def library_quantization(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int32 (out, in / 8), bf16 scale (out, in / g)) as compressed-tensors computes them."""
    args = QuantizationArgs(
        num_bits=4,
        type="int",
        symmetric=True,
        strategy="group",
        group_size=group_size,
        scale_dtype=torch.bfloat16,
    )
    w = weight.float()
    out_f, in_f = w.shape
    groups = w.reshape(out_f, in_f // group_size, group_size)  # (out, groups, g)
    scale, zero_point = calculate_qparams(groups.amin(dim=-1), groups.amax(dim=-1), args)  # (out, groups)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}
    compressed = PackedQuantizationCompressor.compress(state, scheme)
    return compressed["weight_packed"], scale.to(torch.bfloat16)


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantizer_equals_compressed_tensors(group_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(group_size)
    weight = torch.randn(96, 512, generator=gen).to(dtype)
    weight[0, :group_size] = 0  # an all-zero group: the library's scale is then its eps, never 0/0
    weight[1] *= 1e-3  # a small-magnitude row: the bf16 scale's own rounding
    ours_packed, ours_scale = quantize(weight, group_size)
    lib_packed, lib_scale = library_quantization(weight, group_size)
    nonzero = ours_scale != 0  # the library writes eps where a group is all zero; its codes stay 0
    assert torch.equal(ours_scale[nonzero], lib_scale[nonzero]), (
        f"scales differ from compressed-tensors' absmax / 7.5 in {int((ours_scale != lib_scale)[nonzero].sum())} "
        f"of {int(nonzero.sum())} groups"
    )
    differ = (ours_packed != lib_packed).sum().item()
    assert differ == 0, f"{differ} of {ours_packed.numel()} packed words differ from compressed-tensors'"
