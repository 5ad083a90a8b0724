"""The vision tower with every fused kernel switched on (fused.use_fused_kernels) against its
reference path, on the tiny checkpoints, in Triton's CPU interpreter; and the tower's additive
attention mask against the bool mask it replaces.

What the fused path must keep, whole tower and whole model (text encoder included: its norms and
gated MLPs run fused too):
- FP32: soft tokens and embeddings within 1e-5 of each row's scale (float reordering through two
  layers; measured 3.4e-7), yet not bit-identical (proof that the kernels, not the reference, ran);
- BF16: every soft token's cosine to the BF16 reference >= 0.9999 (measured 0.99998), and no further
  from the FP32 model than the BF16 reference is (3x its distance + 1e-5, test_gpu.py's rule);
- switching back (`enable=False`) gives the reference's bits again.
The padded-bucket form CUDA graphs capture (`slots(masked=True)`) is checked the same way. The
interpreter runs the tiny tower in ~5 s per dtype; tests/gpu/test_gpu_kernels.py repeats the check on
the full-size tower on the GPU.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eg2_runtime.layers import additive_mask, key_padding_mask
from tests.support.triton_interpreter import assert_ok_in_interpreter

SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import torch
    from eg2_runtime.engine import Engine, EngineOptions
    from eg2_runtime.fused import use_fused_kernels
    from eg2_runtime.inputs import Item, MediaPart, PrepareOptions, TextPart
    from eg2_runtime.loader import load_model
    from eg2_runtime import samples
    from eg2_runtime.vision import VisionAttention, VisionLayer
    from tests.support.triton_interpreter import fp32_error

    fp32_dir, bf16_dir = sys.argv[1], sys.argv[2]
    items = [
        Item((MediaPart("image", samples.png(64, 48, 0)),)),  # off the 3x3 grid: padding patches
        Item((TextPart("a photo of"), MediaPart("image", samples.png(96, 96, 5)), TextPart("a cat"))),
    ]

    def run(engine):
        prepared = engine.prepare_many(items, PrepareOptions(image_tokens=70))
        _, inputs = engine.device_batch([p.inputs for p in prepared])
        px, pos = inputs["pixel_values"], inputs["image_position_ids"]
        assert bool((pos == -1).all(-1).any()), "no padding patches: the masked path went untested"
        tower = engine.model.vision_tower
        with torch.inference_mode():
            soft = engine.model.image_soft_tokens(px, pos)
            slots, used = tower.slots(px, pos, (pos == -1).all(-1), masked=True)
            return soft, slots[used], torch.from_numpy(engine.embed(prepared))

    def engine(model_dir, dtype):
        return Engine.from_dir(model_dir, device="cpu", dtype=dtype, options=EngineOptions(graph_max_tokens=0))

    cos = lambda a, b: torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)

    for model_dir, dtype in [(fp32_dir, torch.float32), (bf16_dir, torch.bfloat16)]:
        e = engine(model_dir, dtype)
        reference = run(e)
        n = use_fused_kernels(e.model)
        for m in e.model.modules():
            if isinstance(m, (VisionAttention, VisionLayer)):
                assert m.fused is not None, type(m)
        fused = run(e)
        for what, got, ref in zip(("soft tokens", "slots", "embeddings"), fused, reference):
            if dtype == torch.float32:
                err = fp32_error(got, ref)
                assert err <= 1e-5, (what, "fp32", err)
                assert not torch.equal(got, ref), (what, "bit-identical: did the kernels run?")
            else:
                assert cos(got, ref).min() >= 0.9999, (what, "bf16 cosine", cos(got, ref).min())
        assert use_fused_kernels(e.model, enable=False) == 0
        again = run(e)
        assert all(torch.equal(a, b) for a, b in zip(again, reference)), "enable=False is not the reference"
        print(dtype, "fused modules", n, file=sys.stderr)

    # BF16 against the FP32 model of the same weights: the fused path is no further off than the
    # BF16 reference path (`reference` and `fused` hold the loop's last runs, BF16's).
    exact = run(engine(bf16_dir, torch.float32))
    for what, x, f, r in zip(("soft tokens", "slots", "embeddings"), exact, fused, reference):
        fused_off, ref_off = (1 - cos(f, x)).max().item(), (1 - cos(r, x)).max().item()
        assert fused_off <= 3 * ref_off + 1e-5, (what, "fused off fp32", fused_off, "bf16 ref", ref_off)
    print("ok")
    """
)


def test_fused_model_matches_reference_path(tiny_fp32: Path, tiny_bf16: Path) -> None:
    pytest.importorskip("triton")
    assert_ok_in_interpreter(SCRIPT, str(tiny_fp32), str(tiny_bf16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_additive_mask_gives_the_bool_masks_attention(dtype: torch.dtype) -> None:
    """SDPA with the additive mask built once equals SDPA with the bool mask, bit for bit: items whose
    first keys are hidden, a padded image (padding at the end) and an item with no valid key (a
    graph's padding item, which key_padding_mask lets see its first key)."""
    gen = torch.Generator().manual_seed(0)
    valid = torch.rand(4, 50, generator=gen) > 0.4
    valid[0, :20] = False
    valid[1, 30:] = False
    valid[3] = False
    keep = key_padding_mask(valid)
    q, k, v = (torch.randn(4, 4, 50, 16, generator=gen, dtype=dtype) * 3 for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask(keep, dtype))
    assert torch.equal(got, expected), (got.float() - expected.float()).abs().max()
