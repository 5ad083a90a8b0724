"""Probe (GPU): a finer item ladder for the tower buckets against the one they take (tower_graphs.ITEM_LADDER,
powers of two), in one engine.

    python -m benchmarks.probe_ladder --out DIR [--rounds 6] [--budget-mib N]
    python -m benchmarks.probe_ladder --out /tmp/pl --device cpu --size tiny --rounds 1   # dry run

Boots the hybrid-w4 engine on the full-size checkpoint as `eg2 serve` boots it (warm-up, start-up
graphs), prepares tower batches whose sizes the two ladders pad differently (3, 5 and 6 clips of
9.3 s, 3 images of 641x479), then times `Engine.embed` on each under either ladder: the module's
ladder is swapped in place (and put back), so both run in the same process, on the same pool and the
same host. Each ladder's buckets are captured first, untimed (the finer one's first); then --rounds
rounds of 5 embeds a batch, the ladders alternated and their order reversed each round. Both
ladders' buckets share the one graph pool, and a refusal is for good: a bucket refused to either
(`refused`, listed after each ladder's captures) makes its batches run in smaller buckets, which the
comparison then includes. `--budget-mib` gives the process (and so the pool) more room, where neither
should be refused. What the extra rungs cost a server (captures on first use, the pool they hold)
only the bench shows. The CPU dry run only runs the plumbing: a CPU engine has no graphs, so the
ladder changes nothing there.
Writes ladder.json into DIR (medians, every time, the graphs) and prints the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from app.service import GPU_BATCH_TOKENS
from app.settings import Settings
from benchmarks.inprocess import device_times_ms
from benchmarks.timing import Budget
from benchmarks.workloads import DEFAULT_CACHE, checkpoints
from eg2_runtime import samples, tower_graphs
from eg2_runtime.api import PreparedItem
from eg2_runtime.engine import Engine, EngineOptions
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions
from eg2_runtime.memory_plan import MIB

FINER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # a third of a bucket padded at most, not half
ROUND = Budget(seconds=0.0, warmup=0, min_rounds=5, max_rounds=5, cap_s=float("inf"))  # 5 embeds a batch


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", choices=("tiny", "full"), default="full")
    parser.add_argument("--budget-mib", type=int, default=None, help="the GPU memory budget [the default]")
    args = parser.parse_args()

    with checkpoints(None, DEFAULT_CACHE, args.size, print) as (_, w4):
        budget = args.budget_mib * MIB if args.budget_mib else None
        engine = Engine.from_dir(w4, device=args.device, options=EngineOptions(gpu_memory_budget=budget))
    cuda = engine.device.type == "cuda"
    if cuda:  # as `eg2 serve` boots; a CPU dry run has no graphs (and so no ladder)
        engine.warm_up(Settings.model_fields["max_batch_items"].default, GPU_BATCH_TOKENS)
        engine.capture_graphs()
    clip = Item((MediaPart("audio", samples.wav(9.3)),))
    image = Item((MediaPart("image", samples.png(641, 479)),))
    cases = {"3 clips": [clip] * 3, "5 clips": [clip] * 5, "6 clips": [clip] * 6, "3 images": [image] * 3}
    prepared: dict[str, list[PreparedItem]] = {}
    for name, items in cases.items():
        batch = engine.prepare_many(items, PrepareOptions())
        prepared[name] = [p for p in batch if isinstance(p, PreparedItem)]
        assert len(prepared[name]) == len(items), f"{name}: {batch}"
    served = tower_graphs.ITEM_LADDER
    ladders = {"finer": FINER, "powers of two": served}

    # Host-clock ms of an embed (it returns host vectors, so each ends synced), as the bench times one.
    embeds = partial(device_times_ms, device=torch.device("cpu"), budget=ROUND)

    times: dict[str, dict[str, list[float]]] = {name: {lad: [] for lad in ladders} for name in cases}
    refused: dict[str, list[str]] = {}
    try:
        for lad, ladder in ladders.items():  # each ladder's buckets captured on first use, untimed
            tower_graphs.ITEM_LADDER = ladder
            for name in cases:
                for _ in range(3):
                    engine.embed(prepared[name])
            refused[lad] = sorted(str(k) for k in engine.towers.refused) if engine.towers else []
        for r in range(args.rounds):
            for lad in list(ladders)[:: 1 if r % 2 == 0 else -1]:
                tower_graphs.ITEM_LADDER = ladders[lad]
                for name in cases:
                    times[name][lad] += embeds(partial(engine.embed, prepared[name]))
    finally:
        tower_graphs.ITEM_LADDER = served
    medians = {
        name: {lad: round(statistics.median(t), 3) for lad, t in by.items()} for name, by in times.items()
    }
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "plan": engine.plan.describe() if engine.plan is not None else None,
        "medians_ms": medians,
        "times_ms": times,
        "graphs": sorted(str(k) for k in engine.towers.graphs) if engine.towers else [],
        "refused_after_captures": refused,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ladder.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"medians_ms": medians, "refused_after_captures": refused}, indent=1))


if __name__ == "__main__":
    main()
