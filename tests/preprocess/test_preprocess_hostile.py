"""Hostile inputs: every one gives a specific error (MediaDecodeError / InputTooLargeError), never a
crash, a hang or a huge allocation.

Each decode runs in a worker thread with a deadline, so a hang fails the test instead of the suite.
Files are small and built in code (tests/support/media.py): a PNG header claiming 100k x 100k, a 48 KB PNG
that inflates to 400 MP, a WAV whose header claims 100 MB, an MP4 declaring a million frames, ...

Streaming formats (MP3, Ogg) carry no total length that a cut could contradict, so a truncated one
decodes to the part that is there, as every player does; everything with a declared size (images,
WAV, FLAC, MP4/M4A, Matroska/WebM) reports the truncation.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from app.settings import Settings
from eg2_runtime.errors import InputTooLargeError, MediaDecodeError
from eg2_runtime.preprocess.audio import load_audio, stream_clips
from eg2_runtime.preprocess.image import decode_image
from eg2_runtime.preprocess.video import VideoConfig, decode_video
from tests.support import media

LIMITS = Settings().media_limits()  # the service's defaults
DEADLINE_S = 10.0
OURS = (MediaDecodeError, InputTooLargeError)


def bounded(fn: Callable[[], Any]) -> Any:
    """fn() in a worker thread: its result or its exception, failing the test past the deadline."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    start = time.perf_counter()
    future = pool.submit(fn)
    try:
        return future.result(timeout=DEADLINE_S)
    except concurrent.futures.TimeoutError:
        pytest.fail(f"still decoding after {DEADLINE_S} s: a hang")
    except BaseException as e:
        return e
    finally:
        pool.shutdown(wait=False)
        assert time.perf_counter() - start < DEADLINE_S


def image(data: bytes) -> Any:
    return bounded(lambda: decode_image(data, max_pixels=LIMITS.max_image_pixels))


def audio(data: bytes) -> Any:
    return bounded(lambda: load_audio(data, limits=LIMITS)[0])


def video(data: bytes) -> Any:
    return bounded(lambda: decode_video(data, VideoConfig(), LIMITS).frames)


def expect(outcome: Any, error: type[Exception] | tuple[type[Exception], ...], match: str = "") -> None:
    assert isinstance(outcome, error), f"expected {error}, got {outcome!r}"[:300]
    assert match.lower() in outcome.message.lower()
    assert (
        "\n" not in outcome.message and "Traceback" not in outcome.message and "<_io" not in outcome.message
    )
    assert outcome.param == "input"


PICTURE = media.picture(48, 64)
IMAGES = {
    "png": media.encode_image(PICTURE, "PNG"),
    "jpeg": media.encode_image(PICTURE, "JPEG"),
    "webp": media.encode_image(PICTURE, "WEBP"),
    "gif": media.encode_image(PICTURE, "GIF"),
    "bmp": media.encode_image(PICTURE, "BMP"),
    "tiff": media.encode_image(PICTURE, "TIFF"),
}
STEREO = media.noise(1.0, 44_100, channels=2)
AUDIO = {fmt: media.encode_audio(STEREO, 44_100, fmt) for fmt in ("wav", "flac", "ogg", "mp3", "m4a")}
AUDIO["webm"] = media.encode_audio(media.noise(1.0, 48_000, channels=2), 48_000, "webm")
VIDEOS = {fmt: media.encode_video(2, 10, size=(48, 64), fmt=fmt) for fmt in ("mp4", "mov", "mkv", "webm")}
STREAMING = {"mp3", "ogg"}


@pytest.mark.parametrize("fmt", list(IMAGES))
def test_images_truncated_and_corrupt(fmt: str) -> None:
    data = IMAGES[fmt]
    assert isinstance(image(data), np.ndarray)
    expect(image(data[: len(data) // 2]), MediaDecodeError)
    expect(image(data[:20]), MediaDecodeError)
    expect(image(media.garbage_after_magic(data)), OURS)


@pytest.mark.parametrize("fmt", list(AUDIO))
def test_audio_truncated_and_corrupt(fmt: str) -> None:
    data = AUDIO[fmt]
    assert isinstance(audio(data), np.ndarray)
    cut = audio(data[: len(data) // 2])
    if fmt in STREAMING:  # the part that is there
        assert isinstance(cut, np.ndarray) and 0 < len(cut) < 16_000, cut
    else:
        expect(cut, MediaDecodeError)
    expect(audio(data[:40]), MediaDecodeError)
    expect(audio(media.garbage_after_magic(data)), MediaDecodeError)


@pytest.mark.parametrize("fmt", list(VIDEOS))
def test_video_truncated_and_corrupt(fmt: str) -> None:
    data = VIDEOS[fmt]
    assert isinstance(video(data), np.ndarray)
    expect(video(data[: len(data) // 2]), MediaDecodeError)
    expect(video(data[:40]), MediaDecodeError)
    expect(video(media.garbage_after_magic(data)), MediaDecodeError)


def test_png_header_claiming_100k_by_100k() -> None:
    expect(image(media.png_header_only(100_000, 100_000)), InputTooLargeError, "too large")
    expect(image(media.png_header_only(7_000, 7_000)), InputTooLargeError, "7000x7000")  # under Pillow's own


def test_zip_bomb_png() -> None:
    bomb = media.png_bomb(20_000, 20_000)
    assert len(bomb) < 100_000  # 48 KB on disk, 400 MP decoded
    expect(image(bomb), InputTooLargeError, "too large")


def test_jpeg_scan_bomb() -> None:
    """Refused before decoding, by its count of scans; a progressive JPEG's own 10 decode."""
    plain = media.encode_image(PICTURE, "JPEG", progressive=True)
    assert plain.count(b"\xff\xda") == 10 and image(plain).shape == PICTURE.shape
    bomb = media.jpeg_scan_bomb(PICTURE, repeats=200)
    expect(image(bomb), InputTooLargeError, "too many scans")


def test_png_text_chunk_bomb() -> None:
    bomb = media.png_text_bomb(PICTURE)
    assert len(bomb) < 100_000
    expect(image(bomb), MediaDecodeError, "too large")  # Pillow caps each text chunk at 1 MB inflated


def test_wav_header_lying_about_its_length() -> None:
    lying = media.wav_lying_length(STEREO, 44_100, claimed_bytes=100_000_000)
    expect(audio(lying), MediaDecodeError, "truncated")
    # 0xFFFFFFFF is the streaming writers' "length unknown": read what is there.
    streamed = media.wav_lying_length(STEREO, 44_100, claimed_bytes=0xFFFF_FFFF)
    assert len(audio(streamed)) == 16_000


@pytest.mark.parametrize(
    ("rate", "channels", "match"),
    [(1_000_000_000, 1, "sample rate"), (10, 1, "sample rate"), (16_000, 1000, "channel"), (16_000, 0, "")],
)
def test_wav_absurd_format(rate: int, channels: int, match: str) -> None:
    expect(audio(media.wav_header(rate, channels)), MediaDecodeError, match)


def test_audio_decode_work_is_bounded_at_the_service_defaults() -> None:
    """31 s of 8 channels at 384 kHz (100 KB of FLAC, 93 million samples to decode): the decoder
    stops at max_audio_decode_samples (24 million) whatever a header said or an estimate checked."""
    expect(audio(media.silent_flac(31, 384_000, 8)), InputTooLargeError, "too costly to decode")


@pytest.mark.parametrize("fmt", list(AUDIO))
def test_audio_decode_work_is_counted_while_decoding(fmt: str) -> None:
    """Each decoder (libsndfile, PyAV) counts channels x frames as it goes: 1 s of 44.1 kHz stereo
    (about 88,200 samples) is refused under a 60,000 limit and decoded under 120,000; with segments,
    the segment limit applies instead."""
    data = AUDIO[fmt]
    tight, roomy = 60_000, 120_000
    refused = bounded(lambda: load_audio(data, limits=replace(LIMITS, max_audio_decode_samples=tight)))
    expect(refused, InputTooLargeError, "too costly to decode")
    assert isinstance(load_audio(data, limits=replace(LIMITS, max_audio_decode_samples=roomy))[0], np.ndarray)

    def spans(**limits: int) -> Any:
        clips = stream_clips(data, seconds=0.5, overlap=0.0, limits=replace(LIMITS, **limits))
        return bounded(lambda: [clip.whole for clip in clips])

    expect(spans(max_segment_audio_decode_samples=tight), InputTooLargeError, "too costly to decode")
    wholes = spans(max_audio_decode_samples=tight, max_segment_audio_decode_samples=roomy)
    assert wholes[-1] and len(wholes) >= 3, wholes  # to the end: its spans, then the item itself


def test_video_declaring_a_million_frames() -> None:
    mp4 = media.mp4_declaring_frames(VIDEOS["mp4"], 1_000_000)
    expect(video(mp4), InputTooLargeError, "1000000")
    mkv = media.mkv_declaring_seconds(VIDEOS["mkv"], 100_000.0)  # 10^6 frames at 10 fps
    expect(video(mkv), InputTooLargeError, "too long")


@pytest.mark.parametrize("decoder", [image, audio, video])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_bytes(decoder: Callable[[bytes], Any], seed: int) -> None:
    rng = np.random.default_rng(seed)
    expect(decoder(rng.bytes(int(rng.integers(1, 50_000)))), MediaDecodeError)
    expect(decoder(b""), MediaDecodeError)


def test_wrong_kind_is_refused() -> None:
    """Bytes of one kind sent as another: a clean refusal, not a best-effort guess."""
    expect(image(AUDIO["wav"]), MediaDecodeError)
    expect(audio(IMAGES["png"]), MediaDecodeError)
    expect(video(AUDIO["m4a"]), MediaDecodeError, "no video stream")
    expect(video(IMAGES["gif"]), MediaDecodeError)
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"  # would run Ghostscript
    expect(image(eps), MediaDecodeError)
