"""Size limits on decoded media, checked from headers and container metadata before the costly decode.

The service owns these settings (it builds one `MediaLimits` from its own knobs and hands it to the
`Preprocessor`); the defaults here are what a public endpoint can afford on a few CPU cores. They bound
memory and time per item. What the *model* can take (8192 tokens, 30 s of audio, 32 video frames) is
fixed by the checkpoint and lives beside the code that enforces it, not here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MediaLimits:
    # Decoded width x height of one image, read from its header. 40 MP is a 7300 x 5500 photo, 120 MB as
    # RGB. The model sees at most 2.6 MP (1120 tokens) anyway. Pillow refuses more than 178 MP on its own.
    max_image_pixels: int = 40_000_000
    # Audio: channels and sample rates outside these are refused (a forged header could otherwise ask for
    # gigabytes per second). Only the first 30 s is ever decoded, so no duration limit is needed.
    max_audio_channels: int = 32
    min_audio_rate: int = 1_000
    max_audio_rate: int = 384_000
    # Video, from container metadata before any frame is decoded. Every frame up to the last sampled one
    # is decoded (the reference samples by decode index), so decode time grows with duration x fps x
    # frame size: 2 min of 30 fps 1080p is 3600 frames, ~10-20 s of one core. Past 32 s the model sees
    # 32 frames whatever the length, so longer clips buy little.
    max_video_seconds: float = 120.0
    max_video_frame_pixels: int = 3840 * 2160
    max_video_frames: int = 14_400  # declared frame count (120 s at 120 fps)


# Exception types whose message describes the data (Pillow uses SyntaxError for bad headers); anything
# else out of a decoder (AttributeError, KeyError, ...) is a library tripping on garbage, not news.
_DESCRIPTIVE = (OSError, ValueError, EOFError, SyntaxError, RuntimeError)


def reason(e: BaseException) -> str:
    """A decoder exception as a short client-safe reason: never a traceback, a path or a repr."""
    strerror = getattr(e, "strerror", None)  # PyAV / OSError: the message without errno and file name
    if isinstance(strerror, str) and strerror:
        return strerror[:200]
    text = str(e).strip()
    if not isinstance(e, _DESCRIPTIVE) or not text:
        return "corrupt or unsupported data"
    return text.splitlines()[0][:200]
