"""`eg2 embed`: embed a few inputs in-process, for smoke use. An argument naming an existing image,
audio or video file is read as that medium (by extension); anything else is text.

With segments (`--segment-seconds`, `--segment-tokens`), `--json` writes one line per span
(`{"input", "start", "end", "tokens", "embedding"}`) as the spans are embedded, then the item's own line;
spans go to the engine in batches of SEGMENT_BATCH, decoded as they are needed."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from eg2_runtime.api import PreparedItem, matryoshka
from eg2_runtime.engine import Engine
from eg2_runtime.errors import EG2Error
from eg2_runtime.inputs import Item, MediaKind, MediaPart, PrepareOptions, Segments, TextPart, resolve_prompt

KINDS: dict[str, MediaKind] = {
    **dict.fromkeys(("png", "jpg", "jpeg", "webp", "gif", "bmp", "tif", "tiff"), "image"),
    **dict.fromkeys(("wav", "flac", "ogg", "mp3", "m4a"), "audio"),
    **dict.fromkeys(("mp4", "webm", "mov", "mkv"), "video"),
}


def to_item(arg: str) -> Item:
    path = Path(arg)
    kind = KINDS.get(path.suffix.lower().lstrip("."))
    if kind is not None and path.is_file():
        return Item((MediaPart(kind, path.read_bytes(), path.suffix.lstrip(".").lower()),))
    return Item((TextPart(arg),))


SEGMENT_BATCH = 16  # spans embedded per forward


def embed_cli(
    model_dir: Path,
    inputs: list[str],
    dimensions: int = 768,
    as_json: bool = False,
    device: str = "auto",
    segments: Segments | None = None,
) -> int:
    engine = Engine.from_dir(model_dir, device=device)
    options = PrepareOptions(prompt=resolve_prompt(engine.prompts, engine.default_prompt_name))
    status = 0
    for arg in inputs:
        item = replace(to_item(arg), segments=segments)
        try:
            if item.span_unit is not None:
                prepared = _segments(engine, item, options, arg, dimensions, as_json)
            else:
                prepared = engine.prepare(item, options)
            vector = matryoshka(engine.embed([prepared]), dimensions)[0]
        except EG2Error as e:
            print(f"{arg}: {e.message}", file=sys.stderr)
            status = 1
            continue
        if as_json:
            print(json.dumps({"input": arg, "tokens": prepared.num_tokens, "embedding": vector.tolist()}))
        else:
            head = " ".join(f"{x:+.4f}" for x in vector[:6])
            print(
                f"{item.modality:5} {prepared.num_tokens:5d} tok  [{head} ...] |v|={np.linalg.norm(vector):.3f}  {arg}"
            )
    return status


def _segments(
    engine: Engine, item: Item, options: PrepareOptions, arg: str, dimensions: int, as_json: bool
) -> PreparedItem:
    """Embed and print an item's spans as its stream gives them; returns the item itself, prepared."""
    stream = engine.prepare_segments(item, options)
    whole: PreparedItem | None = None
    pending: list[PreparedItem] = []

    def flush() -> None:
        vectors = matryoshka(engine.embed(pending), dimensions)
        for p, vector in zip(pending, vectors, strict=True):
            assert p.span is not None
            if as_json:
                line = {"input": arg, "start": p.span.start, "end": p.span.end, "tokens": p.num_tokens}
                print(json.dumps({**line, "embedding": vector.tolist()}))
            else:
                head = " ".join(f"{x:+.4f}" for x in vector[:6])
                print(f"  [{p.span.start:g}, {p.span.end:g}) {p.num_tokens:5d} tok  [{head} ...]  {arg}")
        pending.clear()

    try:
        while (step := stream.next()) is not None:
            for p in step:
                if p.span is None:
                    whole = p
                else:
                    pending.append(p)
            if len(pending) >= SEGMENT_BATCH:
                flush()
        if pending:
            flush()
    finally:
        stream.close()
    assert whole is not None
    return whole
