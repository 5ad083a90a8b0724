"""Video: frame sampling against the reference loader + sampler, and frame patches against the
reference video processor (transformers' EmbeddingGemma2VideoProcessor, torchvision backend).

The reference decodes with `transformers.video_utils.read_video_pyav` (its PyAV loader) and samples
with `EmbeddingGemma2VideoProcessor.sample_frames` (1 fps, at most 32 frames, uniform thinning). We
must pick the same frames (same decode indices, so the same timestamps) with the same pixels.
"""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import replace
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch

from app.settings import Settings
from eg2_runtime.errors import Cancelled, InputTooLargeError
from eg2_runtime.preprocess import video as video_module
from eg2_runtime.preprocess.image import PatchGeometry, resize_uint8, unit_pixels
from eg2_runtime.preprocess.video import VideoConfig, decode_spans, decode_video, prepare_frames
from tests.support import media

CONFIG = VideoConfig()
LIMITS = Settings().media_limits()  # the service's defaults
GEOMETRY = PatchGeometry()


def video_processor() -> Any:
    from transformers.models.embedding_gemma2.video_processing_embedding_gemma2 import (
        EmbeddingGemma2VideoProcessor,
    )

    return EmbeddingGemma2VideoProcessor()


def reference_sampling(data: bytes, suffix: str) -> tuple[np.ndarray, Any]:
    """The reference's sampled frames and metadata, through its own PyAV loader."""
    from transformers.video_utils import read_video_pyav

    processor = video_processor()
    with tempfile.NamedTemporaryFile(suffix=f".{suffix}") as f:
        f.write(data)
        f.flush()
        return read_video_pyav(
            f.name,
            sample_indices_fn=lambda metadata, **_: processor.sample_frames(
                metadata, fps=processor.fps, max_frames=processor.max_frames, overflow_strategy="uniform"
            ),
        )


CLIPS = {
    "3s_10fps": (3, 10, "mp4"),
    "40s_10fps": (40, 10, "mp4"),  # 40 one-second picks thinned to 32
    "10s_29.97fps": (10, Fraction(30_000, 1001), "mp4"),  # timestamps just below whole seconds
    "4s_0.5fps": (4, Fraction(1, 2), "mp4"),  # fewer frames than seconds: a frame picked twice
    "0.4s": (0.4, 10, "mp4"),  # shorter than a second: one frame
    "3s_mov": (3, 10, "mov"),
    "75s_24fps": (75, 24, "mp4"),
}


@pytest.mark.parametrize("name", list(CLIPS))
def test_same_frames_and_timestamps_as_reference(name: str) -> None:
    seconds, fps, fmt = CLIPS[name]
    data = media.encode_video(seconds, fps, size=(64, 96), fmt=fmt)
    ref_frames, ref_meta = reference_sampling(data, fmt)
    sampled = decode_video(data, CONFIG, LIMITS)
    unique = sorted(set(int(i) for i in ref_meta.frames_indices))  # the loader keeps a repeat once
    assert sampled.indices == unique
    assert sampled.timestamps == [i / ref_meta.fps for i in unique]
    assert np.array_equal(sampled.frames, ref_frames)
    assert len(sampled.indices) <= 32
    if name == "40s_10fps":
        assert len(sampled.indices) == 32 and sampled.indices[:4] == [0, 10, 20, 30]


def test_frame_patches_equal_reference_processor() -> None:
    data = media.encode_video(3, 10, size=(120, 200))
    sampled = decode_video(data, CONFIG, LIMITS)
    ref = video_processor()(videos=[sampled.frames], do_sample_frames=False, return_tensors="pt")
    ours = prepare_frames(sampled.frames, CONFIG.budget, PatchGeometry())
    assert ours.pixel_values.shape == ref["pixel_values_videos"].shape == (3, 630, 768)
    diff = (unit_pixels(ours.pixel_values) - ref["pixel_values_videos"]).abs().max().item()
    assert diff <= 1 / 255, f"max |diff| {diff}"
    assert torch.equal(ours.position_ids, ref["video_position_ids"])
    assert ours.num_soft_tokens == ref["num_soft_tokens_per_video"][0]


@pytest.mark.parametrize("fmt", ["mkv", "webm"])
def test_matroska_without_frame_count(fmt: str) -> None:
    """Matroska declares no frame count: the reference loader then asks for frame -1 and fails. We
    derive the count from the declared duration and pick what the MP4 of the same clip gives."""
    data = media.encode_video(5, 10, size=(64, 96), fmt=fmt)
    with pytest.raises(ValueError):
        reference_sampling(data, fmt)
    sampled = decode_video(data, CONFIG, LIMITS)
    mp4 = decode_video(media.encode_video(5, 10, size=(64, 96), fmt="mp4"), CONFIG, LIMITS)
    assert sampled.indices == mp4.indices == [0, 10, 20, 30, 40]
    if fmt == "mkv":  # same codec: same pixels
        assert np.array_equal(sampled.frames, mp4.frames)


def test_limits_are_parameters() -> None:
    data = media.encode_video(3, 10, size=(64, 96))
    for limits in (
        replace(LIMITS, max_video_seconds=2.5),
        replace(LIMITS, max_video_frames=29),
        replace(LIMITS, max_video_frame_pixels=64 * 96 - 1),
    ):
        with pytest.raises(InputTooLargeError):
            decode_video(data, CONFIG, limits)
    assert (
        len(decode_video(data, CONFIG, replace(LIMITS, max_video_seconds=3, max_video_frames=30)).indices)
        == 3
    )


@pytest.mark.parametrize(
    ("seconds", "fps", "size"), [(3, 10, (120, 200)), (40, 2, (98, 130)), (2, 4, (480, 640))]
)
def test_frames_resized_as_decoded_equal_the_stack_resized(
    seconds: int, fps: int, size: tuple[int, int]
) -> None:
    """decode_video(geometry=...) resizes each sampled frame as it comes (32 frames of 4K: 796 MB at
    full size, 15 MB resized): the same patches as resizing the stack (the reference path)."""
    data = media.encode_video(seconds, fps, size=size)
    whole = decode_video(data, CONFIG, LIMITS)
    each = decode_video(data, CONFIG, LIMITS, geometry=PatchGeometry())
    assert each.indices == whole.indices and each.frames.shape[1:3] != whole.frames.shape[1:3]
    want = prepare_frames(whole.frames, CONFIG.budget, PatchGeometry())
    got = prepare_frames(each.frames, CONFIG.budget, PatchGeometry())
    assert torch.equal(got.pixel_values, want.pixel_values) and torch.equal(
        got.position_ids, want.position_ids
    )


def test_decode_cost_is_limited_from_metadata() -> None:
    """Frame pixels x frames up to the last sampled one, refused before a frame is decoded."""
    data = media.encode_video(20, 10, size=(64, 96))  # last sampled frame: 190
    cost = 64 * 96 * 191
    with pytest.raises(InputTooLargeError, match="costly to decode"):
        decode_video(data, CONFIG, replace(LIMITS, max_video_decode_pixels=cost - 1))
    assert len(decode_video(data, CONFIG, replace(LIMITS, max_video_decode_pixels=cost)).indices) == 20


def test_decode_cost_counts_the_frames_decoded_not_only_the_header() -> None:
    """A stream that declares 16x16 and then sends 240x320 frames passes the header's cost check;
    the pixels decoded so far stop it, in a clip and in its segments."""
    data = media.growing_video(20)  # 1 fps: every frame sampled, the last is 19
    declared, decoded = 16 * 16 * 20, 16 * 16 + 240 * 320 * 19
    limits = replace(
        LIMITS, max_video_decode_pixels=declared * 4, max_segment_video_decode_pixels=declared * 4
    )
    with pytest.raises(InputTooLargeError, match="costly to decode"):
        decode_video(data, CONFIG, limits, geometry=PatchGeometry())
    with pytest.raises(InputTooLargeError, match="costly to decode"):
        list(decode_spans(data, CONFIG, limits, seconds=5, overlap=0, geometry=PatchGeometry()))
    enough = replace(limits, max_video_decode_pixels=decoded, max_segment_video_decode_pixels=decoded)
    assert len(decode_video(data, CONFIG, enough, geometry=PatchGeometry()).indices) == 20


def test_decoding_stops_within_a_frame_once_cancelled() -> None:
    """A 60 s 1080p clip takes seconds to decode; its cancel flag set 0.2 s in stops it at once."""
    data = media.repeated_clip(media.moving_texture_clip(30, (1080, 1920)), 60)
    limits = replace(LIMITS, max_video_decode_pixels=10**13)
    cancel = threading.Event()
    outcome: list[BaseException | None] = []

    def decode() -> None:
        try:
            decode_video(data, CONFIG, limits, geometry=PatchGeometry(), cancel=cancel)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    worker = threading.Thread(target=decode)
    worker.start()
    time.sleep(0.2)
    cancel.set()
    start = time.monotonic()
    worker.join(timeout=30)
    stopped = time.monotonic() - start
    assert outcome and isinstance(outcome[0], Cancelled), outcome
    assert stopped < 1.0, f"decoding went on for {stopped:.2f} s after the cancel"


def test_frames_are_resized_channels_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each sampled frame resized while decoding, and a stack of frames, reach the resize as a view it
    answers channels-last (image.channels_last): the resize converts neither way."""
    answers: list[torch.Tensor] = []

    def resize(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        answers.append(out := resize_uint8(frames, size))
        return out

    monkeypatch.setattr(video_module, "resize_uint8", resize)
    decode_video(media.encode_video(4, 10, size=(100, 130), fmt="mp4"), CONFIG, LIMITS, geometry=GEOMETRY)
    stack = np.random.default_rng(0).integers(0, 256, (3, 100, 130, 3), dtype=np.uint8)
    prepare_frames(stack, CONFIG.budget, GEOMETRY)
    assert len(answers) > 2  # frames one by one, then the stack
    for out in answers:
        assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
