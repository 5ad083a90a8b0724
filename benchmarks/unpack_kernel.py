"""Benchmark (one GPU): the fused unpack kernel on every packed layer shape of the full checkpoint.

    python -m benchmarks.unpack_kernel --out DIR [--reps N]

For each tower Linear shape of the full-size architecture (demo_model's "full" config), one random
weight quantized as hybrid-w4 stores it (group 128): the time of one `unpack_triton.dequantize_into`
on the GPU, the bytes it must move (int32 words and BF16 scales in, BF16 weight out) and the
bandwidth that implies; then each tower's total for one forward (every layer once), the work the
Unpacker's side stream adds to a tower forward. A CUDA graph of --reps launches is replayed and
timed with CUDA events, as the tower graphs run the kernel: timing single launches measures
Triton's host-side launch instead (35-46 us a launch on the H200, 2026-12-02, whatever the shape).
The repeats read one layer's words and scales, which stay in L2: a lower bound on a tower's time.
Writes unpack_kernel.json into DIR and prints a table. Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import json
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.vision_kernels import graph_us
from eg2_runtime.quant import PACKED_TOWERS, quantize
from eg2_runtime.tools.demo_model import checkpoint_shapes, demo_config
from eg2_runtime.unpack_triton import dequantize_into

GROUP = 128


def layer_shapes() -> dict[str, collections.Counter[tuple[int, int]]]:
    """Per tower, how many of its Linears have each (out, in) shape (what hybrid-w4 packs)."""
    shapes: dict[str, collections.Counter[tuple[int, int]]] = {
        t: collections.Counter() for t in PACKED_TOWERS
    }
    for name, shape in checkpoint_shapes(demo_config("full")).items():
        tower = name.split(".", 1)[0]
        if tower in shapes and name.endswith(".weight") and len(shape) == 2:
            shapes[tower][(shape[0], shape[1])] += 1
    return shapes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=100, help="launches in the timed graph [100]")
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict[str, Any]] = []
    towers: dict[str, dict[str, float]] = {}
    for tower, counts in layer_shapes().items():
        total_us = total_bytes = 0.0
        for (out_f, in_f), n in sorted(counts.items()):
            w = torch.randn(out_f, in_f, device="cuda", generator=gen)
            packed, scale = quantize(w, GROUP)
            dense = torch.empty(out_f, in_f, dtype=torch.bfloat16, device="cuda")
            us = graph_us(partial(dequantize_into, packed, scale, dense), args.reps, rounds=5)
            moved = packed.nbytes + scale.nbytes + dense.nbytes
            rows.append(
                {"tower": tower, "shape": [out_f, in_f], "layers": n, "us": round(us, 2),
                 "bytes": moved, "gb_per_s": round(moved / us / 1e3, 1)}
            )  # fmt: skip
            total_us += n * us
            total_bytes += n * moved
        towers[tower] = {
            "us_per_forward": round(total_us, 1),
            "gb_per_s": round(total_bytes / total_us / 1e3, 1),
        }
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": rows,
        "towers": towers,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "unpack_kernel.json").write_text(json.dumps(result, indent=1))
    for r in rows:
        print(
            f"{r['tower']:13} {tuple(r['shape'])!s:13} x{r['layers']:<3} {r['us']:8.2f} us {r['gb_per_s']:7.1f} GB/s"
        )
    for tower, t in towers.items():
        print(f"{tower}: {t['us_per_forward']:.1f} us of unpacking a forward, {t['gb_per_s']:.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
