"""Probe (GPU): the activation costs the memory plan uses, measured on the engine's own paths.

    python -m benchmarks.probe_costs --model W4_DIR --out DIR

For each shape: the allocator's peak above what was allocated before (eager forwards), and the
reserved memory a fresh CUDA graph pool takes to capture one bucket (graphs), per token or per patch
slot. memory_plan.ActivationCosts is checked against these (tests/runtime/test_memory_plan.py cites them).
Writes costs.json into DIR.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from eg2_runtime.engine import Engine, EngineOptions
from eg2_runtime.graphs import GraphedTextEncoder, GraphPool
from eg2_runtime.model import pool as mean_pool
from eg2_runtime.packed_graphs import PackedTextGraphs
from eg2_runtime.packing import Packing
from eg2_runtime.text import MLP_ROWS
from eg2_runtime.tower_graphs import GraphedTowers

UNBOUNDED = 1 << 40


def eager_peak(fn: Callable[[], object]) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


ALLOCATED_GROWTH: list[int] = []  # what each capture left counted as allocated


def pool_growth(capture: Callable[[GraphPool], object]) -> int:
    """Reserved growth of a fresh graph pool capturing one bucket (its warm-up's cache emptied).
    `capture` returns what holds the graph: the pool's blocks are measured while it lives (a graph
    dropped before the reading gave its pool back, and every growth read 0)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    held = capture(GraphPool(None))  # a fresh pool of its own, unbounded
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    ALLOCATED_GROWTH.append(torch.cuda.memory_allocated() - allocated)
    growth = torch.cuda.memory_reserved() - before
    del held
    return growth


def packed_costs(lm: Any, h: int, dt: torch.dtype) -> tuple[dict[str, Any], dict[str, Any]]:
    """The packed text path as served (packed_graphs.py): the eager peak of one forward per layout,
    with the MLP in chunks of MLP_ROWS and whole (mlp_rows past the batch); the growth of a fresh
    pool capturing one token bucket."""
    eager: dict[str, Any] = {}
    layouts = {"1x8192": [8192], "1x4096": [4096], "1x2200": [2200], "64x64": [64] * 64}

    def forward(x: torch.Tensor, packing: Packing, rows: int) -> torch.Tensor:
        return packing.pool(lm.forward_packed(x, packing, mlp_rows=rows).float())

    for name, lengths in layouts.items():
        n = sum(lengths)
        x = torch.randn(n, h, dtype=dt, device="cuda")
        packing = Packing.from_lengths(lengths, "cuda")
        for rows, label in ((MLP_ROWS, "mlp_rows"), (UNBOUNDED, "mlp_whole")):
            peak = eager_peak(functools.partial(forward, x, packing, rows))
            eager.setdefault(name, {})[label] = {"bytes": peak, "per_token": peak // n}
    graph: dict[str, Any] = {}
    for n in (512, 1024, 2048, 4096, 8192):
        growth = pool_growth(lambda p, n=n: PackedTextGraphs(lm, n, pool=p)._capture(n))  # type: ignore[misc]
        graph[str(n)] = {"bytes": growth, "per_token": growth // n}
    return eager, graph


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    options = EngineOptions(gpu_memory_budget=UNBOUNDED, graph_max_tokens=0)
    engine = Engine.from_dir(args.model, device="cuda", options=options)
    model, lm = engine.model, engine.model.language_model
    h, dt = lm.cfg.hidden_size, model.dtype
    out: dict[str, Any] = {"text_eager": {}, "text_graph": {}, "vision": {}, "audio": {}}

    with torch.inference_mode():
        for b, t in [(1, 8192), (1, 2200), (4, 2048), (16, 512), (64, 64), (64, 16)]:
            x = torch.randn(b, t, h, dtype=dt, device="cuda")
            valid = torch.ones(b, t, dtype=torch.bool, device="cuda")
            peak = eager_peak(lambda x=x, v=valid: mean_pool(lm(x, v, lean=True).float(), v))  # type: ignore[misc]
            out["text_eager"][f"{b}x{t}"] = {"bytes": peak, "per_token": peak // (b * t)}
            del x, valid
        for b, t in [(64, 64), (16, 512), (8, 64), (1, 512), (1, 4096), (4, 1024), (32, 64)]:
            growth = pool_growth(lambda p, b=b, t=t: GraphedTextEncoder(lm, b * t, pool=p)._capture((b, t)))  # type: ignore[misc]
            out["text_graph"][f"{b}x{t}"] = {"bytes": growth, "per_token": growth // (b * t)}
        print(json.dumps(out["text_eager"]), json.dumps(out["text_graph"]), flush=True)
        out["packed_eager"], out["packed_graph"] = packed_costs(lm, h, dt)
        print(json.dumps(out["packed_eager"]), json.dumps(out["packed_graph"]), flush=True)

        towers = lambda p: GraphedTowers(  # noqa: E731
            model, vision_slots=UNBOUNDED, audio_tokens=UNBOUNDED, tower_slots=UNBOUNDED, pool=p
        )
        for n, s in [(1, 2520), (4, 2520), (1, 10080), (16, 630), (32, 630)]:
            pixels = torch.randint(0, 255, (n, s, 768), dtype=torch.uint8, device="cuda")
            side = int((s // 9) ** 0.5) * 3
            positions = torch.full((n, s, 2), -1, dtype=torch.long, device="cuda")
            grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), -1)
            positions[:, : side * side] = grid.reshape(-1, 2).cuda()
            peak = eager_peak(lambda p=pixels, q=positions: model.image_soft_tokens(p, q))  # type: ignore[misc]

            def image(pl: GraphPool, p: torch.Tensor = pixels, q: torch.Tensor = positions) -> GraphedTowers:
                held = towers(pl)
                held.image_soft_tokens(p, q)  # captures its bucket, which `held` keeps
                return held

            growth = pool_growth(image)
            out["vision"][f"{n}x{s}"] = {
                "eager_bytes": peak,
                "eager_per_slot": peak // (n * s),
                "graph_bytes": growth,
                "graph_per_slot": growth // (n * s),
            }
        for n, f in [(1, 3072), (4, 1024), (16, 1024), (1, 1024)]:
            feats = torch.randn(n, f, 128, dtype=dt, device="cuda")
            mask = torch.ones(n, f, dtype=torch.bool, device="cuda")
            peak = eager_peak(lambda x=feats, m=mask: model.audio_soft_tokens(x, m))  # type: ignore[misc]

            def clip(pl: GraphPool, x: torch.Tensor = feats, m: torch.Tensor = mask) -> GraphedTowers:
                held = towers(pl)
                held.audio_soft_tokens(x, m)  # captures its bucket, which `held` keeps
                return held

            growth = pool_growth(clip)
            tokens = n * f // 4
            out["audio"][f"{n}x{f}"] = {
                "eager_bytes": peak,
                "eager_per_token": peak // tokens,
                "graph_bytes": growth,
                "graph_per_token": growth // tokens,
            }
    print(json.dumps(out["vision"]), json.dumps(out["audio"]), flush=True)
    out["allocated_growth_per_capture"] = ALLOCATED_GROWTH
    (args.out / "costs.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
