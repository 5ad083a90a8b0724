"""Benchmark (one GPU): the text encoder's fused Triton kernels alone, on the packed batches the
service runs, and qkv_norm_rope's launch tile.

    PYTHONPATH=$PWD python3 benchmarks/text_kernels.py --out out/text_kernels.json     (a minute)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 benchmarks/text_kernels.py --out /tmp/tk.json \\
        --device cpu --tokens 40 --rounds 1                                            (CPU dry run)

For each --tokens count (2,544: the bench's 64 docs; 2,304: the 2,200-token document's graph
bucket) and each layer kind of the text encoder (sliding: 4 query heads and 2 kv heads of 256; full:
4 and 1 of 512), times `rope_triton.qkv_norm_rope` under every tile of TILES (values of one head a
program takes, warps), then `add_rms_norm` and `gelu_tanh_mul` as the encoder calls them (hidden 512,
MLP 2,048). Each time is the device time of one call, from a CUDA graph of --calls calls replayed
--rounds times (median), as the engine's graphs replay them: no launch overhead. Beside each, the
bytes the call must move (inputs read once, outputs written once; the cos/sin tables once) and the
bandwidth that implies. Random BF16 inputs: the kernels' time does not depend on the values. Writes
JSON to --out and prints a table. Not a test: it asserts nothing (tests/runtime/test_rope_triton.py
proves every tile gives the same bits in Triton's CPU interpreter; on the GPU the warps may change
the last bits, tests/gpu/test_gpu_packed_text.py).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.vision_kernels import graph_us
from eg2_runtime.mlp_triton import gelu_tanh_mul
from eg2_runtime.rmsnorm_triton import add_rms_norm
from eg2_runtime.rope_triton import QKV_TILE, qkv_norm_rope

# (heads, kv heads, head_dim) of the text encoder's layer kinds; hidden, MLP: the full checkpoint's
# (eg2_runtime/tools/demo_model.py writes the same config).
KINDS = {"sliding": (4, 2, 256), "full": (4, 1, 512)}
HIDDEN, MLP = 512, 2048
TILES = [(e, w) for e in (2048, 4096, 8192) for w in (4, 8)] + [(1024, 2), (16384, 16)]


def device_us(call: Callable[[], object], device: torch.device, calls: int, rounds: int) -> float:
    """Median microseconds per call: a CUDA graph of `calls` calls replayed `rounds` times; on a
    CPU, the wall clock of `calls` calls."""
    if device.type == "cuda":
        return graph_us(call, calls, rounds)
    call()
    began = time.perf_counter()
    for _ in range(calls):
        call()
    return 1e6 * (time.perf_counter() - began) / calls


def row(name: str, us: float, nbytes: int) -> dict[str, Any]:
    return {
        "kernel": name,
        "us": round(us, 2),
        "mbytes": round(nbytes / 1e6, 2),
        "gbps": round(nbytes / us / 1e3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", default="2544,2304", help="packed tokens per batch, comma-separated")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    rows: list[dict[str, Any]] = []

    def report(entry: dict[str, Any]) -> None:
        rows.append(entry)
        print(json.dumps(entry), flush=True)

    with torch.inference_mode():
        for n in (int(x) for x in args.tokens.split(",")):
            for kind, (heads, kv, hd) in KINDS.items():
                width = (heads + 2 * kv) * hd
                qkv = torch.randn(n, width, generator=g, device=device, dtype=dtype)
                qw, kw = (torch.randn(hd, generator=g, device=device, dtype=dtype) for _ in range(2))
                cos, sin = (torch.randn(n, hd, generator=g, device=device, dtype=dtype) for _ in range(2))
                nbytes = 2 * (2 * n * width + 2 * n * hd)  # qkv read, q k v written, cos and sin read
                for tile in TILES:
                    call = partial(qkv_norm_rope, qkv, heads, kv, qw, kw, (1e-6,) * 3, cos, sin, tile=tile)
                    try:
                        us = device_us(call, device, args.calls, args.rounds)
                    except Exception as e:  # a tile the compiler refuses (registers, shared memory)
                        report({"tokens": n, "layer": kind, "tile": tile, "error": repr(e)[:200]})
                        continue
                    entry = row("qkv_norm_rope", us, nbytes)
                    report({"tokens": n, "layer": kind, "tile": tile, "served": tile == QKV_TILE, **entry})
            x, y = (torch.randn(n, HIDDEN, generator=g, device=device, dtype=dtype) for _ in range(2))
            w = torch.randn(HIDDEN, generator=g, device=device, dtype=dtype)
            scale = torch.ones(1, device=device, dtype=dtype)
            us = device_us(
                partial(add_rms_norm, x, y, w, 1e-6, w, 1e-6, scale), device, args.calls, args.rounds
            )
            report({"tokens": n, **row("add_rms_norm", us, 2 * 4 * n * HIDDEN)})
            gate, up = (torch.randn(n, MLP, generator=g, device=device, dtype=dtype) for _ in range(2))
            us = device_us(partial(gelu_tanh_mul, gate, up), device, args.calls, args.rounds)
            report({"tokens": n, **row("gelu_tanh_mul", us, 2 * 3 * n * MLP)})
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "args": vars(args) | {"out": str(args.out)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
