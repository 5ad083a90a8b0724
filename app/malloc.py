"""glibc malloc under a serving load: the mmap threshold, the arena bound, and giving freed heap back
when the server goes idle. `eg2 serve`'s process applies these (app/server.py); its media-preparing
processes and `eg2 serve-ray`'s replicas do not. Where the C library is not glibc, each is a no-op.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time

from app.cores import usable_cores

M_MMAP_THRESHOLD = -3  # glibc <malloc.h>
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 16 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


# glibc malloc arenas. By default a thread that finds the arenas busy gets a new one (up to 8 per
# core), and each keeps its freed memory: the service's threads (event loop, preprocessing, GPU,
# torch's) made the RSS jump at random points of tests/reliability/test_reliability_load.py's
# measured phase. Bounded arenas removed the jumps that new arenas made; what the bounded ones keep
# free is given back by the idle trim below (docs/RELIABILITY.md). One arena per usable core, not a
# fixed 2: the tokenizer encodes a batch on one thread per core, each allocating through glibc, and
# 16 threads sharing 2 arenas' locks made a 16-core host prepare short docs several times slower
# (docs/PERF.md, benchmarks/probe_malloc_arenas.py). A 2-core host keeps 2 arenas. MALLOC_ARENA_MAX
# in the environment still wins.
def malloc_arenas() -> int:
    """The arena bound tune_malloc sets: one per core this process may use, at least 2."""
    return max(2, usable_cores())


def tune_malloc(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Keep glibc from raising its mmap threshold as large tensors are freed, and bound its arenas
    (malloc_arenas); False where not glibc.

    glibc starts at 128 KiB and, each time an mmapped block is freed, raises the threshold to that
    block's size (up to 32 MiB). After warm-up's full batches, activations of every later size come
    from the heap, whose freed space fragments and is rarely returned: under varied batch shapes the
    RSS crept up over a few thousand requests (docs/RELIABILITY.md). Fixed at 16 MiB, big blocks keep
    their own mappings and go back to the OS when freed; small ones stay on the heap.
    """
    libc = _libc()
    try:
        if libc is None:
            return False
        if "MALLOC_ARENA_MAX" not in os.environ:
            libc.mallopt(M_ARENA_MAX, malloc_arenas())
        return bool(libc.mallopt(M_MMAP_THRESHOLD, nbytes))
    except AttributeError:
        return False


def available() -> bool:
    """Whether this process's C library is glibc, with malloc_trim."""
    libc = _libc()
    return libc is not None and hasattr(libc, "malloc_trim")


def trim() -> float:
    """Give the arenas' free pages back to the OS (glibc's malloc_trim(0)); the seconds it took.

    Blocks under the mmap threshold come from the arenas, and a burst's freed ones stay there,
    resident, between live blocks that keep the heap from shrinking. malloc_trim releases every free
    page of every arena (madvise), holding each arena's lock in turn: its time grows with the free
    heap, and the next allocations fault those pages in again (docs/RELIABILITY.md). ctypes releases
    the GIL for the call."""
    start = time.perf_counter()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
    return time.perf_counter() - start


class IdleTrim:
    """When to trim: once the server has been idle for `idle_s`, and then not again until requests
    have come and gone. Polled from the server's tick (every 0.1 s while the server is ready and no
    trim runs) with the count of requests started so far and whether any work is still held
    (Service.holds_work).

    Nothing is pending at start: the first trim follows the first burst, so a server that just
    turned ready is not trimming as its first requests come."""

    def __init__(self, idle_s: float, now: float) -> None:
        self.idle_s = idle_s
        self._requests = 0
        self._quiet_since = now
        self._pending = False

    def due(self, now: float, requests: int, busy: bool) -> bool:
        """Whether to trim now; True once per quiet spell that follows work."""
        if requests != self._requests or busy:
            self._requests = requests
            self._quiet_since = now
            self._pending = True
            return False
        if not self._pending or now - self._quiet_since < self.idle_s:
            return False
        self._pending = False
        return True
