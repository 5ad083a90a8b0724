"""Side CUDA streams made by the CUDA runtime itself, outside torch's stream pools.

Why: `torch.cuda.Stream()` takes a stream from torch's per-device pools, and the first such call
creates every stream of them. On the H200 that added 92 MiB to the process's GPU memory, where one
stream made by the runtime added 22 MiB, a kernel run on each included (benchmarks/probe_context.py,
2026-12-02). The engine keeps two side streams for the life of the process, the Unpacker's and the
graph captures' warm-up stream; neither needs a pool. The runtime is the library torch loaded
(gpu_memory.cudart), so it shares torch's context and current device.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from eg2_runtime.gpu_memory import cudart

log = logging.getLogger(__name__)

CUDA_STREAM_NON_BLOCKING = 0x01  # as torch's pooled streams: no implicit sync with the legacy stream


_STREAMS: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
_LOCK = threading.Lock()  # engines built on two threads at once get the same stream


def side_stream(device: torch.device, purpose: str) -> torch.cuda.Stream:
    """The side stream on `device` for `purpose` ("unpack", "capture"): one per pair for the life of
    the process, non-blocking, made by cudaStreamCreateWithFlags. A model loaded twice shares it,
    which assumes what the service does: one engine's thread drives the GPU.
    Falls back to torch's pools, with a warning, where the runtime cannot be reached."""
    device = torch.device(
        device.type, device.index if device.index is not None else torch.cuda.current_device()
    )
    key = (device, purpose)
    with _LOCK:
        if key not in _STREAMS:
            _STREAMS[key] = _make(device)
        return _STREAMS[key]


def _make(device: torch.device) -> torch.cuda.Stream:
    raw = ctypes.c_void_p()
    try:
        runtime = cudart()
        if runtime is None:
            why = "the CUDA runtime library was not found"
        else:
            with torch.cuda.device(device):
                torch.cuda.init()  # the runtime makes the stream in torch's context
                err = runtime.cudaStreamCreateWithFlags(ctypes.byref(raw), CUDA_STREAM_NON_BLOCKING)
            if not err:
                return torch.cuda.ExternalStream(raw.value, device=device)
            why = f"CUDA error {err}"
    except OSError as e:
        why = str(e)
    log.warning("no side stream from the CUDA runtime (%s): one from torch's pools", why)
    return torch.cuda.Stream(device)
