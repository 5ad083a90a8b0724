"""Fuzz: the decoders on mutated valid files (hypothesis, a bounded and derandomized run).

Mutations: flipped bytes, overwritten runs, truncation, inserted and duplicated spans. Whatever the
bytes, the only acceptable outcomes are a well-formed result (right shapes, finite values) or one of
our input errors; any other exception, or a run past the deadline, fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.settings import Settings
from eg2_runtime.errors import InputError
from eg2_runtime.preprocess.audio import LogMel, MelConfig, load_audio
from eg2_runtime.preprocess.image import PatchGeometry, decode_image, prepare_image
from eg2_runtime.preprocess.video import VideoConfig, decode_video, prepare_frames
from tests.support import media

LIMITS = Settings().media_limits()  # the service's defaults
GEOMETRY = PatchGeometry()
LOG_MEL = LogMel(MelConfig())
DEADLINE_S = 10.0


def run_image(data: bytes) -> None:
    rgb = decode_image(data, max_pixels=LIMITS.max_image_pixels)
    assert rgb.ndim == 3 and rgb.shape[2] == 3 and rgb.dtype == np.uint8
    patched = prepare_image(rgb, 70, GEOMETRY)
    assert patched.pixel_values.shape == (1, 630, 768) and 0 < patched.num_soft_tokens <= 70


def run_audio(data: bytes) -> None:
    wave, _ = load_audio(data, limits=LIMITS)
    assert wave.ndim == 1 and 0 < len(wave) <= 480_000 and np.isfinite(wave).all()
    features, mask = LOG_MEL(wave)
    assert features.shape == (len(mask), 128)


def run_video(data: bytes) -> None:
    sampled = decode_video(data, VideoConfig(), LIMITS)
    assert sampled.frames.ndim == 4 and 1 <= len(sampled.frames) <= 32
    patched = prepare_frames(sampled.frames, 70, GEOMETRY)
    assert patched.pixel_values.shape == (len(sampled.frames), 630, 768)


PICTURE = media.picture(24, 40, seed=7)
SEEDS: list[tuple[str, bytes, Callable[[bytes], None]]] = [
    *(
        (f"image/{fmt}", media.encode_image(PICTURE, fmt), run_image)
        for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
    ),
    ("image/png16", media.png16_gray(PICTURE[:, :, 0]), run_image),
    ("image/exif", media.exif_rotated_jpeg(PICTURE, 6), run_image),
    *(
        (f"audio/{fmt}", media.encode_audio(media.noise(0.3, 22_050, channels=2), 22_050, fmt), run_audio)
        for fmt in ("wav", "flac", "ogg", "mp3", "m4a")
    ),
    ("audio/webm", media.encode_audio(media.noise(0.3, 48_000), 48_000, "webm"), run_audio),
    *(
        (f"video/{fmt}", media.encode_video(1.2, 5, size=(32, 48), fmt=fmt), run_video)
        for fmt in ("mp4", "mkv")
    ),
]


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, bytes, Callable[[bytes], None]]:
    name, data, run = draw(st.sampled_from(SEEDS))
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "overwrite", "truncate", "insert", "duplicate"]))
        at = draw(st.integers(0, max(len(buf) - 1, 0)))
        if kind == "flip" and buf:
            buf[at] ^= draw(st.integers(1, 255))
        elif kind == "overwrite":
            run_bytes = draw(st.binary(min_size=1, max_size=32))
            buf[at : at + len(run_bytes)] = run_bytes
        elif kind == "truncate":
            del buf[at:]
        elif kind == "insert":
            buf[at:at] = draw(st.binary(min_size=1, max_size=64))
        else:
            size = draw(st.integers(1, 256))
            buf[at:at] = buf[at : at + size]
    return name, bytes(buf), run


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,  # the same 200 cases on every CI run
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=mutated())
def test_decoders_on_mutated_files(case: tuple[str, bytes, Callable[[bytes], None]]) -> None:
    name, data, run = case
    start = time.perf_counter()
    try:
        run(data)
    except InputError as e:
        assert e.message and "\n" not in e.message, (name, e.message)
    elapsed = time.perf_counter() - start
    assert elapsed < DEADLINE_S, f"{name}: {elapsed:.1f} s"


def _all_seeds_are_valid() -> Any:
    return [pytest.param(run, data, id=name) for name, data, run in SEEDS]


@pytest.mark.parametrize(("run", "data"), _all_seeds_are_valid())
def test_seed_files_decode(run: Callable[[bytes], None], data: bytes) -> None:
    run(data)
