"""The full layers' Triton attention (attention_triton.py) against the dense reference path
(packed_attention's "dense": SDPA under the packing's element mask), in Triton's CPU interpreter.

Packings: items of assorted lengths with a pad tail and empty slots, so a program's rows span several
items, one item, and the end of the rows; an item of one token; head_dim 32 and the model's 512. FP32
within 1e-5 of each row's scale (the kernel reorders the softmax's sums); BF16 inputs within 2e-2
(P is rounded to BF16 before P @ V, as FlashAttention rounds it), with the same inputs through
the reference in FP32.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import textwrap
from pathlib import Path

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
        ([33], None, None, 3, 64, (16, 16, 4, 1)),
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


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_default_tiles_compile_for_hopper_without_spills(dtype: str) -> None:
    """The default tiles compiled for sm_90a at the model's shape (4 query heads folded on one kv
    head of 512), no GPU needed: no registers spilled to local memory, shared memory within
    Hopper's 227 KB a block. A larger tile spilled or would not launch (attention_triton.TILE)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from eg2_runtime.attention_triton import FP32_TILE, TILE, _full_attention_kernel

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton build has no ptxas")
    block_m, block_n, warps, stages = TILE if dtype == "bf16" else FP32_TILE
    signature = {
        "q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "doc_ptr": "*i32", "cu_ptr": "*i32",
        "rows": "i32", "HEADS": "constexpr", "HD": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
        "FP32_DOT": "constexpr", "PRECISION": "constexpr",
    }  # fmt: skip
    constants: dict[str, object] = {"HEADS": 4, "HD": 512, "BLOCK_M": block_m, "BLOCK_N": block_n}
    constants |= {"FP32_DOT": False, "PRECISION": "ieee" if dtype == "fp32" else "tf32"}
    names = list(signature)
    source = ASTSource(
        _full_attention_kernel, signature, constexprs={(names.index(k),): v for k, v in constants.items()}
    )
    kernel = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )
    assert kernel.metadata.shared <= 232_448, kernel.metadata.shared
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        done = subprocess.run(
            [str(ptxas), "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(Path(tmp) / "kernel.o")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", done.stderr)]
    assert spills and max(spills) == 0, done.stderr
