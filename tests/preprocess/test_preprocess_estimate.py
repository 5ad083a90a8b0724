"""Engine.estimate_many: an item's cost from headers, durations and characters, before anything is decoded.

Media are exact (the soft tokens and markers `prepare` will give them, from image headers, audio
durations and video metadata); ASCII text is exact on the demo tokenizer (one token per character).
What the headers already prove is refused there, without decoding: media over a limit, media that
alone exceed the model's 8192 tokens (1,000 one-pixel PNGs in one item took 4.8 s and 3.4 GB before).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from app.settings import Settings
from eg2_runtime.api import Estimate
from eg2_runtime.engine import Engine
from eg2_runtime.errors import EG2Error, InputTooLargeError, InputTooLongError
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions, Segments, TextPart
from eg2_runtime.preprocess.preprocessor import Preprocessor
from tests.support import media


@pytest.fixture(scope="module")
def engine(tiny_bf16: Path) -> Engine:
    return Engine.from_dir(tiny_bf16, device="cpu", limits=Settings().media_limits())


PIC = media.picture(48, 64)
CASES: list[tuple[str, Item, PrepareOptions]] = [
    ("text", Item((TextPart("a short query, in ascii"),)), PrepareOptions()),
    ("text-with-prompt", Item((TextPart("query"),)), PrepareOptions(prompt="task: search | query: ")),
    ("png-64x48", Item((MediaPart("image", media.encode_image(PIC, "PNG")),)), PrepareOptions()),
    (
        "jpeg-640x480-1120",
        Item((MediaPart("image", media.encode_image(media.picture(480, 640), "JPEG")),)),
        PrepareOptions(image_tokens=1120),
    ),
    (
        "png-1x1-70",
        Item((MediaPart("image", media.encode_image(PIC[:1, :1], "PNG")),)),
        PrepareOptions(image_tokens=70),
    ),
    (
        "png-3000x20",
        Item((MediaPart("image", media.encode_image(media.picture(20, 3000), "PNG")),)),
        PrepareOptions(),
    ),
    (
        "jpeg-exif-rotated",
        Item((MediaPart("image", media.exif_rotated_jpeg(media.picture(48, 96), 6)),)),
        PrepareOptions(),
    ),
    ("gif", Item((MediaPart("image", media.encode_image(PIC, "GIF")),)), PrepareOptions()),
    (
        "wav-1s",
        Item((MediaPart("audio", media.encode_audio(media.sine(1.0, 16_000), 16_000, "wav")),)),
        PrepareOptions(),
    ),
    (
        "wav-3s-44k-stereo",
        Item((MediaPart("audio", media.encode_audio(media.sine(3.0, 44_100, channels=2), 44_100, "wav")),)),
        PrepareOptions(),
    ),
    (
        "flac-2s",
        Item((MediaPart("audio", media.encode_audio(media.sine(2.0, 22_050), 22_050, "flac")),)),
        PrepareOptions(),
    ),
    (
        "wav-40s-cut-at-30",
        Item((MediaPart("audio", media.encode_audio(media.sine(40.0, 8_000), 8_000, "wav")),)),
        PrepareOptions(),
    ),
    (
        "m4a-2s",
        Item((MediaPart("audio", media.encode_audio(media.sine(2.0, 16_000), 16_000, "m4a")),)),
        PrepareOptions(),
    ),
    ("mp4-8s-1fps", Item((MediaPart("video", media.encode_video(8, 1, size=(48, 64))),)), PrepareOptions()),
    ("mp4-45s-2fps", Item((MediaPart("video", media.encode_video(45, 2, size=(48, 64))),)), PrepareOptions()),
    (
        "mkv-5s",
        Item((MediaPart("video", media.encode_video(5, 4, size=(64, 96), fmt="mkv")),)),
        PrepareOptions(),
    ),
    (
        "interleaved",
        Item(
            (
                TextPart("look at this: "),
                MediaPart("image", media.encode_image(PIC, "PNG")),
                TextPart(" and listen "),
                MediaPart("audio", media.encode_audio(media.sine(1.5, 16_000), 16_000, "wav")),
            )
        ),
        PrepareOptions(prompt="document: "),
    ),
]


@pytest.mark.parametrize(("case", "item", "options"), CASES, ids=[c[0] for c in CASES])
def test_estimate_equals_what_prepare_counts(
    engine: Engine, case: str, item: Item, options: PrepareOptions
) -> None:
    [estimate] = engine.estimate_many([item], options)
    prepared = engine.prepare(item, options)
    # MP3/M4A durations come from the container: the encoder's padding may add a frame or two.
    tolerance = 2 if case.startswith("m4a") else 0
    assert not isinstance(estimate, EG2Error) and estimate.spans == 0, estimate
    assert abs(estimate.tokens - prepared.num_tokens) <= tolerance, (case, estimate, prepared.num_tokens)


def test_estimate_refuses_from_headers_without_decoding(engine: Engine) -> None:
    """A 400 MP PNG bomb and 1,000 one-pixel PNGs in one item: refused from their headers in
    milliseconds, where preparing decoded every pixel first (4.8 s, +3.4 GB for the 1,000)."""
    pixel = media.encode_image(PIC[:1, :1], "PNG")
    many = Item(tuple(MediaPart("image", pixel) for _ in range(1000)))
    bomb = Item((MediaPart("image", media.png_bomb(20_000, 20_000)),))
    long_video = Item(
        (
            MediaPart(
                "video",
                media.mkv_declaring_seconds(media.encode_video(2, 4, size=(48, 64), fmt="mkv"), 500.0),
            ),
        )
    )
    start = time.monotonic()
    results = engine.estimate_many([many, bomb, long_video, Item((TextPart("fine"),))], PrepareOptions())
    took = time.monotonic() - start
    assert isinstance(results[0], InputTooLongError) and "258002 tokens" in results[0].message, results[0]
    assert isinstance(results[1], InputTooLargeError) and "too large" in results[1].message, results[1]
    assert isinstance(results[2], InputTooLargeError) and "too long" in results[2].message, results[2]
    assert results[3] == Estimate(6)
    assert took < 1.0, f"estimating took {took:.2f} s: something was decoded"


def test_unreadable_headers_count_as_the_most_and_leave_the_verdict_to_prepare(engine: Engine) -> None:
    """Garbage is estimated at its kind's maximum (the decoder, not the estimate, says it is garbage)."""
    junk = b"\x89PNG\r\n\x1a\n" + bytes(64)
    [image, audio, video] = engine.estimate_many(
        [Item((MediaPart(kind, junk),)) for kind in ("image", "audio", "video")], PrepareOptions()
    )
    assert (image, audio, video) == (Estimate(2 + 280 + 2), Estimate(2 + 750 + 2), Estimate(2 + 32 * 72))


def test_audio_is_refused_from_its_header_when_decoding_it_would_cost_too_much(engine: Engine) -> None:
    """A hostile-input audit's clip: 31 s of 8 channels at 384 kHz, a 100 KB FLAC, is 93 million samples
    to decode (64 in one request took 49 s of CPU), 192 times 30 s of 16 kHz mono: over
    max_audio_decode_samples from its header, before decoding. Its tokens are still those of 30 s,
    as for the 31 s stereo clip at 384 kHz under the limit (23 million samples)."""
    hostile = Item((MediaPart("audio", media.silent_flac(31, 384_000, 8)),))
    stereo = Item((MediaPart("audio", media.silent_flac(31, 384_000, 2)),))
    start = time.monotonic()
    refused, accepted = engine.estimate_many([hostile, stereo], PrepareOptions())
    took = time.monotonic() - start
    assert isinstance(refused, InputTooLargeError), refused
    assert (
        "30.25 s of 8 channels at 384000 Hz = 92,928,000 samples, more than this server's limit of 24,000,000 (max_audio_decode_samples)"
        in refused.message
    ), refused.message
    assert accepted == Estimate(2 + 750 + 2), accepted
    assert took < 1.0, f"estimating took {took:.2f} s: something was decoded"


def test_audio_with_segments_is_priced_by_all_it_decodes(tiny_bf16: Path) -> None:
    """With segments the whole file is decoded: its channels x rate x every second, under
    max_segment_audio_decode_samples (here 10 s of 48 kHz stereo, 960,000 samples, against 900,000),
    not the single-item limit on its first 30 s (which it passes, or here need not)."""
    limits = replace(Settings().media_limits(), max_segment_audio_decode_samples=900_000)
    pre = Preprocessor.from_dir(tiny_bf16, limits=limits)
    data = media.encode_audio(media.sine(10.0, 48_000, channels=2), 48_000, "flac")
    with pytest.raises(
        InputTooLargeError,
        match=r"= 960,000 samples, more than this server's limit of 900,000 \(max_segment_audio_decode_samples\)",
    ):
        pre.estimate(Item((MediaPart("audio", data),), Segments(seconds=2.0)), PrepareOptions())
    assert pre.estimate(Item((MediaPart("audio", data),)), PrepareOptions()).spans == 0  # no segments: fine
    roomy = Preprocessor.from_dir(
        tiny_bf16,
        limits=replace(limits, max_segment_audio_decode_samples=960_000, max_audio_decode_samples=500_000),
    )
    assert (
        roomy.estimate(Item((MediaPart("audio", data),), Segments(seconds=2.0)), PrepareOptions()).spans == 5
    )
