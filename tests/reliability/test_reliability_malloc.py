"""The server's glibc malloc (app/malloc.py): its trim gives freed heap back, and its arena bound
(tune_malloc) is one arena per usable core, at least 2, where an operator's MALLOC_ARENA_MAX wins.
The arenas are counted from glibc itself: the main thread has the main arena, each other thread's
first allocation takes a new one until the bound is reached (so T threads make min(bound, T + 1)),
and malloc_stats() prints one "Arena N:" per arena. The bound is computed in the child, pinned to
`cores` CPUs, against its own usable_cores() (a cgroup quota caps it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THREADS = 12  # more threads than any bound tested here, fewer than glibc's default (8 per core)

# Pinned to `cores` CPUs, optionally tuned, THREADS threads each hold a 1 MiB heap block at once;
# prints the bound tune_malloc computed (or 0) and max(2, usable_cores()); glibc's count goes to stderr.
CHILD = """
import ctypes, os, sys, threading
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:{cores}])
from app.malloc import malloc_arenas, tune_malloc
from app.cores import usable_cores
if {tune}:
    assert tune_malloc()
barrier = threading.Barrier({threads})
def hold():
    block = bytearray(1 << 20)  # under the 16 MiB mmap threshold: from this thread's arena
    barrier.wait()
threads = [threading.Thread(target=hold) for _ in range({threads})]
for t in threads: t.start()
for t in threads: t.join()
print(malloc_arenas() if {tune} else 0, max(2, usable_cores()), flush=True)
ctypes.CDLL("libc.so.6").malloc_stats()
"""


def arenas(cores: int, tune: bool, env: dict[str, str] | None = None) -> tuple[int, int, int]:
    """(the bound tune_malloc set, one per usable core and at least 2, the arenas glibc made) in a
    fresh process pinned to `cores` CPUs."""
    code = CHILD.format(cores=cores, tune=tune, threads=THREADS)
    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | (env or {})
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True, check=True
    )
    made = sum(line.startswith("Arena ") for line in done.stderr.splitlines())
    bound, per_core = (int(x) for x in done.stdout.split()[-2:])
    return bound, per_core, made


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_arenas_are_bounded_at_one_per_core_and_at_least_two() -> None:
    bound, _, made = arenas(1, tune=True)
    assert (bound, made) == (2, 2), "one core still gets 2 arenas"
    _, _, untuned = arenas(1, tune=False)
    assert untuned > 2, f"glibc's default made {untuned} arenas: the bound above proved nothing"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 3, reason="a bound above 2 needs 3 cores or more")
def test_arenas_grow_with_the_cores() -> None:
    """A fixed bound of 2 (the earlier one) fails here: 4 cores give 4 arenas."""
    cores = min(4, len(os.sched_getaffinity(0)))
    bound, per_core, made = arenas(cores, tune=True)
    assert bound == per_core > 2 and made == min(bound, THREADS + 1), (bound, per_core, made)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_an_operators_malloc_arena_max_wins() -> None:
    _, _, made = arenas(1, tune=True, env={"MALLOC_ARENA_MAX": "5"})
    assert made == 5


# 200 MiB of 64 KiB blocks from the main arena (under the server's 16 MiB mmap threshold), all freed
# but the last, which pins the heap's top: free() alone can give none of it back. Prints the RSS in kB
# after the allocation, after the frees, and after trim().
TRIM_CHILD = """
from app.malloc import trim, tune_malloc
def rss():
    return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmRSS:")))
assert tune_malloc()
blocks = [b"x" * (64 << 10) for _ in range(3200)]
full = rss()
del blocks[:-1]
freed = rss()
trim()
print(full, freed, rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_trim_gives_freed_heap_back() -> None:
    done = subprocess.run(
        [sys.executable, "-c", TRIM_CHILD], cwd=ROOT, capture_output=True, text=True, check=True
    )
    full, freed, trimmed = (int(x) for x in done.stdout.split())
    assert full - freed < 20_000, f"free() gave back {full - freed} kB: nothing was left for the trim"
    assert freed - trimmed > 150_000, f"the trim gave back {freed - trimmed} kB of 200 MiB freed"
