"""The fused per-head RMSNorm + RoPE kernel (rope_triton.py) against the reference path it stands for:
vision.apply_axial_rope(RMSNorm(x)) for the vision tower's q and k, and layers.apply_rope(RMSNorm(x))
for one rotated section, in Triton's CPU interpreter.

Tolerances as in tests/runtime/test_rmsnorm_triton.py: FP32 within 1e-6 of each row's scale; BF16 within
one BF16 step and at most 1% of outputs different (the kernel rounds the norm, both products and
their sum as torch does, so only the norm's reordered mean can move an output). Shapes: head_dim 16
(the tiny checkpoint), 64 (vision), 128 and a non-power of two; token and head counts no block
divides; padding patches (position -1, all-zero rows).
"""

from __future__ import annotations

import textwrap

import pytest

from tests.support.triton_interpreter import assert_ok_in_interpreter

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from eg2_runtime.layers import RMSNorm, apply_rope, rope_cos_sin
    from eg2_runtime.rope_triton import rms_norm_rope
    from eg2_runtime.vision import apply_axial_rope, axial_rope
    from tests.support.triton_interpreter import assert_kernel_matches as check

    gen = torch.Generator().manual_seed(0)

    for (n, s, heads, hd), scale in [
        ((3, 37, 5, 64), True), ((2, 45, 12, 64), False), ((3, 37, 5, 128), True),
        ((2, 41, 4, 16), True), ((2, 13, 3, 24), True),
    ]:
        norm = RMSNorm(hd, eps=1e-6, with_scale=scale)
        if scale:
            norm.weight.data = torch.randn(hd, generator=gen)
        x = torch.randn(n, s, heads, hd, generator=gen) * 4
        positions = torch.randint(0, 60, (n, s, 2), generator=gen)
        positions[0, -7:] = -1  # padding patches: zero rows, the position the vision tower gives them
        x[0, -7:] = 0
        x[-1, 0] *= 1e-3  # eps weighs on these rows
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            cos, sin = axial_rope(positions, hd, 100.0, dtype)
            got = rms_norm_rope(xd, norm.weight, norm.eps, cos, sin, 2)
            check(((n, s, heads, hd), scale, dtype, "axial"), got, apply_axial_rope(norm.reference(xd), cos, sin))
            cos1, sin1 = rope_cos_sin(positions[..., 0], hd, 10_000.0, dtype)  # (n, s, hd)
            got = rms_norm_rope(xd, norm.weight, norm.eps, cos1, sin1, 1)
            ref = apply_rope(norm.reference(xd), cos1[:, :, None], sin1[:, :, None])
            check(((n, s, heads, hd), scale, dtype, "1-D"), got, ref)
    print("ok")
    """
)


def test_triton_rms_norm_rope_matches_reference() -> None:
    assert_ok_in_interpreter(SCRIPT)


QKV_SCRIPT = textwrap.dedent(
    """
    import torch
    from eg2_runtime.layers import RMSNorm, apply_rope, rope_cos_sin
    from eg2_runtime.rope_triton import qkv_norm_rope
    from tests.support.triton_interpreter import assert_kernel_matches

    gen = torch.Generator().manual_seed(1)

    def check(what, got, ref):
        assert got.is_contiguous(), (what, got.stride())
        assert_kernel_matches(what, got, ref)

    # (tokens, heads, kv heads, head_dim): the tiny checkpoint's, the text encoder's sliding and full
    # layers', a token count no block divides.
    for n, heads, kv, hd in [(37, 4, 2, 16), (45, 4, 2, 256), (19, 4, 1, 512), (5, 3, 1, 24)]:
        q_norm, k_norm = RMSNorm(hd, eps=1e-6), RMSNorm(hd, eps=1e-5)
        v_norm = RMSNorm(hd, eps=1e-4, with_scale=False)
        q_norm.weight.data = torch.randn(hd, generator=gen)
        k_norm.weight.data = torch.randn(hd, generator=gen)
        # Read in place from a wider tensor: rows with more columns than the projection's.
        wide = torch.randn(n, (heads + 2 * kv) * hd + 8, generator=gen) * 4
        wide[3] = 0  # a zero row: the norm of zeros is zeros
        wide[-1] *= 1e-3  # eps weighs on this row
        positions = torch.randint(0, 600, (n,), generator=gen)
        for dtype in (torch.float32, torch.bfloat16):
            qkv = wide.to(dtype)[:, : (heads + 2 * kv) * hd]
            assert not qkv.is_contiguous()
            cos, sin = rope_cos_sin(positions, hd, 10_000.0, dtype)  # (n, hd)
            q, k, v = qkv_norm_rope(qkv, heads, kv, q_norm.weight, k_norm.weight, (1e-6, 1e-5, 1e-4), cos, sin)
            rq, rk, rv = qkv.split([heads * hd, kv * hd, kv * hd], dim=-1)
            what = (n, heads, kv, hd, dtype)
            check((what, "q"), q, apply_rope(q_norm.reference(rq.reshape(n, heads, hd)), cos[:, None], sin[:, None]))
            check((what, "k"), k, apply_rope(k_norm.reference(rk.reshape(n, kv, hd)), cos[:, None], sin[:, None]))
            check((what, "v"), v, v_norm.reference(rv.reshape(n, kv, hd)))
            # Another launch tile (a program of 1 token, 4 warps; QKV_TILE takes 1,024 values on 2)
            # gives the same bits.
            tiled = qkv_norm_rope(
                qkv, heads, kv, q_norm.weight, k_norm.weight, (1e-6, 1e-5, 1e-4), cos, sin, tile=(hd, 4)
            )
            for name, a, b in zip("qkv", (q, k, v), tiled):
                assert torch.equal(a, b), (what, name, "tile")
    print("ok")
    """
)


def test_triton_qkv_norm_rope_matches_the_three_norms_and_rope() -> None:
    assert_ok_in_interpreter(QKV_SCRIPT)
