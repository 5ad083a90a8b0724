"""The server's glibc malloc bound (app.server.tune_malloc): one arena per usable core, at least 2,
and an operator's MALLOC_ARENA_MAX wins. Counted from glibc itself: each thread's first allocation
takes a new arena until the bound is reached, and malloc_stats() prints one "Arena N:" per arena."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THREADS = 12  # more threads than any bound tested here, fewer than glibc's default (8 per core)

# Pinned to `cores` CPUs, optionally tuned, THREADS threads each hold a 1 MiB heap block at once;
# prints the bound tune_malloc computed (or 0) and glibc's arena count goes to stderr.
CHILD = """
import ctypes, os, sys, threading
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:{cores}])
from app.server import malloc_arenas, tune_malloc
if {tune}:
    assert tune_malloc()
barrier = threading.Barrier({threads})
def hold():
    block = bytearray(1 << 20)  # under the 16 MiB mmap threshold: from this thread's arena
    barrier.wait()
threads = [threading.Thread(target=hold) for _ in range({threads})]
for t in threads: t.start()
for t in threads: t.join()
print(malloc_arenas() if {tune} else 0, flush=True)
ctypes.CDLL("libc.so.6").malloc_stats()
"""


def arenas(cores: int, tune: bool, env: dict[str, str] | None = None) -> tuple[int, int]:
    """(the bound tune_malloc set, the arenas glibc made) in a fresh process."""
    code = CHILD.format(cores=cores, tune=tune, threads=THREADS)
    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | (env or {})
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True, check=True
    )
    made = sum(line.startswith("Arena ") for line in done.stderr.splitlines())
    return int(done.stdout.split()[-1]), made


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_arenas_are_bounded_at_one_per_core_and_at_least_two() -> None:
    cores = len(os.sched_getaffinity(0))
    bound, made = arenas(1, tune=True)
    assert (bound, made) == (2, 2), "one core still gets 2 arenas"
    if cores >= 2:
        bound, made = arenas(cores, tune=True)
        assert bound == max(2, cores) and made == min(bound, THREADS), (bound, made)
    _, untuned = arenas(1, tune=False)
    assert untuned > 2, f"glibc's default made {untuned} arenas: the bound above proved nothing"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_an_operators_malloc_arena_max_wins() -> None:
    _, made = arenas(1, tune=True, env={"MALLOC_ARENA_MAX": "5"})
    assert made == 5
