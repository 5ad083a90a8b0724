"""Probe (GPU): what the CUDA context and the libraries cost a process, and what shrinks it.

    python -m benchmarks.probe_context            prints one JSON line per step

The process's own GPU memory (NVML) after CUDA init, after cuBLAS, after SDPA, and after lowering
the per-thread stack limit (cudaLimitStackSize, which sizes the context's local-memory reserve) and
the device heap (cudaLimitMallocHeapSize): the base every budget pays before any weight. Then what a
second stream adds: one made by the CUDA runtime, and one from torch's stream pools.
"""

from __future__ import annotations

import ctypes
import json

from eg2_runtime.gpu_memory import ProcessGpuMemory, cudart

MEM = ProcessGpuMemory()

import torch  # noqa: E402

from eg2_runtime.streams import side_stream  # noqa: E402

STACK, HEAP = 0x00, 0x02  # cudaLimit enum


def step(name: str, **extra: object) -> None:
    torch.cuda.synchronize()
    r = MEM.read()
    mib = None if r is None else round(r.bytes / 2**20, 1)
    print(json.dumps({"step": name, "process_mib": mib, **extra}), flush=True)


def main() -> None:
    torch.zeros(1, device="cuda")
    step("cuda init")
    rt = cudart() or ctypes.CDLL("libcudart.so")  # the one torch loaded, else the linker's
    value = ctypes.c_size_t()
    limits = {}
    for name, which in (("stack", STACK), ("heap", HEAP)):
        rt.cudaDeviceGetLimit(ctypes.byref(value), which)
        limits[name] = value.value
    step("limits read", **limits)
    a = torch.randn(2048, 2048, dtype=torch.bfloat16, device="cuda")
    (a @ a).sum().item()
    step("cublas")
    q = torch.randn(1, 4, 512, 64, dtype=torch.bfloat16, device="cuda")
    torch.nn.functional.scaled_dot_product_attention(q, q, q)
    step("sdpa")
    for name, which, size in (("stack", STACK, 256), ("heap", HEAP, 1 << 20)):
        err = rt.cudaDeviceSetLimit(which, ctypes.c_size_t(size))
        torch.cuda.synchronize()
        step(f"{name} limit -> {size}", cuda_error=err)
    (a @ a).sum().item()
    torch.nn.functional.scaled_dot_product_attention(q, q, q)
    step("cublas and sdpa again")
    # A side stream (the Unpacker's): one made by the CUDA runtime, then torch's own, which is taken
    # from torch's stream pools (created, every stream of them, on the first such call).
    side = side_stream(torch.device("cuda"), "probe")  # what the engine makes (streams.py)
    with torch.cuda.stream(side):
        (a + 1).sum().item()
    step("one stream from the runtime, a kernel on it", external=isinstance(side, torch.cuda.ExternalStream))
    pooled = torch.cuda.Stream()
    with torch.cuda.stream(pooled):
        (a + 1).sum().item()
    step("torch.cuda.Stream(), a kernel on it")


if __name__ == "__main__":
    main()
