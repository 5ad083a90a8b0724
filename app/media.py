"""Request items -> runtime Items: decode data: URIs, refuse (or, when enabled, fetch) URLs and paths.

Only transport encodings are undone here (base64, data: URIs, downloads); the media bytes themselves
are decoded by the runtime (Engine.prepare), which sniffs them, so the MIME subtype is only a hint.
A data URI whose MIME type names another kind of media (a video in image_url) is refused here.
"""

from __future__ import annotations

import asyncio
import binascii
from pathlib import Path
from typing import cast
from urllib.parse import unquote, urlsplit

import pybase64

from app.errors import clip
from app.schemas import AudioPartIn, ImagePartIn, InputRequest, PartIn, TextPartIn, VideoPartIn
from app.settings import Settings
from eg2_runtime.errors import InputError, InputTooLargeError, MediaDecodeError, ModalityNotLoadedError
from eg2_runtime.inputs import Item, MediaKind, MediaPart, Part, TextPart

# MIME subtype (as clients send it) -> the format hint the runtime gets.
IMAGE_TYPES = {
    "png": "png",
    "jpeg": "jpeg",
    "jpg": "jpeg",
    "pjpeg": "jpeg",
    "webp": "webp",
    "gif": "gif",
    "bmp": "bmp",
    "x-ms-bmp": "bmp",
    "tiff": "tiff",
}
VIDEO_TYPES = {
    "mp4": "mp4",
    "webm": "webm",
    "quicktime": "mov",
    "mov": "mov",
    "x-matroska": "mkv",
    "matroska": "mkv",
    "mkv": "mkv",
}
AUDIO_FORMATS = {"wav", "flac", "ogg", "mp3", "m4a", "webm"}


def _b64(data: str, param: str) -> bytes:
    # pybase64 (SIMD) with the standard library's strict checks: a payload decodes on the event loop,
    # where the standard library's byte-at-a-time loop held it for milliseconds (docs/PERF.md).
    try:
        raw = pybase64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise MediaDecodeError("media payload is not valid base64", param=param) from None
    if not raw:
        raise MediaDecodeError("empty media payload", param=param)
    return raw


def parse_data_uri(url: str, kind: MediaKind, param: str) -> tuple[bytes, str]:
    """`data:image/png;base64,...` -> (bytes, format hint). Wrong MIME or bad base64 -> 400.

    The scheme, the MIME type and the `base64` token are case-insensitive (RFC 2397, RFC 2045)."""
    header, comma, payload = url.partition(",")
    if not comma:
        raise MediaDecodeError("malformed data URI: no ',' before the payload", param=param)
    scheme, _, header = header.partition(":")
    if scheme.strip().lower() != "data":
        raise MediaDecodeError("expected a data: URI", param=param)
    mime, *params = header.split(";")
    if "base64" not in (p.strip().lower() for p in params):
        raise MediaDecodeError("data URIs must be base64-encoded (data:<mime>;base64,...)", param=param)
    major, _, subtype = mime.strip().lower().partition("/")
    table = IMAGE_TYPES if kind == "image" else VIDEO_TYPES
    if major != kind or subtype not in table:
        allowed = ", ".join(sorted({f"{kind}/{s}" for s in table}))
        raise MediaDecodeError(
            f"expected a {kind} data URI ({allowed}), got {clip(mime.strip()) or 'no type'}", param=param
        )
    return _b64(payload, param), table[subtype]


class MediaResolver:
    """Turns a request's parts into runtime Parts, under the server's settings."""

    def __init__(self, settings: Settings, modalities: frozenset[str]) -> None:
        self._settings = settings
        self._modalities = modalities
        self._media_dir = settings.media_dir.resolve() if settings.media_dir else None

    async def items(self, request: InputRequest) -> list[Item]:
        """The request's items; `segments` set on those sent alone (a string or a single part).

        A request of plain strings takes a fast path: the Items `items_by_part`, its reference, gives.
        """
        strings = self._strings(request)
        if strings is not None:
            spec = request.segments.spec() if request.segments is not None else None
            return [Item((TextPart(text),), spec) for text in strings]
        return await self.items_by_part(request)

    def _strings(self, request: InputRequest) -> list[str] | None:
        """The input when it is a string or an array of strings, None otherwise. Each is an item of one
        text part, sent alone: within whatever limits `check_counts` holds it to (one part, no media)."""
        s, value = self._settings, request.input
        if s.max_item_parts < 1 or s.max_request_media < 0:  # outside Settings' bounds: check_counts decides
            return None
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(type(x) is str for x in value):
            return cast("list[str]", value)
        return None

    async def items_by_part(self, request: InputRequest) -> list[Item]:
        """`items` for any request, part by part: the limits checked, each part resolved on its own."""
        self.check_counts(request)
        spec = request.segments.spec() if request.segments is not None else None
        items = []
        for param, parts, alone in request.items():
            resolved = [
                await self._part(part, f"{param}[{j}]" if param.endswith(("content", "messages")) else param)
                for j, part in enumerate(parts)
            ]
            items.append(Item(parts=tuple(resolved), segments=spec if alone else None))
        return items

    def check_counts(self, request: InputRequest) -> None:
        """413 for too many parts in one item or too many media in the request, before any payload is
        decoded (the limits: max_item_parts, max_request_media)."""
        s = self._settings
        media = 0
        for param, parts, _ in request.items():
            if len(parts) > s.max_item_parts:
                raise InputTooLargeError(
                    f"{len(parts)} parts in one item, more than this server's limit of {s.max_item_parts} "
                    "(max_item_parts)",
                    param=param,
                )
            media += sum(isinstance(p, ImagePartIn | AudioPartIn | VideoPartIn) for p in parts)
        if media > s.max_request_media:
            raise InputTooLargeError(
                f"{media} images, audio clips and videos in one request, more than this server's limit of "
                f"{s.max_request_media} (max_request_media); send them in several requests",
                param="input",
            )

    async def _part(self, part: str | PartIn, param: str) -> Part:
        if isinstance(part, str):
            return TextPart(part)
        if isinstance(part, TextPartIn):
            return TextPart(part.text)
        if isinstance(part, AudioPartIn):
            self._check_loaded("audio", param)
            audio_format = part.input_audio.format.strip().lower()
            if audio_format not in AUDIO_FORMATS:
                raise MediaDecodeError(
                    f"audio format must be one of {', '.join(sorted(AUDIO_FORMATS))}, got {clip(audio_format)!r}",
                    param=f"{param}.input_audio.format",
                )
            return MediaPart("audio", _b64(part.input_audio.data, f"{param}.input_audio.data"), audio_format)
        kind: MediaKind
        if isinstance(part, ImagePartIn):
            kind, url, url_param = "image", part.image_url.url, f"{param}.image_url.url"
        else:
            assert isinstance(part, VideoPartIn)
            kind, url, url_param = "video", part.video_url.url, f"{param}.video_url.url"
        self._check_loaded(kind, param)
        data, fmt = await self._fetch(url, kind, url_param)
        return MediaPart(kind, data, fmt)

    def _check_loaded(self, kind: MediaKind, param: str) -> None:
        if kind not in self._modalities:
            loaded = ", ".join(sorted(self._modalities))
            raise ModalityNotLoadedError(
                f"{kind} input needs the {kind} tower, which this server did not load (loaded: {loaded})",
                param=param,
            )

    async def _fetch(self, url: str, kind: MediaKind, param: str) -> tuple[bytes, str | None]:
        colon = url.find(":", 0, 12)
        scheme = url[:colon].lower() if colon > 0 else ""
        if scheme == "data":
            return parse_data_uri(url, kind, param)
        if scheme in ("http", "https"):
            if not self._settings.allow_remote_urls:
                raise InputError(
                    "remote URLs are disabled on this server; send the media inline as a data: URI",
                    param=param,
                )
            return await self._download(url, param), None
        if scheme == "file" or url.startswith("/"):
            return await self._read_file(url, param), None
        raise InputError("expected a data: URI", param=param)

    async def _download(self, url: str, param: str) -> bytes:
        import httpx  # only needed when an operator enables remote URLs

        limit = self._settings.max_request_bytes
        try:
            async with (
                httpx.AsyncClient(timeout=self._settings.remote_timeout_s, follow_redirects=False) as client,
                client.stream("GET", url) as response,
            ):
                if response.status_code != 200:
                    raise InputError(f"fetching the URL gave HTTP {response.status_code}", param=param)
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > limit:
                        raise InputTooLargeError(f"remote media over {limit} bytes", param=param)
                    chunks.append(chunk)
        except httpx.HTTPError as exc:
            raise InputError(f"could not fetch the URL ({type(exc).__name__})", param=param) from None
        return b"".join(chunks)

    async def _read_file(self, url: str, param: str) -> bytes:
        if self._media_dir is None:
            raise InputError(
                "file paths are disabled on this server; send the media inline as a data: URI", param=param
            )
        path = Path(unquote(urlsplit(url).path) if url.startswith("file:") else url).resolve()
        if not path.is_relative_to(self._media_dir) or not path.is_file():
            # One message for "outside" and "missing": do not reveal what exists outside the media dir.
            raise InputError("no such file in the server's media directory", param=param)
        limit = self._settings.max_request_bytes
        if path.stat().st_size > limit:
            raise InputTooLargeError(f"media file over {limit} bytes", param=param)
        return await asyncio.to_thread(path.read_bytes)
