"""Preprocessing throughput on this CPU: text tokens/s, images/s, audio seconds/s, video clips/s.

    python -m benchmarks.preprocess --model DIR [--seconds 2] [--reference]

Inputs are synthesised here (photos with noise, a 30 s stereo 44.1 kHz recording, a 10 s 30 fps clip)
and every case starts from the encoded bytes, as a request does. `--reference` times transformers'
processors on the same bytes (the [bench] extra installs them): PIL decode + the Gemma 4
image processor, the Gemma 4 feature extractor on 16 kHz samples (it cannot resample, so its row starts
from decoded samples), its PyAV loader + the EmbeddingGemma 2 video processor, and the tokenizer.
"""

from __future__ import annotations

import argparse
import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from eg2_runtime.inputs import Item, MediaPart, PrepareOptions, TextPart
from eg2_runtime.preprocess.audio import load_audio
from eg2_runtime.preprocess.layout import Prepared
from eg2_runtime.preprocess.preprocessor import Preprocessor


@dataclass
class Row:
    case: str
    unit: str
    ours: float  # units per second
    reference: float | None = None


def measure(fn: Callable[[], float], seconds: float) -> float:
    """Units per second of `fn` (which returns the units it processed), after one warm-up call."""
    fn()
    done, start = 0.0, time.perf_counter()
    while True:
        done += fn()
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return done / elapsed


# ------------------------------------------------------------------------------------------ inputs


def _photo(height: int, width: int, seed: int = 0) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = 127 + 100 * np.sin(x / 97 + y / 53)[..., None] * np.array([1.0, 0.8, 0.6], np.float32)
    pixels = np.clip(base + rng.normal(0, 12, (height, width, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _recording(seconds: float, rate: int = 44_100) -> bytes:
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(0)
    left = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(len(t))
    right = 0.3 * np.sin(2 * np.pi * 330 * t) + 0.05 * rng.standard_normal(len(t))
    buf = io.BytesIO()
    sf.write(buf, np.stack([left, right], axis=1).astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _clip(seconds: int, fps: int = 30, size: tuple[int, int] = (360, 640)) -> bytes:
    import av

    height, width = size
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast"}
        y, x = np.mgrid[0:height, 0:width]
        for i in range(seconds * fps):
            frame = np.stack([(x + 3 * i) % 256, (y + i) % 256, (x + y) % 256], axis=-1).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def _texts(count: int, chars: int) -> list[str]:
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "embeddings",
        "of",
        "every",
        "modality",
        "share",
        "one",
        "space",
    ]
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(words, size=chars // 5)) for _ in range(count)]


# -------------------------------------------------------------------------------------------- runs


def run(model_dir: str | Path, seconds: float = 2.0, reference: bool = False) -> list[Row]:
    pre = Preprocessor.from_dir(model_dir)
    ref = _Reference(model_dir) if reference else None
    opts = PrepareOptions()
    rows: list[Row] = []

    texts = _texts(64, 2000)
    items = [Item((TextPart(t),)) for t in texts]

    def text_ours() -> float:
        prepared = pre.prepare_batch(items, opts, raise_errors=True)
        return float(sum(p.num_tokens for p in prepared if isinstance(p, Prepared)))

    rows.append(Row("text, 64 x 2000 chars, batch", "tokens/s", measure(text_ours, seconds)))
    if ref:
        rows[-1].reference = measure(lambda: ref.text(texts), seconds)

    for label, data in (
        ("image 1920x1080 JPEG", _photo(1080, 1920)),
        ("image 4000x3000 JPEG", _photo(3000, 4000)),
    ):
        item = Item((MediaPart("image", data),))
        rows.append(
            Row(f"{label} -> 280 tokens", "images/s", measure(partial(_one, pre, item, opts), seconds))
        )
        if ref:
            rows[-1].reference = measure(partial(ref.image, data), seconds)

    wav = _recording(30.0)
    audio_item = Item((MediaPart("audio", wav),))
    rows.append(
        Row(
            "audio 30 s WAV 44.1k stereo -> 16k mel",
            "audio s/s",
            30 * measure(lambda: _one(pre, audio_item, opts), seconds),
        )
    )
    wave16 = load_audio(wav)[0]
    rows.append(
        Row(
            "audio 30 s, mel only (16 kHz samples)",
            "audio s/s",
            30 * measure(lambda: _mel(pre, wave16), seconds),
        )
    )
    if ref:
        rows[-1].reference = 30 * measure(lambda: ref.audio(wave16), seconds)

    clip = _clip(10)
    video_item = Item((MediaPart("video", clip),))
    rows.append(
        Row("video 10 s 640x360 30 fps MP4", "clips/s", measure(lambda: _one(pre, video_item, opts), seconds))
    )
    if ref:
        rows[-1].reference = measure(lambda: ref.video(clip), seconds)
    return rows


def _one(pre: Preprocessor, item: Item, opts: PrepareOptions) -> float:
    pre.prepare(item, opts)
    return 1.0


def _mel(pre: Preprocessor, wave: np.ndarray) -> float:
    pre.log_mel(wave)
    return 1.0


class _Reference:
    """transformers' processors, timed from the same bytes where they can start from bytes."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)

    def text(self, texts: list[str]) -> float:
        out = self.processor.tokenizer(texts)
        return float(sum(len(ids) for ids in out["input_ids"]))

    def image(self, data: bytes) -> float:
        from PIL import Image, ImageOps

        pil = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
        self.processor.image_processor(pil, return_tensors="pt")
        return 1.0

    def audio(self, wave: np.ndarray) -> float:
        self.processor.feature_extractor([wave], return_tensors="pt")
        return 1.0

    def video(self, data: bytes) -> float:
        import tempfile

        from transformers.video_utils import read_video_pyav

        vp = self.processor.video_processor

        def sample(metadata: Any, **_: Any) -> Any:
            return vp.sample_frames(
                metadata, fps=vp.fps, max_frames=vp.max_frames, overflow_strategy="uniform"
            )

        with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
            f.write(data)
            f.flush()
            frames, _ = read_video_pyav(f.name, sample_indices_fn=sample)  # type: ignore[arg-type]
        vp(videos=[frames], do_sample_frames=False, return_tensors="pt")
        return 1.0


def format_table(rows: list[Row]) -> str:
    head = f"{'case':44s} {'unit':>10s} {'ours':>12s} {'reference':>12s} {'speedup':>8s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ref = f"{r.reference:12,.1f}" if r.reference else f"{'-':>12s}"
        speed = f"{r.ours / r.reference:7.1f}x" if r.reference else f"{'':>8s}"
        lines.append(f"{r.case:44s} {r.unit:>10s} {r.ours:12,.1f} {ref} {speed}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", required=True, help="model directory (tokenizer.json, processor_config.json)"
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="time per case")
    parser.add_argument("--reference", action="store_true", help="also time transformers' processors")
    args = parser.parse_args(argv)
    print(format_table(run(args.model, args.seconds, args.reference)))


if __name__ == "__main__":
    main()
