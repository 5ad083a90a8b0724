"""Probe (GPU): the towers' item ladder (tower_graphs.ITEM_LADDER) against powers of two, in one engine.

    python -m benchmarks.probe_ladder --out DIR [--rounds 6]
    python -m benchmarks.probe_ladder --out /tmp/pl --device cpu --size tiny --rounds 1   # dry run

Boots the hybrid-w4 engine on the full-size checkpoint as `eg2 serve` boots it (warm-up, start-up
graphs), prepares tower batches whose sizes the two ladders pad differently (3, 5 and 6 clips of
9.3 s, 3 images of 641x479), then times `Engine.embed` on each under either ladder: the module's
ladder is swapped in place, so both run in the same process, on the same pool and the same host. Each
ladder's buckets are captured first, untimed; then --rounds rounds of 5 embeds a batch, the ladders
alternated and their order reversed each round. A bucket the pool refuses under one ladder shows in
`refused`. Writes ladder.json into DIR (medians, every time, the graphs) and prints the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from app.service import GPU_BATCH_TOKENS
from app.settings import Settings
from benchmarks.workloads import DEFAULT_CACHE, checkpoints
from eg2_runtime import samples, tower_graphs
from eg2_runtime.api import PreparedItem
from eg2_runtime.engine import Engine
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions

POWERS_OF_TWO = (1, 2, 4, 8, 16, 32, 64)  # the text graphs' rows, which the towers took before


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", choices=("tiny", "full"), default="full")
    args = parser.parse_args()

    with checkpoints(None, DEFAULT_CACHE, args.size, print) as (_, w4):
        engine = Engine.from_dir(w4, device=args.device)
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
    ladders = {"ladder": tower_graphs.ITEM_LADDER, "powers of two": POWERS_OF_TWO}

    def embed_ms(name: str) -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.embed(prepared[name])  # returns host vectors: the batch's end is synced
        return 1e3 * (time.perf_counter() - start)

    times: dict[str, dict[str, list[float]]] = {name: {lad: [] for lad in ladders} for name in cases}
    try:
        for ladder in ladders.values():  # each ladder's buckets captured on first use, untimed
            tower_graphs.ITEM_LADDER = ladder
            for name in cases:
                for _ in range(3):
                    embed_ms(name)
        for r in range(args.rounds):
            for lad in list(ladders)[:: 1 if r % 2 == 0 else -1]:
                tower_graphs.ITEM_LADDER = ladders[lad]
                for name in cases:
                    times[name][lad] += [embed_ms(name) for _ in range(5)]
    finally:
        tower_graphs.ITEM_LADDER = ladders["ladder"]
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
        "refused": sorted(str(k) for k in engine.towers.refused) if engine.towers else [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ladder.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"medians_ms": medians, "refused": result["refused"]}, indent=1))


if __name__ == "__main__":
    main()
