"""Probe (GPU, one process): where the served process's GPU memory and media time go.

    python -m benchmarks.probe_memory_media --out DIR

Answers, for the memory budget and the media speed work:
- the process's GPU memory (NVML) after CUDA init, cuBLAS, SDPA, loading the w4 engine;
- the activation peak (allocator) of one eager batch per modality and size, per token;
- the graph pool growth of single text and tower buckets;
- eager vs graphed time of small media batches, and a kernel table of one image each way;
- image preprocessing time, one thread and 16 images on the engine's pool;
- which warnings the profiler raises (the GPU test suite turns warnings into errors).
Writes probe.json and profile_*.txt into DIR.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from eg2_runtime.gpu_memory import ProcessGpuMemory

MEM = ProcessGpuMemory()  # before torch touches CUDA: the fallback's baseline excludes our context

import torch  # noqa: E402

from eg2_runtime import samples  # noqa: E402
from eg2_runtime.api import PreparedItem  # noqa: E402
from eg2_runtime.engine import Engine, EngineOptions  # noqa: E402
from eg2_runtime.graphs import GraphedTextEncoder  # noqa: E402
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions, TextPart  # noqa: E402
from eg2_runtime.tools.demo_model import write_demo_model  # noqa: E402
from eg2_runtime.tools.quantize import quantize_checkpoint  # noqa: E402
from eg2_runtime.tower_graphs import GraphedTowers  # noqa: E402

MIB = 2**20
out: dict[str, Any] = {"steps": [], "peaks": {}, "pool": {}, "times": {}, "prep": {}}


def step(name: str) -> None:
    torch.cuda.synchronize()
    r = MEM.read()
    row = {
        "step": name,
        "process_mib": None if r is None else round(r.bytes / MIB, 1),
        "source": None if r is None else r.source,
        "allocated_mib": round(torch.cuda.memory_allocated() / MIB, 1),
        "reserved_mib": round(torch.cuda.memory_reserved() / MIB, 1),
    }
    out["steps"].append(row)
    print(json.dumps(row), flush=True)


def median_ms(fn: Callable[[], object], rounds: int = 7) -> float:
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return round(statistics.median(times), 2)


def text(n_words: int, seed: int) -> Item:
    words = ["embeddings", "map", "meaning", "to", "vectors", "and", "similar", "texts", "land", "close"]
    return Item((TextPart(" ".join(words[(seed + i) % len(words)] for i in range(n_words))),))


def cases() -> dict[str, tuple[list[Item], PrepareOptions]]:
    image = lambda i, w=641, h=479: Item((MediaPart("image", samples.png(w, h, i)),))  # noqa: E731
    clip = lambda s: Item((MediaPart("audio", samples.wav(s)),))  # noqa: E731
    video = lambda n: Item((MediaPart("video", samples.mp4(n, width=640, height=480)),))  # noqa: E731
    default = PrepareOptions()
    return {
        "text 1x20": ([text(3, 0)], default),
        "text 64x40": ([text(6, i) for i in range(64)], default),
        "text 16x512": ([text(78, i) for i in range(16)], default),
        "text 1x2200": ([text(335, 0)], default),
        "text 4x2200": ([text(335, i) for i in range(4)], default),
        "text 1x8192": ([text(1300, 0)], default),
        "image280 b1": ([image(0)], default),
        "image280 b4": ([image(i) for i in range(4)], default),
        "image280 b8": ([image(i) for i in range(8)], default),
        "image280 b16": ([image(i) for i in range(16)], default),
        "image70 b1": ([image(0)], PrepareOptions(image_tokens=70)),
        "image1120 b1": ([image(0, 1280, 960)], PrepareOptions(image_tokens=1120)),
        "audio 9.3s b1": ([clip(9.3)], default),
        "audio 9.3s b16": ([clip(9.3) for _ in range(16)], default),
        "audio 30s b1": ([clip(30.0)], default),
        "audio 30s b8": ([clip(30.0) for _ in range(8)], default),
        "video 8f b1": ([video(8)], default),
        "video 32f b1": ([video(32)], default),
    }


def peaks(engine: Engine, prepared: dict[str, list[PreparedItem]], label: str) -> None:
    for name, items in prepared.items():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        try:
            engine.embed(items)
            ms = median_ms(partial(engine.embed, items), rounds=3)
        except Exception as e:  # record and go on: one failing case must not end the probe
            out["peaks"][f"{label} {name}"] = {"error": f"{type(e).__name__}: {e}"}
            continue
        peak = torch.cuda.max_memory_allocated() - base
        tokens = sum(p.num_tokens for p in items)
        out["peaks"][f"{label} {name}"] = {
            "items": len(items),
            "tokens": tokens,
            "padded_tokens": len(items) * max(p.num_tokens for p in items),
            "peak_mib": round(peak / MIB, 1),
            "peak_kib_per_token": round(peak / 1024 / tokens, 1),
            "ms": ms,
        }
        print(label, name, out["peaks"][f"{label} {name}"], flush=True)


def profile_table(fn: Callable[[], object], path: Path) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            fn()
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30)
    path.write_text(table + "\n")
    return [f"{w.category.__name__} {w.filename}:{w.lineno}: {w.message}" for w in caught]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    step("start")
    torch.zeros(1, device="cuda")
    step("cuda init")
    a = torch.randn(1024, 1024, dtype=torch.bfloat16, device="cuda")
    (a @ a).sum().item()
    step("cublas bf16 matmul")
    q = torch.randn(1, 4, 256, 64, dtype=torch.bfloat16, device="cuda")
    torch.nn.functional.scaled_dot_product_attention(q, q, q)
    step("sdpa")
    del a, q

    tmp = Path(tempfile.mkdtemp())
    bf16 = write_demo_model(tmp / "bf16", size="full", seed=0)
    w4 = tmp / "w4"
    quantize_checkpoint(bf16, w4, group_size=128, progress=False)

    # A budget far above anything probed: the allocator's cap never stops a case, and the towers'
    # graph buckets are the plan's for that budget.
    unbounded = EngineOptions(gpu_memory_budget=64 << 30, graph_max_tokens=0, tower_graphs=False)
    engine = Engine.from_dir(w4, device="cuda", options=unbounded)
    step("w4 engine loaded (no graphs)")
    out["report"] = engine.report.summary()

    t0 = time.perf_counter()
    inputs = cases()
    built = {name: [engine.prepare(x, opts) for x in items] for name, (items, opts) in inputs.items()}
    out["prep"]["all cases s"] = round(time.perf_counter() - t0, 2)
    peaks(engine, built, "eager")
    torch.cuda.empty_cache()
    step("after eager peaks, empty_cache")

    # Image preprocessing on the host.
    png = samples.png(641, 479, 0)
    item = Item((MediaPart("image", png),))
    one = [time.perf_counter()]
    for _ in range(10):
        engine.prepare(item, PrepareOptions())
        one.append(time.perf_counter())
    out["prep"]["image 641x479 one thread ms"] = round(
        1e3 * statistics.median(b - a for a, b in itertools.pairwise(one)), 2
    )
    many = [Item((MediaPart("image", samples.png(641, 479, i)),)) for i in range(16)]
    engine.prepare_many(many, PrepareOptions())
    t0 = time.perf_counter()
    engine.prepare_many(many, PrepareOptions())
    out["prep"]["16 images prepare_many ms"] = round(1e3 * (time.perf_counter() - t0), 2)
    out["prep"]["png bytes"] = len(png)

    # Graph pools: one text bucket at a time, then tower buckets, each growth on its own.
    graphs = GraphedTextEncoder(engine.model.language_model, 16384)
    with torch.inference_mode():
        for key in [
            (1, 32),
            (1, 320),
            (8, 64),
            (64, 64),
            (16, 512),
            (1, 2048),
            (4, 2048),
            (16, 1024),
            (1, 4096),
        ]:
            before = torch.cuda.memory_reserved()
            t0 = time.perf_counter()
            graphs._capture(key)
            out["pool"][f"text {key}"] = {
                "growth_mib": round((torch.cuda.memory_reserved() - before) / MIB, 1),
                "capture_s": round(time.perf_counter() - t0, 3),
            }
    step("after 9 text buckets")
    engine.graphs = graphs
    plan = engine.plan
    assert plan is not None  # on CUDA the engine always has one
    towers = GraphedTowers(
        engine.model,
        vision_slots=plan.graph_vision_slots,
        audio_tokens=plan.graph_audio_tokens,
        tower_slots=plan.tower_slots,
    )
    engine.towers = towers
    graphed_cases = {
        k: v for k, v in built.items() if k.split()[0] in ("image280", "audio", "video", "image70", "text")
    }
    for name, items in graphed_cases.items():
        before = torch.cuda.memory_reserved()
        n_before = len(towers.graphs)
        try:
            engine.embed(items)
            eager_ms = out["peaks"].get(f"eager {name}", {}).get("ms")
            out["times"][name] = {
                "eager_ms": eager_ms,
                "graphed_ms": median_ms(partial(engine.embed, items)),
            }
        except Exception as e:
            out["times"][name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        out["pool"][f"tower after {name}"] = {
            "new_graphs": [str(k) for k in list(towers.graphs)[n_before:]],
            "growth_mib": round((torch.cuda.memory_reserved() - before) / MIB, 1),
        }
        print(name, out["times"][name], out["pool"][f"tower after {name}"], flush=True)
    step("after tower graphs")

    warned = profile_table(
        lambda: engine.embed(built["image280 b1"]), args.out / "profile_image_b1_graphed.txt"
    )
    warned += profile_table(
        lambda: engine.embed(built["audio 9.3s b1"]), args.out / "profile_audio_b1_graphed.txt"
    )
    engine.towers = None
    warned += profile_table(
        lambda: engine.embed(built["image280 b1"]), args.out / "profile_image_b1_eager.txt"
    )
    warned += profile_table(
        lambda: engine.embed(built["image280 b8"]), args.out / "profile_image_b8_eager.txt"
    )
    out["profiler_warnings"] = sorted(set(warned))

    bf = Engine.from_dir(bf16, device="cuda", options=unbounded)
    for name in ("image280 b1", "image280 b8", "audio 9.3s b1", "audio 9.3s b16"):
        items = [bf.prepare(x, inputs[name][1]) for x in inputs[name][0]]
        bf.embed(items)
        out["times"][f"bf16 eager {name}"] = median_ms(partial(bf.embed, items))
    (args.out / "probe.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["times"], indent=1))


if __name__ == "__main__":
    main()
