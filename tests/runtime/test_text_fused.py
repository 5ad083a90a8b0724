"""The packed text forward with its fused kernels (TextAttention: q, k, v from one merged matmul, then
their norms and RoPE in one kernel; the MLP's gate and up merged; TextLayer: residual adds with their
norms, the PLE block's included; the PLE gate) against its reference path, on the tiny checkpoints,
in Triton's CPU interpreter, with the PLE slices up front and one layer at a time:
- FP32: per-token outputs within 1e-5 of each row's scale, yet not bit-identical (the kernels ran);
- BF16: every item's pooled vector at cosine >= 0.9999 to the BF16 reference, and no further from
  the FP32 model than the BF16 reference is (3x its distance + 1e-5, test_gpu.py's rule);
- switching back (`enable=False`) gives the reference's bits again.
The GPU suite holds the served path (packed graphs, fused) to the same rule on the full-size model.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.support.triton_interpreter import assert_ok_in_interpreter

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from eg2_runtime import text
    from eg2_runtime.fused import use_fused_kernels
    from eg2_runtime.layers import GatedMLP
    from eg2_runtime.loader import load_model
    from eg2_runtime.packing import Packing
    from eg2_runtime.text import PLEBlock, TextAttention, TextLayer
    from tests.support.triton_interpreter import fp32_error

    fp32_dir, bf16_dir = sys.argv[1], sys.argv[2]
    lengths = [5, 19, 2, 40]  # 40: past the tiny model's window (8)

    def run(encoder, dtype):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(sum(lengths) + 6, encoder.cfg.hidden_size, generator=gen).to(dtype)
        packing = Packing.from_lengths(lengths, tokens=sum(lengths) + 6, items=len(lengths) + 2)
        with torch.inference_mode():
            tokens = encoder.forward_packed(x, packing)
            return tokens, packing.pool(tokens.float())[: len(lengths)]

    cos = lambda a, b: torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)
    runs = {}
    for model_dir, dtype in [(fp32_dir, torch.float32), (bf16_dir, torch.bfloat16)]:
        encoder = load_model(model_dir, "cpu", {"text"}, dtype=dtype)[0].language_model
        reference = run(encoder, dtype)
        # Each layer's PLE slice when it runs (a batch past PLE_UPFRONT_TOKENS) against all up front
        upfront_default = text.PLE_UPFRONT_TOKENS
        text.PLE_UPFRONT_TOKENS = 0
        layer_by_layer = run(encoder, dtype)
        text.PLE_UPFRONT_TOKENS = upfront_default
        if dtype == torch.float32:
            assert fp32_error(layer_by_layer[0], reference[0]) <= 1e-5
        else:
            assert cos(layer_by_layer[1], reference[1]).min() >= 0.9999
        use_fused_kernels(encoder)
        for m in encoder.modules():
            if isinstance(m, (TextAttention, TextLayer, PLEBlock)):
                assert m.fused is not None, type(m)
            if isinstance(m, TextAttention):  # the merged weight, which the three Linears view
                assert m.qkv is not None and m.qkv.live(m.q_proj, m.k_proj, m.v_proj)
            if isinstance(m, GatedMLP):
                assert m.gate_up is not None and m.gate_up.live(m.gate_proj, m.up_proj)
        for upfront in (upfront_default, 0):
            text.PLE_UPFRONT_TOKENS = upfront
            fused = run(encoder, dtype)
            if dtype == torch.float32:
                err = fp32_error(fused[0], reference[0])
                assert err <= 1e-5, ("fp32", upfront, err)
                assert not torch.equal(fused[0], reference[0]), "bit-identical: did the kernels run?"
            else:
                assert cos(fused[1], reference[1]).min() >= 0.9999, ("bf16 cosine", upfront, cos(fused[1], reference[1]))
        text.PLE_UPFRONT_TOKENS = upfront_default
        assert use_fused_kernels(encoder, enable=False) == 0
        assert torch.equal(run(encoder, dtype)[0], reference[0]), "enable=False is not the reference"
        runs[dtype] = reference, fused

    exact = run(load_model(bf16_dir, "cpu", {"text"}, dtype=torch.float32)[0].language_model, torch.float32)
    reference, fused = runs[torch.bfloat16]
    fused_off, ref_off = (1 - cos(fused[1], exact[1])).max().item(), (1 - cos(reference[1], exact[1])).max().item()
    assert fused_off <= 3 * ref_off + 1e-5, ("fused off fp32", fused_off, "bf16 ref", ref_off)
    print("ok")
    """
)


def test_fused_packed_text_matches_reference_path(tiny_fp32: Path, tiny_bf16: Path) -> None:
    pytest.importorskip("triton")
    assert_ok_in_interpreter(SCRIPT, str(tiny_fp32), str(tiny_bf16))
