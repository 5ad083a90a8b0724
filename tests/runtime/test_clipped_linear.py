"""ClippableLinear's frozen bounds (Python floats, read once at load) against the reference path that
clamps by the checkpoint's bound tensors on every call: bit for bit, on the CPU."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from eg2_runtime.layers import ClippableLinear
from eg2_runtime.loader import load_model


def _linear(bounds: tuple[float, float, float, float], dtype: torch.dtype) -> ClippableLinear:
    torch.manual_seed(0)
    layer = ClippableLinear(64, 48, clipped=True).to(dtype)
    with torch.no_grad():
        for name, value in zip(("input_min", "input_max", "output_min", "output_max"), bounds, strict=True):
            getattr(layer, name).fill_(value)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "bounds",
    [
        (-0.75, 1.25, -0.5, 0.625),  # every bound bites: inputs are N(0, 1), outputs wider
        (-math.inf, math.inf, -0.5, 0.625),  # no input clamp
        (-0.75, 1.25, -math.inf, math.inf),  # no output clamp
        (-math.inf, 1.25, -0.5, math.inf),  # one side of each
    ],
)
def test_frozen_bounds_clamp_as_the_buffers_do(
    bounds: tuple[float, float, float, float], dtype: torch.dtype
) -> None:
    layer = _linear(bounds, dtype)
    x = 2 * torch.randn(5, 7, 64).to(dtype)
    x[0, 0, :3] = torch.tensor([math.inf, -math.inf, math.nan])
    with torch.inference_mode():
        expected = layer(x)
        layer.freeze_bounds()
        assert layer.bounds == bounds
        got = layer(x)
        unclamped = layer.linear(x)
    assert not torch.allclose(expected, unclamped, equal_nan=True)  # the bounds bite
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


def test_the_loader_freezes_every_clipped_linear_and_the_tower_is_unchanged(tiny_fp32: Path) -> None:
    model, _ = load_model(tiny_fp32, "cpu", modalities={"audio"})
    assert model.audio_tower is not None
    clipped = [m for m in model.audio_tower.modules() if isinstance(m, ClippableLinear) and m.clipped]
    assert clipped and all(m.bounds is not None for m in clipped)
    torch.manual_seed(0)
    features, mask = 3 * torch.randn(2, 96, 128), torch.ones(2, 96, dtype=torch.bool)
    mask[1, 60:] = False
    with torch.inference_mode():
        got, _ = model.audio_tower(features, mask)
        for m in clipped:
            m.bounds = None  # the reference path: the buffers, read on every call
        expected, _ = model.audio_tower(features, mask)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
