"""Timing and memory of one in-process configuration, and the two runners it times.

A cell is one workload on one configuration: warm-up rounds, then timed rounds (every call of the
workload once per round) inside a time box. A call is what a user makes, timed on the host with
perf_counter from the client's bytes and strings to vectors in host memory: results are copied back,
so a CUDA call is complete when its clock stops. For our runtime two more figures per cell, on the same
items prepared beforehand: `embed` (Engine.embed alone: collate, copy in, forward, copy out) and
`forward` (EG2Model on inputs already on the device, timed with CUDA events, and its FLOPs counted
once by torch's FlopCounterMode, so TFLOP/s can be set against the card's matmul peak).

Memory (CUDA only; None on a CPU): weights resident = memory_allocated after load minus before (the
previous configuration freed first), peak = max_memory_allocated with the peak reset per configuration
and per cell, reserved = what the caching allocator holds after the workloads (the in-process stand-in
for "process GPU memory": the CUDA context is shared by every configuration of the run), and the
device's used memory (mem_get_info: context included, as nvidia-smi counts it).
"""

from __future__ import annotations

import gc
import io
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
import torch

from eg2_runtime.api import PreparedItem
from eg2_runtime.engine import Engine
from eg2_runtime.inputs import PrepareOptions
from eg2_runtime.tools.bench_workloads import Input, Workload

OPTIONS = PrepareOptions()  # no prompt, the default 280-token image budget: what the reference does


@dataclass(frozen=True)
class Budget:
    """How long a cell runs. Fast calls get `min_rounds` timed rounds at least; slow ones stop after
    `seconds * min_rounds`, one round at least, so a 3-second call costs one warm-up and one round."""

    seconds: float  # the time box of the timed rounds
    warmup: int  # warm-up rounds, fewer when they outlast `seconds`
    min_rounds: int
    max_rounds: int
    per_client: int = 2  # service sweep: requests each concurrent client sends, at least

    def scaled(self, factor: float, warmup: int | None = None) -> Budget:
        return replace(self, seconds=self.seconds * factor, warmup=self.warmup if warmup is None else warmup)


def cell_header(w: Workload) -> dict[str, Any]:
    """What every result cell records about its workload, before any figure."""
    return {
        "family": w.family,
        "modality": w.modality,
        "batch": w.batch,
        "calls_per_round": len(w.calls),
        "items_per_round": w.items,
        "tokens_per_round": w.tokens,
        "error": None,
    }


def stats(
    latencies_s: Sequence[float], items: int, tokens: int, wall_s: float, per_call: int
) -> dict[str, Any]:
    """Latency percentiles of the calls, and items and tokens per second over the wall time. With
    fewer than 100 calls p99 is close to the slowest call."""
    ms = np.asarray(latencies_s, dtype=np.float64) * 1000
    p50 = float(np.percentile(ms, 50))
    return {
        "calls": len(ms),
        "p50_ms": p50,
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
        "min_ms": float(ms.min()),
        "max_ms": float(ms.max()),
        "items_per_s": items / wall_s,
        "tokens_per_s": tokens / wall_s,
        "ms_per_item": p50 / per_call,
    }


def time_rounds(fn: Callable[[int], object], workload: Workload, budget: Budget) -> dict[str, Any]:
    """Run `fn(i)` for every call i of the workload, round after round, under `budget`."""
    n = len(workload.calls)
    start = time.perf_counter()
    warm = 0
    while warm < budget.warmup:
        for i in range(n):
            fn(i)
        warm += 1
        if time.perf_counter() - start >= budget.seconds:
            break
    latencies: list[float] = []
    rounds = 0
    t0 = time.perf_counter()
    while True:
        for i in range(n):
            s = time.perf_counter()
            fn(i)
            latencies.append(time.perf_counter() - s)
        rounds += 1
        elapsed = time.perf_counter() - t0
        if rounds >= budget.max_rounds or elapsed >= budget.seconds * max(budget.min_rounds, 1):
            break
        if rounds >= budget.min_rounds and elapsed >= budget.seconds:
            break
    out = stats(latencies, rounds * workload.items, rounds * workload.tokens, elapsed, workload.batch)
    out.update(warmup_rounds=warm, rounds=rounds)
    return out


def device_times_ms(fn: Callable[[], object], device: torch.device, budget: Budget) -> list[float]:
    """Per-call milliseconds of `fn`: CUDA events around it on the current stream (host clock on a CPU)."""
    for _ in range(budget.warmup):
        fn()
    times: list[float] = []
    t0 = time.perf_counter()
    while len(times) < budget.max_rounds:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            s = time.perf_counter()
            fn()
            times.append((time.perf_counter() - s) * 1000)
        elapsed = time.perf_counter() - t0
        if elapsed >= budget.seconds * max(budget.min_rounds, 1):
            break
        if len(times) >= budget.min_rounds and elapsed >= budget.seconds:
            break
    return times


def count_flops(fn: Callable[[], object]) -> int | None:
    """FLOPs of one call by torch's dispatch-level counter (matmuls and attention; elementwise ops are
    not counted, which is the convention peak TFLOP/s figures use). None if the counter fails."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with FlopCounterMode(display=False) as counter:
            fn()
        return int(counter.get_total_flops())
    except Exception:
        return None


def matmul_peak_tflops(device: torch.device) -> float:
    """The card's measured BF16 matmul rate: square matmuls, best of a few timed batches."""
    n, reps = (8192, 10) if device.type == "cuda" else (512, 3)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)

    def batch() -> None:
        for _ in range(reps):
            torch.mm(a, b)

    best = min(device_times_ms(batch, device, Budget(0.2, 2, 3, 5)))
    return 2 * n**3 * reps / (best / 1000) / 1e12


class Memory:
    """CUDA allocator figures; every reader gives None on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def settle(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated(self.device) if self.cuda else None

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None

    def reserved(self) -> int | None:
        return torch.cuda.memory_reserved(self.device) if self.cuda else None

    def device_used(self) -> int | None:
        """Memory in use on the whole device (CUDA context, every process): what nvidia-smi shows."""
        if not self.cuda:
            return None
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free


# ------------------------------------------------------------------------------------------ runners


class Ours:
    """Our runtime through its public surface: Engine.prepare_many, then Engine.embed."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.device = engine.device

    def prepare(self, inputs: Sequence[Input]) -> list[PreparedItem]:
        prepared = self.engine.prepare_many([x.item() for x in inputs], OPTIONS)
        for p in prepared:
            if not isinstance(p, PreparedItem):
                raise p
        return prepared  # type: ignore[return-value]

    def call(self, inputs: Sequence[Input]) -> None:
        # The whole call an in-process user makes: media decoded on the engine's thread pool, all
        # text tokenized in one call, then one embed.
        vectors = self.engine.embed(self.prepare(inputs))
        assert vectors.shape[0] == len(inputs)

    def extras(self, workload: Workload, budget: Budget, flops: bool) -> dict[str, Any]:
        """Engine.embed and the model forward alone, on the workload's first call prepared once."""
        prepared = self.prepare(workload.calls[0])
        out: dict[str, Any] = {}
        embed = device_times_ms(lambda: self.engine.embed(prepared), torch.device("cpu"), budget)
        out["embed"] = _ms_stats(embed, len(prepared))
        model = self.engine.model
        ids, on_device = self.engine.device_batch([p.inputs for p in prepared])

        @torch.inference_mode()
        def forward() -> object:  # the engine's path: CUDA graphs where it has them
            return self.engine.forward(ids, on_device)

        @torch.inference_mode()
        def eager() -> object:  # the same math op by op, which is what a FLOP counter can see
            return model(ids, **on_device)

        times = device_times_ms(forward, self.device, budget)
        out["forward"] = _ms_stats(times, len(prepared))
        n = count_flops(eager) if flops else None
        out["forward_flops"] = n
        out["forward_tflops"] = n / (out["forward"]["p50_ms"] / 1000) / 1e12 if n else None
        return out


class Reference:
    """transformers 5.23 + sentence-transformers in BF16, as a user would run it: the checkpoint's own
    pipeline through `SentenceTransformer.encode`, after decoding the bytes with the usual libraries
    (PIL, soundfile, PyAV), since it takes no encoded media."""

    def __init__(self, model_dir: str | os.PathLike[str], device: torch.device) -> None:
        # The reference stack must never reach for a hub (the GPU machine has no network).
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.model = SentenceTransformer(
            str(model_dir),
            device=str(device),
            model_kwargs={"dtype": torch.bfloat16},  # the BF16 source: no quantization config
            local_files_only=True,
        )
        self.model.eval()
        self.device = device

    @property
    def image_backend(self) -> str:
        """Which image processor runs: "torchvision" (Gemma4ImageProcessor) or "pil" (its fallback)."""
        processor = getattr(self.model[0], "processor", None)
        name = type(getattr(processor, "image_processor", None)).__name__
        return "pil" if name.endswith("Pil") else "torchvision"

    def weight_bytes(self) -> int:
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def call(self, inputs: Sequence[Input]) -> None:
        batch = [_decode(x) for x in inputs]
        # batch_size = the call's size: one forward per call, as our engine does.
        vectors = self.model.encode(
            batch, batch_size=len(batch), convert_to_numpy=True, show_progress_bar=False
        )
        assert len(vectors) == len(inputs)


def _decode(x: Input) -> Any:
    """An input as sentence-transformers 6.2 takes it: str, PIL image, audio dict, video dict."""
    if x.kind == "text":
        return x.text
    if x.kind == "image":
        from PIL import Image

        with Image.open(io.BytesIO(x.data)) as im:
            return im.convert("RGB")
    if x.kind == "audio":
        import soundfile as sf

        wave, rate = sf.read(io.BytesIO(x.data), dtype="float32")
        if wave.ndim == 2:
            wave = wave.mean(axis=1)
        # The reference feature extractor does not resample: the bench's clips are 16 kHz already.
        return {"array": wave, "sampling_rate": rate}
    import av

    with av.open(io.BytesIO(x.data), "r") as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        fps = float(stream.average_rate or 1)
    n = len(frames)
    # fps and duration let the processor sample at 1 fps; without them it keeps every frame.
    return {"array": frames, "video_metadata": {"fps": fps, "total_num_frames": n, "duration": n / fps}}


def _ms_stats(times_ms: Sequence[float], per_call: int) -> dict[str, Any]:
    wall_s = sum(times_ms) / 1000
    return stats([t / 1000 for t in times_ms], per_call * len(times_ms), 0, wall_s, per_call) | {
        "tokens_per_s": None
    }


# ------------------------------------------------------------------------------------------- cells

Progress = Callable[[str], None]


def measure(
    runner: Ours | Reference,
    workloads: Sequence[Workload],
    budget: Budget,
    memory: Memory,
    progress: Progress,
    *,
    extras: Callable[[Workload], bool] = lambda w: False,
    flops: Callable[[Workload], bool] = lambda w: False,
) -> dict[str, dict[str, Any]]:
    """Every workload on one runner: a cell each, keyed by workload. A failing cell (out of memory, a
    missing reference processor) records its error and the run goes on."""
    cells: dict[str, dict[str, Any]] = {}
    for w in workloads:
        cell = cell_header(w)
        memory.reset_peak()
        t0 = time.perf_counter()
        try:
            cell["call"] = time_rounds(partial(_call, runner, w), w, budget)
        except Exception as e:  # recorded, reported, and the exit status says so
            cell["error"], cell["traceback"] = _failure(e)
        if isinstance(runner, Ours) and extras(w) and not cell["error"]:
            # Apart: the embed / forward figures failing (say, a model signature changed under the
            # bench) leaves the call's figures standing.
            try:
                cell |= runner.extras(w, budget.scaled(0.3, warmup=min(budget.warmup, 1)), flops(w))
            except Exception as e:
                cell["extras_error"], cell["traceback"] = _failure(e)
        cell["peak_allocated_bytes"] = memory.peak()
        if cell["error"] or cell.get("extras_error"):  # outside `except`: its traceback held the tensors
            memory.settle()
        cell["cell_s"] = time.perf_counter() - t0
        cells[w.key] = cell
        progress(_line(w, cell))
    return cells


def _failure(e: Exception) -> tuple[str, str]:
    return f"{type(e).__name__}: {e}"[:500], traceback.format_exc(limit=-8)[-3000:]


def _call(runner: Ours | Reference, w: Workload, i: int) -> None:
    runner.call(w.calls[i])


def _line(w: Workload, cell: dict[str, Any]) -> str:
    if cell["error"]:
        return f"{w.key}: FAILED {cell['error'][:200]}"
    c = cell["call"]
    text = (
        f"{w.key}: {c['items_per_s']:.1f} items/s, p50 {c['p50_ms']:.1f} ms, p99 {c['p99_ms']:.1f} ms "
        f"({c['rounds']} rounds, {cell['cell_s']:.1f} s)"
    )
    if "forward" in cell:
        text += f"; forward {cell['forward']['p50_ms']:.1f} ms"
    if cell.get("extras_error"):
        text += f"; embed / forward FAILED {cell['extras_error'][:200]}"
    return text
