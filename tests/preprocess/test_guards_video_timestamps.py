"""Video with the processor's `add_timestamps` on: each frame preceded by its "mm:ss " time, frames
joined by spaces, as transformers' EmbeddingGemma2 processor renders them. Checked end to end (bytes
-> Engine.prepare_many -> one Engine.embed) against transformers + sentence-transformers on the same
checkpoint with the flag on, FP32 on the CPU, within 1e-5, for clips at a whole and at a fractional
frame rate (29.97 fps: sampled frames land just before whole seconds, and the time is rounded).
"""

from __future__ import annotations

import json
import shutil
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from eg2_runtime.engine import Engine, PreparedItem
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions
from tests.support import media
from tests.support.reference import load_reference

TOL = 1e-5

pytestmark = pytest.mark.slow

CLIPS = {
    "3 s at 10 fps": media.encode_video(3, 10, size=(64, 96)),
    "10 s at 29.97 fps": media.encode_video(10, Fraction(30_000, 1001), size=(64, 96)),
    "70 s at 2 fps (past a minute, thinned to 32 frames)": media.encode_video(70, 2, size=(32, 48)),
}


@pytest.fixture(scope="module")
def timestamped(tiny_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with the video processor's add_timestamps turned on."""
    model_dir = tmp_path_factory.mktemp("tiny-timestamps") / "model"
    shutil.copytree(tiny_fp32, model_dir)
    path = model_dir / "processor_config.json"
    config = json.loads(path.read_text())
    config["video_processor"]["add_timestamps"] = True
    path.write_text(json.dumps(config, indent=2))
    return model_dir


def test_timestamped_video_embeds_like_the_reference(timestamped: Path) -> None:
    engine = Engine.from_dir(timestamped, device="cpu")
    reference = load_reference(timestamped, dtype=torch.float32)
    prepared = engine.prepare_many(
        [Item((MediaPart("video", data),)) for data in CLIPS.values()], PrepareOptions()
    )
    assert all(isinstance(p, PreparedItem) for p in prepared), prepared
    got = engine.embed(prepared)  # type: ignore[arg-type]  # checked above
    report = []
    for (name, data), row in zip(CLIPS.items(), got, strict=True):
        frames, fps = media.all_frames(data)
        expected = reference.encode([{"video": frames, "fps": fps}])[0]
        report.append((name, float(np.abs(row - expected).max())))
    lines = "\n".join(f"  {n}: max abs diff {d:.2e}" for n, d in report)
    assert max(d for _, d in report) <= TOL, f"timestamped video vs reference ({TOL:.0e}):\n{lines}"


def test_timestamps_reach_the_token_ids(timestamped: Path, tiny_fp32: Path) -> None:
    """The flag changes the layout: the same clip tokenizes longer with the times written in."""
    data = CLIPS["3 s at 10 fps"]
    item, options = Item((MediaPart("video", data),)), PrepareOptions()
    (plain,) = Engine.from_dir(tiny_fp32, device="cpu").prepare_many([item], options)
    (timed,) = Engine.from_dir(timestamped, device="cpu").prepare_many([item], options)
    assert isinstance(plain, PreparedItem) and isinstance(timed, PreparedItem)
    # Three frames: "00:00 " + "00:01 " + "00:02 " = 18 characters, and 2 joining spaces.
    assert timed.num_tokens - plain.num_tokens == 20, (plain.num_tokens, timed.num_tokens)
