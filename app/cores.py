"""How many cores this process may use: what sizes its thread and process pools and malloc's arenas."""

from __future__ import annotations

import os
from pathlib import Path


def usable_cores(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The cores this process may use: its CPU affinity, capped by its cgroup's CPU quota where one
    is set (a container given `--cpus 4` on a 64-core host sees 64 cores in its affinity)."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return cores
    if quota == "max":
        return cores
    try:
        return max(1, min(cores, int(quota) // max(1, int(period))))
    except ValueError:
        return cores
