"""Probe (CPU): what the idle trim costs the first request after it.

    python -m benchmarks.trim_latency [--rounds 12] [--idle-s 1]     (from the repository root)

After a trim the heap's free pages are gone, and the next request's allocations fault them in again.
Two `eg2 serve` processes on the tiny demo checkpoint, default settings but the trim: one trims after
`--idle-s` of quiet (malloc_trim_idle_s), the other never (0). Each round, on each server in turn
(the order alternating): the same burst of tests/reliability/test_reliability_load.py's mixed load
(300 requests, 128 clients), a pause of `--idle-s` + 1.5 s (the first server trims in it, which is
checked), then one single-text request and a second one, each timed at the client. Prints each
side's medians and the median of the rounds' ratios (trim / no trim).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from eg2_runtime.tools.demo_model import write_demo_model
from tests.reliability.test_reliability_load import (
    Reference,
    phase,
    trims,
)
from tests.support.load import Serve

BURST = 300
QUERY = {"input": "how far is the river from the north stone", "encoding_format": "base64"}


def timed_ms(client: httpx.Client) -> float:
    start = time.perf_counter()
    response = client.post("/v1/embeddings", json=QUERY)
    elapsed = (time.perf_counter() - start) * 1000
    response.raise_for_status()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--idle-s", type=float, default=1.0, help="the trimming server's malloc_trim_idle_s")
    args = parser.parse_args()

    model = write_demo_model(Path(tempfile.mkdtemp()), size="tiny", seed=0, dtype="bfloat16")
    reference = Reference(model).embed_every_item()
    sides = {"trim": args.idle_s, "no trim": 0.0}
    first: dict[str, list[float]] = {side: [] for side in sides}
    second: dict[str, list[float]] = {side: [] for side in sides}
    with contextlib.ExitStack() as stack:
        servers = {
            side: stack.enter_context(
                Serve(
                    [
                        "--model",
                        str(model),
                        "--device",
                        "cpu",
                        "--log-level",
                        "warning",
                        "--malloc-trim-idle-s",
                        str(idle),
                    ]
                )
            )
            for side, idle in sides.items()
        }
        clients = {
            side: stack.enter_context(httpx.Client(base_url=s.wait_ready().url, timeout=30))
            for side, s in servers.items()
        }
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for side in order:
                before = trims(servers[side])
                phase(servers[side], reference, r * BURST, BURST)  # both sides: the same requests
                time.sleep(args.idle_s + 1.5)
                trimmed = trims(servers[side]) > before
                assert trimmed == (side == "trim"), f"{side}: trimmed {trimmed}"
                first[side].append(timed_ms(clients[side]))
                second[side].append(timed_ms(clients[side]))
    for side in sides:
        print(
            f"{side}: first request after the pause {statistics.median(first[side]):.2f} ms, "
            f"the next {statistics.median(second[side]):.2f} ms (medians of {args.rounds})"
        )
    ratios = [a / b for a, b in zip(first["trim"], first["no trim"], strict=True)]
    print(f"first request, trim / no trim: median of rounds {statistics.median(ratios):.3f}x")


if __name__ == "__main__":
    main()
