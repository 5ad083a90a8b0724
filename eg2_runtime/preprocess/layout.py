"""Token layout: where the text, the media markers and the soft-token placeholders go in `input_ids`.

The reference path (sentence-transformers -> EmbeddingGemma2Processor.apply_chat_template) renders an
item as one string: the prompt (a system message, emitted first), then the parts in order, text as is
and each media part as a bare placeholder that the processor expands:

    image   <|image>  N x <|image|>  <image|>
    audio   <|audio>  N x <|audio|>  <audio|>
    video   per frame <|image> N x <|video|> <image|>, frames back to back (no separator, no
            timestamps: the checkpoint's add_timestamps is false; with it true each frame is
            preceded by "mm:ss " and frames are joined by " ")

and tokenizes it with `<bos> ... <eos>` around. Adjacent text parts are simply concatenated. We render
the same string with ONE placeholder per block, tokenize it, then repeat each placeholder id N times:
markers are special tokens, so the text between them tokenizes exactly as in the expanded string.
Client text may not contain the marker strings (the reference would misplace or crash on them).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from eg2_runtime.errors import InputError, InputTooLongError
from eg2_runtime.inputs import MediaKind, Modality
from eg2_runtime.preprocess.image import unit_pixels

PIXEL_INPUTS = frozenset({"pixel_values", "pixel_values_videos"})  # uint8 codes until the model runs


@dataclass(frozen=True)
class Markers:
    """Marker strings and ids (from the tokenizer, checked against config.json)."""

    boi: str = "<|image>"
    eoi: str = "<image|>"
    boa: str = "<|audio>"
    eoa: str = "<audio|>"
    image: str = "<|image|>"
    video: str = "<|video|>"
    audio: str = "<|audio|>"
    ids: dict[str, int] = field(default_factory=dict)  # marker string -> token id

    @property
    def strings(self) -> tuple[str, ...]:
        return (self.boi, self.eoi, self.boa, self.eoa, self.image, self.video, self.audio)

    def image_block(self) -> str:
        return f"{self.boi}{self.image}{self.eoi}"

    def audio_block(self) -> str:
        return f"{self.boa}{self.audio}{self.eoa}"

    def video_block(self, timestamps: Sequence[float] | None, num_frames: int) -> str:
        frame = f"{self.boi}{self.video}{self.eoi}"
        if timestamps is None:
            return frame * num_frames
        return " ".join(f"{_mmss(t)} {frame}" for t in timestamps)


def _mmss(seconds: float) -> str:
    s = round(seconds)  # the reference rounds: 29.97 fps timestamps land just below whole seconds
    return f"{s // 60:02d}:{s % 60:02d}"


@dataclass
class Prepared:
    """One item's model inputs, CPU tensors named as the Hugging Face processor names them."""

    input_ids: torch.Tensor  # (T,) int64: <bos> ... <eos>, markers and placeholders included
    modality: Modality
    pixel_values: torch.Tensor | None = None  # (n_images, budget*9, 768) uint8 codes (image.unit_pixels)
    image_position_ids: torch.Tensor | None = None  # (n_images, budget*9, 2) int64 (x, y), -1 pads
    pixel_values_videos: torch.Tensor | None = None  # (n_frames, 630, 768) uint8 codes, all videos' frames
    video_position_ids: torch.Tensor | None = None  # (n_frames, 630, 2) int64
    num_frames_per_video: torch.Tensor | None = None  # (n_videos,) int64: splits pixel_values_videos
    input_features: torch.Tensor | None = None  # (n_audio, F, 128) float32 log-mel, zero past the mask
    input_features_mask: torch.Tensor | None = None  # (n_audio, F) bool: frames of real audio
    text_truncated: bool = False  # text tokens were dropped to fit the 8192-token context
    audio_truncated: bool = False  # some audio was cut at 30 s
    frame_timestamps: list[list[float]] = field(default_factory=list)  # per video: seconds of each frame
    media_tokens: list[tuple[MediaKind, int]] = field(default_factory=list)  # per media part: tokens it adds

    @property
    def num_tokens(self) -> int:
        """Tokens the text encoder sees (usage): soft tokens and markers included."""
        return int(self.input_ids.shape[0])

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The non-empty tensors, keyed by the reference model's argument names, pixels in [0, 1] as
        the reference processor gives them."""
        names = (
            "input_ids",
            "pixel_values",
            "image_position_ids",
            "pixel_values_videos",
            "video_position_ids",
            "num_frames_per_video",
            "input_features",
            "input_features_mask",
        )
        out = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        return {n: unit_pixels(t) if n in PIXEL_INPUTS else t for n, t in out.items()}


def check_text(text: str, markers: Markers, param: str = "input") -> None:
    """Refuse client text holding a media marker string: it would shift every placeholder."""
    for marker in markers.strings:
        if marker in text:
            raise InputError(
                f"text contains the reserved media marker {marker!r}; send media as image_url, "
                "input_audio or video_url parts instead",
                param=param,
            )


def expand(
    ids: list[int],
    soft_tokens: dict[int, Iterator[int]],
    *,
    prefix: Sequence[int],
    suffix: Sequence[int],
    max_tokens: int,
    truncate: bool,
    marker_ids: set[int],
) -> tuple[torch.Tensor, bool]:
    """Wrap the rendered ids in prefix/suffix and repeat each placeholder id as often as its block needs.

    `soft_tokens[placeholder_id]` yields the soft-token count of each occurrence, in order. Over
    `max_tokens`: with `truncate`, trailing text tokens are dropped (markers, placeholders, `<bos>` and
    `<eos>` always stay: cutting media would desync it from its features); otherwise, or when the media
    alone is too long, InputTooLongError. Returns ((T,) int64 ids, whether text was dropped).
    """
    if not soft_tokens and len(prefix) + len(ids) + len(suffix) <= max_tokens:  # plain text that fits
        return torch.from_numpy(np.array([*prefix, *ids, *suffix], dtype=np.int64)), False
    arr = np.asarray(ids, dtype=np.int64)
    repeats = np.ones(len(arr), dtype=np.int64)
    for placeholder, counts in soft_tokens.items():
        where = np.flatnonzero(arr == placeholder)
        if len(where):
            repeats[where] = [next(counts) for _ in where]
    total = len(prefix) + int(repeats.sum()) + len(suffix)
    truncated = False
    if total > max_tokens:
        is_text = ~np.isin(arr, list(marker_ids))
        fixed = total - int(is_text.sum())  # media, markers and the wrapper
        if not truncate:
            raise InputTooLongError(
                f"input is {total} tokens, more than the model's {max_tokens}; send truncate=true to cut the text",
                param="input",
            )
        if fixed > max_tokens:
            raise InputTooLongError(
                f"the media of this input alone is {fixed} tokens, more than the model's {max_tokens}",
                param="input",
            )
        # Keep the first (max_tokens - fixed) text tokens, in order; drop the rest.
        keep = ~is_text | (np.cumsum(is_text) <= max_tokens - fixed)
        arr, repeats, truncated = arr[keep], repeats[keep], True
    body = np.repeat(arr, repeats)
    out = np.concatenate([np.asarray(prefix, np.int64), body, np.asarray(suffix, np.int64)])
    return torch.from_numpy(out), truncated
