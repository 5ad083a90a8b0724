"""Video: bytes -> frames sampled at 1 fps (at most 32, thinned uniformly) -> padded patches per frame.

Sampling reproduces transformers' `EmbeddingGemma2VideoProcessor.sample_frames` on the metadata its
PyAV loader (`read_video_pyav`) reads: frame count = the stream's declared `frames`, fps = its
`average_rate`, duration = frames / fps; frame i*fps for i < int(duration), clamped to the last frame,
then `linspace(0, n - 1, 32)` when more than 32. Indices count frames in decode order, as the loader
does, and a frame picked twice is returned once. Where the reference breaks we go on: Matroska/WebM
declare no frame count (the loader then asks for frame -1 and fails), so we derive it from the
container's duration.

Each frame is converted with PyAV's rgb24 conversion (the loader's), resized and patchified exactly as
images are, with the video budget (70 soft tokens per frame by default). The conversion and resize of
each sampled frame run on one helper thread while the next frames decode (`_Converter`), at most
`_CONVERT_AHEAD` frames waiting; `helper=False` runs them inline, the reference.

Safety: the frame size, declared duration, declared frame count and the pixels to decode (frame size x
frames up to the last sampled one) are checked against `MediaLimits` before decoding; decoding stops
after the last sampled frame, and checks every decoded frame's size and the pixels decoded so far
(a stream may grow its frames past the size its header declares).
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from threading import Event
from types import TracebackType
from typing import Any

import numpy as np

from eg2_runtime.errors import Cancelled, InputTooLargeError, MediaDecodeError, check_cancel
from eg2_runtime.inputs import MediaLimits
from eg2_runtime.preprocess import containers, segments
from eg2_runtime.preprocess.image import (
    PatchedImages,
    PatchGeometry,
    channels_last,
    patchify,
    resize_uint8,
    soft_tokens,
    target_size,
)
from eg2_runtime.preprocess.limits import reason

_FORMATS = {containers.MP4, containers.MATROSKA}  # mp4 / mov / m4v, and mkv / webm
# Sampled frames waiting for the helper thread, beside the one it converts: each a decoded frame
# (4K: 12 MB in 8-bit 4:2:0, up to 50 MB in 10-bit 4:4:4). Two keep the decoder from waiting on a
# slow conversion without letting a fast decoder pile frames up.
_CONVERT_AHEAD = 2


@dataclass(frozen=True)
class VideoConfig:
    """The video processor's settings (processor config `video_processor`); defaults are the class's."""

    budget: int = 70  # max_soft_tokens per frame
    fps: float = 1.0
    max_frames: int = 32
    add_timestamps: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VideoConfig:
        if d.get("overflow_strategy", "uniform") != "uniform" or d.get("do_sample_frames", True) is False:
            raise ValueError("only uniform 1-fps-style frame sampling is supported")
        return cls(
            budget=int(d.get("max_soft_tokens", 70)),
            fps=float(d.get("fps", 1)),
            max_frames=int(d.get("max_frames", 32)),
            add_timestamps=bool(d.get("add_timestamps", False)),
        )


@dataclass(frozen=True)
class VideoMetadata:
    total_frames: int  # declared (or, for Matroska, derived from the duration)
    fps: float
    width: int
    height: int


@dataclass
class SampledVideo:
    frames: np.ndarray  # (n, H, W, 3) uint8 RGB
    indices: list[int]  # decode-order index of each returned frame
    timestamps: list[float]  # seconds: index / fps, as the reference's metadata.timestamps
    metadata: VideoMetadata


def sample_indices(meta: VideoMetadata, config: VideoConfig) -> np.ndarray:
    """The reference's frame indices (possibly repeated) for this metadata."""
    step = meta.fps / config.fps  # native frames per sampled frame
    duration = meta.total_frames / meta.fps
    count = max(1, int(duration * config.fps))
    indices = np.array([min(meta.total_frames - 1, int(i * step)) for i in range(count)], dtype=int)
    if len(indices) > config.max_frames:
        indices = indices[np.linspace(0, len(indices) - 1, config.max_frames, dtype=int)]
    return indices


def decode_video(
    data: bytes,
    config: VideoConfig,
    limits: MediaLimits,
    *,
    geometry: PatchGeometry | None = None,
    cancel: Event | None = None,
    helper: bool = True,
) -> SampledVideo:
    """Check the container's metadata against `limits`, then decode only up to the last sampled frame.

    `geometry`: resize each sampled frame to its patch size (`target_size` for the video budget) as it
    is decoded, instead of returning it at full size: 32 frames of 4K are 796 MB as RGB, 15 MB
    resized. The same kernel on one frame at a time gives the same pixels as on the stack
    (`prepare_frames` then has nothing left to resize). `cancel`: checked per decoded frame; raises
    Cancelled once set. `helper`: convert and resize the sampled frames on one helper thread while
    the next ones decode (`_Converter`; the server's path); False converts them inline, the reference.
    The same frames and the same errors either way.
    """
    try:
        with containers.open_container(data, _FORMATS, "video", "an MP4, MOV, MKV or WebM file") as container:
            if not container.streams.video:
                raise MediaDecodeError("could not decode video: the file has no video stream", param="input")
            stream = container.streams.video[0]
            meta = _metadata(container, stream, limits)
            wanted = sample_indices(meta, config)
            keep = set(wanted.tolist())
            last = int(wanted.max())
            check_decode_cost(meta, last, limits)
            size = None if geometry is None else target_size(meta.height, meta.width, config.budget, geometry)
            with _Converter(meta.width, meta.height, size, helper=helper) as converter:
                for _ in _decode_sampled(container, stream, keep, last, limits, converter, cancel):
                    pass
            indices = list(converter.frames)  # decode order
            frames = list(converter.frames.values())
    except (MediaDecodeError, InputTooLargeError, Cancelled):
        raise
    except MemoryError as e:
        raise InputTooLargeError("video is too large to decode", param="input") from e
    except Exception as e:  # av.error.* for corrupt or truncated files
        raise MediaDecodeError(f"could not decode video: {reason(e)}", param="input") from e
    if not frames:
        raise MediaDecodeError("could not decode video: no frames could be decoded", param="input")
    if indices[-1] < last and len(indices) < len(keep):
        # Decoding ended before the last frame the metadata promised: a cut or damaged file.
        raise MediaDecodeError(
            f"video is truncated: {len(indices)} of its {len(keep)} sampled frames could be decoded",
            param="input",
        )
    return SampledVideo(np.stack(frames), indices, [i / meta.fps for i in indices], meta)


def _decode_sampled(
    container: Any,
    stream: Any,
    wanted: set[int],
    last: int,
    limits: MediaLimits,
    converter: _Converter,
    cancel: Event | None,
) -> Iterator[int]:
    """Decode frames 0..`last` in decode order, each checked (cancel, a failed conversion, its size and
    the pixels decoded so far), and hand the `wanted` ones to `converter`; yields each frame's index
    once it is handed over (a span ending there may then settle the converter)."""
    decoded = 0  # pixels decoded so far: frames may be larger than the declared size
    for i, frame in enumerate(container.decode(stream)):
        check_cancel(cancel)
        converter.check()  # a frame's conversion failed: decode no further
        if i > last:
            return
        decoded = _check_frame(frame, decoded, limits)
        if i in wanted:
            converter.submit(i, frame)
        yield i


class _Converter:
    """Sampled frames -> (H, W, 3) uint8 RGB in `frames` (decode index -> frame, in decode order): a
    frame of a size the stream changed to is scaled back to the declared (width, height) so the frames
    stack, converted with PyAV's rgb24 conversion (the loader's `to_ndarray(format="rgb24")`), and
    resized to `size` (h, w) where one is given.

    Inline (`helper=False`, the reference), `submit` converts the frame before it returns. With the
    helper, one thread of its own converts the frames in the order submitted while the caller decodes
    the next ones (PyAV's decoder releases the GIL; the 8-frame clip's loop on the 16-core host: 21.6
    -> 18.7 ms, the same pixels); `submit` blocks while `_CONVERT_AHEAD` frames wait. `frames` is
    complete after `settle` (every frame submitted so far) or after the `with` block, which converts the
    frames still waiting and ends the thread; on Cancelled (or a generator closed) it drops them
    instead. A conversion's error is raised in the caller by the next `submit` or `settle`, or on
    leaving the block, there in place of an error from a later frame (a size check, a decode error):
    the earliest frame's error, as inline.
    """

    def __init__(self, width: int, height: int, size: tuple[int, int] | None, *, helper: bool) -> None:
        from av.video.reformatter import VideoReformatter  # PyAV only where video is served

        self.width, self.height, self.size = width, height, size
        # One reformatter per stream: `frame.to_ndarray(format=...)` builds a new swscale context for
        # every frame (an 8-frame clip: 15.4 -> 3.0 ms on the dev machine). Same pixels.
        self._to_rgb, self._rescale = VideoReformatter(), VideoReformatter()
        self.frames: dict[int, np.ndarray] = {}
        self._error: BaseException | None = None  # the helper's first, until raised in the caller
        self._failed = False  # a conversion raised: the helper converts nothing after it
        self._drop = False  # set before the stop: drop the frames still waiting
        self._jobs: queue.Queue[tuple[int, Any] | None] | None = None
        self._thread: threading.Thread | None = None
        if helper:
            self._jobs = queue.Queue(maxsize=_CONVERT_AHEAD)
            # daemon: never holds up the interpreter's exit; `__exit__` joins it in every case.
            self._thread = threading.Thread(target=self._work, name="eg2-video-convert", daemon=True)
            try:
                self._thread.start()
            except RuntimeError:  # no thread to be had (a process at its limit): convert inline
                self._jobs = self._thread = None

    def convert(self, frame: Any) -> np.ndarray:
        """One frame, on the calling thread (the reference; the helper runs this too)."""
        if (frame.width, frame.height) != (self.width, self.height):
            # A mid-stream size change: scale to the declared size so the frames stack.
            frame = self._rescale.reformat(frame, width=self.width, height=self.height)
        # (H, W, 3), as the reference loader's frame.to_ndarray(format="rgb24")
        rgb = self._to_rgb.reformat(frame, format="rgb24").to_ndarray()
        return rgb if self.size is None else _resized(rgb, self.size)

    def submit(self, index: int, frame: Any) -> None:
        if self._jobs is None:
            self.frames[index] = self.convert(frame)
            return
        self.check()
        self._jobs.put((index, frame))  # blocks while _CONVERT_AHEAD wait

    def settle(self) -> None:
        """Return once every frame submitted is in `frames`; raise the helper's error, if any."""
        if self._jobs is not None:
            self._jobs.join()
            self.check()

    def check(self) -> None:
        """Raise the helper's error, once. The converter lets go of it (the error's traceback holds the
        helper's frame, which holds the converter: kept, they would wait for the cyclic collector
        with the request's bytes and frames)."""
        error, self._error = self._error, None
        if error is not None:
            try:
                raise error
            finally:
                error = None

    def _work(self) -> None:
        assert self._jobs is not None
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if not self._failed and not self._drop:
                    self.frames[job[0]] = self.convert(job[1])
            except BaseException as e:  # raised in the caller, mapped there as inline
                self._error, self._failed = e, True
            finally:
                job = None  # the decoded frame is not held while waiting for the next
                self._jobs.task_done()

    def __enter__(self) -> _Converter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._jobs is None or self._thread is None:
            return
        # Cancelled or a generator closed: nobody wants the frames still waiting. Otherwise they are
        # converted (at most _CONVERT_AHEAD + 1): on success they are wanted, and on another error
        # they are earlier frames, whose own error is the one inline decoding would have raised.
        self._drop = kind is not None and (issubclass(kind, Cancelled) or not issubclass(kind, Exception))
        self._jobs.put(None)
        self._thread.join()
        if self._drop or self._error is error:
            self._error = None
        else:
            self.check()


@dataclass(frozen=True)
class SpanPlan:
    """One span of a video with segments: its seconds and the frames sampled inside it."""

    start: float  # seconds
    end: float
    first: int  # the span's first frame (decode order): the span as its own clip starts here
    frames: int  # frames inside the span
    indices: tuple[int, ...]  # sampled frames, unique, in the whole clip's numbering


def span_plans(meta: VideoMetadata, config: VideoConfig, seconds: float, overlap: float) -> list[SpanPlan]:
    """The spans of `seconds` (preprocess/segments.py, in milliseconds of the declared duration), each
    holding the frames whose time index / fps lies inside it, sampled as `sample_indices` samples a clip
    of just those frames. A span with no frame inside (a last sliver between two frames) is left out."""
    duration_ms = round(1000 * meta.total_frames / meta.fps)
    plans = []
    for start_ms, end_ms in segments.spans(duration_ms, round(1000 * seconds), overlap):
        first = _frame_at(start_ms / 1000, meta.fps)
        last = meta.total_frames if end_ms >= duration_ms else _frame_at(end_ms / 1000, meta.fps)
        if last <= first:
            continue
        local = sample_indices(VideoMetadata(last - first, meta.fps, meta.width, meta.height), config)
        indices = tuple(sorted({first + int(i) for i in local}))
        plans.append(SpanPlan(start_ms / 1000, end_ms / 1000, first, last - first, indices))
    return plans


def _frame_at(t: float, fps: float) -> int:
    """The first frame whose time (index / fps) is at or after t seconds."""
    return math.ceil(t * fps - 1e-6)


def decode_spans(
    data: bytes,
    config: VideoConfig,
    limits: MediaLimits,
    *,
    seconds: float,
    overlap: float,
    geometry: PatchGeometry | None = None,
    cancel: Event | None = None,
    helper: bool = True,
) -> Iterator[tuple[SpanPlan | None, SampledVideo]]:
    """Decode the whole clip once, under the segment limits (MediaLimits.for_segments), and give each
    span's sampled frames as soon as its last one is decoded, as `decode_video` would give the span
    sent as a clip of its own (its frames, its own timestamps from 0); then the clip itself, as
    `decode_video` gives it: (None, its 32 frames at most). Frames are resized as they are decoded
    (`geometry`) on the helper thread as in `decode_video` (`helper`), and only those a span or the
    whole still needs are kept.
    """
    limits = limits.for_segments()
    try:
        with containers.open_container(data, _FORMATS, "video", "an MP4, MOV, MKV or WebM file") as container:
            if not container.streams.video:
                raise MediaDecodeError("could not decode video: the file has no video stream", param="input")
            stream = container.streams.video[0]
            meta = _metadata(container, stream, limits)
            check_decode_cost(meta, meta.total_frames - 1, limits)
            plans = span_plans(meta, config, seconds, overlap)
            whole = sorted(set(sample_indices(meta, config).tolist()))
            wanted = set(whole).union(*(p.indices for p in plans))
            last = max(wanted)
            size = None if geometry is None else target_size(meta.height, meta.width, config.budget, geometry)
            todo = list(plans)
            with _Converter(meta.width, meta.height, size, helper=helper) as converter:
                for i in _decode_sampled(container, stream, wanted, last, limits, converter, cancel):
                    if todo and todo[0].indices[-1] <= i:
                        converter.settle()  # the span's last frame, converted
                    while todo and todo[0].indices[-1] <= i:
                        plan = todo.pop(0)
                        local = [j - plan.first for j in plan.indices]
                        span_meta = VideoMetadata(plan.frames, meta.fps, meta.width, meta.height)
                        frames = np.stack([converter.frames[j] for j in plan.indices])
                        yield plan, SampledVideo(frames, local, [j / meta.fps for j in local], span_meta)
                        still = set(whole).union(*(p.indices for p in todo[:2]))  # overlap < 0.5: 2 spans
                        # settled: the helper waits for a frame, so the dict is the caller's here
                        converter.frames = {j: f for j, f in converter.frames.items() if j in still}
            kept = converter.frames
    except (MediaDecodeError, InputTooLargeError, Cancelled):
        raise
    except MemoryError as e:
        raise InputTooLargeError("video is too large to decode", param="input") from e
    except Exception as e:  # av.error.* for corrupt or truncated files
        raise MediaDecodeError(f"could not decode video: {reason(e)}", param="input") from e
    missing = [j for j in whole if j not in kept]
    if todo or missing:
        raise MediaDecodeError(
            f"video is truncated: it ended before frame {min([*missing, *(p.indices[0] for p in todo)])} "
            f"of its {meta.total_frames} declared frames",
            param="input",
        )
    frames = np.stack([kept[j] for j in whole])
    yield None, SampledVideo(frames, whole, [j / meta.fps for j in whole], meta)


def probe_spans(
    data: bytes,
    config: VideoConfig,
    geometry: PatchGeometry,
    limits: MediaLimits,
    seconds: float,
    overlap: float,
) -> tuple[int, list[int]]:
    """(tokens of the clip itself, tokens of each span) of a video with segments, from its container
    metadata alone; InputTooLargeError where `decode_spans` would refuse the metadata. Metadata that
    cannot be read counts as the most: the segment duration limit in spans of 32 frames."""
    limits = limits.for_segments()
    try:
        with containers.open_container(data, _FORMATS, "video", "video") as container:
            if not container.streams.video:
                raise MediaDecodeError("no video stream")
            meta = _metadata(container, container.streams.video[0], limits)
    except InputTooLargeError:
        raise
    except Exception:
        most = config.max_frames * (config.budget + 2)
        span_ms = round(1000 * seconds)
        length = (
            round(1000 * limits.max_video_seconds) if math.isfinite(limits.max_video_seconds) else span_ms
        )
        return most, [most] * segments.count(length, span_ms, overlap)
    check_decode_cost(meta, meta.total_frames - 1, limits)
    per_frame = soft_tokens(meta.height, meta.width, config.budget, geometry) + 2
    whole = len(set(sample_indices(meta, config).tolist()))
    return whole * per_frame, [len(p.indices) * per_frame for p in span_plans(meta, config, seconds, overlap)]


def _resized(rgb: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """(H, W, 3) uint8 -> (h, w, 3) uint8, the kernel `prepare_frames` applies to the stack."""
    out = resize_uint8(channels_last(rgb), size)  # (1, 3, h, w) channels-last
    return out[0].permute(1, 2, 0).contiguous().numpy()  # a view already: no copy


def probe_tokens(data: bytes, config: VideoConfig, geometry: PatchGeometry, limits: MediaLimits) -> int:
    """Tokens this video will take (per sampled frame: its soft tokens and two markers), from container
    metadata alone (nothing decoded).

    Raises InputTooLargeError where decode_video would refuse the metadata (size, length, frame count,
    decode cost). Metadata that cannot be read counts as the most a video can take: the decoder has the
    last word on the file.
    """
    try:
        with containers.open_container(data, _FORMATS, "video", "video") as container:
            if not container.streams.video:
                raise MediaDecodeError("no video stream")
            meta = _metadata(container, container.streams.video[0], limits)
    except InputTooLargeError:
        raise
    except Exception:
        return config.max_frames * (config.budget + 2)
    wanted = sample_indices(meta, config)
    check_decode_cost(meta, int(wanted.max()), limits)
    frames = len(set(wanted.tolist()))
    return frames * (soft_tokens(meta.height, meta.width, config.budget, geometry) + 2)


def _metadata(container: Any, stream: Any, limits: MediaLimits) -> VideoMetadata:
    """Declared size, rate and length, refused here when over a limit (nothing is decoded yet)."""
    width, height = int(stream.codec_context.width), int(stream.codec_context.height)
    if width <= 0 or height <= 0:
        raise MediaDecodeError(f"could not decode video: frame size {width}x{height}", param="input")
    if width * height > limits.max_video_frame_pixels:
        raise InputTooLargeError(
            f"video frames are too large: {width}x{height} = {width * height} pixels, the limit is "
            f"{limits.max_video_frame_pixels}",
            param="input",
        )
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    fps = float(rate) if rate else 0.0
    if not math.isfinite(fps) or fps <= 0 or fps > 1000:
        raise MediaDecodeError(f"could not decode video: frame rate {fps:g}", param="input")
    total = int(stream.frames or 0)
    seconds = containers.declared_seconds(container, stream)
    if total <= 0:
        # Matroska / WebM keep no frame count: derive it as the reference would have read it.
        if seconds is None or seconds <= 0:
            raise MediaDecodeError("could not decode video: unknown duration and frame count", param="input")
        if seconds > limits.max_video_seconds:
            raise _too_long(seconds, limits)
        total = max(1, round(seconds * fps))
    if total > limits.max_video_frames:
        raise InputTooLargeError(
            f"video has too many frames: {total} declared, the limit is {limits.max_video_frames}",
            param="input",
        )
    seconds = max(seconds or 0.0, total / fps)
    if seconds > limits.max_video_seconds:
        raise _too_long(seconds, limits)
    return VideoMetadata(total, fps, width, height)


def check_decode_cost(meta: VideoMetadata, last: int, limits: MediaLimits) -> None:
    """Refuse a clip whose decode (every frame up to the last sampled one) would produce more pixels
    than the limit: decode time follows that product, not the duration alone."""
    pixels = meta.width * meta.height * (last + 1)
    if pixels > limits.max_video_decode_pixels:
        raise InputTooLargeError(
            f"video is too costly to decode: {last + 1} frames of {meta.width}x{meta.height} = "
            f"{pixels / 1e9:.1f} billion pixels, the limit is {limits.max_video_decode_pixels / 1e9:g} billion",
            param="input",
        )


def _check_frame(frame: Any, decoded: int, limits: MediaLimits) -> int:
    """Refuse a decoded frame over the frame-size limit, or one that takes the pixels decoded so far
    past the decode limit; the new total. `check_decode_cost` judged the declared size, and a stream
    can change its size after the header (a 16x16 header, then 4K frames)."""
    pixels = frame.width * frame.height
    if pixels > limits.max_video_frame_pixels:
        raise InputTooLargeError(f"video frame is too large: {frame.width}x{frame.height}", param="input")
    decoded += pixels
    if decoded > limits.max_video_decode_pixels:
        raise InputTooLargeError(
            f"video is too costly to decode: its frames exceed {limits.max_video_decode_pixels / 1e9:g} "
            "billion pixels (its frames are larger than its header declares)",
            param="input",
        )
    return decoded


def _too_long(seconds: float, limits: MediaLimits) -> InputTooLargeError:
    return InputTooLargeError(
        f"video is too long: {seconds:.0f} s, the limit is {limits.max_video_seconds:g} s", param="input"
    )


def prepare_frames(frames: np.ndarray, budget: int, geometry: PatchGeometry) -> PatchedImages:
    """(n, H, W, 3) uint8 -> per-frame padded patches, every frame resized to the same target size."""
    size = target_size(frames.shape[1], frames.shape[2], budget, geometry)
    return patchify(resize_uint8(channels_last(frames), size), geometry.max_patches(budget), geometry)
