"""Not run yet: the next H200 session's probe for the 64-text gap.

In both H200 benches (2026-11-29 evening, 2026-11-30), a call of 64 short texts (prepare_many + embed)
took 15.6-15.8 ms at p50 while Engine.embed on the same prepared items took 7.1-8.2 ms: ~8 ms of
host work, against 1.2 ms at 32 texts and 0.5 ms for prepare_many of 64 texts on the 2-core dev
machine (CPU engine, same inputs: no gap there). The suspicion: the tokenizer's Rayon pool (16 threads
on that host) against torch's OpenMP threads spinning after their parallel regions. This times each
stage on the GPU engine, with the tokenizer parallel and serial.

    python3 docs/results/2026-11-30-h200/probe_text64.py        (repo root, .whl installed, on the GPU)
"""

import os
import statistics
import sys
import time

parallel = os.environ.get("TOKENIZERS_PARALLELISM", "unset")
import torch  # noqa: E402

from eg2_runtime.engine import Engine  # noqa: E402
from eg2_runtime.tools.bench_measure import OPTIONS  # noqa: E402
from eg2_runtime.tools.bench_workloads import Factory, Sizes  # noqa: E402
from eg2_runtime.tools.demo_model import write_demo_model  # noqa: E402

cuda = torch.cuda.is_available()  # on a CPU (a smoke test): the tiny checkpoint
model = write_demo_model(
    sys.argv[1] if len(sys.argv) > 1 else "/tmp/full", size="full" if cuda else "tiny", seed=0
)
engine = Engine.from_dir(model, device="cuda" if cuda else "cpu", modalities={"text"})
if cuda:
    engine.capture_graphs()
factory = Factory(engine.preprocessor)


def median_ms(fn, n: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


print(f"TOKENIZERS_PARALLELISM={parallel} torch threads {torch.get_num_threads()} cpus {os.cpu_count()}")
for b in (32, 64):
    items = [x.item() for x in factory.row("text_short", Sizes(), b)]
    prepared = engine.prepare_many(items, OPTIONS)
    call = median_ms(lambda items=items: engine.embed(engine.prepare_many(items, OPTIONS)))
    embed = median_ms(lambda prepared=prepared: engine.embed(prepared))
    prepare = median_ms(lambda items=items: engine.prepare_many(items, OPTIONS))
    print(f"b{b}: call {call:.2f} ms, embed {embed:.2f}, prepare_many {prepare:.2f}, gap {call - embed:.2f}")
