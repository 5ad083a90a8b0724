"""What `eg2 bench` runs on: the checkpoints, and the inputs and workloads, the same for every configuration.

Checkpoints: a BF16 one (given, or random weights generated once and cached) and its hybrid-w4
quantization, with the largest group size its widths allow. Random weights run the same kernels as
trained ones: nothing measured depends on the values.

Inputs are kept as a client holds them (a string, PNG bytes, 16 kHz mono WAV bytes, H.264 MP4 bytes),
so every configuration pays its own decoding inside the timed call. Texts are cut to a token count
measured with the checkpoint's own tokenizer (the demo checkpoint's is one token per character; a
real one is not), and every count is what the text encoder sees: BOS and EOS, media markers and soft
tokens included. Those counts give tokens/s for every configuration alike.

Three sets of workloads, built once by the orchestrating process and handed to every configuration:
- the matrix: 7 rows (text ~20 / ~500 / ~2,200 tokens, image 640x480, audio 9.3 s and 30 s, video of
  8 frames at 1 fps, 640x480) x the batch sizes, one call of B items each. A text batch holds B
  distinct texts of one length; a media batch holds B copies of one file (nothing on either path
  caches by content);
- the named workloads of issues #12 and #15, as the outside measurement ran them (docs/BENCH.md);
- the HTTP sweep's single items: a short text, one image, one clip.
Quick mode (`QUICK`) keeps every row and workload but shrinks sizes and counts; labels say what ran.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from eg2_runtime import samples
from eg2_runtime.errors import CheckpointError
from eg2_runtime.inputs import Item, MediaKind, MediaPart, PrepareOptions, TextPart

if TYPE_CHECKING:  # the HTTP client processes unpickle inputs without importing torch
    from eg2_runtime.preprocess import Preprocessor

Kind = Literal["text", "image", "audio", "video"]
FORMATS = {"image": "png", "audio": "wav", "video": "mp4"}
MIME = {"image": "image/png", "video": "video/mp4"}


@dataclass(frozen=True)
class Input:
    kind: Kind
    text: str = ""
    data: bytes = b""
    tokens: int = 0  # what the text encoder sees, from our preprocessor

    def item(self) -> Item:
        if self.kind == "text":
            return Item((TextPart(self.text),))
        return Item((MediaPart(self.kind, self.data, FORMATS[self.kind]),))


@dataclass(frozen=True)
class Workload:
    key: str  # unique: "text_long/b8" in the matrix, the named key otherwise
    family: str  # the matrix row ("text_long"), or the named key
    modality: Kind
    label: str
    calls: tuple[tuple[Input, ...], ...]  # one round: each call's items, in order

    @property
    def batch(self) -> int:
        return len(self.calls[0])

    @property
    def items(self) -> int:
        return sum(len(c) for c in self.calls)

    @property
    def tokens(self) -> int:
        return sum(x.tokens for c in self.calls for x in c)


@dataclass(frozen=True)
class Sizes:
    """Input sizes and named-workload counts. Quick mode (a CPU, the tiny model) keeps every row and
    every code path but shrinks what dominates a CPU's time: long texts, long clips, frames, counts."""

    text: tuple[int, int, int] = (20, 500, 2200)  # short, medium, long: tokens
    audio: tuple[float, float] = (9.3, 30.0)  # short, long: seconds
    video_frames: int = 8  # at 1 fps: the processor keeps them all
    docs: int = 64  # "64 docs of 20-60 tokens, one call"
    docs_total: int = 256  # "256 docs of 40 tokens, in calls of 64"
    per_call: int = 64
    media: int = 16  # "16 images / clips in one call"


FULL = Sizes()
QUICK = Sizes(
    text=(20, 100, 400), audio=(2.0, 5.0), video_frames=2, docs=8, docs_total=32, per_call=8, media=4
)
FAMILIES = ("text_short", "text_medium", "text_long", "image", "audio_short", "audio_long", "video")
TEXT_NAMED = ("short_query", "docs_one_call", "long_doc", "docs_many_calls")
IMAGE_SIZE = (640, 480)
NAMED_IMAGE_SIZE = (641, 479)  # the outside measurement's size: no side a multiple of the 48-pixel grid
VIDEO_SIZE = (640, 480)

# Plain words, so a real tokenizer gives ordinary token counts too.
_VOCABULARY = (
    "the quick brown fox jumps over a lazy dog while embeddings of every modality share one space "
    "search results rank documents by meaning and queries find images audio video and text alike"
)
WORDS = _VOCABULARY.split()


class Factory:
    """Builds inputs and counts their tokens with the checkpoint's preprocessor."""

    def __init__(self, preprocessor: Preprocessor) -> None:
        self.pre = preprocessor
        self._media: dict[tuple[object, ...], Input] = {}
        self._texts: dict[tuple[int, int], Input] = {}  # (tokens, seed): batch sizes share their texts

    def count(self, item: Item) -> int:
        return self.pre.prepare(item, PrepareOptions()).num_tokens

    def text(self, tokens: int, seed: int) -> Input:
        """A text of at most `tokens` tokens (exactly, for a one-token-per-character tokenizer)."""
        if (tokens, seed) not in self._texts:
            self._texts[tokens, seed] = self._cut(tokens, seed)
        return self._texts[tokens, seed]

    def _cut(self, tokens: int, seed: int) -> Input:
        def count(s: str) -> int:
            return self.count(Item((TextPart(s),)))

        words = [str(w) for w in np.random.default_rng(seed).choice(WORDS, size=2 * tokens + 8)]
        lo, hi = 1, len(words)  # the longest prefix of words within `tokens`: counts grow with words
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if count(" ".join(words[:mid])) <= tokens:
                lo = mid
            else:
                hi = mid - 1
        text = " ".join(words[:lo])
        following = words[lo] if lo < len(words) else ""
        for k in range(len(following), 0, -1):  # then as much of the next word as fits
            if count(f"{text} {following[:k]}") <= tokens:
                text = f"{text} {following[:k]}"
                break
        return Input("text", text=text, tokens=count(text))

    def image(self, width: int, height: int) -> Input:
        return self._cached("image", (width, height), lambda: samples.png(width, height))

    def audio(self, seconds: float) -> Input:
        return self._cached("audio", (seconds,), lambda: samples.wav(seconds))

    def video(self, frames: int) -> Input:
        w, h = VIDEO_SIZE
        return self._cached("video", (frames,), lambda: samples.mp4(frames, 1, w, h))

    def _cached(self, kind: MediaKind, size: tuple[float, ...], make: Callable[[], bytes]) -> Input:
        key = (kind, *size)
        if key not in self._media:
            data = make()
            tokens = self.count(Item((MediaPart(kind, data, FORMATS[kind]),)))
            self._media[key] = Input(kind, data=data, tokens=tokens)
        return self._media[key]

    def row(self, family: str, sizes: Sizes, count: int, seed: int = 0) -> tuple[Input, ...]:
        """`count` inputs of a matrix row: distinct texts of one length, or copies of one media file."""
        if family.startswith("text_"):
            tokens = sizes.text[("text_short", "text_medium", "text_long").index(family)]
            return tuple(self.text(tokens, seed + i) for i in range(count))
        if family == "image":
            return (self.image(*IMAGE_SIZE),) * count
        if family.startswith("audio_"):
            return (self.audio(sizes.audio[1 if family == "audio_long" else 0]),) * count
        return (self.video(sizes.video_frames),) * count


@dataclass(frozen=True)
class Workloads:
    """Everything the configurations run, built once and handed to each of them (pickled)."""

    matrix: tuple[Workload, ...]
    named: tuple[Workload, ...]
    sweep: dict[str, Input]  # family -> the single item each request of the HTTP sweep carries

    def describe(self) -> dict[str, object]:
        def wl(w: Workload) -> dict[str, object]:
            return {
                "key": w.key,
                "family": w.family,
                "modality": w.modality,
                "label": w.label,
                "batch": w.batch,
                "calls": len(w.calls),
                "items": w.items,
                "tokens": w.tokens,
            }

        return {
            "matrix": [wl(w) for w in self.matrix],
            "named": [wl(w) for w in self.named],
            "sweep": {f: {"modality": x.kind, "tokens": x.tokens} for f, x in self.sweep.items()},
        }


def build(preprocessor: Preprocessor, sizes: Sizes, batch_sizes: tuple[int, ...]) -> Workloads:
    factory = Factory(preprocessor)
    return Workloads(
        tuple(matrix(factory, sizes, batch_sizes)),
        tuple(named(factory, sizes)),
        {
            "text_short": factory.text(sizes.text[0], seed=5000),
            "image": factory.image(*NAMED_IMAGE_SIZE),
            "audio_short": factory.audio(sizes.audio[0]),
        },
    )


def _describe(x: Input) -> str:
    return f"{x.tokens} tokens" if x.kind == "text" else f"{x.kind}, {x.tokens} tokens"


def matrix(factory: Factory, sizes: Sizes, batch_sizes: tuple[int, ...]) -> list[Workload]:
    out = []
    for family in FAMILIES:
        for b in batch_sizes:
            calls = (factory.row(family, sizes, b),)
            kind = calls[0][0].kind
            label = f"{family} ({_describe(calls[0][0])}) x {b}"
            out.append(Workload(f"{family}/b{b}", family, kind, label, calls))
    return out


def _one(key: str, label: str, kind: Kind, calls: list[tuple[Input, ...]]) -> Workload:
    return Workload(key, key, kind, label, tuple(calls))


def named_text(factory: Factory, sizes: Sizes) -> list[Workload]:
    """The text ones of the named workloads (issue #15's): they need only the tokenizer."""
    docs, total, per_call = sizes.docs, sizes.docs_total, sizes.per_call
    short = factory.text(17, seed=1000)
    lengths = np.linspace(20, 60, docs).round().astype(int)
    mixed = tuple(factory.text(int(n), seed=2000 + i) for i, n in enumerate(lengths))
    long_doc = factory.text(sizes.text[2], seed=3000)
    forty = [factory.text(40, seed=4000 + i) for i in range(total)]
    return [
        _one("short_query", f"1 query ({short.tokens} tokens)", "text", [(short,)]),
        _one("docs_one_call", f"{docs} docs of 20-60 tokens, one call", "text", [mixed]),
        _one("long_doc", f"1 doc of {long_doc.tokens} tokens", "text", [(long_doc,)]),
        _one(
            "docs_many_calls",
            f"{total} docs of 40 tokens, {total // per_call} calls",
            "text",
            [tuple(forty[i : i + per_call]) for i in range(0, total, per_call)],
        ),
    ]


def named(factory: Factory, sizes: Sizes) -> list[Workload]:
    """The named workloads of issues #12 and #15, with `sizes`' counts (theirs in full mode). Each is
    measured as the time of one round: all its calls, one after the other."""
    media = sizes.media
    image = factory.image(*NAMED_IMAGE_SIZE)
    clip = factory.audio(sizes.audio[0])
    video = factory.video(sizes.video_frames)
    w, h = NAMED_IMAGE_SIZE
    return [
        *named_text(factory, sizes),
        _one("image_one", f"1 image {w}x{h}", "image", [(image,)]),
        _one("images_one_call", f"{media} images {w}x{h}, one call", "image", [(image,) * media]),
        _one("audio_one", f"1 clip {sizes.audio[0]:g} s", "audio", [(clip,)]),
        _one("audio_one_call", f"{media} clips {sizes.audio[0]:g} s, one call", "audio", [(clip,) * media]),
        _one("video_one", f"1 video, {sizes.video_frames} frames", "video", [(video,)]),
    ]


# ------------------------------------------------------------------------------------- checkpoints

# Where `checkpoints` generates the random-weight checkpoints, for the bench and every probe.
DEFAULT_CACHE = Path.home() / ".cache" / "eg2" / "bench"


def _quantize(src: Path, dst: Path) -> int:
    """Quantize with the largest group size the checkpoint allows (the tiny one's widths are 32-aligned)."""
    from eg2_runtime.tools.quantize import quantize_checkpoint

    for group in (128, 64, 32):
        try:
            quantize_checkpoint(src, dst, group_size=group, progress=False)
            return group
        except CheckpointError as e:
            if "not a multiple" not in str(e) or group == 32:
                raise
    raise AssertionError("unreachable")


def _cached(target: Path, build: Callable[[Path], object]) -> Path:
    """`target`, built once by `build(tmp)` into a sibling and renamed, so a crash leaves no half model."""
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        (tmp / ".complete").touch()
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def checkpoints(
    model_dir: Path | None, cache_dir: Path, size: str, progress: Callable[[str], None]
) -> Iterator[tuple[Path, Path]]:
    """(BF16 dir, hybrid-w4 dir): `model_dir` and its quantization in a temporary directory, or the
    random-weight checkpoint of `size`, generated and quantized once under `cache_dir`."""
    if model_dir is not None:
        config = json.loads((model_dir / "config.json").read_text())
        if "quantization_config" in config:
            raise CheckpointError(f"{model_dir} is quantized: give the BF16 checkpoint it was made from")
        with tempfile.TemporaryDirectory(prefix="eg2-bench-w4-") as tmp:
            group = _quantize(model_dir, Path(tmp))
            progress(f"quantized {model_dir} (group size {group})")
            yield model_dir, Path(tmp)
        return
    from eg2_runtime.tools.demo_model import write_demo_model

    root = cache_dir / f"{size}-seed0"
    bf16 = _cached(root / "bf16", lambda d: write_demo_model(d, size=size, seed=0))
    w4 = _cached(root / "w4", lambda d: _quantize(bf16, d))
    progress(f"checkpoints ready under {root}")
    yield bf16, w4


CHECKPOINT_KINDS = ("w4", "bf16")


def full_checkpoint(kind: str) -> Path:
    """The full-size random-weight checkpoint the GPU probes load, hybrid-w4 ("w4") or BF16, generated
    once under DEFAULT_CACHE (as `eg2 bench` generates it; a cached one outlives `checkpoints`)."""
    with checkpoints(None, DEFAULT_CACHE, "full", print) as (bf16, w4):
        return w4 if kind == "w4" else bf16
