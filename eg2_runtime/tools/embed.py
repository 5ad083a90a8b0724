"""`eg2 embed`: embed a few inputs in-process, for smoke use. An argument naming an existing image,
audio or video file is read as that medium (by extension); anything else is text."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from eg2_runtime.api import matryoshka
from eg2_runtime.engine import Engine
from eg2_runtime.errors import EG2Error
from eg2_runtime.inputs import Item, MediaKind, MediaPart, PrepareOptions, TextPart, resolve_prompt

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


def embed_cli(
    model_dir: Path, inputs: list[str], dimensions: int = 768, as_json: bool = False, device: str = "auto"
) -> int:
    engine = Engine.from_dir(model_dir, device=device)
    options = PrepareOptions(prompt=resolve_prompt(engine.prompts, engine.default_prompt_name))
    status = 0
    for arg in inputs:
        item = to_item(arg)
        try:
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
