"""Probe (CPU): what Python's GIL switch interval costs a thread that blocks often beside a busy one.

    python -m benchmarks.gil_switch [--steps 5] [--intervals 5,1,0.5]

The server's GPU thread releases the GIL at each blocking step of a batch (a copy, a sync) and must
win it back from the event loop, which holds it while it parses requests. This times a stand-in:
`--steps` waits of 0.2 ms (GIL released), each followed by a little Python, while another thread runs
pure Python, once per switch interval (sys.setswitchinterval). Alone the call takes ~1-1.5 ms.
The figures behind the `gil_switch_interval_ms` setting (app/settings.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time


def call(steps: int) -> float:
    """ms of one stand-in GPU call: `steps` blocking waits, Python between them."""
    start = time.perf_counter()
    for _ in range(steps):
        time.sleep(0.0002)  # the GIL released, as in a CUDA synchronize
        sum(range(2000))  # the thread's own Python between the waits
    return 1e3 * (time.perf_counter() - start)


def beside_a_busy_thread(interval_s: float, steps: int, calls: int = 40) -> float:
    """Median ms of `call` while another thread runs pure Python, at this switch interval."""
    sys.setswitchinterval(interval_s)
    stop = threading.Event()

    def busy() -> None:  # the event loop parsing requests
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i

    thread = threading.Thread(target=busy)
    thread.start()
    try:
        return statistics.median(call(steps) for _ in range(calls))
    finally:
        stop.set()
        thread.join()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--intervals", default="5,1,0.5", help="switch intervals in ms")
    args = parser.parse_args()
    default = sys.getswitchinterval()
    print(f"alone: {statistics.median(call(args.steps) for _ in range(40)):.2f} ms")
    for ms in (float(v) for v in args.intervals.split(",")):
        print(
            f"switch interval {ms:g} ms: {beside_a_busy_thread(ms / 1000, args.steps):.2f} ms beside a busy thread"
        )
    sys.setswitchinterval(default)


if __name__ == "__main__":
    main()
