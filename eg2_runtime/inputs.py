"""What a client asks to embed, before any decoding: plain data, no tensors.

An `Item` is one embedding: an ordered tuple of parts (text and media, interleaved as the client
sent them), and optionally `Segments`: one more embedding per span of a single text, audio or video
part. The service builds Items from requests; `Engine.prepare` turns one into model inputs.
`MediaLimits` are the decoding limits the service hands the engine (built from its Settings).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from eg2_runtime.errors import InputError

MediaKind = Literal["image", "audio", "video"]
Modality = Literal["text", "image", "audio", "video", "mixed"]


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class MediaPart:
    kind: MediaKind
    data: bytes
    # A hint only: a MIME subtype ("png", "mp4") or an audio format ("wav"). Decoders sniff the bytes.
    format: str | None = None


Part = TextPart | MediaPart


SEGMENT_SECONDS = (2.0, 120.0)  # a span of audio or video: at least 2 s, at most 120 s
SEGMENT_TOKENS = (64, 8192)  # a span of text: at most the model's context


@dataclass(frozen=True)
class Segments:
    """Spans of one item to embed each on its own, as if the client had sent each span alone."""

    seconds: float | None = None  # audio and video items: span length in seconds
    tokens: int | None = None  # text items: at most this many text tokens per span
    overlap: float = 0.0  # share of a span repeated at the start of the next, in [0, 0.5)

    def __post_init__(self) -> None:
        if not 0.0 <= self.overlap < 0.5:
            raise InputError("segments.overlap must be at least 0 and below 0.5", param="segments.overlap")
        if self.seconds is not None and not SEGMENT_SECONDS[0] <= self.seconds <= SEGMENT_SECONDS[1]:
            lo, hi = SEGMENT_SECONDS
            raise InputError(f"segments.seconds must be within {lo:g}-{hi:g}", param="segments.seconds")
        if self.tokens is not None and not SEGMENT_TOKENS[0] <= self.tokens <= SEGMENT_TOKENS[1]:
            lo, hi = SEGMENT_TOKENS
            raise InputError(f"segments.tokens must be within {lo}-{hi}", param="segments.tokens")


@dataclass(frozen=True)
class Item:
    parts: tuple[Part, ...]
    # Spans to embed too. Applies to an item of one text part (`tokens`) or one audio or video part
    # (`seconds`); the service sets it only on items sent as a single string or part.
    segments: Segments | None = None

    @property
    def span_unit(self) -> float | int | None:
        """The span length that applies to this item (seconds or tokens), None when it has no spans."""
        if self.segments is None or len(self.parts) != 1:
            return None
        part = self.parts[0]
        if isinstance(part, TextPart):
            return self.segments.tokens
        return self.segments.seconds if part.kind in ("audio", "video") else None

    @property
    def modality(self) -> Modality:
        kinds = {"text" if isinstance(p, TextPart) else p.kind for p in self.parts}
        if len(kinds) == 1:
            return kinds.pop()  # type: ignore[return-value]
        # Text beside a single kind of media batches with that media: the text adds a few tokens.
        media = kinds - {"text"}
        return media.pop() if len(media) == 1 else "mixed"  # type: ignore[return-value]


@dataclass(frozen=True)
class PrepareOptions:
    prompt: str | None = None  # a literal prefix, already resolved from a prompt name
    truncate: bool = True  # cut over-long text / audio instead of refusing it
    image_tokens: int = 280  # soft-token budget per image: 70, 140, 280, 560 or 1120


def resolve_prompt(
    prompts: Mapping[str, str],
    default_name: str | None,
    prompt_name: str | None = None,
    prompt: str | None = None,
) -> str | None:
    """The literal prefix for a request, picked as sentence-transformers' `encode` picks it (6.2,
    `_resolve_prompt`): a literal prompt as given (`""`: no prompt at all); else the named prompt,
    which must exist; else the checkpoint's `default_prompt_name`, if it sets one. Both at once is
    refused (sentence-transformers warns and takes the literal one).

    The one rule for the service, the engine's preprocessor and the tools alike.
    """
    if prompt is not None and prompt_name is not None:
        raise InputError("give prompt or prompt_name, not both", param="prompt")
    if prompt is not None:
        return prompt
    if prompt_name is not None:
        if prompt_name not in prompts:
            # The name is not echoed: it is the client's, and may be megabytes long.
            known = ", ".join(sorted(prompts)) or "none"
            raise InputError(f"unknown prompt_name; this model has: {known}", param="prompt_name")
        return prompts[prompt_name]
    return prompts[default_name] if default_name is not None else None


IMAGE_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)
MATRYOSHKA_DIMS = (768, 512, 256, 128)


@dataclass(frozen=True)
class MediaLimits:
    """Limits on media, checked from headers and container metadata before the costly decode.

    No defaults here: the service builds one from its Settings (app/settings.py, where each value and
    its trade-off is documented). What the *model* can take (8192 tokens, 30 s of audio, 32 video
    frames) is fixed by the checkpoint and lives beside the code that enforces it, not here.
    """

    max_image_pixels: int  # decoded width x height of one image, from its header
    max_audio_channels: int
    min_audio_rate: int  # Hz
    max_audio_rate: int  # Hz
    max_audio_decode_samples: int  # channels x frames decoded (at most the first 30 s)
    max_video_seconds: float  # declared duration
    max_video_frame_pixels: int  # declared width x height of one frame
    max_video_frames: int  # declared frame count
    max_video_decode_pixels: int  # frame pixels x frames decoded to reach the last sampled frame
    # Items with segments: every frame and sample is decoded, and the model sees them span by span.
    max_segment_audio_seconds: float  # audio decoded whole, span by span
    max_segment_audio_decode_samples: int  # channels x every frame
    max_segment_video_seconds: float  # declared duration
    max_segment_video_decode_pixels: int  # frame pixels x every frame

    @classmethod
    def unbounded(cls) -> MediaLimits:
        """No limits: for tools and tests on trusted files. A server always passes its own."""
        n, inf = sys.maxsize, float("inf")
        return cls(n, n, 1, n, n, inf, n, n, n, inf, n, inf, n)

    def for_segments(self) -> MediaLimits:
        """The limits media with segments are checked against: a video's duration and decode cost and an
        audio's decode cost under the segment limits; a video's frame count bounded by those (frames
        stream through, a span at a time)."""
        return replace(
            self,
            max_audio_decode_samples=self.max_segment_audio_decode_samples,
            max_video_seconds=self.max_segment_video_seconds,
            max_video_frames=sys.maxsize,
            max_video_decode_pixels=self.max_segment_video_decode_pixels,
        )
