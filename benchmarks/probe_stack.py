"""Probe (GPU): which of the engine's paths makes the driver grow the per-thread CUDA stack.

    python -m benchmarks.probe_stack --out DIR [--checkpoint w4|bf16]

The engine sets the stack limit to 256 bytes (gpu_memory.set_cuda_stack_limit); a kernel that needs
more makes the driver grow the reservation for every thread the GPU can hold (~69 MiB on the H200
per 256 bytes). This boots an engine as `eg2 serve` does, reads the limit back, then for each path
sets it to 256 again, runs the path once and reads the limit and the process's GPU memory (NVML).
Writes stack-<checkpoint>.json into DIR.
"""

from __future__ import annotations

import argparse
import ctypes
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.workloads import checkpoints
from eg2_runtime.engine import Engine
from eg2_runtime.gpu_memory import CUDA_LIMIT_STACK_SIZE, set_cuda_stack_limit
from eg2_runtime.memory_plan import MIB
from eg2_runtime.packing import Packing
from eg2_runtime.quant import PackedLinear


def stack_limit() -> int:
    with open("/proc/self/maps") as maps:
        path = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})[0]
    value = ctypes.c_size_t(0)
    ctypes.CDLL(path).cudaDeviceGetLimit(ctypes.byref(value), CUDA_LIMIT_STACK_SIZE)
    return value.value


def paths(engine: Engine) -> dict[str, Callable[[], Any]]:
    model, dev, dt = engine.model, engine.device, engine.model.dtype
    h = model.config.text.hidden_size
    out: dict[str, Callable[[], Any]] = {}
    packing = Packing.from_lengths([40], dev)
    out["text packed"] = lambda: model.language_model.forward_packed(
        torch.zeros(40, h, dtype=dt, device=dev), packing
    )
    out["text lean"] = lambda: model.encode(
        torch.zeros(1, 40, h, dtype=dt, device=dev), torch.ones(1, 40, device=dev), lean=True
    )
    unpacker = model.unpacker
    if unpacker is not None and unpacker.fast is not None:
        layer = next(m for m in model.modules() if isinstance(m, PackedLinear))
        out["dequant kernel"] = lambda: unpacker.fast(
            layer.weight_packed, layer.weight_scale, unpacker._view(layer, 0)
        )  # type: ignore[misc]
    if model.vision_tower is not None:
        cfg = model.vision_tower.cfg
        s = 70 * cfg.pooling_kernel_size**2
        positions = torch.full((1, s, 2), -1, dtype=torch.long, device=dev)
        positions[0, 0] = 0
        pixels = torch.zeros(1, s, 3 * cfg.patch_size**2, dtype=torch.uint8, device=dev)
        out["vision tower"] = lambda: model.image_soft_tokens(pixels, positions)
    if model.audio_tower is not None:
        bins = model.audio_tower.cfg.subsampling_conv_channels[0]
        features = torch.zeros(1, 256, bins, dtype=dt, device=dev)
        mask = torch.ones(1, 256, dtype=torch.bool, device=dev)
        out["audio tower"] = lambda: model.audio_soft_tokens(features, mask)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint", choices=("w4", "bf16"), default="w4")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with checkpoints(None, Path.home() / ".cache/eg2/bench", "full", print) as (bf16, w4):
        engine = Engine.from_dir(w4 if args.checkpoint == "w4" else bf16, device="cuda")
    nvml = lambda: engine.memory().get("process_gpu_bytes", 0) / MIB  # noqa: E731
    result: dict[str, Any] = {
        "checkpoint": args.checkpoint,
        "plan": engine.plan.describe() if engine.plan else None,
        "after_boot": {"stack_bytes": stack_limit(), "process_mib": nvml()},
        "paths": {},
    }
    with torch.inference_mode():
        for name, run in paths(engine).items():
            torch.cuda.synchronize()
            set_cuda_stack_limit(256)
            before = nvml()
            run()
            torch.cuda.synchronize()
            result["paths"][name] = {
                "stack_bytes": stack_limit(),
                "process_mib_before": before,
                "after": nvml(),
            }
            print(name, result["paths"][name], flush=True)
    (args.out / f"stack-{args.checkpoint}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
