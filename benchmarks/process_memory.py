"""The GPU memory of the process under test, read from outside it: a sampler thread polling NVML.

What a co-located model loses is the process's own GPU memory as nvidia-smi shows it (CUDA context,
libraries, weights, graphs, activations, allocator cache): eg2_runtime.gpu_memory reads it, by PID.
The orchestrating process polls the configuration's process every ~50 ms from a thread of its own
(it holds no CUDA context itself, so it perturbs nothing on the GPU), and the peak of any phase is
the largest sample inside that phase's time span. The configuration's own readings at named points
(after load, after the named workloads) come from the same reader.

On a machine without NVML (a CPU, CI) every figure is None: nothing is made up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from eg2_runtime.gpu_memory import ProcessGpuMemory

MiB = 1 << 20
POLL_S = 0.05


class PeakSampler:
    """Samples process `pid`'s GPU memory every POLL_S seconds, from now until `stop()`.

    Build it before the process initialises CUDA: where NVML cannot name the PID (a container's PID
    namespace), the reading falls back to the device's used memory minus what it was at construction,
    which is exact only with the process alone on the GPU (the benchmark runs one at a time)."""

    def __init__(self, reader: ProcessGpuMemory | None = None) -> None:
        self.reader = reader if reader is not None else ProcessGpuMemory()
        self.samples: list[tuple[float, int]] = []  # (time.time(), bytes)
        self.source: str | None = None
        self._pid: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self.reader.available

    def start(self, pid: int) -> PeakSampler:
        self._pid = pid
        if self.available:
            self._thread = threading.Thread(target=self._run, name="bench-gpu-sampler", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.read()
            self._stop.wait(POLL_S)

    def read(self) -> int | None:
        """The process's GPU memory now (also recorded as a sample), or None without NVML."""
        if self._pid is None:
            return None
        reading = self.reader.read(self._pid)
        if reading is None:
            return None
        self.samples.append((time.time(), reading.bytes))
        self.source = reading.source
        return reading.bytes

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def peak(self, start: float | None = None, end: float | None = None) -> int | None:
        """The largest sample between `start` and `end` (time.time(); open ends take everything)."""
        picked = [b for t, b in self.samples if (start is None or t >= start) and (end is None or t <= end)]
        return max(picked) if picked else None

    def phase_peaks(self, phases: Mapping[str, tuple[float, float]]) -> dict[str, int | None]:
        """{phase: peak bytes} for phases given as {name: (start, end)}."""
        return {name: self.peak(a, b) for name, (a, b) in phases.items()}


def settle_device(reader: ProcessGpuMemory, timeout_s: float = 5.0) -> None:
    """Wait until the device's used memory stops falling (a process that just exited has handed its
    memory back), so the next configuration's baseline is the idle device's. No-op without NVML."""
    last = reader.device_used_bytes()
    deadline = time.monotonic() + timeout_s
    while last is not None and time.monotonic() < deadline:
        time.sleep(0.2)
        now = reader.device_used_bytes()
        if now is None or now >= last:
            return
        last = now


def memory_record(
    sampler: PeakSampler, points: Mapping[str, int | None], phases: Mapping[str, tuple[float, float]]
) -> dict[str, Any]:
    """A configuration's `memory` figures: readings at named points, peaks per phase and overall, in
    bytes; None where NVML is unavailable."""
    return {
        "source": sampler.source,
        "points_bytes": dict(points),
        "phase_peaks_bytes": sampler.phase_peaks(phases),
        "peak_bytes": sampler.peak(),
        "samples": len(sampler.samples),
    }
