"""Video: the sampled frames converted on the helper thread (`_Converter`, the server's path) against
inline (`helper=False`, the reference): the same frames, indices and timestamps; at most
`_CONVERT_AHEAD` frames waiting; the same errors; a cancel that stops; no thread left behind.

The slow or failing conversions are subclasses of the real converter, swapped in for the module's:
the queue, the thread and the error hand-back under test are the product's own.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import replace
from fractions import Fraction
from typing import Any

import av.error
import numpy as np
import pytest

from app.settings import Settings
from eg2_runtime.errors import Cancelled, InputTooLargeError, MediaDecodeError
from eg2_runtime.inputs import MediaLimits
from eg2_runtime.preprocess import video as video_module
from eg2_runtime.preprocess.image import PatchGeometry
from eg2_runtime.preprocess.video import SampledVideo, VideoConfig, decode_spans, decode_video
from tests.support import media

CONFIG = VideoConfig()
LIMITS = Settings().media_limits()  # the service's defaults
GEOMETRY = PatchGeometry()

CLIPS = {
    "3s_10fps": lambda: media.encode_video(3, 10, size=(120, 200)),
    "40s_10fps": lambda: media.encode_video(40, 10, size=(64, 96)),  # 40 picks thinned to 32
    "4s_0.5fps": lambda: media.encode_video(4, Fraction(1, 2), size=(64, 96)),  # a frame picked twice
    "mov": lambda: media.encode_video(3, 10, size=(98, 130), fmt="mov"),
    "mkv": lambda: media.encode_video(5, 10, size=(64, 96), fmt="mkv"),
    "webm": lambda: media.encode_video(5, 10, size=(64, 96), fmt="webm"),
    # 16x16 declared, then 240x320 frames: every frame after the first scaled back mid-stream
    "size_change": lambda: media.growing_video(12),
}


@contextlib.contextmanager
def no_thread_left() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    left = set(threading.enumerate()) - before
    assert not left, f"threads left running: {left}"


def decode(
    data: bytes,
    spans: bool,
    limits: MediaLimits = LIMITS,
    *,
    helper: bool,
    cancel: threading.Event | None = None,
) -> None:
    """The clip through decode_video, or through decode_spans (5 s spans) to its end."""
    if spans:
        list(decode_spans(data, CONFIG, limits, seconds=5, overlap=0, cancel=cancel, helper=helper))
    else:
        decode_video(data, CONFIG, limits, cancel=cancel, helper=helper)


def assert_same(got: SampledVideo, want: SampledVideo) -> None:
    assert got.indices == want.indices and got.timestamps == want.timestamps
    assert got.metadata == want.metadata
    assert got.frames.dtype == want.frames.dtype and got.frames.shape == want.frames.shape
    assert np.array_equal(got.frames, want.frames), "pixels differ (bit-equality expected)"


@pytest.mark.parametrize("geometry", [None, GEOMETRY], ids=["full", "resized"])
@pytest.mark.parametrize("name", list(CLIPS))
def test_helper_gives_the_inline_frames(name: str, geometry: PatchGeometry | None) -> None:
    data = CLIPS[name]()
    inline = decode_video(data, CONFIG, LIMITS, geometry=geometry, helper=False)
    with no_thread_left():
        helped = decode_video(data, CONFIG, LIMITS, geometry=geometry, helper=True)
    assert_same(helped, inline)
    if name == "size_change" and geometry is None:
        assert helped.frames.shape[1:3] == (16, 16)  # the rescale ran: 240x320 frames came


@pytest.mark.parametrize("geometry", [None, GEOMETRY], ids=["full", "resized"])
@pytest.mark.parametrize("name", ["40s_10fps", "size_change"])
def test_helper_gives_the_inline_spans(name: str, geometry: PatchGeometry | None) -> None:
    data = CLIPS[name]()

    def spans(helper: bool) -> list[tuple[Any, SampledVideo]]:
        return list(
            decode_spans(data, CONFIG, LIMITS, seconds=5, overlap=0.2, geometry=geometry, helper=helper)
        )

    inline = spans(False)
    with no_thread_left():
        helped = spans(True)
    assert len(helped) == len(inline) > 2
    for (plan, got), (want_plan, want) in zip(helped, inline, strict=True):
        assert plan == want_plan
        assert_same(got, want)


def test_spans_closed_early_leave_no_thread() -> None:
    """A consumer that stops after the first span (its request cancelled) closes the generator
    while the helper waits for a frame: the thread ends with it."""
    data = CLIPS["40s_10fps"]()
    with no_thread_left():
        spans = decode_spans(data, CONFIG, LIMITS, seconds=5, overlap=0, helper=True)
        next(spans)
        spans.close()


class SlowConverter(video_module._Converter):
    """The real converter, each conversion `delay` s longer; records how many frames waited."""

    delay = 0.02
    fail_at: int | None = None  # the frame (decode index) whose conversion raises `error`
    error: BaseException = MemoryError()
    cancel: threading.Event | None = None  # set as the frame `cancel_at` converts
    cancel_at = -1
    after_cancel = 0.2
    last: SlowConverter  # the latest made
    waiting: list[int]
    converted: list[int]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waiting, self.converted = [], []
        type(self).last = self

    def submit(self, index: int, frame: Any) -> None:
        super().submit(index, frame)
        if self._jobs is not None:
            self.waiting.append(self._jobs.qsize())

    def convert(self, frame: Any) -> np.ndarray:
        if self._jobs is not None:
            self.waiting.append(self._jobs.qsize())
        cancelled = self.cancel is not None and self.cancel.is_set()
        # After the cancel, a conversion takes long enough that the decoder sees the flag within it
        # even on a loaded machine: which frames are converted then depends on the code, not the clock.
        time.sleep(self.after_cancel if cancelled else self.delay)
        index = len(self.converted)
        self.converted.append(index)
        if index == self.fail_at:
            raise self.error
        if index == self.cancel_at and self.cancel is not None:
            self.cancel.set()
        return super().convert(frame)


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> type[SlowConverter]:
    class Slow(SlowConverter):
        pass

    monkeypatch.setattr(video_module, "_Converter", Slow)
    return Slow


def test_at_most_convert_ahead_frames_wait(slow: type[SlowConverter]) -> None:
    """20 tiny frames decode far faster than they convert (20 ms each): the decoder must block once
    `_CONVERT_AHEAD` wait, not queue them all. `helper` left to its default: the server's path."""
    data = media.encode_video(20, 1, size=(64, 96))  # 1 fps: every frame sampled
    with no_thread_left():
        helped = decode_video(data, CONFIG, LIMITS)
    waiting = slow.last.waiting
    assert max(waiting) == video_module._CONVERT_AHEAD, f"frames waiting: {waiting}"
    assert len(helped.indices) == 20


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (MemoryError(), InputTooLargeError),
        (av.error.InvalidDataError(1094995529, "Invalid data found when processing input"), MediaDecodeError),
        (RuntimeError("swscale failed"), MediaDecodeError),
    ],
    ids=["memory", "av", "runtime"],
)
@pytest.mark.parametrize("spans", [False, True], ids=["clip", "spans"])
def test_a_conversion_error_is_the_inline_error(
    slow: type[SlowConverter], error: BaseException, expected: type[Exception], spans: bool
) -> None:
    data = media.encode_video(20, 1, size=(64, 96))
    slow.delay, slow.fail_at, slow.error = 0.005, 3, error

    def failure(helper: bool) -> Exception:
        with pytest.raises(expected) as raised:
            decode(data, spans, helper=helper)
        assert raised.value.__cause__ is error
        return raised.value

    inline = failure(False)
    with no_thread_left():
        helped = failure(True)
    assert type(helped) is type(inline) and str(helped) == str(inline)
    assert slow.last.converted == [0, 1, 2, 3]  # nothing converted after the error


@pytest.mark.parametrize("spans", [False, True], ids=["clip", "spans"])
def test_the_earliest_frames_error_wins_as_inline(slow: type[SlowConverter], spans: bool) -> None:
    """Frame 2's conversion fails (after 50 ms), and frame 3 takes the decoded pixels past the limit.
    Inline, frame 2's error comes first; the helper's decoder reaches frame 3's size check while frame
    2 still converts, and must still raise frame 2's error."""
    data = media.growing_video(12)  # frame 0: 16x16, then 240x320
    cap = 16 * 16 + 240 * 320 * 2  # frames 0..2 pass, frame 3 does not
    limits = replace(LIMITS, max_video_decode_pixels=cap, max_segment_video_decode_pixels=cap)
    with pytest.raises(InputTooLargeError, match="costly"):  # frame 3's check, every frame converting
        decode_video(data, CONFIG, limits, helper=False)
    slow.delay, slow.fail_at, slow.error = 0.05, 2, RuntimeError("frame 2 failed")

    def failure(helper: bool) -> Exception:
        with pytest.raises(MediaDecodeError) as raised:
            decode(data, spans, limits, helper=helper)
        return raised.value

    inline = failure(False)
    with no_thread_left():
        helped = failure(True)
    assert str(helped) == str(inline) == "could not decode video: frame 2 failed"


@pytest.mark.parametrize("spans", [False, True], ids=["clip", "spans"])
def test_cancel_while_frames_wait(slow: type[SlowConverter], spans: bool) -> None:
    """The cancel flag set as frame 3 converts: Cancelled within a frame or two, the frames still
    waiting dropped unconverted, and no thread left."""
    data = media.encode_video(20, 1, size=(64, 96))
    cancel = threading.Event()
    slow.cancel, slow.cancel_at = cancel, 3
    start = time.monotonic()
    with no_thread_left(), pytest.raises(Cancelled):
        decode(data, spans, cancel=cancel, helper=True)
    took = time.monotonic() - start
    # frame 3's, and the one the helper took before the decoder saw the flag; the waiting ones dropped
    assert len(slow.last.converted) <= 5, slow.last.converted
    assert took < 2.0, f"{took:.2f} s: the 16 frames after the cancel would take 3.2 s to convert"


def test_no_thread_to_be_had_converts_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process at its thread limit: the video still decodes, inline, not a 400 naming the thread."""
    data = media.encode_video(8, 1, size=(64, 96))
    inline = decode_video(data, CONFIG, LIMITS, helper=False)

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    assert_same(decode_video(data, CONFIG, LIMITS, helper=True), inline)


@pytest.mark.parametrize("spans", [False, True], ids=["clip", "spans"])
def test_a_failed_conversion_lets_go_of_the_converter(slow: type[SlowConverter], spans: bool) -> None:
    """Once its error is raised, nothing but the error's own traceback holds the converter: with the
    cyclic collector off, dropping the error frees it (and the frames and bytes it holds)."""
    data = media.encode_video(20, 1, size=(64, 96))
    slow.delay, slow.fail_at = 0.005, 3
    made: list[weakref.ref[SlowConverter]] = []
    gc.disable()
    try:
        for _ in range(2):
            slow.error = MemoryError()  # a fresh one each time: the class holds it
            with contextlib.suppress(InputTooLargeError):
                decode(data, spans, helper=True)
            made.append(weakref.ref(slow.last))
            del slow.last
        slow.error = MemoryError()
        assert made[0]() is None, "the first failed converter is still alive: a reference cycle holds it"
    finally:
        gc.enable()
