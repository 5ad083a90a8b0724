"""The full layers' Triton attention (attention_triton.py) against the dense reference path
(packed_attention's "dense": SDPA under the packing's element mask), in Triton's CPU interpreter.

Packings: items of assorted lengths with a pad tail and empty slots, so a program's rows span several
items, one item, and the end of the rows; an item of one token; head_dim 32 and the model's 512. FP32
within 1e-5 of each row's scale (the kernel reorders the softmax's sums); BF16 inputs within 2e-2
(P is rounded to BF16 before P @ V, as FlashAttention rounds it), with the same inputs through
the reference in FP32.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.support.triton_interpreter import assert_ok_in_interpreter

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from eg2_runtime.attention_triton import full_attention
    from eg2_runtime.config import FULL, SLIDING
    from eg2_runtime.packed_attention import element_mask, block_mask, _dense
    from eg2_runtime.packing import Packing
    from tests.support.triton_interpreter import fp32_error

    gen = torch.Generator().manual_seed(0)
    cases = [
        # (item lengths, bucket tokens, bucket items, heads, head_dim, tile)
        ([5, 17, 1, 40], 70, 7, 4, 32, (16, 16, 4, 1)),
        ([3, 2, 9], None, None, 4, 32, (64, 32, 8, 2)),
        ([19, 6], 32, 4, 4, 512, (64, 32, 8, 2)),
        ([33], None, None, 3, 64, (16, 8, 4, 1)),
    ]
    for lengths, tokens, items, heads, hd, tile in cases:
        packing = Packing.from_lengths(lengths, tokens=tokens, items=items)
        n = packing.num_tokens
        q = torch.randn(n, heads, hd, generator=gen)
        k, v = (torch.randn(n, 1, hd, generator=gen) for _ in range(2))
        q, k = q / hd ** 0.25, k / hd ** 0.25  # logits of order 1, as the model's normed q and k give
        ref = _dense(q, k, v, element_mask(block_mask(packing, None)))
        got = full_attention(q.clone(), k, v, packing.doc_ids, packing.cu_seqlens, tile)
        err = fp32_error(got, ref)
        assert err < 1e-5, (lengths, hd, tile, "fp32", err)
        got = full_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), packing.doc_ids, packing.cu_seqlens, tile)
        err = fp32_error(got, ref)
        assert err < 2e-2, (lengths, hd, tile, "bf16", err)
    print("ok")
    """
)


def test_triton_full_attention_matches_the_dense_reference() -> None:
    assert_ok_in_interpreter(SCRIPT)
