"""Banded sliding-window attention (text.band, text.banded_attention) against the dense window masks
of the reference path: the same visible (query, key) pairs, the same attention output, the same text
encoder output, in FP32 on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eg2_runtime.config import FULL, SLIDING
from eg2_runtime.loader import load_model
from eg2_runtime.text import Band, attention_masks, band, banded_attention

WINDOW = 8


def _valid(lengths: list[int], t: int) -> torch.Tensor:
    return torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]


@pytest.mark.parametrize(("t", "size"), [(25, 8), (40, 8), (97, 8), (97, 5), (64, 16)])
def test_band_sees_exactly_the_dense_window(t: int, size: int) -> None:
    """For every valid query, the keys of the dense mask and no others are visible in the band; keys
    past a query's span are outside the window; every query, padding too, sees some key."""
    valid = _valid([t, t - 3, 1, 0], t)
    dense = attention_masks(valid, WINDOW, static=True)[SLIDING]
    b = band(valid, WINDOW, size)
    assert isinstance(dense, torch.Tensor) and isinstance(b, Band)
    span = size + 2 * WINDOW
    mask = b.mask.view(valid.shape[0], b.blocks, size, span)
    seen = torch.zeros(valid.shape[0], t, t, dtype=torch.bool)
    for i in range(b.blocks):
        for a in range(size):
            q = i * size + a
            if q >= t:
                continue
            for c in range(span):
                k = i * size - WINDOW + c
                if 0 <= k < t:
                    seen[:, q, k] = mask[:, i, a, c]
                else:
                    assert not mask[:, i, a, c].any(), f"key {k} outside the sequence is visible"
    rows = valid[:, :, None].expand(-1, t, t)
    assert torch.equal(seen[rows], dense[:, 0].expand(-1, t, t)[rows]), "band and dense masks differ"
    assert seen.any(dim=-1).all(), "a query sees no key"


@pytest.mark.parametrize("t", [1, 7, 25, 26, 40, 100])
def test_banded_attention_equals_dense(t: int) -> None:
    torch.manual_seed(t)
    valid = _valid([t, max(1, t - 5), 1, 0], t)
    q, k, v = (torch.randn(4, 2, t, 16) for _ in range(3))
    dense = attention_masks(valid, WINDOW, static=True)[SLIDING]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=1.0)
    got = banded_attention(q, k, v, band(valid, WINDOW))
    assert got.shape == expected.shape
    assert torch.isfinite(got).all(), "a padding row went NaN"
    rows = valid[:, None, :, None].expand_as(got)
    diff = float((got - expected)[rows].abs().max()) if rows.any() else 0.0
    assert diff <= 1e-5, f"banded vs dense attention on valid rows: {diff:.2e} > 1e-5"


def test_long_inputs_get_a_band_and_short_ones_a_dense_mask() -> None:
    long, short = _valid([100, 60], 100), _valid([24, 20], 24)
    assert isinstance(attention_masks(long, WINDOW, banded=True)[SLIDING], Band)
    assert isinstance(attention_masks(short, WINDOW, banded=True)[SLIDING], torch.Tensor)
    assert isinstance(attention_masks(long, WINDOW)[SLIDING], torch.Tensor), "the reference is dense"
    full = attention_masks(long, WINDOW, banded=True)[FULL]
    assert isinstance(full, torch.Tensor) and full.shape == (2, 1, 1, 100), "key padding, broadcast"


def test_lean_text_encoder_equals_reference(tiny_fp32: Path) -> None:
    """The whole text encoder, padded batch of mixed lengths: the lean path (banded attention,
    per-layer PLE) against the reference (dense window masks, PLE up front)."""
    model, _ = load_model(tiny_fp32, "cpu")
    encoder = model.language_model
    assert encoder.cfg.sliding_window == WINDOW
    torch.manual_seed(0)
    lengths = [90, 33, 5, 61]
    valid = _valid(lengths, 90)
    embeds = torch.randn(4, 90, encoder.cfg.hidden_size) * valid[..., None]
    with torch.no_grad():
        expected = encoder(embeds, valid)
        got = encoder(embeds, valid, lean=True)
        static = encoder(embeds, valid, static=True, lean=True)
    scale = float(expected.abs().max())  # per-token outputs, not unit vectors: a relative bound
    for i, n in enumerate(lengths):
        for name, out in (("lean", got), ("lean static", static)):
            diff = float((out[i, :n] - expected[i, :n]).abs().max()) / scale
            assert diff <= 1e-5, f"{name} item {i} ({n} tokens): relative {diff:.2e} > 1e-5"
