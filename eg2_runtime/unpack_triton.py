"""The fast path of `quant.dequantize`: one Triton kernel that reads the int32 words and the BF16
scales and writes the BF16 weight straight into the Unpacker's scratch buffer.

The reference (pure torch) materialises int32, int8 and fp32 copies of the whole weight on the way,
about ten times the bytes and ten launches; this reads 0.5 B and writes 2 B per weight, once. The
arithmetic is the reference's: the exact fp32 product q * scale, rounded once to BF16, so the two
agree bit for bit (tests/runtime/test_unpack_triton.py runs the kernel in Triton's CPU interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eg2_runtime.quant import PACK


@triton.jit
def _dequant_kernel(
    packed_ptr,  # (rows, words) int32
    scale_ptr,  # (rows, groups) bf16
    out_ptr,  # (rows, words * 8) bf16, viewed as int16
    words,
    groups,
    WORDS_PER_GROUP: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)  # word indices of this block
    in_row = w < words
    word = tl.load(packed_ptr + row * words + w, mask=in_row, other=0)  # (BLOCK_W,)
    nibble = (word[:, None] >> (tl.arange(0, 8) * 4)[None, :]) & 0xF  # (BLOCK_W, 8), element j of word
    scale = tl.load(scale_ptr + row * groups + w // WORDS_PER_GROUP, mask=in_row, other=0.0).to(tl.float32)
    value = (nibble - 8).to(tl.float32) * scale[:, None]  # exact: a 4-bit code times an 8-bit mantissa
    # Round to BF16, nearest-even, by hand: torch's rule for finite values, and the same bits in
    # Triton's CPU interpreter (whose own float downcast does not round to even).
    bits = value.to(tl.uint32, bitcast=True)
    bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)
    cols = w[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(out_ptr + row * words * 8 + cols, bf16, mask=in_row[:, None])


def dequantize_into(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write q * scale (BF16) into `out` (rows, words * 8), contiguous; returns `out`."""
    rows, words = packed.shape
    groups = scale.shape[1]
    if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.shape != (rows, words * PACK):
        raise ValueError(f"out must be a contiguous bf16 ({rows}, {words * PACK}) tensor")
    words_per_group = words // groups
    block = min(128, triton.next_power_of_2(words))
    _dequant_kernel[(rows, triton.cdiv(words, block))](
        packed, scale, out.view(torch.int16), words, groups, WORDS_PER_GROUP=words_per_group, BLOCK_W=block
    )
    return out
