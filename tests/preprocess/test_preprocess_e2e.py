"""End to end: media files -> our Preprocessor -> our model == sentence-transformers + transformers on
the same files (FP32, the tiny demo checkpoint), within 1e-5.

The reference gets each file decoded the way a user of sentence-transformers would hand it over: the
image opened and EXIF-transposed, the audio as 16 kHz samples (its feature extractor does not
resample, so it gets our resampled waveform), the video as all its frames with their frame rate (its
processor samples them). Everything else, layout included, is the reference's own path.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from eg2_runtime.inputs import Item, MediaPart, PrepareOptions, TextPart
from eg2_runtime.preprocess import Prepared, Preprocessor
from eg2_runtime.preprocess.audio import load_audio
from tests.support import media

TOL = 1e-5
PROMPT = "task: search result | query: "

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tiny_fp32: Path) -> Any:
    from tests.support.reference import load_reference

    return load_reference(tiny_fp32, dtype=torch.float32)


@pytest.fixture(scope="module")
def model(tiny_fp32: Path) -> Any:
    from eg2_runtime.loader import load_model

    return load_model(tiny_fp32, "cpu")[0]


@pytest.fixture(scope="module")
def pre(tiny_fp32: Path) -> Preprocessor:
    return Preprocessor.from_dir(tiny_fp32)


def embed(model: Any, prepared: Prepared) -> np.ndarray:
    inputs = prepared.model_inputs()
    inputs.pop("num_frames_per_video", None)
    ids = inputs.pop("input_ids")[None]
    with torch.no_grad():
        return model(ids, torch.ones_like(ids), **inputs).numpy()[0]


def as_reference(kind: str, data: bytes) -> Any:
    if kind == "image":
        return ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    if kind == "audio":
        return (load_audio(data)[0], 16_000)
    frames, fps = media.all_frames(data)
    return frames, fps


def smooth(height: int, width: int, seed: int) -> np.ndarray:
    """Smooth pixels: random weights in a ViT amplify white noise (docs/CORRECTNESS.md)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    phase = rng.uniform(0, 2 * np.pi, 3)
    return ((np.sin(3 * x[..., None] + 2 * y[..., None] + phase) * 0.5 + 0.5) * 255).astype(np.uint8)


JPEG = media.exif_rotated_jpeg(smooth(300, 400, 0), 6)
PNG_RGBA = media.rgba_png(smooth(120, 90, 1))
MP3 = media.encode_audio(media.sine(2.5, 44_100, freq=330.0, channels=2), 44_100, "mp3")
WAV = media.encode_audio(media.sine(1.2, 8_000, freq=500.0), 8_000, "wav")
MP4 = media.encode_video(3, 10, size=(64, 96))

CASES: dict[str, list[tuple[str, Any]]] = {
    "jpeg_exif": [("image", JPEG)],
    "png_rgba": [("image", PNG_RGBA)],
    "mp3_44k_stereo": [("audio", MP3)],
    "wav_8k": [("audio", WAV)],
    "mp4": [("video", MP4)],
    "mixed": [("text", "a photo "), ("image", PNG_RGBA), ("text", " and a sound "), ("audio", WAV)],
}


@pytest.mark.parametrize("prompt", [None, PROMPT])
@pytest.mark.parametrize("name", list(CASES))
def test_files_embed_like_the_reference(
    name: str, prompt: str | None, reference: Any, model: Any, pre: Preprocessor
) -> None:
    parts = CASES[name]
    item = Item(tuple(TextPart(v) if k == "text" else MediaPart(k, v) for k, v in parts))
    got = embed(model, pre.prepare(item, PrepareOptions(prompt=prompt)))
    if len(parts) == 1:
        kind, data = parts[0]
        value = as_reference(kind, data)
        ref_input = {"video": value[0], "fps": value[1]} if kind == "video" else value
        if kind == "audio":
            ref_input = {"audio": value}
    else:
        ref_input = {"content": [(k, v if k == "text" else as_reference(k, v)) for k, v in parts]}
    expected = reference.encode([ref_input], prompt=prompt)[0]
    diff = float(np.abs(got - expected).max())
    assert diff <= TOL, f"{name}: max abs diff {diff:.2e} > {TOL:.0e}"
