"""The engine's batched media path against the reference: encoded bytes -> `Engine.prepare_many` ->
one `Engine.embed` call (collate, device batch, pixel rescale, forward) == transformers +
sentence-transformers on the same media, item by item, FP32 on the CPU, within 1e-5.

The batches mix what a batch pads: images of different soft-token budgets (patch slots padded with
position -1), audio of different lengths (features padded, mask 0), video clips of different frame
sizes, and every modality in one call. The reference gets each medium decoded as a user of
sentence-transformers would hand it over (as tests/preprocess/test_preprocess_e2e.py does, one item at a time).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from eg2_runtime.engine import Engine, PreparedItem
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions, TextPart
from eg2_runtime.preprocess.audio import load_audio
from tests.support import media
from tests.support.reference import Reference, load_reference

TOL = 1e-5

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tiny_fp32: Path) -> Engine:
    return Engine.from_dir(tiny_fp32, device="cpu")


@pytest.fixture(scope="module")
def reference(tiny_fp32: Path) -> Reference:
    return load_reference(tiny_fp32, dtype=torch.float32)


def smooth(height: int, width: int, seed: int) -> np.ndarray:
    """Smooth pixels: random weights amplify white noise (docs/CORRECTNESS.md)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    phase = rng.uniform(0, 2 * np.pi, 3)
    return ((np.sin(3 * x[..., None] + 2 * y[..., None] + phase) * 0.5 + 0.5) * 255).astype(np.uint8)


def png(height: int, width: int, seed: int) -> bytes:
    return media.encode_image(smooth(height, width, seed), "PNG")


def wav(seconds: float, freq: float) -> bytes:
    return media.encode_audio(media.sine(seconds, 16_000, freq=freq), 16_000, "wav")


class Case:
    """One item: what the engine gets, and what the reference gets for it."""

    def __init__(self, name: str, parts: list[tuple[str, Any]], image_tokens: int = 280) -> None:
        self.name, self.parts, self.image_tokens = name, parts, image_tokens

    def item(self) -> Item:
        return Item(tuple(TextPart(v) if k == "text" else MediaPart(k, v) for k, v in self.parts))

    def reference_input(self) -> Any:
        decoded = [(k, v if k == "text" else _decoded(k, v)) for k, v in self.parts]
        if len(decoded) > 1:
            return {"content": decoded}
        kind, value = decoded[0]
        if kind == "video":
            return {"video": value[0], "fps": value[1]}
        return {"audio": value} if kind == "audio" else value


def _decoded(kind: str, data: bytes) -> Any:
    if kind == "image":
        return Image.open(io.BytesIO(data)).convert("RGB")
    if kind == "audio":
        return (load_audio(data)[0], 16_000)
    return media.all_frames(data)  # every frame and the rate: the reference's processor samples them


def batched(engine: Engine, cases: list[Case]) -> np.ndarray:
    """Each case prepared under its own options (as separate requests are), then ONE embed call."""
    prepared: list[PreparedItem] = []
    for case in cases:
        (one,) = engine.prepare_many([case.item()], PrepareOptions(image_tokens=case.image_tokens))
        assert isinstance(one, PreparedItem), f"{case.name}: {one}"
        prepared.append(one)
    return engine.embed(prepared)


def assert_each_matches_reference(engine: Engine, reference: Reference, cases: list[Case]) -> None:
    got = batched(engine, cases)
    assert got.shape == (len(cases), 768)
    report = []
    for case, row in zip(cases, got, strict=True):
        budget = {"image": {"max_soft_tokens": case.image_tokens}}
        expected = reference.encode([case.reference_input()], processing_kwargs=budget)[0]
        report.append((case.name, float(np.abs(row - expected).max()), float(row @ expected)))
    worst = max(report, key=lambda r: r[1])
    lines = "\n".join(f"  {n}: max abs diff {d:.2e}, cosine {c:.6f}" for n, d, c in report)
    assert worst[1] <= TOL, (
        f"batched engine vs reference, worst {worst[0]} ({worst[1]:.2e} > {TOL:.0e}):\n{lines}"
    )


def test_images_of_mixed_budgets_in_one_batch(engine: Engine, reference: Reference) -> None:
    cases = [
        Case("image 70 tokens", [("image", png(240, 320, 0))], image_tokens=70),
        Case("image 280 tokens", [("image", png(480, 640, 1))], image_tokens=280),
        Case("image 140 tokens", [("image", png(500, 120, 2))], image_tokens=140),
    ]
    assert_each_matches_reference(engine, reference, cases)


def test_audio_of_mixed_lengths_in_one_batch(engine: Engine, reference: Reference) -> None:
    cases = [
        Case("audio 1 s", [("audio", wav(1.0, 440.0))]),
        Case("audio 4.5 s", [("audio", wav(4.5, 220.0))]),
        Case("audio 10 s", [("audio", wav(10.0, 330.0))]),
    ]
    assert_each_matches_reference(engine, reference, cases)


def test_video_clips_in_one_batch(engine: Engine, reference: Reference) -> None:
    cases = [
        Case("video 3 s landscape", [("video", media.encode_video(3, 10, size=(64, 96)))]),
        Case("video 5 s portrait", [("video", media.encode_video(5, 10, size=(96, 64)))]),
    ]
    assert_each_matches_reference(engine, reference, cases)


def test_every_modality_in_one_batch(engine: Engine, reference: Reference) -> None:
    cases = [
        Case("text", [("text", "a caption about a cat")]),
        Case("image 70 tokens", [("image", png(240, 320, 3))], image_tokens=70),
        Case("audio 2 s", [("audio", wav(2.0, 550.0))]),
        Case("video 3 s", [("video", media.encode_video(3, 10, size=(64, 96)))]),
        Case("text + image 280", [("text", "a photo of "), ("image", png(300, 400, 4))]),
        Case("image 1120 tokens", [("image", png(600, 800, 5))], image_tokens=1120),
    ]
    assert_each_matches_reference(engine, reference, cases)
