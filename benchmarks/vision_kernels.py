"""Benchmark (one GPU): the vision tower's fused Triton kernels against their torch reference paths.

    python benchmarks/vision_kernels.py --out out/vision_kernels.json            # H200: full size
    TRITON_INTERPRET=1 python benchmarks/vision_kernels.py --out /tmp/vk.json \\
        --device cpu --size tiny --images 1,2 --tokens 70 --rounds 2            # CPU dry run

Times, with CUDA events (median of --rounds after warm-up), on a random-weight checkpoint of the
real architecture (hybrid-w4 as served unless --weights bf16):
- the vision tower (`image_soft_tokens`, media embedder included) at each --images count of
  --tokens-token images (641x479 gradients: 266 soft tokens in a 280-token budget, padding patches
  included), eager and through tower_graphs.GraphedTowers, under three wirings:
  reference (every module on torch), norms (only RMSNorm fused: the engine's wiring before
  fused.use_fused_kernels) and fused (every fused kernel);
- each kernel alone on the 8-image shapes against the torch ops it replaces, with the bytes it must
  move and the bandwidth that implies;
- SDPA with the tower's bool mask against the additive mask now built once per forward.
Also the cosine of fused to reference soft tokens per image (the GPU test asserts it; here it is
only reported). Writes JSON to --out and prints a table. Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.timing import host_median_ms
from eg2_runtime import samples
from eg2_runtime.engine import Engine, EngineOptions
from eg2_runtime.fused import use_fused_kernels
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions
from eg2_runtime.layers import RMSNorm, additive_mask, key_padding_mask, use_fused_norms
from eg2_runtime.tools.demo_model import write_demo_model
from eg2_runtime.tools.quantize import quantize_checkpoint
from eg2_runtime.tower_graphs import GraphedTowers
from eg2_runtime.vision import apply_axial_rope, axial_rope


def timer(device: torch.device, rounds: int, warmup: int = 3) -> Callable[[Callable[[], object]], float]:
    """fn -> median milliseconds per call: CUDA events on a GPU, the wall clock elsewhere."""

    def cuda(fn: Callable[[], object]) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    return cuda if device.type == "cuda" else partial(host_median_ms, rounds=rounds)


def graph_us(fn: Callable[[], object], calls: int, rounds: int) -> float:
    """Microseconds of one `fn` on the GPU, as the engine's graphs replay it (no launch overhead): a
    CUDA graph of `calls` calls, captured after one call on a side stream (where Triton compiles),
    replayed `rounds` times after one warm-up replay; the median."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return 1e3 * timer(torch.device("cuda"), rounds, warmup=1)(graph.replay) / calls


def checkpoint(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return Path(args.model)
    tmp = Path(tempfile.mkdtemp())
    bf16 = write_demo_model(tmp / "bf16", size=args.size, seed=0)
    if args.weights == "bf16":
        return bf16
    quantize_checkpoint(bf16, tmp / "w4", group_size=128 if args.size == "full" else 32, progress=False)
    return tmp / "w4"


def wire(model: torch.nn.Module, wiring: str) -> None:
    use_fused_kernels(model, enable=False)
    if wiring == "norms":
        use_fused_norms(model)
    elif wiring == "fused":
        use_fused_kernels(model)


def tower_times(
    engine: Engine, args: argparse.Namespace, ms: Callable[[Callable[[], object]], float]
) -> dict[str, Any]:
    """Eager and graphed tower times per image count and wiring, and fused-vs-reference cosines."""
    model = engine.model
    out: dict[str, Any] = {}
    for n in args.images:
        items = [Item((MediaPart("image", samples.png(641, 479, i)),)) for i in range(n)]
        prepared = [engine.prepare(x, PrepareOptions(image_tokens=args.tokens)) for x in items]
        _, inputs = engine.device_batch([p.inputs for p in prepared])
        pixels, positions = inputs["pixel_values"], inputs["image_position_ids"]
        row: dict[str, Any] = {"patch_slots": list(pixels.shape[:2])}
        soft = {}
        with torch.inference_mode():
            for wiring in ("reference", "norms", "fused"):
                wire(model, wiring)
                soft[wiring] = model.image_soft_tokens(pixels, positions)
                slots = pixels.shape[0] * pixels.shape[1]  # one bucket, captured with this wiring's kernels
                towers = GraphedTowers(model, vision_slots=slots, audio_tokens=0, tower_slots=slots)
                for mode, tower in (("eager", model), ("graphed", towers)):
                    call = lambda t=tower, x=pixels, p=positions: t.image_soft_tokens(x, p)  # noqa: E731
                    row[f"{wiring}_{mode}_ms"] = round(ms(call), 3)
                del towers
        per_image = soft["reference"].shape[0] // n
        cos = F.cosine_similarity(
            soft["fused"].float().reshape(n, per_image, -1).flatten(1),
            soft["reference"].float().reshape(n, per_image, -1).flatten(1),
            dim=-1,
        )
        row["fused_vs_reference_cosine_per_image"] = [round(c, 6) for c in cos.tolist()]
        for mode in ("eager", "graphed"):
            row[f"{mode}_speedup"] = round(row[f"reference_{mode}_ms"] / row[f"fused_{mode}_ms"], 3)
            row[f"{mode}_fused_ms_per_image"] = round(row[f"fused_{mode}_ms"] / n, 3)
        out[f"{n} images"] = row
        print(f"{n} images", json.dumps(row), flush=True)
    use_fused_kernels(model, enable=False)
    return out


def kernel_times(
    engine: Engine, n: int, slots: int, ms: Callable[[Callable[[], object]], float]
) -> dict[str, dict[str, float | None]]:
    """Each fused kernel alone against the torch ops it replaces, on n images of `slots` patches."""
    from eg2_runtime.mlp_triton import gelu_tanh_mul
    from eg2_runtime.rmsnorm_triton import add_rms_norm, rms_norm
    from eg2_runtime.rope_triton import rms_norm_rope

    cfg = engine.model.config.vision
    assert cfg is not None
    dev, dt = engine.device, engine.model.dtype
    gen = torch.Generator(device=dev).manual_seed(0)
    heads, hd, hidden, mlp = cfg.num_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=dev, dtype=dt)  # noqa: E731
    head_norm, wide, wide2 = RMSNorm(hd).to(dev, dt), RMSNorm(hidden).to(dev, dt), RMSNorm(hidden).to(dev, dt)
    qkv, x, y = rand(n, slots, heads, hd), rand(n, slots, hidden), rand(n, slots, hidden)
    gate, up = rand(n, slots, mlp), rand(n, slots, mlp)
    positions = torch.stack(
        torch.meshgrid(
            torch.arange(slots // 42 + 1, device=dev), torch.arange(42, device=dev), indexing="ij"
        ),
        -1,
    ).reshape(-1, 2)[:slots]
    cos, sin = axial_rope(positions.expand(n, -1, -1), hd, cfg.rope_theta, dt)
    valid = torch.ones(n, slots, dtype=torch.bool, device=dev)
    valid[:, -slots // 20 :] = False  # ~5% padding patches, as a 641x479 image has
    keep = key_padding_mask(valid)
    mask = additive_mask(keep, dt)
    q = qkv.transpose(1, 2)
    eps = cfg.rms_norm_eps
    width = torch.tensor([], dtype=dt).element_size()
    cases: dict[str, tuple[Callable[[], object], Callable[[], object], int]] = {
        # name: (reference, fused, bytes the fused kernel must read and write)
        "q/k/v norm (rows of head_dim)": (
            lambda: head_norm.reference(qkv),
            lambda: rms_norm(qkv, head_norm.weight, eps),
            2 * qkv.numel() * width,
        ),
        "q/k/v norm, one row per program (before)": (
            lambda: head_norm.reference(qkv),
            lambda: one_row_per_program(qkv, head_norm.weight, eps),  # type: ignore[arg-type]
            2 * qkv.numel() * width,
        ),
        "norm + axial rope (q or k)": (
            lambda: apply_axial_rope(head_norm.reference(qkv), cos, sin),
            lambda: rms_norm_rope(qkv, head_norm.weight, eps, cos, sin, 2),
            (2 * qkv.numel() + 2 * cos.numel()) * width,
        ),
        "layer norm (rows of hidden)": (
            lambda: wide.reference(x),
            lambda: rms_norm(x, wide.weight, eps),
            2 * x.numel() * width,
        ),
        "residual add + post-norm + pre-norm": (
            lambda: wide2.reference(x + wide.reference(y)),
            lambda: add_rms_norm(x, y, wide.weight, eps, wide2.weight, eps),
            4 * x.numel() * width,
        ),
        "gelu_tanh(gate) * up": (
            lambda: F.gelu(gate, approximate="tanh") * up,
            lambda: gelu_tanh_mul(gate, up),
            3 * gate.numel() * width,
        ),
        "sdpa: bool mask vs additive mask built once": (
            lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=keep, scale=1.0),
            lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=mask, scale=1.0),
            0,
        ),
    }
    out: dict[str, dict[str, float | None]] = {}
    with torch.inference_mode():
        for name, (reference, fused, nbytes) in cases.items():
            ref_ms, fused_ms = ms(reference), ms(fused)
            out[name] = {
                "reference_us": round(1e3 * ref_ms, 1),
                "fused_us": round(1e3 * fused_ms, 1),
                "speedup": round(ref_ms / fused_ms, 2),
                "fused_gb_per_s": round(nbytes / fused_ms / 1e6, 1) if nbytes else None,
            }
            print(name, json.dumps(out[name]), flush=True)
    return out


def one_row_per_program(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm_triton's kernel launched as it was before rows were blocked: one program per row."""
    from eg2_runtime.rmsnorm_triton import _rms_norm_kernel

    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty_like(x2)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, weight, out, x2.shape[0], n, eps,
        HAS_WEIGHT=True, ROUND_BF16=x.dtype == torch.bfloat16, BLOCK_ROWS=1, BLOCK=n, num_warps=4,
    )  # fmt: skip
    return out


def table(result: dict[str, Any]) -> str:
    lines = [
        "tower (ms)          ref eager  norms eager  fused eager  x  | ref graph  norms graph  fused graph  x"
    ]
    for name, r in result["tower"].items():
        lines.append(
            f"{name:<18} {r['reference_eager_ms']:>10.2f} {r['norms_eager_ms']:>12.2f} {r['fused_eager_ms']:>12.2f}"
            f" {r['eager_speedup']:>5.2f} | {r['reference_graphed_ms']:>9.2f} {r['norms_graphed_ms']:>12.2f}"
            f" {r['fused_graphed_ms']:>12.2f} {r['graphed_speedup']:>5.2f}"
        )
    lines.append("")
    lines.append(f"kernels ({result['kernel_shapes']})".ljust(46) + "ref us   fused us      x   GB/s")
    for name, r in result["kernels"].items():
        gbs = "" if r["fused_gb_per_s"] is None else f"{r['fused_gb_per_s']:>7.0f}"
        lines.append(
            f"{name:<44} {r['reference_us']:>8.1f} {r['fused_us']:>10.1f} {r['speedup']:>6.2f} {gbs}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="full", choices=["full", "tiny"])
    parser.add_argument("--weights", default="w4", choices=["w4", "bf16"])
    parser.add_argument("--model", default=None, help="an existing checkpoint directory instead")
    parser.add_argument("--images", default="1,8", type=lambda s: [int(v) for v in s.split(",")])
    parser.add_argument("--tokens", default=280, type=int, help="soft-token budget per image")
    parser.add_argument("--rounds", default=20, type=int)
    args = parser.parse_args()

    device = torch.device(args.device)
    model_dir = checkpoint(args)
    # No text graphs, every module on torch until `wire` switches it, and a budget far above what
    # the measured batches take (the engine caps the allocator at its budget).
    options = EngineOptions(gpu_memory_budget=64 << 30, graph_max_tokens=0, fused_norms=False)
    engine = Engine.from_dir(model_dir, device=args.device, options=options)
    ms = timer(device, args.rounds)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "checkpoint": f"{args.size} {args.weights}" if args.model is None else str(args.model),
        "dtype": str(engine.model.dtype),
        "tokens_per_image": args.tokens,
        "rounds": args.rounds,
    }
    result["tower"] = tower_times(engine, args, ms)
    n, slots = max(args.images), args.tokens * engine.model.config.vision.pooling_kernel_size**2  # type: ignore[union-attr]
    result["kernel_shapes"] = f"{n} images x {slots} patch slots"
    result["kernels"] = kernel_times(engine, n, slots, ms)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
