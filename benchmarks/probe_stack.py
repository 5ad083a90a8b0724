"""Probe (GPU): what each of the engine's paths adds to the process's GPU memory outside torch's
allocator (kernels, library handles, the per-thread CUDA stack) the first time it runs.

    python -m benchmarks.probe_stack --out DIR [--checkpoint w4|bf16]

The engine sets the stack limit to 256 bytes (gpu_memory.set_cuda_stack_limit); a kernel that needs
more makes the driver grow the reservation for every thread the GPU can hold (~69 MiB on the H200
per 256 bytes). This loads the model as the engine does (fused kernels, the stack limit), then runs
each path once, reading after each the stack limit and the process's GPU memory (NVML) less the
allocator's reserved bytes. Then it boots an engine in the same process and reads them again.
Writes stack-<checkpoint>.json into DIR.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.workloads import CHECKPOINT_KINDS, full_checkpoint
from eg2_runtime.engine import Engine
from eg2_runtime.fused import use_fused_kernels
from eg2_runtime.gpu_memory import ProcessGpuMemory, cuda_stack_limit, set_cuda_stack_limit
from eg2_runtime.loader import load_model
from eg2_runtime.memory_plan import MIB
from eg2_runtime.packing import Packing
from eg2_runtime.quant import PackedLinear


def paths(model: Any) -> dict[str, Callable[[], Any]]:
    dev, dt = model.language_model.embedding_projection.weight.device, model.dtype
    h = model.config.text.hidden_size
    out: dict[str, Callable[[], Any]] = {}
    packing = Packing.from_lengths([40], dev)
    out["text packed"] = lambda: model.language_model.forward_packed(
        torch.zeros(40, h, dtype=dt, device=dev), packing
    )
    long = 3 * model.config.text.sliding_window + 1
    out["text lean, banded"] = lambda: model.encode(
        torch.zeros(1, long, h, dtype=dt, device=dev), torch.ones(1, long, device=dev), lean=True
    )
    unpacker = model.unpacker
    if unpacker is not None and unpacker.fast is not None:
        layer = next(m for m in model.modules() if isinstance(m, PackedLinear))
        out["dequant kernel"] = lambda: unpacker.fast(
            layer.weight_packed.view(-1), layer.weight_scale.view(-1), unpacker._view(layer, 0).view(-1)
        )
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
    parser.add_argument("--checkpoint", choices=CHECKPOINT_KINDS, default="w4")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = full_checkpoint(args.checkpoint)
    gpu = ProcessGpuMemory()

    def outside() -> dict[str, float]:
        torch.cuda.synchronize()
        reading = gpu.read()
        process = reading.bytes / MIB if reading is not None else float("nan")
        stack = cuda_stack_limit()
        assert stack is not None, "torch has not loaded the CUDA runtime"
        return {
            "stack_bytes": stack,
            "outside_allocator_mib": process - torch.cuda.memory_reserved() / MIB,
        }

    result: dict[str, Any] = {"checkpoint": args.checkpoint, "steps": {}}
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    result["steps"]["context"] = outside()
    set_cuda_stack_limit(256)
    model, _ = load_model(model_dir, "cuda")
    use_fused_kernels(model)
    result["steps"]["loaded, fused, stack 256"] = outside()
    with torch.inference_mode():
        for name, run in paths(model).items():
            run()
            result["steps"][name] = outside()
            print(name, result["steps"][name], flush=True)
    del model
    engine = Engine.from_dir(model_dir, device="cuda")
    result["plan"] = engine.plan.describe() if engine.plan else None
    result["steps"]["+ an engine booted beside it"] = outside()
    (args.out / f"stack-{args.checkpoint}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
