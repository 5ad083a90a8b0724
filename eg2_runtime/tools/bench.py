"""`eg2 bench`: speed and memory of the runtime against the reference a user would pick, in one process.

    eg2 bench [--out DIR] [--device auto|cuda|cpu] [--size tiny|full] [--quick] [--configs a,b,c,d,e]
              [--model-dir DIR] [--cache-dir DIR] [--batch-sizes 1,8,32,64] [--concurrency 1,32,128]
              [--seconds S]
    python -m eg2_runtime.tools.bench ...          the same, where the console script is not installed

Configurations, run in this order on the same inputs (bench_workloads.py):
    (a) our runtime serving the hybrid-w4 checkpoint, packed        Engine.from_dir(w4)
    (d) the HTTP service over loopback, serving the (a) engine      app/bench_service.py
    (e) (a) with the token table in pinned host memory, named workloads only: what it saves and costs
    (b) our runtime serving the BF16 checkpoint the w4 was made from  Engine.from_dir(bf16)
    (c) transformers 5.23 + sentence-transformers in BF16 on that BF16 checkpoint: `encode()` end to end
Each configuration is freed before the next loads, so its memory figures are its own.

Measured per cell (workload x configuration, bench_measure.py): the whole call a user makes (bytes and
strings in, vectors in host memory out) after warm-up, inside a time box: items/s, tokens/s, p50/p99
latency; for (a) and (b) also Engine.embed alone and the model forward alone (CUDA events, FLOPs, so
TFLOP/s against the card's measured BF16 matmul peak); peak GPU memory per cell and configuration, and
the weights resident after load. Outputs in --out: bench.json (every figure, machine and versions,
the command), bench.md (tables, ratios, issue 6's targets with met / not met), bench.png.

Assumes: without --model-dir, a random-weight checkpoint of --size is generated once and cached with its
w4 quantization under --cache-dir (full: 1.5 GB, ~20 s); --model-dir names a BF16 checkpoint, quantized
into a temporary directory. Random weights time the same as real ones: nothing here depends on values.
--quick (CI, a CPU): the tiny checkpoint, batch sizes 1 and 8, no warm-up and one timed round per cell,
concurrency 1 and 8, smaller inputs and counts (bench_workloads.QUICK): it proves the harness works,
its figures mean little. The exit status is 1 when any cell failed; the outputs are written anyway.

Files: bench.py (CLI, the run, outputs), bench_workloads.py (checkpoints, inputs), bench_measure.py (timing,
memory, the in-process runners), app/bench_service.py (d, injected by `eg2 bench`), bench_report.py (targets, markdown),
bench_chart.py (the PNG). How to read the results: docs/BENCH.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from eg2_runtime.preprocess import Preprocessor
from eg2_runtime.tools.bench_chart import chart
from eg2_runtime.tools.bench_measure import (
    Budget,
    Memory,
    Ours,
    Progress,
    Reference,
    matmul_peak_tflops,
    measure,
)
from eg2_runtime.tools.bench_report import CONFIG_LABELS, markdown, named_value, targets
from eg2_runtime.tools.bench_workloads import (
    FULL,
    QUICK,
    Factory,
    Input,
    Named,
    Workload,
    checkpoints,
    matrix,
    named,
    sweep_inputs,
)

CONFIGS = ("a", "b", "c", "d", "e")
DEFAULT_CACHE = Path.home() / ".cache" / "eg2" / "bench"


ServiceRunner = Callable[..., dict[str, Any]]


@dataclass(frozen=True)
class Options:
    out: Path
    device: str  # "cuda" or "cpu", resolved
    size: str
    quick: bool
    configs: tuple[str, ...]
    model_dir: Path | None
    cache_dir: Path
    batch_sizes: tuple[int, ...]
    concurrency: tuple[int, ...]
    budget: Budget
    # Configuration (d), the HTTP service: injected by `eg2 bench` (app/bench_service.py), since the
    # runtime never imports the app. None: (d) is reported as not run.
    service: ServiceRunner | None = None


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, comma-separated: {text!r}")
    return values


def parse(argv: list[str]) -> Options:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        prog="eg2 bench",
        description=doc.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="output directory [out/bench]")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument(
        "--size", choices=("tiny", "full"), help="generated checkpoint [full; tiny with --quick]"
    )
    parser.add_argument("--quick", action="store_true", help="the CI mode: tiny, batches 1 and 8, few rounds")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="which of a,b,c,d,e to run [all]")
    parser.add_argument("--model-dir", type=Path, help="a BF16 checkpoint instead of a generated one")
    parser.add_argument(
        "--cache-dir", type=Path, default=DEFAULT_CACHE, help=f"generated checkpoints [{DEFAULT_CACHE}]"
    )
    parser.add_argument("--batch-sizes", type=_ints, help="matrix batch sizes [1,8,32,64; 1,8 with --quick]")
    parser.add_argument(
        "--concurrency", type=_ints, help="service sweep clients [1,32,128; 1,8 with --quick]"
    )
    parser.add_argument(
        "--seconds", type=float, help="time box of one cell's timed rounds [0.5; 0.05 with --quick]"
    )
    args = parser.parse_args(argv)
    configs = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    if not configs or set(configs) - set(CONFIGS):
        parser.error(f"--configs takes letters of {','.join(CONFIGS)}, got {args.configs!r}")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    q = args.quick
    if device == "cpu" and not q and args.size is None:
        # The full-size benchmark on a CPU would run for hours; asking for it must be explicit.
        parser.error("no CUDA device: `eg2 bench --quick` checks the harness on a CPU (--size full insists)")
    seconds = args.seconds if args.seconds is not None else (0.05 if q else 0.5)
    # Quick mode checks the harness, not speed: no warm-up, one timed round, one request per client.
    budget = (
        Budget(seconds, warmup=0, min_rounds=1, max_rounds=2, per_client=1)
        if q
        else Budget(seconds, 2, 3, 200)
    )
    return Options(
        out=args.out,
        device=device,
        size=args.size or ("tiny" if q else "full"),
        quick=q,
        configs=tuple(c for c in CONFIGS if c in configs),
        model_dir=args.model_dir,
        cache_dir=args.cache_dir,
        batch_sizes=args.batch_sizes or ((1, 8) if q else (1, 8, 32, 64)),
        concurrency=args.concurrency or ((1, 8) if q else (1, 32, 128)),
        budget=budget,
    )


# ------------------------------------------------------------------------------------ configurations


def _run_ours(
    model_dir: Path,
    opts: Options,
    memory: Memory,
    matrix_wl: list[Workload],
    named_wl: list[Named],
    progress: Progress,
    tag: str,
) -> tuple[dict[str, Any], Any]:
    """Load our engine and, unless only (d) wants it, measure it. Returns (figures, engine).

    Every configuration of ours runs the engine's defaults (CUDA graphs included); (e) adds the
    host-resident token table."""
    from eg2_runtime.engine import Engine, EngineOptions

    memory.settle()
    memory.reset_peak()
    before = memory.allocated()
    reserved_before = memory.reserved()
    t0 = time.perf_counter()
    options = EngineOptions(host_token_table=tag == "e")
    engine = Engine.from_dir(model_dir, device=opts.device, options=options)
    memory.settle()
    after = memory.allocated()
    r = engine.report
    out: dict[str, Any] = {
        "label": CONFIG_LABELS[tag],
        "model_dir": str(model_dir),
        "load_s": time.perf_counter() - t0,
        "weights": {
            "dtype": str(engine.model.dtype).removeprefix("torch."),
            "allocated_before_load_bytes": before,  # not 0: an earlier configuration was not freed
            "allocated_bytes": after - before if after is not None and before is not None else None,
            "reserved_before_load_bytes": reserved_before,  # what earlier configurations left behind
            "resident_bytes": r.resident_bytes,
            "host_bytes": r.host_bytes,
            "bf16_equivalent_bytes": r.bf16_bytes,
            "summary": r.summary(),
        },
    }
    load_peak = memory.peak()
    if tag in opts.configs:
        runner = Ours(engine)
        # Quick mode times the embed and forward alone at batch 1 only, to keep CI short. FLOPs only
        # where the issue sets TFLOP/s against the peak: each count is one more forward.
        extras = (lambda w: w.batch == 1) if opts.quick else (lambda w: True)
        out["matrix"] = measure(
            runner,
            matrix_wl,
            opts.budget,
            memory,
            _tagged(progress, tag),
            extras=extras,
            flops=lambda w: extras(w) and w.family in ("text_long", "image"),
        )
        out["named"] = measure(
            runner, [n.workload for n in named_wl], opts.budget, memory, _tagged(progress, tag)
        )
        out["memory"] = _memory_after(memory, load_peak, out)
    return out, engine


def _run_reference(
    model_dir: Path,
    opts: Options,
    memory: Memory,
    matrix_wl: list[Workload],
    named_wl: list[Named],
    progress: Progress,
) -> dict[str, Any]:
    memory.settle()
    memory.reset_peak()
    before = memory.allocated()
    t0 = time.perf_counter()
    ref = Reference(model_dir, torch.device(opts.device))
    memory.settle()
    after = memory.allocated()
    out: dict[str, Any] = {
        "label": CONFIG_LABELS["c"],
        "model_dir": str(model_dir),
        "load_s": time.perf_counter() - t0,
        "image_backend": ref.image_backend,
        "weights": {
            "dtype": str(next(ref.model.parameters()).dtype).removeprefix("torch."),
            "allocated_before_load_bytes": before,
            "allocated_bytes": after - before if after is not None and before is not None else None,
            "resident_bytes": ref.weight_bytes(),
        },
    }
    load_peak = memory.peak()
    out["matrix"] = measure(ref, matrix_wl, opts.budget, memory, _tagged(progress, "c"))
    out["named"] = measure(ref, [n.workload for n in named_wl], opts.budget, memory, _tagged(progress, "c"))
    out["memory"] = _memory_after(memory, load_peak, out)
    del ref
    memory.settle()
    return out


def _memory_after(memory: Memory, load_peak: int | None, out: dict[str, Any]) -> dict[str, Any]:
    peaks = [c["peak_allocated_bytes"] for g in ("matrix", "named") for c in out[g].values()]
    peaks = [p for p in [load_peak, *peaks] if p is not None]
    return {
        "peak_allocated_bytes": max(peaks) if peaks else None,
        "reserved_after_bytes": memory.reserved(),
        "device_used_after_bytes": memory.device_used(),
    }


def _tagged(progress: Progress, tag: str) -> Progress:
    return lambda line: progress(f"{tag} {line}")


# ------------------------------------------------------------------------------------------ the run


def run(opts: Options, argv: list[str]) -> dict[str, Any]:
    threads = torch.get_num_threads()
    if opts.quick and opts.device == "cpu":
        # One intra-op thread: on a small shared CPU (CI) a parallel region waits for its slowest thread,
        # and one descheduled thread stalls a 2 ms forward for hundreds of ms.
        torch.set_num_threads(1)
    try:
        return _run(opts, argv)
    finally:
        torch.set_num_threads(threads)


def _run(opts: Options, argv: list[str]) -> dict[str, Any]:
    start = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[bench {time.perf_counter() - start:6.1f} s] {line}", file=sys.stderr, flush=True)

    device = torch.device(opts.device)
    memory = Memory(device)
    results: dict[str, Any] = {"schema": 1, "meta": _meta(opts, argv), "configs": {}}
    results["meta"]["matmul_peak_tflops"] = matmul_peak_tflops(device)
    progress(f"{opts.device}: BF16 matmul peak {results['meta']['matmul_peak_tflops']:.1f} TFLOP/s")
    with checkpoints(opts.model_dir, opts.cache_dir, opts.size, progress) as (bf16, w4):
        factory = Factory(Preprocessor.from_dir(bf16))
        sizes = QUICK if opts.quick else FULL
        matrix_wl = matrix(factory, sizes, opts.batch_sizes)
        named_wl = named(factory, sizes)
        sweep_wl = sweep_inputs(factory, sizes)
        results["workloads"] = _describe(matrix_wl, named_wl, sweep_wl)
        progress(
            f"{len(matrix_wl)} matrix cells, {len(named_wl)} named workloads, configs {','.join(opts.configs)}"
        )
        configs: dict[str, Any] = results["configs"]

        def done() -> None:  # conclude and save after each configuration: a killed run keeps its figures
            _conclude(results, named_wl, start, complete=False)
            write(results, opts.out, chart_too=False)

        if {"a", "d"} & set(opts.configs):
            configs |= _run_packed(w4, opts, memory, matrix_wl, named_wl, sweep_wl, progress)
            done()
        if "e" in opts.configs:
            configs["e"] = _guarded("e", lambda: _run_ours(w4, opts, memory, [], named_wl, progress, "e")[0])
            done()
        if "b" in opts.configs:
            configs["b"] = _guarded(
                "b", lambda: _run_ours(bf16, opts, memory, matrix_wl, named_wl, progress, "b")[0]
            )
            done()
        if "c" in opts.configs:
            configs["c"] = _guarded(
                "c", lambda: _run_reference(bf16, opts, memory, matrix_wl, named_wl, progress)
            )
        memory.settle()
    _conclude(results, named_wl, start, complete=True)
    return results


def _conclude(results: dict[str, Any], named_wl: list[Named], start: float, *, complete: bool) -> None:
    """Named figures, errors and targets from what has run so far."""
    for cfg in results["configs"].values():
        for n in named_wl:
            cell = (cfg.get("named") or {}).get(n.workload.key)
            if cell is not None:
                cell["value"] = named_value(cell, n.metric)
    results["errors"] = _errors(results["configs"])
    results["targets"] = targets(results)
    results["meta"]["wall_s"] = time.perf_counter() - start
    results["meta"]["complete"] = complete


def _run_packed(
    w4: Path,
    opts: Options,
    memory: Memory,
    matrix_wl: list[Workload],
    named_wl: list[Named],
    sweep_wl: list[tuple[str, Input]],
    progress: Progress,
) -> dict[str, Any]:
    """(a) and (d): one engine, measured in-process, then served over HTTP."""
    out: dict[str, Any] = {}
    engine: Any = None

    def load_and_measure() -> dict[str, Any]:
        nonlocal engine
        figures, engine = _run_ours(w4, opts, memory, matrix_wl, named_wl, progress, "a")
        return figures

    a = _guarded("a", load_and_measure)
    if "a" in opts.configs:
        out["a"] = a
    if "d" in opts.configs:
        if engine is None:
            out["d"] = {
                "label": CONFIG_LABELS["d"],
                "error": f"the (a) engine did not load: {a.get('error')}",
            }
        elif opts.service is None:
            out["d"] = {"label": CONFIG_LABELS["d"], "error": "the service runs only under `eg2 bench`"}
        else:
            run_service = opts.service
            out["d"] = _guarded(
                "d",
                lambda: {
                    "label": CONFIG_LABELS["d"],
                    **run_service(engine, named_wl, sweep_wl, opts.concurrency, opts.budget, progress),
                },
            )
    return out


def _guarded(key: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A configuration's figures, or its error: one configuration failing (its packages missing, out
    of memory at load) leaves the others' figures standing."""
    try:
        return fn()
    except Exception as e:
        traceback.print_exc()
        return {"label": CONFIG_LABELS[key], "error": f"{type(e).__name__}: {e}", "traceback": _trace()}


def _trace() -> str:
    return traceback.format_exc(limit=-8)[-3000:]


def _describe(
    matrix_wl: list[Workload], named_wl: list[Named], sweep_wl: list[tuple[str, Input]]
) -> dict[str, Any]:
    def wl(w: Workload) -> dict[str, Any]:
        return {
            "key": w.key,
            "family": w.family,
            "modality": w.modality,
            "label": w.label,
            "batch": w.batch,
            "calls": len(w.calls),
            "items": w.items,
            "tokens": w.tokens,
        }

    return {
        "matrix": [wl(w) for w in matrix_wl],
        "named": [
            {
                **wl(n.workload),
                "metric": n.metric,
                "better": n.better,
                "target": n.target,
                "issue_reference": n.issue_reference,
            }
            for n in named_wl
        ],
        "sweep": [{"family": f, "modality": x.kind, "tokens": x.tokens} for f, x in sweep_wl],
    }


def _errors(configs: dict[str, Any]) -> list[str]:
    errors = []
    for key, cfg in configs.items():
        if cfg.get("error"):
            errors.append(f"({key}) {cfg['error']}")
        for group in ("matrix", "named"):
            for k, c in (cfg.get(group) or {}).items():
                errors += [f"({key}) {k}: {c[e]}" for e in ("error", "extras_error") if c.get(e)]
        errors += [
            f"({key}) sweep {r['family']} c={r['concurrency']}: {r['error']}"
            for r in cfg.get("sweep") or []
            if r.get("error")
        ]
    return errors


def _meta(opts: Options, argv: list[str]) -> dict[str, Any]:
    def pkg(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    cuda = opts.device == "cuda"
    props = torch.cuda.get_device_properties(0) if cuda else None
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["eg2", "bench", *argv]),  # the same as `python -m eg2_runtime.tools.bench ...`
        "process_argv": sys.argv,
        "options": {
            k: str(v) if isinstance(v, Path) else v
            for k, v in asdict(replace(opts, service=None)).items()
            if k != "service"
        }
        | {"service": opts.service is not None},
        "size": opts.size,
        "quick": opts.quick,
        "configs": list(opts.configs),
        "device": opts.device,
        "gpu": props.name if props else None,
        "gpu_memory_bytes": props.total_memory if props else None,
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "versions": {
            p: pkg(p)
            for p in (
                "eg2-serve",
                "transformers",
                "sentence-transformers",
                "numpy",
                "tokenizers",
                "fastapi",
                "uvicorn",
                "httpx",
                "torchvision",
                "triton",
            )
        },
        "git": _git(),
    }


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _git() -> str | None:
    """The commit of this checkout, with "+dirty" for local changes; None outside a git checkout."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=True
        )
        return done.stdout.strip()

    try:
        head, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def write(results: dict[str, Any], out: Path, *, chart_too: bool = True) -> list[Path]:
    """bench.json, bench.md and bench.png in `out`; the chart is skipped, with a note, without matplotlib."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.json", out / "bench.md"]
    paths[0].write_text(json.dumps(_finite(results), indent=1, allow_nan=False) + "\n")
    paths[1].write_text(markdown(results))
    if chart_too:
        try:
            chart(results, out / "bench.png")
            paths.append(out / "bench.png")
        except ImportError as e:
            print(f"bench.png not written: {e} (pip install matplotlib)", file=sys.stderr)
    return paths


def _finite(x: Any) -> Any:
    """NaN and infinities -> None: strict JSON, readable by any parser."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def main(argv: list[str] | None = None, service: ServiceRunner | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = replace(parse(argv), service=service)
    results = run(opts, argv)
    paths = write(results, opts.out)
    print("\n".join(str(p) for p in paths))
    for t in results["targets"]:
        status = {True: "met", False: "NOT MET", None: "n/a"}[t["met"]]
        value = "-" if t["value"] is None else f"{t['value']:.3g}"
        print(f"  {status:8s} {t['name']}: {value} (goal {t['goal']})")
    if results["errors"]:
        print(f"{len(results['errors'])} cell(s) failed:", *results["errors"], sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
