"""Probe (CPU; run it on a many-core host such as the H200's): does the server's bound on glibc's malloc
arenas slow its text preparation?

    python -m benchmarks.probe_malloc_arenas [--model DIR] [--rounds 3]     (from the repository root)

`eg2 serve` bounds glibc's arenas (app.malloc.tune_malloc) against RSS drift: one per usable core, at
least 2. The tokenizer's batch encode spreads over every core (Rust threads that allocate through
glibc). Under the earlier fixed bound of 2, 16 threads shared 2 arenas' locks, and the H200 host
prepared 64 docs in 4.0x the time of glibc's defaults (docs/PERF.md); a 2-core machine cannot show
such contention.

Each configuration runs in a fresh process (a thread's arena is fixed at its first allocation), the
modes alternated for --rounds rounds: glibc's defaults; the server's `tune_malloc()`; that with a
serial tokenizer (TOKENIZERS_PARALLELISM=false); and the earlier 2 arenas, alone and with the
tokenizer's threads capped at 4 (RAYON_NUM_THREADS). Each prepares the bench's named 64 docs (20-60
tokens), its query, and 64 docs of 500 tokens (where a serial tokenizer would lose) with
`Engine.prepare_many` on a thread of its own, at the server's GIL switch interval, as the server
does. The tiny demo checkpoint serves by default: its tokenizer is the full checkpoint's stand-in.
Prints each side's median and its ratio to glibc's defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Each mode's environment. tune_malloc leaves an operator's MALLOC_ARENA_MAX alone, which sets the
# earlier bound of 2. Rayon reads RAYON_NUM_THREADS at the tokenizer pool's first use: fewer threads
# on the 2 arenas. TOKENIZERS_PARALLELISM=false encodes a batch on the calling thread.
ENVIRONMENTS: dict[str, dict[str, str]] = {
    "glibc default": {},
    "tune_malloc": {},
    "tune_malloc, serial encode": {"TOKENIZERS_PARALLELISM": "false"},
    "tune_malloc, 2 arenas": {"MALLOC_ARENA_MAX": "2"},
    "tune_malloc, 2 arenas, 4 encode threads": {"MALLOC_ARENA_MAX": "2", "RAYON_NUM_THREADS": "4"},
}
MODES = tuple(ENVIRONMENTS)
# Stripped from the caller's environment first, so that each mode is what its name says.
SET_BY_MODES = {"MALLOC_ARENA_MAX", "RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM"}


def child(mode: str, model: str, calls_per_shape: int) -> dict[str, float]:
    """Microseconds per prepare_many call (median) in this process, set up as `mode` says."""
    if mode.startswith("tune_malloc"):
        from app.malloc import tune_malloc

        tune_malloc()  # before anything allocates on another thread
    from app.settings import Settings
    from benchmarks.workloads import FULL, Factory, named_text
    from eg2_runtime.engine import Engine
    from eg2_runtime.inputs import PrepareOptions

    sys.setswitchinterval(Settings().gil_switch_interval_ms / 1000)
    engine = Engine.from_dir(model, device="cpu")
    named = {w.key: w for w in named_text(Factory(engine.preprocessor), FULL)}
    calls = {
        name: [x.item() for x in named[key].calls[0]]
        for name, key in (
            ("64 docs", "docs_one_call"),
            ("1 query", "short_query"),
        )
    }
    factory = Factory(engine.preprocessor)
    calls["64 docs of 500 tokens"] = [factory.text(500, seed=5000 + i).item() for i in range(64)]
    out: dict[str, float] = {}

    def run() -> None:  # on a thread of its own, as the server's preparing pool runs it
        for name, items in calls.items():
            engine.prepare_many(items, PrepareOptions())
            times = []
            for _ in range(calls_per_shape):
                start = time.perf_counter()
                engine.prepare_many(items, PrepareOptions())
                times.append(time.perf_counter() - start)
            out[name] = 1e6 * statistics.median(times)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: a tiny demo checkpoint)")
    parser.add_argument("--rounds", type=int, default=3, help="processes per configuration, alternated")
    parser.add_argument("--calls", type=int, default=400, help="timed calls per shape in each process")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.calls)), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from eg2_runtime.tools.demo_model import write_demo_model

            model = str(write_demo_model(Path(tmp) / "tiny", size="tiny"))
        got: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for i in range(args.rounds):
            for mode in MODES if i % 2 == 0 else MODES[::-1]:  # no mode always first
                cmd = [sys.executable, "-m", "benchmarks.probe_malloc_arenas", "--child", mode]
                cmd += ["--model", model, "--calls", str(args.calls)]
                env = {k: v for k, v in os.environ.items() if k not in SET_BY_MODES} | ENVIRONMENTS[mode]
                done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
                line = done.stdout.splitlines()[-1]
                got[mode].append(json.loads(line))
    for shape in got[MODES[0]][0]:
        medians = {mode: statistics.median(r[shape] for r in runs) for mode, runs in got.items()}
        base = medians[MODES[0]]
        sides = ", ".join(f"{m} {us:.0f} us ({us / base:.2f}x)" for m, us in medians.items())
        runs = json.dumps({m: [round(r[shape]) for r in rs] for m, rs in got.items()})
        print(f"{shape}: {sides}; each process: {runs}")


if __name__ == "__main__":
    main()
