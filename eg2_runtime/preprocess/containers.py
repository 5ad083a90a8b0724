"""PyAV containers opened from untrusted bytes: only the demuxers we name, and their declared length.

Shared by audio.py (MP3 / M4A / WebM and the Ogg that libsndfile lacks) and video.py. PyAV is imported
on first use: it loads FFmpeg, which a text-only process never needs.
"""

from __future__ import annotations

import io
from typing import Any

from eg2_runtime.errors import MediaDecodeError

# container.format.name of the demuxers we let FFmpeg pick (it guesses from the bytes otherwise).
MP4 = "mov,mp4,m4a,3gp,3g2,mj2"
MATROSKA = "matroska,webm"
# Containers whose declared duration is exact; MP3 and Ogg durations are estimates, or are read from
# the end of the data itself, so a shortfall there proves nothing.
EXACT_DURATION = {MP4, MATROSKA}


def open_container(data: bytes, formats: set[str], kind: str, names: str) -> Any:
    """av.open on the bytes, refused unless FFmpeg recognises one of `formats`.

    Callers wrap it in their own `except` that turns FFmpeg errors into MediaDecodeError.
    """
    import av

    container = av.open(io.BytesIO(data), mode="r")
    if container.format.name not in formats:
        container.close()
        raise MediaDecodeError(f"could not decode {kind}: not {names}", param="input")
    return container


def declared_seconds(container: Any, stream: Any) -> float | None:
    """The stream's (else the container's) declared duration in seconds, None when it declares none."""
    if stream.duration is not None and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return float(container.duration) / 1_000_000  # AV_TIME_BASE
    return None
