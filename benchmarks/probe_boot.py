"""Probe (GPU): an engine booted as `eg2 serve` boots it, then what each request shape runs through.

    python -m benchmarks.probe_boot --out DIR [--checkpoint w4|bf16] [--modalities text]
                                    [--budget-mib N] [--host-token-table] [--padded-text]
                                    [--profile SHAPE,...] [--full-attention BACKEND]

Generates (or reuses) the full-size random checkpoints of `eg2 bench`. A thread samples the process's
GPU memory (NVML) throughout, so the boot's peak is split by phase: load (weights, the plan, the
table's placement), warm-up, start-up captures. After warm-up and the start-up captures it writes the
plan, the graph pool's measured use, the captured and refused
buckets; then, per request shape, the median embed time, the allocator's peak above what was held
before, the process's GPU memory (NVML) and the buckets that shape added or had refused.
Writes boot-<tag>.json into DIR.

--full-attention BACKEND serves the full layers with another packed_attention backend than the
default (e.g. flex): an A/B of the engine as booted; the output's tag names it.

--history records the caching allocator's history through the warm-up (torch.cuda.memory's
`_record_memory_history`) and writes, beside the phases, the live set at the warm-up's allocator peak
grouped by the innermost eg2_runtime frame that allocated it (what a long batch holds at once), and
after each phase the memory outside the allocator (NVML less reserved) and the CUDA stack limit.

At /ready it also counts cuBLAS's workspaces (`cublas_workspaces`: the allocator's live blocks of the
workspace's exact size, by stream). Set CUBLAS_WORKSPACE_CONFIG in the environment to try another size.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.service import GPU_BATCH_TOKENS
from benchmarks import workloads
from benchmarks.inprocess import graph_buckets
from benchmarks.process_memory import PeakSampler
from benchmarks.workloads import CHECKPOINT_KINDS, Factory, Input, full_checkpoint
from eg2_runtime import packed_attention, samples
from eg2_runtime.config import FULL
from eg2_runtime.engine import Engine, EngineOptions
from eg2_runtime.errors import EngineOutOfMemory
from eg2_runtime.gpu_memory import cuda_stack_limit
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions, TextPart
from eg2_runtime.memory_plan import MIB


def shapes(factory: Factory) -> dict[str, tuple[list[Item], PrepareOptions]]:
    """The request shapes, texts cut to token counts by the checkpoint's tokenizer as `eg2 bench`
    cuts them: the query, the 64 docs and the long document are its named workloads' own."""

    def texts(*inputs: Input) -> list[Item]:
        return [Item((TextPart(x.text or ""),)) for x in inputs]

    named = {w.key: w for w in workloads.named_text(factory, workloads.FULL)}  # a text-only engine too
    image = Item((MediaPart("image", samples.png(641, 479)),))
    clip = Item((MediaPart("audio", samples.wav(9.3)),))
    return {
        "query": (texts(*named["short_query"].calls[0]), PrepareOptions()),
        "8 short": (texts(*(factory.text(20, i) for i in range(8))), PrepareOptions()),
        "32 short": (texts(*(factory.text(20, i) for i in range(32))), PrepareOptions()),
        "64 docs": (texts(*named["docs_one_call"].calls[0]), PrepareOptions()),
        "doc 2200": (texts(*named["long_doc"].calls[0]), PrepareOptions()),
        "doc 8000": (texts(factory.text(8000, 2)), PrepareOptions()),
        "1 image": ([image], PrepareOptions()),
        "4 images": ([image] * 4, PrepareOptions()),
        "16 images": ([image] * 16, PrepareOptions()),
        "1 clip": ([clip], PrepareOptions()),
        "8 clips": ([clip] * 8, PrepareOptions()),
        "16 clips": ([clip] * 16, PrepareOptions()),
        "clip 30": ([Item((MediaPart("audio", samples.wav(30.0)),))], PrepareOptions()),
        "video 8": ([Item((MediaPart("video", samples.mp4(8, width=640, height=480)),))], PrepareOptions()),
        "video 32": ([Item((MediaPart("video", samples.mp4(32, width=640, height=480)),))], PrepareOptions()),
        "8 videos": (
            [Item((MediaPart("video", samples.mp4(8, width=640, height=480)),))] * 8,
            PrepareOptions(),
        ),
    }


def profile(engine: Engine, prepared: list[Any], rows: int = 24) -> dict[str, Any]:
    """Three embeds under torch.profiler: wall ms each, the device kernels an embed launches (a
    graph's replay counts each of its kernels), and the top operators by self host time and by
    device time (ms over the three)."""
    from torch.profiler import DeviceType, ProfilerActivity
    from torch.profiler import profile as torch_profile

    walls = []
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            t = time.perf_counter()
            engine.embed(prepared)
            walls.append(1e3 * (time.perf_counter() - t))
    events = prof.key_averages()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]

    def top(attr: str) -> list[tuple[str, float, int]]:
        ranked = sorted(events, key=lambda e: -getattr(e, attr))[:rows]
        return [(e.key[:60], round(getattr(e, attr) / 1e3, 3), e.count) for e in ranked]

    return {
        "wall_ms": walls,
        "device_ms": round(sum(e.self_device_time_total for e in events) / 1e3, 3),
        "kernels_per_embed": len(kernels) / 3,
        "host_self_ms": top("self_cpu_time_total"),
        "device_self_ms": top("self_device_time_total"),
    }


ALLOCATOR_EVENTS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms")


def workspace_bytes() -> int:
    """cuBLAS's workspace size as torch picks it: CUBLAS_WORKSPACE_CONFIG's `:KiB:COUNT` terms summed,
    else 32 MiB on compute capability 9.x (the H200) and 8 MiB + 2 MiB elsewhere."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        terms = re.findall(r":(\d+):(\d+)", config)
        if terms:
            return sum(int(kib) * 1024 * int(count) for kib, count in terms)
    major = torch.cuda.get_device_capability()[0]
    return 4096 * 8 * 1024 if major >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8


def cublas_workspaces() -> dict[str, Any]:
    """The caching allocator's live blocks asked for at exactly cuBLAS's workspace size, by stream:
    torch keeps one per (thread's cuBLAS handle, stream) that ran a matmul. A tensor of that very size
    would count too, so the streams say which is which."""
    size = workspace_bytes()
    by_stream: collections.Counter[str] = collections.Counter()
    for segment in torch.cuda.memory_snapshot():
        for block in segment.get("blocks", ()):
            if block.get("state") == "active_allocated" and block.get("requested_size") == size:
                by_stream[f"stream {segment.get('stream')} pool {segment.get('segment_pool_id')}"] += 1
    return {"bytes": size, "blocks": dict(by_stream)}


def peak_live_set(snapshot: dict[str, Any], top: int = 40) -> dict[str, Any]:
    """Replays the allocator's trace: the most bytes its traced blocks held at once, and those blocks
    grouped by the innermost eg2_runtime frame that allocated them (blocks from before the recording
    started are not in the trace)."""
    live: dict[int, tuple[int, str]] = {}
    held = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in snapshot["device_traces"][0]:
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            frames = event.get("frames") or []
            ours = [f for f in frames if "eg2_runtime" in f["filename"]]
            where = (
                f"{ours[0]['filename'].split('eg2_runtime/')[-1]}:{ours[0]['line']} {ours[0]['name']}"
                if ours
                else "-"
            )
            live[addr] = (size, where)
            held += size
            if held > peak:
                peak, at_peak = held, dict(live)
        elif action == "free_completed" and addr in live:
            held -= live.pop(addr)[0]
    groups: collections.Counter[str] = collections.Counter()
    for size, where in at_peak.values():
        groups[where] += size
    return {
        "peak_mib": peak / MIB,
        "blocks": len(at_peak),
        "by_frame_mib": {k: round(v / MIB, 2) for k, v in groups.most_common(top)},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint", choices=CHECKPOINT_KINDS, default="w4")
    parser.add_argument("--modalities", default=None)
    parser.add_argument("--budget-mib", type=int, default=None)
    parser.add_argument("--host-token-table", action="store_true")
    parser.add_argument("--padded-text", action="store_true", help="padded text graphs (packed_text off)")
    parser.add_argument(
        "--profile", default="", help="shapes to profile, comma-separated (e.g. query,1 image)"
    )
    parser.add_argument("--only", default="", help="run only these shapes, comma-separated")
    parser.add_argument("--history", action="store_true", help="the warm-up's live set at its peak")
    parser.add_argument(
        "--full-attention",
        choices=[
            b for b in packed_attention.BACKENDS if b != "flash"
        ],  # flash stops at head_dim 256; the full layers' is 512
        default=None,
        help="the full layers' CUDA attention backend",
    )
    args = parser.parse_args()
    if args.full_attention:
        packed_attention.CUDA_BACKENDS[FULL] = args.full_attention
    args.out.mkdir(parents=True, exist_ok=True)
    table = "-host-table" if args.host_token_table else ""
    padded = "-padded" if args.padded_text else ""
    full = f"-{args.full_attention}" if args.full_attention else ""
    tag = f"{args.checkpoint}-{args.modalities or 'all'}-{args.budget_mib or 'default'}{table}{padded}{full}"
    model_dir = full_checkpoint(args.checkpoint)
    sampler = PeakSampler().start(os.getpid())  # before CUDA starts: see PeakSampler
    phases = {"load": time.time()}
    options = EngineOptions(
        gpu_memory_budget=args.budget_mib * MIB if args.budget_mib else None,
        host_token_table=True if args.host_token_table else None,
        packed_text=not args.padded_text,
    )
    modalities = args.modalities.split(",") if args.modalities else None
    engine = Engine.from_dir(model_dir, device="cuda", modalities=modalities, options=options)
    out: dict[str, Any] = {"tag": tag, "plan": engine.plan.describe() if engine.plan else None}
    nvml = lambda: engine.memory().get("process_gpu_bytes", 0) / MIB  # noqa: E731
    out["load_mib"] = nvml()
    outside: dict[str, Any] = {}  # phase -> (NVML less the allocator's reserved MiB, stack bytes)
    if args.history:
        outside["load"] = (nvml() - torch.cuda.memory_reserved() / MIB, cuda_stack_limit())
        torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    phases["warm_up"] = time.time()
    try:
        out["limits"] = engine.warm_up(64, GPU_BATCH_TOKENS)
    except EngineOutOfMemory as e:
        out["warm_up_error"] = str(e)
    out["warmup_mib"] = nvml()
    if args.history:
        torch.cuda.synchronize()
        out["warm_up_live_set"] = peak_live_set(torch.cuda.memory._snapshot())
        torch.cuda.memory._record_memory_history(enabled=None)
        outside["warm_up"] = (nvml() - torch.cuda.memory_reserved() / MIB, cuda_stack_limit())
    phases["capture"] = time.time()
    t0 = time.perf_counter()
    out["graphs_at_start"] = engine.capture_graphs()
    out["capture_s"] = time.perf_counter() - t0
    sampler.read()
    sampler.stop()
    starts = list(phases.values())
    spans = {
        name: (start, end)
        for name, start, end in zip(phases, starts, [*starts[1:], time.time()], strict=True)
    }
    out["phase_peak_mib"] = {k: (v or 0) / MIB for k, v in sampler.phase_peaks(spans).items()}
    text = engine.packed or engine.graphs
    pool = text.pool if text is not None else None
    out["pool"] = {
        "budget_mib": (pool.budget or 0) / MIB if pool else None,
        "used_mib": pool.used / MIB if pool else None,
    }
    out["ready_mib"] = nvml()
    try:
        out["cublas_workspaces"] = cublas_workspaces()
    except Exception as e:  # a probe of torch's snapshot format: never the reason a run is lost
        out["cublas_workspaces"] = f"{type(e).__name__}: {e}"
    if args.history:
        outside["ready"] = (nvml() - torch.cuda.memory_reserved() / MIB, cuda_stack_limit())
        out["outside_allocator_mib_and_stack"] = outside
    graphs, refused, deferred = graph_buckets(engine)
    out["start_graphs"], out["start_refused"] = sorted(graphs), sorted(refused)
    out["start_deferred"] = sorted(deferred)
    print(json.dumps(out), flush=True)
    rows: dict[str, Any] = {}
    for name, (items, opts) in shapes(Factory(engine.preprocessor)).items():
        if args.only and name not in args.only.split(","):
            continue
        kinds = {p.kind for i in items for p in i.parts if isinstance(p, MediaPart)}
        if any(k not in engine.modalities for k in kinds):
            continue
        prepared = [p for p in engine.prepare_many(items, opts)]
        if any(not hasattr(p, "inputs") for p in prepared):
            rows[name] = {"error": str(prepared)}
            continue
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        stats = {k: torch.cuda.memory_stats().get(k, 0) for k in ALLOCATOR_EVENTS}
        torch.cuda.reset_peak_memory_stats()
        times: list[float] = []
        row: dict[str, Any] = {}
        try:
            for _ in range(6):
                t = time.perf_counter()
                engine.embed(prepared)  # type: ignore[arg-type]
                times.append(1e3 * (time.perf_counter() - t))
        except EngineOutOfMemory as e:
            row["error"] = str(e)
        now_graphs, now_refused, _ = graph_buckets(engine)
        row |= {
            "tokens": sum(int(getattr(p, "num_tokens", 0)) for p in prepared),
            "first_ms": times[0] if times else None,
            "median_ms": float(np.median(times[2:])) if len(times) > 2 else None,
            "peak_above_held_mib": (torch.cuda.max_memory_allocated() - held) / MIB,
            # the allocator's own work during the shape's embeds: device allocations and frees
            # (cudaMalloc / cudaFree, or the pages mapped with expandable segments), and retries
            # after its cap refused one (its cache released first): each a stall
            **{k: torch.cuda.memory_stats().get(k, 0) - v for k, v in stats.items()},
            "process_mib": nvml(),
            "new_graphs": sorted(now_graphs - graphs),
            "new_refused": sorted(now_refused - refused),
            "pool_used_mib": pool.used / MIB if pool else None,
        }
        graphs, refused = now_graphs, now_refused
        if name in args.profile.split(",") and "error" not in row:
            row["profile"] = profile(engine, prepared)
        rows[name] = row
        print(name, json.dumps(row), flush=True)
    out["shapes"] = rows
    (args.out / f"boot-{tag}.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
