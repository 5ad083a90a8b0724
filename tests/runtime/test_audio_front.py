"""The audio tower's two subsampling convolutions a few clips at a time (audio.FRONT_FRAMES), against
one pass over the whole batch, the reference: each clip's convolutions are its own."""

from __future__ import annotations

from pathlib import Path

import torch

from eg2_runtime.loader import load_model


def test_the_convolutions_in_passes_give_what_one_pass_gives(tiny_fp32: Path) -> None:
    model, _ = load_model(tiny_fp32, "cpu", modalities={"audio"})
    assert model.audio_tower is not None
    front = model.audio_tower.subsample_conv_projection
    torch.manual_seed(0)
    features, mask = 3 * torch.randn(5, 96, 128), torch.ones(5, 96, dtype=torch.bool)
    mask[1, 60:] = False
    mask[4, 8:] = False
    passes: list[int] = []
    convolve = front._convolve

    def counted(x: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        passes.append(x.shape[0])
        return convolve(x, m)

    front._convolve = counted  # type: ignore[method-assign]
    with torch.inference_mode():
        front.frames_per_pass = 2 * 96 + 50  # two clips a pass
        got, got_mask = front(features, mask)
        assert passes == [2, 2, 1]
        front.frames_per_pass = 1 << 30
        expected, expected_mask = front(features, mask)
        assert passes[3:] == [5]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert torch.equal(got_mask, expected_mask)
