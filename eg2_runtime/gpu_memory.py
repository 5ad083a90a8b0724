"""The process's own GPU memory, as nvidia-smi shows it: what a co-located model cannot use.

torch's allocator counters (allocated, reserved) miss the CUDA context, the libraries' kernels and
handles, and memory other allocators hold; a co-located language model loses all of it. NVML's
per-process figure holds everything. Where NVML cannot name this process (a PID namespace that hides
host PIDs, say), the fallback is the device's used memory now minus what it was before this process
touched the GPU: exact only with nothing else starting on the GPU meanwhile, which is how the
benchmark runs it, and marked as such in `source`.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reading:
    bytes: int
    source: str  # "nvml-process" or "nvml-device-delta"


class ProcessGpuMemory:
    """Reads a process's GPU memory on one device: this process's, or another's by its PID (the
    benchmark reads the process under test from outside it). Build it before the process it reads
    initialises CUDA, so the fallback's baseline excludes that process's own context."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self._nvml = None
        self._handle = None
        self._baseline: int | None = None
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._baseline = int(pynvml.nvmlDeviceGetMemoryInfo(self._handle).used)
            self._nvml = pynvml
        except Exception as e:  # no NVIDIA driver (CPU machines), or no nvidia-ml-py
            log.debug("NVML unavailable: %s", e)

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def read(self, pid: int | None = None) -> Reading | None:
        """The GPU memory of process `pid` (this process when None) now, or None without NVML."""
        nvml = self._nvml
        if nvml is None:
            return None
        pid = os.getpid() if pid is None else pid
        for query in (nvml.nvmlDeviceGetComputeRunningProcesses, nvml.nvmlDeviceGetGraphicsRunningProcesses):
            try:
                for p in query(self._handle):
                    if p.pid == pid and p.usedGpuMemory is not None:
                        return Reading(int(p.usedGpuMemory), "nvml-process")
            except nvml.NVMLError:
                continue
        used = int(nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        return Reading(max(0, used - (self._baseline or 0)), "nvml-device-delta")

    def device_used_bytes(self) -> int | None:
        """The whole device's used memory (every process), or None without NVML."""
        if self._nvml is None:
            return None
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def total_bytes(self) -> int | None:
        if self._nvml is None:
            return None
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).total)


CUDA_LIMIT_STACK_SIZE = 0x00  # cudaLimitStackSize


def set_cuda_stack_limit(nbytes: int) -> bool:
    """Set the per-thread stack size the CUDA context reserves local memory for (cudaDeviceSetLimit on
    the current device, which torch has initialised); False where the CUDA runtime is not loaded.

    The runtime's default, 1 KiB per thread, reserves local memory for every thread the GPU can hold
    at once: on the H200 the process's memory fell from 738 to 540 MiB at 256 bytes, with cuBLAS and
    SDPA running after it (benchmarks/probe_context.py, 2026-12-01). A kernel that needs a deeper
    stack makes the driver grow the reservation when it launches, so the limit costs no kernel.
    """
    runtime = cudart()
    if runtime is None:
        return False
    err = runtime.cudaDeviceSetLimit(CUDA_LIMIT_STACK_SIZE, ctypes.c_size_t(nbytes))
    if err:
        log.warning("cudaDeviceSetLimit(stack, %d) failed with CUDA error %d", nbytes, err)
    return err == 0


CUBLAS_WORKSPACE_CONFIG = "CUBLAS_WORKSPACE_CONFIG"


def bound_cublas_workspace(nbytes: int) -> bool:
    """Give cuBLAS one workspace of `nbytes` per (handle, stream) it runs on, instead of torch's
    default (32 MiB on Hopper; 4 MiB x 2 + 16 KiB x 8 elsewhere), through CUBLAS_WORKSPACE_CONFIG.
    torch reads that once, at the process's first cuBLAS call, so this must come before it; an
    operator's own CUBLAS_WORKSPACE_CONFIG wins. False where the variable was already set.

    The workspaces are allocator blocks held for the life of the process, one for each stream a
    matmul ran on: the engine's eager stream and the graph captures' stream, so 64 MiB by default.
    """
    if CUBLAS_WORKSPACE_CONFIG in os.environ:
        return False
    os.environ[CUBLAS_WORKSPACE_CONFIG] = f":{max(1, nbytes >> 10)}:1"
    return True


def cuda_stack_limit() -> int | None:
    """The per-thread stack bytes the CUDA context reserves now (cudaDeviceGetLimit); None where the
    CUDA runtime is not loaded or the call fails. What set_cuda_stack_limit set, or what the driver
    grew it to since."""
    runtime, value = cudart(), ctypes.c_size_t(0)
    if runtime is None or runtime.cudaDeviceGetLimit(ctypes.byref(value), CUDA_LIMIT_STACK_SIZE) != 0:
        return None
    return value.value


def cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded, wherever it lives; None where none is loaded."""
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    return ctypes.CDLL(paths[0]) if paths else None
