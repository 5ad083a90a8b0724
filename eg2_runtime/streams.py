"""Side CUDA streams made by the CUDA runtime itself, outside torch's stream pools.

Why: `torch.cuda.Stream()` takes a stream from torch's per-device pools, and the first such call
creates every stream of them. On the H200 that added 92 MiB to the process's GPU memory, where one
stream made by the runtime added 22 MiB, a kernel run on each included (benchmarks/probe_context.py,
2026-12-02). The engine keeps two side streams for the life of the process, the Unpacker's and the
graph captures' warm-up stream; neither needs a pool.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from eg2_runtime.gpu_memory import cudart

log = logging.getLogger(__name__)

CUDA_STREAM_NON_BLOCKING = 0x01  # as torch's pooled streams: no implicit sync with the legacy stream


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """A new non-blocking stream on `device`, made by cudaStreamCreateWithFlags and never destroyed
    (callers keep theirs for the life of the process). Falls back to torch's pools, with a warning,
    where the runtime cannot be reached."""
    runtime = cudart()
    raw = ctypes.c_void_p()
    with torch.cuda.device(device):
        torch.cuda.init()
        err = (
            -1
            if runtime is None
            else runtime.cudaStreamCreateWithFlags(ctypes.byref(raw), CUDA_STREAM_NON_BLOCKING)
        )
    if err:
        log.warning("cudaStreamCreateWithFlags failed (%s): a side stream from torch's pools", err)
        return torch.cuda.Stream(device)
    return torch.cuda.ExternalStream(raw.value, device=device)
