"""One in-process configuration, alone in this process: (a) or (b), our engine, or (c), the reference.

    python -m benchmarks.inprocess CONFIG --spec SPEC.json --workloads W.pkl --out OUT.json
    python -m benchmarks.inprocess peak --device cuda --out OUT.json     the BF16 matmul peak

`eg2 bench` (benchmarks/bench.py) starts one such process per configuration, with the workloads it
built, and samples this process's GPU memory from outside; this process reads its own at named
points. Steps: load; warm up (ours: Engine.warm_up + capture_graphs, as `eg2 serve` boots; the
reference: one call per modality); the named workloads; the matrix. OUT.json is rewritten after every
cell, so a process killed midway leaves what it measured.

Runners:
- ours: Engine.prepare_many, then Engine.embed, the engine's defaults. Two more figures per matrix
  cell, on its items prepared beforehand: `embed` (Engine.embed alone: collate, copy in, forward, copy
  out) and `forward` (Engine.forward on inputs already on the device, CUDA events), with the forward's
  FLOPs counted once on the same math run op by op for the long-text and image rows, so TFLOP/s can
  be set against the card's measured BF16 matmul peak;
- the reference: transformers + sentence-transformers in BF16, `SentenceTransformer.encode` after
  decoding the bytes with the usual libraries (it takes no encoded media).
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import pickle
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from eg2_runtime.gpu_memory import ProcessGpuMemory

READER = ProcessGpuMemory()  # before torch touches CUDA: its fallback's baseline excludes this process

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.timing import Budget, Progress, cell_header, cell_line, failure, time_rounds  # noqa: E402
from benchmarks.workloads import Input, Workload, Workloads  # noqa: E402
from eg2_runtime.api import PreparedItem  # noqa: E402
from eg2_runtime.engine import Engine, EngineOptions  # noqa: E402
from eg2_runtime.inputs import PrepareOptions  # noqa: E402

OPTIONS = PrepareOptions()  # no prompt, the default 280-token image budget: what the reference does


# ------------------------------------------------------------------------------------------- timing


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
        if elapsed >= budget.cap_s or (len(times) >= budget.min_rounds and elapsed >= budget.seconds):
            break
    return times


def ms_stats(times_ms: Sequence[float], per_call: int) -> dict[str, Any]:
    ms = np.asarray(times_ms, dtype=np.float64)
    return {
        "calls": len(ms),
        "p50_ms": float(np.percentile(ms, 50)),
        "min_ms": float(ms.min()),
        "items_per_s": per_call * len(ms) / (ms.sum() / 1000),
    }


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

    best = min(device_times_ms(batch, device, Budget(0.2, 2, 3, 5, 1.0)))
    return 2 * n**3 * reps / (best / 1000) / 1e12


def graph_buckets(engine: Engine) -> tuple[set[str], set[str], set[str]]:
    """The engine's graph buckets: captured, refused (by the pool), deferred (to first use). Keys
    as (kind, rows, size) for the towers, total tokens for text."""
    graphs, refused, deferred = set(), set(), set()
    for g in (engine.graphs, engine.packed, engine.towers):
        if g is not None:
            graphs |= {str(k) for k, c in g.graphs.items() if c.graph is not None}
            refused |= {str(k) for k in g.refused}
            deferred |= {str(k) for k in g.deferred}
    return graphs, refused, deferred


def graph_pool_mib(engine: Engine) -> dict[str, float | None] | None:
    """The graph pool's fill and budget (MiB, as the pool counts them: measured captures), or None
    where the engine has no graphs."""
    for g in (engine.towers, engine.packed, engine.graphs):
        if g is not None:
            budget = g.pool.budget
            return {
                "used": round(g.pool.used / 2**20, 1),
                "budget": round(budget / 2**20, 1) if budget is not None else None,
            }
    return None


# ------------------------------------------------------------------------------------------ runners


class Ours:
    """Our runtime through its public surface: Engine.prepare_many, then Engine.embed."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.device = engine.device
        self._flops: dict[str, int | None] = {}  # matrix row -> one item's forward FLOPs

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
        """Engine.embed and the engine's forward alone, on the workload's first call prepared once.

        `forward` is the sum of the forwards Engine.embed makes of the batch (one per run of items
        within the modality's batch token limit, each on inputs already on the device), so a batch
        the engine splits is timed as it runs, within the process's memory budget."""
        prepared = self.prepare(workload.calls[0])
        out: dict[str, Any] = {}
        embed = device_times_ms(lambda: self.engine.embed(prepared), torch.device("cpu"), budget)
        out["embed"] = ms_stats(embed, len(prepared))
        chunks = self.forwards(prepared)
        ms_by_size: dict[int, float] = {}  # the runs are all alike but the last: each size timed once
        for chunk in chunks:
            if len(chunk) in ms_by_size:
                continue
            ids, on_device = self.engine.device_batch([p.inputs for p in chunk])

            @torch.inference_mode()
            def forward(ids: torch.Tensor = ids, on_device: dict[str, torch.Tensor] = on_device) -> object:
                return self.engine.forward(ids, on_device)  # the engine's path: CUDA graphs where it has them

            ms_by_size[len(chunk)] = float(np.median(device_times_ms(forward, self.device, budget)))
            if self.engine.towers is not None:  # what Engine.embed checks after each batch
                self.engine.towers.check_counts()
            del ids, on_device
        total_ms = sum(ms_by_size[len(chunk)] for chunk in chunks)
        out["forward"] = ms_stats([total_ms], len(prepared))
        out["forward_chunks"] = len(chunks)
        # FLOPs are counted on one item and scaled: every item of a matrix row has the same length,
        # so a batch of B does B times one item's work (no padding). One item also fits any budget,
        # where counting a whole batch op by op on the reference path might not.
        per_item = self.flops_per_item(workload.calls[0][0], workload.family) if flops else None
        n = per_item * len(prepared) if per_item else None
        out["forward_flops"] = n
        out["forward_tflops"] = n / (total_ms / 1000) / 1e12 if n else None
        return out

    def forwards(self, prepared: list[PreparedItem]) -> list[list[PreparedItem]]:
        """The runs of items Engine.embed gives one forward each: as many as the modality's batch
        token limit holds at the batch's longest item (a matrix row's items are all that long)."""
        limit = self.engine.batch_token_limits().get(prepared[0].modality)
        longest = max(p.num_tokens for p in prepared)
        n = len(prepared) if limit is None else max(1, limit // longest)
        return [prepared[i : i + n] for i in range(0, len(prepared), n)]

    def flops_per_item(self, x: Input, family: str) -> int | None:
        """One item's forward FLOPs, counted once per matrix row on the same math run op by op (a
        FLOP counter cannot see inside a CUDA graph replay)."""
        if family not in self._flops:
            ids, inputs = self.engine.device_batch([p.inputs for p in self.prepare([x])])
            # device_batch keeps the attention mask on the host (the packed path reads it there).
            on_device = {k: v.to(self.engine.device) for k, v in inputs.items()}

            @torch.inference_mode()
            def eager() -> object:
                return self.engine.model(ids, **on_device)

            self._flops[family] = count_flops(eager)
        return self._flops[family]


class Reference:
    """transformers + sentence-transformers in BF16, as a user would run it: the checkpoint's own
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
    """An input as sentence-transformers takes it: str, PIL image, audio dict, video dict."""
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


# --------------------------------------------------------------------------------------------- cells


def measure(
    runner: Ours | Reference,
    workloads: Sequence[Workload],
    budget: Budget,
    progress: Progress,
    save: Callable[[dict[str, dict[str, Any]]], None],
    *,
    extras: Callable[[Workload], bool] = lambda w: False,
    flops: Callable[[Workload], bool] = lambda w: False,
) -> dict[str, dict[str, Any]]:
    """Every workload on one runner: a cell each, keyed by workload, `save`d after each. A failing
    cell (out of memory, a missing reference processor) records its error and the run goes on."""
    cells: dict[str, dict[str, Any]] = {}
    for w in workloads:
        cell = cell_header(w)
        t0 = time.perf_counter()
        captured = graph_buckets(runner.engine)[0] if isinstance(runner, Ours) else set()
        try:
            cell["call"] = time_rounds(partial(_call, runner, w), w, budget)
        except Exception as e:  # recorded, reported, and the exit status says so
            cell["error"], cell["traceback"] = failure(e)
        if isinstance(runner, Ours) and extras(w) and not cell["error"]:
            # Apart: the embed / forward figures failing leaves the call's figures standing.
            try:
                cell |= runner.extras(w, budget.scaled(0.3, warmup=min(budget.warmup, 1)), flops(w))
            except Exception as e:
                cell["extras_error"], cell["traceback"] = failure(e)
        if isinstance(runner, Ours):
            # A bucket the pool refused sends its batches to smaller ones, in more replays (eagerly
            # where none holds them): the buckets this cell captured, every one refused so far, and
            # the pool's fill after the cell (which capture took the room a later one lacked).
            now, refused, _ = graph_buckets(runner.engine)
            cell["graphs"] = {
                "captured": sorted(now - captured),
                "refused": sorted(refused),
                "pool_mib": graph_pool_mib(runner.engine),
            }
        if cell["error"] or cell.get("extras_error"):  # outside `except`: its traceback held the tensors
            settle()
        cell["cell_s"] = time.perf_counter() - t0
        cells[w.key] = cell
        save(cells)
        progress(cell_line(w.key, cell))
    return cells


def _call(runner: Ours | Reference, w: Workload, i: int) -> None:
    runner.call(w.calls[i])


def settle() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- run


class Run:
    """This configuration's results, written to `path` whenever they change."""

    def __init__(self, path: Path, spec: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "key": spec["key"],
            "label": spec["label"],
            "pid": os.getpid(),
            "argv": sys.argv,
            "model_dir": spec["model_dir"],
            "phases": {},
            "points": {},
            "complete": False,
        }
        self._phase_start = time.time()

    def point(self, name: str) -> None:
        """The end of phase `name`: this process's GPU memory now, and the phase's time span."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        reading = READER.read()
        now = time.time()
        self.data["points"][name] = reading.bytes if reading is not None else None
        self.data["phases"][name] = (self._phase_start, now)
        self._phase_start = now
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, allow_nan=True) + "\n")
        os.replace(tmp, self.path)


def run_engine(
    spec: dict[str, Any], workloads: Workloads, run: Run, budget: Budget, progress: Progress
) -> None:
    quick, cuda = spec["quick"], spec["device"] == "cuda"
    t0 = time.perf_counter()
    options = EngineOptions(
        gpu_memory_budget=spec.get("gpu_memory_budget"), host_token_table=spec.get("host_token_table")
    )
    engine = Engine.from_dir(spec["model_dir"], device=spec["device"], options=options)
    r = engine.report
    run.data["load_s"] = time.perf_counter() - t0
    run.data["weights"] = {
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "resident_bytes": r.resident_bytes,
        "host_bytes": r.host_bytes,
        "bf16_equivalent_bytes": r.bf16_bytes,
        "summary": r.summary(),
    }
    run.data["memory_plan"] = engine.plan.describe() if engine.plan is not None else None
    run.data["engine_memory"] = {"load": engine.memory()}
    run.point("load")
    if cuda and not quick:  # as `eg2 serve` boots; a CPU has no memory to prove and quick mode no time
        run.data["batch_token_limits"] = engine.warm_up(spec["max_batch_items"], spec["max_batch_tokens"])
        run.data["graphs_at_start"] = engine.capture_graphs()
    run.data["engine_memory"]["warmup"] = engine.memory()
    run.point("warmup")
    runner = Ours(engine)
    run.data["named"] = measure(runner, workloads.named, budget, progress, _saver(run, "named"))
    run.data["engine_memory"]["named"] = engine.memory()
    run.point("named")
    # Quick mode times the embed and forward alone at batch 1 only. FLOPs where issue #15 sets
    # TFLOP/s against the peak (long text), and images for comparison.
    wanted = (lambda w: w.batch == 1) if quick else (lambda w: True)
    run.data["matrix"] = measure(
        runner,
        workloads.matrix,
        budget,
        progress,
        _saver(run, "matrix"),
        extras=wanted,
        flops=lambda w: wanted(w) and w.family in ("text_long", "image"),
    )
    run.data["engine_memory"]["matrix"] = engine.memory()
    run.point("matrix")


def run_reference(
    spec: dict[str, Any], workloads: Workloads, run: Run, budget: Budget, progress: Progress
) -> None:
    t0 = time.perf_counter()
    ref = Reference(spec["model_dir"], torch.device(spec["device"]))
    run.data["load_s"] = time.perf_counter() - t0
    run.data["image_backend"] = ref.image_backend
    run.data["weights"] = {
        "dtype": str(next(ref.model.parameters()).dtype).removeprefix("torch."),
        "resident_bytes": ref.weight_bytes(),
    }
    run.point("load")
    video = next(w.calls[0][0] for w in workloads.named if w.modality == "video")
    for x in (*workloads.sweep.values(), video):  # one call per modality: its processor is loaded
        ref.call([x])
    run.point("warmup")
    run.data["named"] = measure(ref, workloads.named, budget, progress, _saver(run, "named"))
    run.point("named")
    run.data["matrix"] = measure(ref, workloads.matrix, budget, progress, _saver(run, "matrix"))
    run.point("matrix")


def _saver(run: Run, group: str) -> Callable[[dict[str, dict[str, Any]]], None]:
    def save(cells: dict[str, dict[str, Any]]) -> None:
        run.data[group] = cells
        run.save()

    return save


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("config", help="the configuration's key, or `peak` for the matmul peak")
    parser.add_argument("--spec", type=Path, help="the configuration, as benchmarks/bench.py writes it")
    parser.add_argument("--workloads", type=Path, help="the pickled Workloads")
    parser.add_argument("--device", default="cuda", help="`peak` only")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.config == "peak":  # the machine's figures the orchestrator, holding no GPU, cannot read
        device = torch.device(args.device)
        props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
        figures = {
            "matmul_peak_tflops": matmul_peak_tflops(device),
            "gpu": props.name if props else None,
            "gpu_memory_bytes": props.total_memory if props else None,
        }
        args.out.write_text(json.dumps(figures) + "\n")
        return 0

    spec = json.loads(args.spec.read_text())
    with args.workloads.open("rb") as f:
        workloads: Workloads = pickle.load(f)  # written by the orchestrating process, moments ago
    budget = Budget(**spec["budget"])
    t_origin = spec["t_origin"]

    def progress(line: str) -> None:
        print(f"[bench {time.time() - t_origin:6.1f} s] {spec['key']} {line}", file=sys.stderr, flush=True)

    if spec["quick"] and spec["device"] == "cpu":
        # One intra-op thread: on a small shared CPU (CI) a parallel region waits for its slowest
        # thread, and one descheduled thread stalls a 2 ms forward for hundreds of ms.
        torch.set_num_threads(1)
    run = Run(args.out, spec)
    run.data["torch_threads"] = torch.get_num_threads()
    run.save()
    try:
        if spec["kind"] == "engine":
            run_engine(spec, workloads, run, budget, progress)
        else:
            run_reference(spec, workloads, run, budget, progress)
    except Exception as e:  # the configuration failed as a whole (a load, a missing package)
        run.data["error"], run.data["traceback"] = failure(e)
        run.save()
        progress(f"FAILED: {run.data['error']}")
        return 1
    run.data["complete"] = True
    run.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
