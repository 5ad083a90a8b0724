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

# Words per program: 4,096 BF16 outputs (8 KiB) each, so the towers' layers (0.6-4.2 M weights) and
# their unpack groups (at most LAYERS_PER_SLOT times the largest layer) are 144-1,024 programs at
# the default cap, where one program a row per 128 words made 768-4,096 programs of 1-2 KiB a layer.
BLOCK_WORDS = 512


@triton.jit
def _dequant_kernel(
    packed_ptr,  # (rows * words,) int32: the (rows, words) weight, flat
    scale_ptr,  # (rows * groups,) bf16, flat
    out_ptr,  # (rows * words * 8,) bf16 viewed as int16, flat
    total_words,
    WORDS_PER_GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # The weight read as one flat run of words: a row's words are a whole number of groups, so flat
    # word f has scale f // WORDS_PER_GROUP, and its 8 outputs are elements 8f .. 8f + 7.
    f = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    live = f < total_words
    word = tl.load(packed_ptr + f, mask=live, other=0)
    nibble = (word[:, None] >> (tl.arange(0, 8) * 4)[None, :]) & 0xF  # (BLOCK, 8), element j of word
    scale = tl.load(scale_ptr + f // WORDS_PER_GROUP, mask=live, other=0.0).to(tl.float32)
    value = (nibble - 8).to(tl.float32) * scale[:, None]  # exact: a 4-bit code times an 8-bit mantissa
    # Round to BF16, nearest-even, by hand: torch's rule for finite values, and the same bits in
    # Triton's CPU interpreter (whose own float downcast does not round to even).
    bits = value.to(tl.uint32, bitcast=True)
    bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)
    cols = f[:, None] * 8 + tl.arange(0, 8)[None, :]  # 8 consecutive outputs a word: 16-byte stores
    tl.store(out_ptr + cols, bf16, mask=live[:, None])


def dequantize_into(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write q * scale (BF16) into `out` (rows, words * 8), contiguous; returns `out`."""
    rows, words = packed.shape
    groups = scale.shape[1]
    if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.shape != (rows, words * PACK):
        raise ValueError(f"out must be a contiguous bf16 ({rows}, {words * PACK}) tensor")
    if words % groups or not packed.is_contiguous() or not scale.is_contiguous():
        raise ValueError("packed and scale must be contiguous, with whole groups of words per row")
    dequantize_run(packed.view(-1), scale.view(-1), out.view(-1))
    return out


def dequantize_run(words: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """One launch over a flat run: (N,) int32 words, (N / w,) bf16 scales, one per w consecutive
    words, -> (8 N,) bf16 `out`. Layers laid end to end, each a whole number of scale groups of the
    same size, are such a run: their weights land end to end in `out`. Returns `out`."""
    if words.dim() != 1 or scales.dim() != 1 or out.dim() != 1:
        raise ValueError("words, scales and out must be flat")
    total = words.numel()
    if not scales.numel() or total % scales.numel():
        raise ValueError(f"{scales.numel()} scales do not split {total} words into equal groups")
    if out.dtype != torch.bfloat16 or out.numel() != total * PACK:
        raise ValueError(f"out must be {total * PACK} bf16 elements")
    if not (words.is_contiguous() and scales.is_contiguous() and out.is_contiguous()):
        raise ValueError("words, scales and out must be contiguous")
    _dequant_kernel[(triton.cdiv(total, BLOCK_WORDS),)](
        words,
        scales,
        out.view(torch.int16),
        total,
        WORDS_PER_GROUP=total // scales.numel(),
        BLOCK=BLOCK_WORDS,
    )
    return out
