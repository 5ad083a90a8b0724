"""`eg2 bench`: our engine and server against the reference a user would pick, each alone in its own process.

    eg2 bench [--out DIR] [--device auto|cuda|cpu] [--size tiny|full] [--quick]
              [--configs a,b,c,d,d-text,d-bf16] [--budgets MIB,...] [--model-dir DIR] [--cache-dir DIR]
              [--batch-sizes 1,8,32,64] [--concurrency 1,32,128] [--media-clients 16]
              [--seconds S] [--time-limit S] [--pairs N] [--commit SHA]
    python -m benchmarks.bench ...          the same, from a source checkout

Configurations, run one after the other, each in a process of its own (this one only orchestrates:
it never touches the GPU):
    a       our engine, hybrid-w4 checkpoint, its defaults: Engine.prepare_many + embed    benchmarks/inprocess.py
    b       our engine, the BF16 checkpoint the w4 was made from, with (a)'s working memory benchmarks/inprocess.py
            (its budget: (a)'s plus what its weights add), so (a) / (b) compares weights only
    c       transformers + sentence-transformers, BF16, in-process: the reference          benchmarks/inprocess.py
    d       `eg2 serve` on the w4 checkpoint, called over loopback HTTP by client processes benchmarks/served.py
    d-text  the same with --modalities text (the text workloads only)
    d-bf16  `eg2 serve` on the BF16 checkpoint
    d-mibN  (--budgets N,...) `eg2 serve --gpu-memory-mib N` on the w4 checkpoint
`--pairs N` runs (a) and (b) N times each, right after their first run and before the others,
alternating which of the two goes first; packed / BF16 is then judged per matrix cell on the median
items/s of each, since one pair of processes moves with the host (docs/BENCH.md).
Each process's GPU memory is read through NVML by its PID (benchmarks/process_memory.py): after load
(a server: at /ready), after warm-up, after the named workloads, and its peak, sampled every 50 ms.

Outputs in --out: bench.json (every figure, with the command, date, commit and machine), bench.md
(tables, the targets of benchmarks/targets.py judged), bench.png, and each server's log in logs/.
bench.json and bench.md are rewritten after every configuration, and a configuration's process
rewrites its own JSON after every cell, so a run killed midway keeps what it measured; so does a
configuration stopped at its share of --time-limit. The exit status is 1 when anything failed; the
outputs are written either way. How to run it and read it: docs/BENCH.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import pickle
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Literal

from benchmarks.chart import chart
from benchmarks.http_load import client_processes
from benchmarks.process_memory import PeakSampler, memory_record, settle_device
from benchmarks.report import markdown, targets
from benchmarks.served import Served, run_served
from benchmarks.timing import Budget, Progress, Stopped
from benchmarks.workloads import DEFAULT_CACHE, FULL, QUICK, TEXT_NAMED, Input, Workloads, build, checkpoints
from eg2_runtime.gpu_memory import ProcessGpuMemory

ROOT = Path(__file__).resolve().parents[1]  # the source checkout: benchmarks/ sits at its top
NVML = ProcessGpuMemory()  # the device's figures; this process itself never holds GPU memory


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    kind: Literal["engine", "reference", "server"]
    checkpoint: Literal["w4", "bf16"]
    time_s: float  # its share of the run at most (full mode), then it is stopped and keeps what it has
    modalities: tuple[str, ...] | None = None
    gpu_memory_mib: int | None = None
    sweep: bool = True
    # The w4 configuration's default budget plus the bytes this checkpoint's weights add over the
    # w4 one's: the same working memory (graph pool, batch limits), so packed / BF16 compares the
    # weights' format, not two memory plans.
    matched_budget: bool = False


CONFIGS = (
    Config("a", "ours, hybrid-w4, in-process", "engine", "w4", 150),
    Config("b", "ours, BF16, in-process, w4's working memory", "engine", "bf16", 150, matched_budget=True),
    Config("c", "transformers + sentence-transformers, BF16, in-process", "reference", "bf16", 180),
    Config("d", "eg2 serve, hybrid-w4, over HTTP", "server", "w4", 120),
    Config(
        "d-text",
        "eg2 serve --modalities text, hybrid-w4, over HTTP",
        "server",
        "w4",
        60,
        ("text",),
        sweep=False,
    ),
    Config("d-bf16", "eg2 serve, BF16, over HTTP", "server", "bf16", 120),
)
DEFAULT_CONFIGS = ("a", "b", "c", "d", "d-text", "d-bf16")
QUICK_CONFIGS = ("a", "b", "c", "d")


def budget_config(mib: int) -> Config:
    return Config(
        f"d-mib{mib}",
        f"eg2 serve --gpu-memory-mib {mib}, hybrid-w4, over HTTP",
        "server",
        "w4",
        120,
        gpu_memory_mib=mib,
    )


@dataclass(frozen=True)
class Options:
    out: Path
    device: str  # "cuda" or "cpu", resolved
    size: str
    quick: bool
    configs: tuple[Config, ...]
    model_dir: Path | None
    cache_dir: Path
    batch_sizes: tuple[int, ...]
    concurrency: tuple[int, ...]  # the sweep's clients for single short texts
    media_clients: int  # the sweep's clients for single images and single clips
    budget: Budget
    time_limit_s: float | None
    commit: str | None = None  # recorded as given; else the checkout's own
    pairs: int = 1  # runs of (a) and of (b), the further ones alternating (schedule)
    argv: tuple[str, ...] = field(default=())


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
    parser.add_argument(
        "--configs",
        help=f"which configurations, run in the order {','.join(c.key for c in CONFIGS)} whatever the list's "
        f"[{','.join(DEFAULT_CONFIGS)}; {','.join(QUICK_CONFIGS)} with --quick]",
    )
    parser.add_argument(
        "--budgets", type=_ints, default=(), help="also `eg2 serve --gpu-memory-mib N` for each N"
    )
    parser.add_argument("--model-dir", type=Path, help="a BF16 checkpoint instead of a generated one")
    parser.add_argument(
        "--cache-dir", type=Path, default=DEFAULT_CACHE, help=f"generated checkpoints [{DEFAULT_CACHE}]"
    )
    parser.add_argument("--batch-sizes", type=_ints, help="matrix batch sizes [1,8,32,64; 1,8 with --quick]")
    parser.add_argument(
        "--concurrency", type=_ints, help="clients sending single short texts [1,32,128; 1,4 with --quick]"
    )
    parser.add_argument(
        "--media-clients", type=int, help="clients sending single images, clips [16; 2 with --quick]"
    )
    parser.add_argument(
        "--seconds", type=float, help="time box of one cell's timed rounds [0.4; 0.05 with --quick]"
    )
    parser.add_argument(
        "--time-limit", type=float, help="stop the run after this many seconds [510; none with --quick]"
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="run (a) and (b) this many times each, alternating which goes first; packed / BF16 per "
        "matrix cell from the medians [1]",
    )
    parser.add_argument(
        "--commit", help="the commit to record instead of the checkout's own (a copied tree's may be stale)"
    )
    args = parser.parse_args(argv)
    q = args.quick
    known = {c.key: c for c in CONFIGS}
    keys = [
        k.strip()
        for k in (args.configs or ",".join(QUICK_CONFIGS if q else DEFAULT_CONFIGS)).split(",")
        if k.strip()
    ]
    if not keys or set(keys) - set(known):
        parser.error(f"--configs takes keys of {','.join(known)}, got {args.configs!r}")
    configs = tuple(c for c in CONFIGS if c.key in keys) + tuple(budget_config(m) for m in args.budgets)
    if args.pairs < 1 or (args.pairs > 1 and not {"a", "b"} <= set(keys)):
        parser.error(
            f"--pairs {args.pairs}: a count of at least 1, and past 1 with both a and b in --configs"
        )

    import torch  # here: `eg2 bench --help` answers without it

    # torch.cuda.is_available() asks the driver how many devices there are; it creates no CUDA
    # context, so this process holds no GPU memory of its own.
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    if device == "cpu" and not q and args.size is None:
        # The full-size benchmark on a CPU would run for hours; asking for it must be explicit.
        parser.error("no CUDA device: `eg2 bench --quick` checks the harness on a CPU (--size full insists)")
    seconds = args.seconds if args.seconds is not None else (0.05 if q else 0.4)
    # Quick mode checks the harness, not speed: no warm-up, one timed round, one request per client.
    budget = (
        Budget(seconds, warmup=0, min_rounds=1, max_rounds=2, cap_s=seconds, per_client=1)
        if q
        else Budget(seconds, warmup=2, min_rounds=3, max_rounds=200, cap_s=2.5 * seconds)
    )
    return Options(
        out=args.out.resolve(),
        device=device,
        size=args.size or ("tiny" if q else "full"),
        quick=q,
        configs=configs,
        model_dir=args.model_dir.resolve() if args.model_dir else None,
        cache_dir=args.cache_dir,
        batch_sizes=args.batch_sizes or ((1, 8) if q else (1, 8, 32, 64)),
        concurrency=args.concurrency or ((1, 4) if q else (1, 32, 128)),
        media_clients=args.media_clients or (2 if q else 16),
        budget=budget,
        time_limit_s=args.time_limit if args.time_limit is not None else (None if q else 510.0),
        commit=args.commit,
        pairs=args.pairs,
        argv=tuple(argv),
    )


def schedule(configs: tuple[Config, ...], pairs: int) -> list[tuple[Config, int]]:
    """Each configuration once (run 0), in order, with the further runs of (a) and (b) right after
    (b)'s first: (b), (a) as run 1, (a), (b) as run 2, and so on up to `pairs` runs of each. The
    order alternates, so neither side always runs first on a host whose speed drifts, and the pairs
    come before the other configurations take the time limit's share."""
    by_key = {c.key: c for c in configs}
    later = [(by_key[k], i) for i in range(1, pairs) for k in (("b", "a") if i % 2 else ("a", "b"))]
    runs: list[tuple[Config, int]] = []
    for c in configs:
        runs.append((c, 0))
        if c.key == "b":
            runs += later
    return runs


# ------------------------------------------------------------------------------------------ the run


def _stop_on_signal(*_: object) -> None:
    raise Stopped


def run(opts: Options) -> dict[str, Any]:
    t_origin = time.time()

    def progress(line: str) -> None:
        print(f"[bench {time.time() - t_origin:6.1f} s] {line}", file=sys.stderr, flush=True)

    deadline = t_origin + opts.time_limit_s if opts.time_limit_s else math.inf
    results: dict[str, Any] = {"schema": 2, "meta": _meta(opts, t_origin), "configs": {}, "workloads": {}}
    previous = {s: signal.signal(s, _stop_on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    opts.out.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix="eg2-bench-") as tmp_dir, contextlib.ExitStack() as stack:
            tmp = Path(tmp_dir)
            peak = _start(
                [sys.executable, "-m", "benchmarks.inprocess", "peak", "--device", opts.device,
                 "--out", str(tmp / "peak.json")]
            )  # fmt: skip
            bf16, w4 = stack.enter_context(checkpoints(opts.model_dir, opts.cache_dir, opts.size, progress))
            workloads = _workloads(bf16, opts, tmp / "workloads.pkl")
            results["workloads"] = workloads.describe()
            results["meta"] |= _peak(peak, tmp / "peak.json")
            progress(
                f"{len(workloads.matrix)} matrix cells, {len(workloads.named)} named workloads; "
                f"BF16 matmul peak {results['meta'].get('matmul_peak_tflops') or 0:.3g} TFLOP/s; "
                f"configs {','.join(c.key for c in opts.configs)}"
            )
            pool: ProcessPoolExecutor | None = None
            for cfg, run_no in schedule(opts.configs, opts.pairs):
                head = {
                    "label": cfg.label,
                    "kind": cfg.kind,
                    "checkpoint": cfg.checkpoint,
                    "gpu_memory_mib": cfg.gpu_memory_mib,
                }
                left = deadline - time.time()
                if left < 20:
                    skipped = {"error": "skipped: --time-limit reached"}
                    if run_no:
                        _repeat(results, cfg.key, head, skipped | {"run": run_no})
                    else:
                        results["configs"][cfg.key] = head | skipped
                    continue
                limit = left if opts.quick else min(left, cfg.time_s)
                settle_device(NVML)  # the previous configuration's memory is back: alone on the GPU
                model_dir = w4 if cfg.checkpoint == "w4" else bf16
                again = f", run {run_no + 1} of {opts.pairs}" if run_no else ""
                progress(f"({cfg.key}) {cfg.label}{again}: starting ({limit:.0f} s at most)")
                try:
                    if cfg.kind == "server":
                        if pool is None:
                            spawn = multiprocessing.get_context("spawn")
                            pool = stack.enter_context(
                                ProcessPoolExecutor(client_processes(), mp_context=spawn)
                            )
                        figures = _served(cfg, model_dir, workloads, opts, pool, limit, t_origin, progress)
                    else:
                        budget_bytes = matched_budget(bf16, w4) if cfg.matched_budget else None
                        head["gpu_memory_mib"] = budget_bytes // (1 << 20) if budget_bytes else None
                        # Where (a) kept the token table, so does (b): the same plan but the weights.
                        a_host = results["configs"].get("a", {}).get("weights", {}).get("host_bytes")
                        table = bool(a_host) if cfg.matched_budget and a_host is not None else None
                        figures = _inprocess(
                            cfg, model_dir, opts, tmp, limit, t_origin, progress, budget_bytes, table, run_no
                        )
                except Stopped as stopped:  # keep what the configuration measured before the signal
                    if stopped.args and not run_no:
                        results["configs"][cfg.key] = head | stopped.args[0]
                    raise
                if run_no:  # another run of (a) or (b): its matrix beside the first run's
                    run_figures = {k: figures.get(k) for k in ("matrix", "error", "wall_s")}
                    _repeat(results, cfg.key, head, run_figures | {"run": run_no})
                else:
                    results["configs"][cfg.key] = head | figures
                _conclude(results, t_origin, complete=False)
                write(results, opts.out, chart_too=False)
    except Stopped:
        progress("stopped by a signal: writing what was measured")
        results["meta"]["stopped"] = True
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    _conclude(results, t_origin, complete=not results["meta"].get("stopped"))
    return results


def _repeat(results: dict[str, Any], key: str, head: dict[str, Any], record: dict[str, Any]) -> None:
    """A further run of (a) or (b) (`--pairs`), kept in its configuration's `repeats`."""
    results["configs"].setdefault(key, head).setdefault("repeats", []).append(record)


def _start(cmd: list[str]) -> subprocess.Popen[bytes]:
    """A configuration's process, run from the checkout's root (so `benchmarks` and `app` import)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    return subprocess.Popen(cmd, cwd=ROOT, env=env)


def _peak(proc: subprocess.Popen[bytes], path: Path) -> dict[str, Any]:
    """The matmul peak's child (run while the inputs were built): its figure, or its failure."""
    code = proc.wait()
    if code != 0 or not path.exists():
        return {"matmul_peak_tflops": None, "matmul_peak_error": f"exit status {code}"}
    return dict(json.loads(path.read_text()))


def _workloads(bf16: Path, opts: Options, path: Path) -> Workloads:
    from eg2_runtime.preprocess import Preprocessor

    workloads = build(Preprocessor.from_dir(bf16), QUICK if opts.quick else FULL, opts.batch_sizes)
    with path.open("wb") as f:
        pickle.dump(workloads, f)
    return workloads


def matched_budget(bf16: Path, w4: Path) -> int:
    """The w4 engine's default budget plus what the BF16 weight files add over the w4 ones (the text
    weights are the same in both; the towers' Linears are BF16 in one, packed in the other)."""
    from eg2_runtime.memory_plan import DEFAULT_MEDIA_BUDGET

    size = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))  # noqa: E731
    return DEFAULT_MEDIA_BUDGET + max(0, size(bf16) - size(w4))


def _inprocess(
    cfg: Config,
    model_dir: Path,
    opts: Options,
    tmp: Path,
    limit: float,
    t_origin: float,
    progress: Progress,
    gpu_memory_budget: int | None = None,
    host_token_table: bool | None = None,
    run_no: int = 0,
) -> dict[str, Any]:
    """(a), (b) or (c) in a child process, its memory sampled from here. A child past `limit` is
    killed; its JSON, rewritten after every cell, keeps what it measured. `run_no`: which run of the
    configuration this is (`--pairs`), each with files of its own."""
    from app.service import GPU_BATCH_TOKENS
    from app.settings import Settings

    spec = {
        "key": cfg.key,
        "label": cfg.label,
        "kind": cfg.kind,
        "model_dir": str(model_dir),
        "device": opts.device,
        "quick": opts.quick,
        "budget": asdict(opts.budget),
        # Engine.warm_up's batch as `eg2 serve` runs it on a GPU with its default settings.
        "max_batch_items": Settings.model_fields["max_batch_items"].default,
        "max_batch_tokens": GPU_BATCH_TOKENS,
        "gpu_memory_budget": gpu_memory_budget,  # bytes; None: the engine's default
        "host_token_table": host_token_table,  # None: the memory plan decides
        "t_origin": t_origin,
    }
    name = f"{cfg.key}.{run_no}" if run_no else cfg.key
    spec_path, out = tmp / f"{name}.spec.json", tmp / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    sampler = PeakSampler()  # before the child starts: the fallback's baseline excludes it
    t0 = time.time()
    proc = _start([sys.executable, "-m", "benchmarks.inprocess", cfg.key, "--spec", str(spec_path),
                   "--workloads", str(tmp / "workloads.pkl"), "--out", str(out)])  # fmt: skip
    sampler.start(proc.pid)
    error = None
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        error = f"stopped after {limit:.0f} s (its time limit); what it measured is kept"
    except Stopped:
        error = "stopped by a signal; what it measured is kept"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sampler.stop()
    figures: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"pid": proc.pid}
    figures["exit_code"] = proc.returncode
    figures["wall_s"] = time.time() - t0
    if error or (proc.returncode != 0 and not figures.get("error")):
        figures["error"] = error or f"the process exited with {proc.returncode}"
    figures["memory"] = memory_record(sampler, figures.get("points") or {}, figures.get("phases") or {})
    if error and error.startswith("stopped by a signal"):
        raise Stopped(figures)
    return figures


def _served(
    cfg: Config,
    model_dir: Path,
    workloads: Workloads,
    opts: Options,
    pool: ProcessPoolExecutor,
    limit: float,
    t_origin: float,
    progress: Progress,
) -> dict[str, Any]:
    served = Served(model_dir, opts.device, cfg.modalities, cfg.gpu_memory_mib, cfg.sweep)
    named = [w for w in workloads.named if cfg.modalities is None or w.key in TEXT_NAMED]
    rows: list[tuple[str, Input, int]] = [
        ("text_short", workloads.sweep["text_short"], c) for c in opts.concurrency
    ]
    rows += [(f, workloads.sweep[f], opts.media_clients) for f in ("image", "audio_short")]
    processes = min(client_processes(), max(c for _, _, c in rows))
    (opts.out / "logs").mkdir(parents=True, exist_ok=True)
    log_path = opts.out / "logs" / f"server-{cfg.key}.log"
    return run_served(
        cfg.key, served, named, rows, opts.budget, pool, processes, log_path, limit, t_origin, progress
    )


def _conclude(results: dict[str, Any], t_origin: float, *, complete: bool) -> None:
    """Errors and targets from what has run so far."""
    results["errors"] = _errors(results["configs"])
    if results["meta"].get("stopped"):
        results["errors"].append("the run was stopped by a signal before it finished")
    results["meta"]["wall_s"] = time.time() - t_origin
    results["meta"]["complete"] = complete
    results["targets"] = targets(results)


def _errors(configs: dict[str, Any]) -> list[str]:
    errors = []
    for key, cfg in configs.items():
        if cfg.get("error"):
            errors.append(f"({key}) {cfg['error']}")
        for group in ("matrix", "named"):
            for k, c in (cfg.get(group) or {}).items():
                errors += [f"({key}) {k}: {c[e]}" for e in ("error", "extras_error") if c.get(e)]
        errors += [
            f"({key}) sweep {r['family']} x {r['concurrency']}: {r['error']}"
            for r in cfg.get("sweep") or []
            if r.get("error")
        ]
        for repeat in cfg.get("repeats") or []:  # --pairs' further runs
            run = f"({key}) run {repeat['run'] + 1}"
            errors += [f"{run}: {repeat['error']}"] if repeat.get("error") else []
            errors += [
                f"{run} {k}: {c['error']}" for k, c in (repeat.get("matrix") or {}).items() if c.get("error")
            ]
    return errors


# ------------------------------------------------------------------------------------------- outputs


def _meta(opts: Options, t_origin: float) -> dict[str, Any]:
    def pkg(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    import torch

    options = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items() if k != "configs"}
    return {
        "date": datetime.fromtimestamp(t_origin, UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["eg2", "bench", *opts.argv]),  # = python -m benchmarks.bench ...
        "process_argv": sys.argv,
        "options": options,
        "size": opts.size,
        "quick": opts.quick,
        "configs": [c.key for c in opts.configs],
        "device": opts.device,
        "gpu": None,  # filled in by the matmul peak's child, which holds the GPU
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
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
                "nvidia-ml-py",
            )
        },
        # A copied tree may carry stale git metadata (the H200's copy does): a given commit wins.
        "git": f"{opts.commit} (given)" if opts.commit else _git(),
    }


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _git() -> str | None:
    """The commit of this checkout, with "+dirty" for local changes; None outside a git checkout."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10, check=True
        )
        return done.stdout.strip()

    try:
        head, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parse(argv)
    results = run(opts)
    paths = write(results, opts.out)
    print("\n".join(str(p) for p in paths))
    for t in results["targets"]:
        status = "not judged" if not t["judged"] else {True: "met", False: "NOT MET", None: "n/a"}[t["met"]]
        value = "-" if t["value"] is None else f"{t['value']:.3g}"
        print(f"  #{t['issue']} {status:10s} {t['name']}: {value} (goal {t['goal']})")
    if results["errors"]:
        print(f"{len(results['errors'])} failure(s):", *results["errors"], sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
