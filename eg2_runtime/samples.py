"""Small synthetic media, encoded as a client would send it: for warm-up, smoke tests and benchmarks.

Deterministic and smooth (gradients and tones): random weights are ill-conditioned on white noise in
BF16, and a smooth input keeps GPU-vs-CPU comparisons meaningful.
"""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf
from PIL import Image


def gradient(width: int, height: int, seed: int = 0) -> np.ndarray:
    """(height, width, 3) uint8 smooth colour gradient."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    phase = rng.uniform(0, 2 * np.pi, 3)
    rgb = np.stack([np.sin(3 * x + 2 * y + p) for p in phase], axis=-1) * 0.5 + 0.5
    return (rgb * 255).astype(np.uint8)


def png(width: int = 640, height: int = 480, seed: int = 0) -> bytes:
    out = io.BytesIO()
    Image.fromarray(gradient(width, height, seed)).save(out, format="PNG")
    return out.getvalue()


def tone(seconds: float = 1.0, rate: int = 16_000, hz: float = 440.0) -> np.ndarray:
    """(n,) float32 mono: a tone and its third harmonic."""
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * hz * t) + 0.05 * np.sin(2 * np.pi * 3 * hz * t)).astype(np.float32)


def wav(seconds: float = 1.0, rate: int = 16_000, hz: float = 440.0) -> bytes:
    out = io.BytesIO()
    sf.write(out, tone(seconds, rate, hz), rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def mp4(seconds: int = 8, fps: int = 1, width: int = 128, height: int = 96) -> bytes:
    """An H.264 clip of `seconds * fps` smoothly changing frames."""
    import av  # here, not at the top: a text-only server warms up without PyAV installed

    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(seconds * fps):
            frame = av.VideoFrame.from_ndarray(gradient(width, height, seed=i), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return out.getvalue()
