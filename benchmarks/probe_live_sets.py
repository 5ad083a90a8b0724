"""Probe (GPU): what one eager step holds at its allocator peak, by the eg2_runtime line that
allocated it: the long packed text forward, and the towers' padded graph steps.

    python -m benchmarks.probe_live_sets --out DIR [--checkpoint w4|bf16]

Each step runs once untraced, then once with the caching allocator's history recorded
(torch.cuda.memory._record_memory_history); the trace is replayed to its peak (probe_boot.peak_live_set).
A graph captured from the same step holds the same tensors, so the tower rows are also what a bucket
of that shape adds to the graph pool. Writes live_sets.json into DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.probe_boot import peak_live_set
from benchmarks.workloads import CHECKPOINT_KINDS, full_checkpoint
from eg2_runtime.engine import Engine, EngineOptions
from eg2_runtime.memory_plan import MIB
from eg2_runtime.packing import Packing
from eg2_runtime.text import MLP_ROWS
from eg2_runtime.tower_graphs import GraphedTowers

UNBOUNDED = 1 << 40


def traced(fn: Callable[[], object]) -> dict[str, Any]:
    """The live set at `fn`'s allocator peak, and that peak above what was allocated before."""
    fn()  # kernels chosen, workspaces made, outside the trace
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    try:
        fn()
        torch.cuda.synchronize()
        live = peak_live_set(torch.cuda.memory._snapshot())
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return {"allocator_peak_mib": (torch.cuda.max_memory_allocated() - before) / MIB, **live}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint", choices=CHECKPOINT_KINDS, default="w4")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    options = EngineOptions(gpu_memory_budget=UNBOUNDED, graph_max_tokens=0)
    engine = Engine.from_dir(full_checkpoint(args.checkpoint), device="cuda", options=options)
    model, lm = engine.model, engine.model.language_model
    towers = GraphedTowers(model, vision_slots=UNBOUNDED, audio_tokens=UNBOUNDED, tower_slots=UNBOUNDED)
    around = towers.unpacker.capturing if towers.unpacker is not None else contextlib.nullcontext
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for n in (8192, 4096):
            x = torch.randn(n, lm.cfg.hidden_size, dtype=model.dtype, device="cuda")
            packing = Packing.from_lengths([n], "cuda")
            out[f"text 1x{n}"] = traced(
                lambda x=x, p=packing: p.pool(lm.forward_packed(x, p, mlp_rows=MLP_ROWS).float())  # type: ignore[misc]
            )
            print(f"text 1x{n}", json.dumps(out[f"text 1x{n}"]), flush=True)
        for n, s in ((1, 2520), (4, 2520)):
            assert model.vision_tower is not None
            channels = 3 * model.vision_tower.cfg.patch_size**2
            pixels = torch.zeros(n, s, channels, dtype=torch.uint8, device="cuda")
            positions = torch.full((n, s, 2), -1, dtype=torch.long, device="cuda")

            def image(p: torch.Tensor = pixels, q: torch.Tensor = positions) -> object:
                with around():
                    return towers._image_step(p, q)

            out[f"image {n}x{s}"] = traced(image)
            print(f"image {n}x{s}", json.dumps(out[f"image {n}x{s}"]), flush=True)
        for n, f in ((1, 1024), (8, 1024), (16, 1024), (4, 3072)):
            assert model.audio_tower is not None
            bins = model.audio_tower.cfg.subsampling_conv_channels[0]  # as tower_graphs sizes them
            feats = torch.zeros(n, f, bins, dtype=model.dtype, device="cuda")
            mask = torch.zeros(n, f, dtype=torch.bool, device="cuda")

            def clip(x: torch.Tensor = feats, m: torch.Tensor = mask) -> object:
                with around():
                    return towers._audio_step(x, m)

            out[f"audio {n}x{f}"] = traced(clip)
            print(f"audio {n}x{f}", json.dumps(out[f"audio {n}x{f}"]), flush=True)
    (args.out / "live_sets.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
