"""The /v1/embeddings request and response: shapes and field rules, nothing decoded yet.

An item is a string, one content part (`text`, `image_url`, `input_audio`, `video_url`), or
`{"content": [parts]}` for one embedding of interleaved parts; the vLLM `messages` form stands in for
`input` and gives one embedding. The item's shape is chosen by a discriminator on its keys, so an error
names the one shape the client meant instead of listing every union member. Media payloads stay
strings here; app/media.py decodes them into runtime Items.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Self, TypeVar

import numpy as np
import orjson
import pybase64
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from eg2_runtime.api import EmbeddingType, quantize
from eg2_runtime.errors import InputError, InputTooLargeError
from eg2_runtime.inputs import (
    IMAGE_TOKEN_BUDGETS,
    MATRYOSHKA_DIMS,
    SEGMENT_SECONDS,
    SEGMENT_TOKENS,
    Segments,
)

# strict: a value of the wrong JSON type is refused, not coerced (OpenAI's API refuses "dimensions": "256";
# lax pydantic would read it as 256, "false" as a bool, 256.0 as an int). Numbers must be finite: pydantic's
# JSON parser reads NaN, Infinity and 1e999, which a bound check would refuse as out of range.
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextPartIn(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    model_config = _STRICT
    url: str = Field(
        description="data:image/<png|jpeg|webp|gif|bmp|tiff>;base64,... (remote URLs if enabled)"
    )
    detail: str | None = Field(
        None, description="Accepted for OpenAI compatibility; use image_tokens instead."
    )


class ImagePartIn(BaseModel):
    model_config = _STRICT
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(BaseModel):
    model_config = _STRICT
    data: str = Field(description="base64 of the audio file")
    format: str = Field(description="wav, flac, ogg, mp3, m4a or webm")


class AudioPartIn(BaseModel):
    model_config = _STRICT
    type: Literal["input_audio"]
    input_audio: InputAudio


class VideoUrl(BaseModel):
    model_config = _STRICT
    url: str = Field(
        description="data:video/<mp4|webm|quicktime|x-matroska>;base64,... (remote URLs if enabled)"
    )


class VideoPartIn(BaseModel):
    model_config = _STRICT
    type: Literal["video_url"]
    video_url: VideoUrl


PartIn = TextPartIn | ImagePartIn | AudioPartIn | VideoPartIn
_PART_TAGS = {"text", "image_url", "input_audio", "video_url"}

# Union members are picked by a discriminator on the value's shape, so an error names the one shape
# the client meant. Tags are in angle brackets: pydantic puts them in error locations, and
# errors.py drops bracketed names from the `param` it reports.


def _part_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        tag = value.get("type")
        return f"<{tag}>" if isinstance(tag, str) and tag in _PART_TAGS else None
    if isinstance(value, BaseModel):
        return f"<{getattr(value, 'type', '')}>"
    return None


def _item_tag(value: Any) -> str | None:
    if isinstance(value, str):
        return "<string>"
    if isinstance(value, ContentItemIn) or (isinstance(value, dict) and "content" in value):
        return "<content>"
    return _part_tag(value)


def _string_or_list_tag(value: Any) -> str | None:
    if isinstance(value, str):
        return "<string>"
    return "<array>" if isinstance(value, list) else None


Part = Annotated[
    Annotated[TextPartIn, Tag("<text>")]
    | Annotated[ImagePartIn, Tag("<image_url>")]
    | Annotated[AudioPartIn, Tag("<input_audio>")]
    | Annotated[VideoPartIn, Tag("<video_url>")],
    Discriminator(
        _part_tag,
        custom_error_type="invalid_part",
        custom_error_message="a part is {type: text | image_url | input_audio | video_url, ...}",
    ),
]


class ContentItemIn(BaseModel):
    """One embedding of several parts, in order (interleaved text and media)."""

    model_config = _STRICT
    content: list[Part] = Field(min_length=1)


ItemIn = Annotated[
    Annotated[str, Tag("<string>")]
    | Annotated[TextPartIn, Tag("<text>")]
    | Annotated[ImagePartIn, Tag("<image_url>")]
    | Annotated[AudioPartIn, Tag("<input_audio>")]
    | Annotated[VideoPartIn, Tag("<video_url>")]
    | Annotated[ContentItemIn, Tag("<content>")],
    Discriminator(
        _item_tag,
        custom_error_type="invalid_item",
        custom_error_message="an item is a string, a part {type: text | image_url | input_audio | video_url, "
        "...}, or {content: [parts]}",
    ),
]

InputIn = Annotated[
    Annotated[str, Tag("<string>")] | Annotated[list[ItemIn], Tag("<array>")],
    Discriminator(
        _string_or_list_tag,
        custom_error_type="invalid_input",
        custom_error_message="input is a string or an array of items",
    ),
]

MessageContent = Annotated[
    Annotated[str, Tag("<string>")] | Annotated[list[Part], Tag("<array>")],
    Discriminator(
        _string_or_list_tag,
        custom_error_type="invalid_content",
        custom_error_message="content is a string or an array of parts",
    ),
]


class Message(BaseModel):
    """The vLLM chat form; roles are accepted and ignored, contents are concatenated in order."""

    model_config = _STRICT
    role: Literal["system", "user", "assistant"] = "user"
    content: MessageContent


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _looks_like_token_ids(value: Any) -> bool:
    if not isinstance(value, list) or not value:
        return False
    return all(_is_int(v) for v in value) or all(
        isinstance(v, list) and v and all(_is_int(t) for t in v) for v in value
    )


class SegmentsIn(BaseModel):
    """One more vector per span of each long item: `seconds` for audio and video, `tokens` for text."""

    model_config = _STRICT
    seconds: float | None = Field(
        None,
        ge=SEGMENT_SECONDS[0],
        le=SEGMENT_SECONDS[1],
        description="Span length of audio and video items, in seconds.",
    )
    tokens: int | None = Field(
        None,
        ge=SEGMENT_TOKENS[0],
        le=SEGMENT_TOKENS[1],
        description="Most text tokens in a span of a text item.",
    )
    overlap: float = Field(0.0, ge=0.0, lt=0.5, description="Share of a span repeated in the next one.")

    @model_validator(mode="after")
    def _some_unit(self) -> SegmentsIn:
        if self.seconds is None and self.tokens is None:
            raise ValueError("segments needs seconds (audio, video), tokens (text), or both")
        return self

    def spec(self) -> Segments:
        return Segments(seconds=self.seconds, tokens=self.tokens, overlap=self.overlap)


class InputRequest(BaseModel):
    """The fields that say what to embed and how to prepare it: /v1/embeddings and /tokenize alike."""

    model_config = ConfigDict(**_STRICT, json_schema_extra={"examples": [{"model": "eg2", "input": "hi"}]})

    model: str | None = Field(None, description="The served name or an alias; another name gets 404.")
    input: InputIn | None = Field(
        None, description="A string, or an array of items: one embedding per item, in order."
    )
    messages: list[Message] | None = Field(
        None, min_length=1, description="vLLM form, instead of input: all contents give one embedding."
    )
    prompt_name: str | None = Field(
        None, description="A prompt of the model's config (e.g. query, document)."
    )
    prompt: str | None = Field(None, description="A literal prefix; exclusive with prompt_name.")
    truncate: bool = Field(True, description="Cut over-long text (8192 tokens) and audio (30 s); false: 400.")
    image_tokens: int = Field(280, description="Soft tokens per image: 70, 140, 280, 560 or 1120.")
    segments: SegmentsIn | None = Field(
        None,
        description="Also a vector per span of each text, audio or video item sent alone (not in content).",
    )

    @field_validator("input", mode="before")
    @classmethod
    def _refuse_token_ids_and_floods(cls, value: Any, info: ValidationInfo) -> Any:
        # Raised as runtime errors, not ValueError, so they keep their own status (400 with a hint, 413).
        if _looks_like_token_ids(value):
            raise InputError(
                "token-id input is not supported: ids from another tokenizer would embed garbage; "
                "send the text instead",
                param="input",
            )
        limit = (info.context or {}).get("max_items")
        if isinstance(value, list) and limit is not None and len(value) > limit:
            raise InputTooLargeError(f"too many items: {len(value)} > {limit} per request", param="input")
        if isinstance(value, list) and not value:
            raise InputError("input must not be an empty array", param="input")
        return value

    @field_validator("image_tokens")
    @classmethod
    def _image_budget(cls, value: int) -> int:
        if value not in IMAGE_TOKEN_BUDGETS:
            raise ValueError(
                f"image_tokens must be one of {', '.join(map(str, IMAGE_TOKEN_BUDGETS))}, got {value}"
            )
        return value

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        if (self.input is None) == (self.messages is None):
            raise InputError("give exactly one of input and messages", param="input")
        if self.prompt is not None and self.prompt_name is not None:
            raise InputError("give prompt or prompt_name, not both", param="prompt")
        return self

    def items(self) -> Iterator[tuple[str, list[str | PartIn], bool]]:
        """(param path, parts, alone) per embedding, in order; a plain string is one text part. `alone`:
        the item was sent as a string or a single part (not `content`, not `messages`), the items that
        `segments` applies to."""
        if self.messages is not None:
            parts: list[str | PartIn] = []
            for message in self.messages:
                parts.extend([message.content] if isinstance(message.content, str) else message.content)
            yield "messages", parts, False
            return
        if isinstance(self.input, str):
            yield "input", [self.input], True
            return
        for i, item in enumerate(self.input or ()):
            if isinstance(item, ContentItemIn):
                yield f"input[{i}].content", list(item.content), False
            else:
                yield f"input[{i}]", [item], True


class EmbeddingRequest(InputRequest):
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: the little-endian bytes of each vector, in its embedding_type."
    )
    dimensions: int | None = Field(
        None, description=f"Matryoshka size, one of {', '.join(map(str, MATRYOSHKA_DIMS))}; renormalized."
    )
    embedding_type: EmbeddingType = Field(
        "float",
        description="float, float16, int8 (with a per-row scale), binary or ubinary (bits of v > 0, packed).",
    )
    user: str | None = Field(None, description="Accepted and ignored.")

    @field_validator("dimensions")
    @classmethod
    def _matryoshka(cls, value: int | None) -> int | None:
        if value is not None and value not in MATRYOSHKA_DIMS:
            allowed = ", ".join(map(str, sorted(MATRYOSHKA_DIMS)))
            raise ValueError(f"dimensions must be one of {allowed}, got {value}")
        return value


class TokenizeRequest(InputRequest):
    """POST /tokenize: the fields of an embeddings request that decide its tokens."""


R = TypeVar("R", bound=InputRequest)


def parse_request(body: bytes, *, max_items: int) -> EmbeddingRequest:
    """Validate a raw /v1/embeddings body (pydantic's parser: strict UTF-8, bounded nesting)."""
    return parse_body(body, EmbeddingRequest, max_items=max_items)


def parse_body(body: bytes, kind: type[R], *, max_items: int) -> R:
    """Validate a raw JSON body as `kind` (pydantic's parser: strict UTF-8, bounded nesting)."""
    return kind.model_validate_json(body, context={"max_items": max_items})


# --- Responses -----------------------------------------------------------------------------------


class SegmentData(BaseModel):
    start: int | float = Field(description="seconds (audio, video) or a character offset (text)")
    end: int | float
    embedding: list[float] | str
    scale: float | None = Field(None, description="int8 only: the row's value is embedding x scale")


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(
        description="numbers of the embedding_type (floats by default), or base64 of their little-endian bytes"
    )
    scale: float | None = Field(None, description="int8 only: the row's value is embedding x scale")
    segments: list[SegmentData] | None = Field(None, description="with `segments`: one per span, in order")


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[EmbeddingData]
    usage: Usage


class TokenizePart(BaseModel):
    type: Literal["image_url", "input_audio", "video_url"]
    tokens: int = Field(description="its soft tokens and markers")


class TokenizeSegment(BaseModel):
    start: int | float = Field(description="seconds (audio, video) or a character offset (text)")
    end: int | float
    tokens: int


class TokenizeData(BaseModel):
    index: int
    tokens: int = Field(
        description="what an embeddings request reports in usage for this item, segments included"
    )
    truncated: bool = Field(description="text was cut at the model's context, or audio at 30 s")
    ids: list[int] | None = Field(None, description="text items: the model's input ids, BOS and EOS included")
    parts: list[TokenizePart] | None = Field(None, description="items with media: each media part's tokens")
    segments: list[TokenizeSegment] | None = Field(None, description="with `segments`: each span's tokens")


class TokenizeResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[TokenizeData]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


@dataclass(frozen=True)
class SegmentRows:
    """One item's segments for the response: each span's (start, end) and its (S, D) unit rows."""

    bounds: list[tuple[float, float]]
    vectors: np.ndarray


def encode_embeddings(
    vectors: np.ndarray,
    *,
    encoding_format: str,
    model: str,
    num_tokens: int,
    embedding_type: EmbeddingType = "float",
    segments: dict[int, SegmentRows] | None = None,
) -> bytes:
    """The response body, built directly: (N, D) float32 unit rows (and each item's segment rows) ->
    `embedding_type` (eg2_runtime.api.quantize) -> JSON numbers or base64 of the type's little-endian
    bytes; int8 rows carry their `scale`.

    Floats are written by orjson, each as the shortest decimal that reads back to the same float32 (as
    TEI's serde_json writes f32): parsed as float32, they are exactly the vector base64 carries. The
    stdlib's json wrote each float32 widened to a double: 32 x 768 floats took 9.8 ms of the event
    loop (0.47 ms now) and 1.7x the bytes (benchmarks/encode_embeddings.py).
    """
    segments = segments or {}
    data: list[dict[str, Any]] = []
    for i, row in enumerate(_encoded_rows(vectors, encoding_format, embedding_type)):
        entry = {"object": "embedding", "index": i, **row}
        if i in segments:
            seg = segments[i]
            rows = _encoded_rows(seg.vectors, encoding_format, embedding_type)
            entry["segments"] = [
                {"start": start, "end": end, **r} for (start, end), r in zip(seg.bounds, rows, strict=True)
            ]
        data.append(entry)
    body = {
        "object": "list",
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def base64_rows(rows: np.ndarray) -> list[str]:
    """(N, k) array -> each row's bytes in base64 (what `base64.b64encode(row.tobytes())` gives).

    pybase64 (SIMD) encodes many times faster than the standard library's byte-at-a-time loop
    (docs/PERF.md). A row of a multiple of 3 bytes encodes without padding, so the rows' bytes encoded
    in one call are their encodings end to end, cut every 4/3 of a row's bytes: one call instead of one
    a row, for the full 768-d float32 rows (3,072 bytes) and int8 / uint8 ones (768 bytes). Other
    widths (512-d float32: 2,048 bytes) end in padding, and encode a row at a time."""
    row_bytes = rows.shape[1] * rows.itemsize
    if rows.shape[0] < 2 or row_bytes % 3 or not row_bytes:
        return [pybase64.b64encode_as_string(row.tobytes()) for row in rows]
    text = pybase64.b64encode_as_string(np.ascontiguousarray(rows).tobytes())
    width = row_bytes // 3 * 4
    return [text[i : i + width] for i in range(0, len(text), width)]


def _encoded_rows(
    vectors: np.ndarray, encoding_format: str, embedding_type: EmbeddingType
) -> list[dict[str, Any]]:
    """(N, D) float32 rows -> per row {"embedding": ..., ["scale": ...]} in the type and encoding."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)  # (N, D), native order: what orjson reads
    if not np.isfinite(vectors).all():  # either encoding
        raise ValueError("an embedding holds NaN or infinity")  # a bug: 500, never a null in a vector
    values, scales = quantize(vectors, embedding_type)
    rows: list[Any]
    if encoding_format == "base64":
        little = values.astype(values.dtype.newbyteorder("<"), copy=False)  # little-endian on any host
        rows = base64_rows(little)
    else:
        rows = list(values)  # (D,) views: orjson writes numpy arrays itself
    if scales is None:
        return [{"embedding": row} for row in rows]
    return [{"embedding": row, "scale": float(scale)} for row, scale in zip(rows, scales, strict=True)]
