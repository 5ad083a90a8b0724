"""Side CUDA streams made by the CUDA runtime itself, outside torch's stream pools.

Why: `torch.cuda.Stream()` takes a stream from torch's per-device pools, and the first such call
creates every stream of them. On the H200 that added 92 MiB to the process's GPU memory, where one
stream made by the runtime added 22 MiB, a kernel run on each included (benchmarks/probe_context.py,
2026-12-02). The engine keeps two side streams for the life of the process, the Unpacker's and the
graph captures' warm-up stream; neither needs a pool. The runtime is the library torch loaded
(gpu_memory.cudart), so it shares torch's context and current device.

A stream's priority orders the blocks of kernels waiting for free SMs: a block of a higher-priority
stream's kernel is dispatched before one of a lower. A CUDA graph keeps the priority of the stream each
kernel was captured on (torch instantiates graphs with cudaGraphInstantiateFlagUseNodePriority).
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from eg2_runtime.gpu_memory import cudart

log = logging.getLogger(__name__)

CUDA_STREAM_NON_BLOCKING = 0x01  # as torch's pooled streams: no implicit sync with the legacy stream


_STREAMS: dict[tuple[torch.device, str, bool], torch.cuda.Stream] = {}
_LOCK = threading.Lock()  # engines built on two threads at once get the same stream


def side_stream(device: torch.device, purpose: str, high_priority: bool = False) -> torch.cuda.Stream:
    """The side stream on `device` for `purpose` ("unpack", "capture"): one per (device, purpose,
    priority) for the life of the process, non-blocking, made by cudaStreamCreateWithPriority at the
    device's greatest priority with `high_priority`, else at its least (the default streams'). A
    model loaded twice shares it, which assumes what the service does: one engine's thread drives the
    GPU. Falls back to torch's pools, with a warning, where the runtime cannot be reached."""
    device = torch.device(
        device.type, device.index if device.index is not None else torch.cuda.current_device()
    )
    key = (device, purpose, high_priority)
    with _LOCK:
        if key not in _STREAMS:
            _STREAMS[key] = _make(device, high_priority)
        return _STREAMS[key]


def _make(device: torch.device, high_priority: bool) -> torch.cuda.Stream:
    raw = ctypes.c_void_p()
    least, greatest = ctypes.c_int(), ctypes.c_int()
    try:
        runtime = cudart()
        if runtime is None:
            why = "the CUDA runtime library was not found"
        else:
            with torch.cuda.device(device):
                torch.cuda.init()  # the runtime makes the stream in torch's context
                err = runtime.cudaDeviceGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest))
                priority = greatest.value if high_priority else least.value
                err = err or runtime.cudaStreamCreateWithPriority(
                    ctypes.byref(raw), CUDA_STREAM_NON_BLOCKING, priority
                )
            if not err:
                return torch.cuda.ExternalStream(raw.value, device=device)
            why = f"CUDA error {err}"
    except OSError as e:
        why = str(e)
    log.warning("no side stream from the CUDA runtime (%s): one from torch's pools", why)
    # torch maps a priority past the device's range to its nearest end.
    return torch.cuda.Stream(device, priority=-(1 << 10) if high_priority else 0)
