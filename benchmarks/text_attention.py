"""Padded vs packed text forward: milliseconds, and achieved TFLOP/s against the card's measured BF16
matmul peak (issue #15's workloads).

    # from the repository root; the H200 (about 5 minutes; --sections splits it into shorter runs)
    PYTHONPATH=$PWD python3 benchmarks/text_attention.py out/text_attention.json
    # a CPU dry run of the harness: the tiny checkpoint, short workloads, a minute
    PYTHONPATH=$PWD python3 benchmarks/text_attention.py /tmp/text_attention.json --size tiny --quick

Workloads: 64 docs of 20-60 tokens in one batch; 256 docs of 40 tokens in 4 batches of 64; 1 doc of
2,200 tokens; 1 doc of 8,000 tokens (--quick: a tenth of each length, a quarter of each count).

Three measurements per workload, each a median of CUDA-event times after warm-ups, eager (no CUDA
graphs), on embeddings made before timing:
- `forward`: the text encoder plus pooling, padded (`TextEncoder.forward` + `pool`, the reference)
  against packed (`Packing.from_lengths` + `forward_packed` + `Packing.pool`) for each attention
  backend combination, with the packed vectors' lowest cosine against the padded ones;
- `attention`: one layer's attention kernel alone per layer kind and backend, against the padded
  path's SDPA call on the same batch; for one item on the full layers (no mask needed), also SDPA
  forced to cuDNN and to the CUTLASS kernel, and scores by cuBLAS with an FP32 softmax;
- `flex_512`: FlexAttention on the full layers (head_dim 512) under several tile options; an option
  that does not compile is recorded with its error.

FLOPs are "useful" FLOPs: every token's matmuls plus attention over the allowed pairs only (each item
with itself, within the window on sliding layers), the same count for both paths, so the TFLOP/s
ratio of two paths is their speed ratio. `dense_attention_flops` is what the padded path's attention
computes (every pair of the padded batch), the convention of `eg2 bench`'s FlopCounterMode figure.

One run, no interaction; the JSON is rewritten after every measurement, so a run cut short keeps
what it measured. Each measurement that fails records its error and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.inprocess import device_times_ms, matmul_peak_tflops
from benchmarks.timing import Budget
from eg2_runtime import packed_attention
from eg2_runtime.config import FULL, SLIDING, TextConfig
from eg2_runtime.loader import load_model
from eg2_runtime.model import pool
from eg2_runtime.packed_attention import PackedAttention
from eg2_runtime.packing import Packing
from eg2_runtime.text import TextEncoder, attention_masks
from eg2_runtime.tools.demo_model import write_demo_model

CUDA_COMBOS = {
    "flex+efficient": {SLIDING: "flex", FULL: "efficient"},
    "flash+efficient": {SLIDING: "flash", FULL: "efficient"},  # the CUDA default (served)
    "flex+flex": {SLIDING: "flex", FULL: "flex"},
    "flash+flex": {SLIDING: "flash", FULL: "flex"},
}
CPU_COMBOS = {"dense+dense": {SLIDING: "dense", FULL: "dense"}, "flex+flex": {SLIDING: "flex", FULL: "flex"}}
FLEX_512_OPTIONS: list[dict[str, Any] | None] = [
    None,  # inductor's defaults
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 2, "num_warps": 4},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 2, "num_warps": 8},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 1, "num_warps": 4},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 1, "num_warps": 8},
    {"BLOCK_M": 128, "BLOCK_N": 32, "num_stages": 1, "num_warps": 8},
    {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 2, "num_warps": 4},
]


def workloads(quick: bool) -> dict[str, list[list[int]]]:
    """name -> its batches, each a list of item lengths (seeded)."""
    g = torch.Generator().manual_seed(0)
    if quick:
        return {
            "64 docs of 20-60": [torch.randint(2, 7, (16,), generator=g).tolist()],
            "256 docs of 40, 4 x 64": [[4] * 16 for _ in range(4)],
            "1 doc of 2200": [[220]],
            "1 doc of 8000": [[800]],
        }
    return {
        "64 docs of 20-60": [torch.randint(20, 61, (64,), generator=g).tolist()],
        "256 docs of 40, 4 x 64": [[40] * 64 for _ in range(4)],
        "1 doc of 2200": [[2200]],
        "1 doc of 8000": [[8000]],
    }


# ---- FLOPs -------------------------------------------------------------------------------------


def allowed_pairs(n: int, window: int | None) -> int:
    """(query, key) pairs of one item of n tokens: all of them, or those with |q - k| <= window."""
    if window is None or window >= n - 1:
        return n * n
    q = torch.arange(n)
    return int(((q + window).clamp(max=n - 1) - (q - window).clamp(min=0) + 1).sum())


def useful_flops(cfg: TextConfig, batches: list[list[int]]) -> dict[str, int]:
    """Matmul FLOPs every token needs, attention FLOPs over the allowed pairs, and what a padded
    batch's attention computes (every pair of B x T x T)."""
    h, nh = cfg.hidden_size, cfg.num_heads
    per_token = 2 * h * cfg.num_layers * cfg.ple_dim + 2 * h * cfg.embedding_dim  # PLE + projection
    attention = dense = 0
    for i, kind in enumerate(cfg.layer_types):
        hd, kv = cfg.head_dims[i], cfg.kv_heads[i]
        per_token += 2 * (
            2 * h * nh * hd + 2 * h * kv * hd + 3 * h * cfg.intermediate_size + 2 * h * cfg.ple_dim
        )
        window = cfg.sliding_window if kind == SLIDING else None
        pairs = sum(allowed_pairs(n, window) for batch in batches for n in batch)
        attention += 4 * nh * hd * pairs  # QK^T and PV, 2 FLOPs per multiply-add each
        dense += 4 * nh * hd * sum(len(batch) * max(batch) ** 2 for batch in batches)
    tokens = sum(sum(batch) for batch in batches)
    return {
        "matmul_flops": per_token * tokens,
        "attention_flops": attention,
        "total_flops": per_token * tokens + attention,
        "dense_attention_flops": dense,
    }


# ---- the runs ----------------------------------------------------------------------------------


class Run:
    def __init__(self, out: Path, device: torch.device, budget: Budget) -> None:
        self.out, self.device, self.budget = out, device, budget
        self.results: dict[str, Any] = {"meta": {}, "forward": {}, "attention": {}, "flex_512": {}}

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.results, indent=1) + "\n")

    def time(self, fn: Callable[[], object]) -> float:
        times = sorted(device_times_ms(fn, self.device, self.budget))
        return round(times[len(times) // 2], 4)

    def measure(self, section: str, workload: str, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        t0 = time.perf_counter()
        try:
            entry = fn()
        except Exception as e:
            entry = {"error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-3000:]}
        entry["wall_s"] = round(time.perf_counter() - t0, 1)
        self.results[section].setdefault(workload, {})[name] = entry
        shown = {k: v for k, v in entry.items() if k not in ("trace", "error")}
        print(f"{section} | {workload} | {name}: {entry.get('error', shown)}", flush=True)
        self.save()


def rate(flops: int, ms: float, peak: float) -> dict[str, float]:
    tflops = flops / (ms / 1e3) / 1e12
    return {"tflops": round(tflops, 2), "share_of_matmul_peak": round(tflops / peak, 4)}


def make_batches(
    encoder: TextEncoder, batches: list[list[int]], device: torch.device
) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Per batch: (lengths, (B, T, H) embeddings of random ids, (B, T) valid)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for lengths in batches:
        t = max(lengths)
        ids = torch.randint(10, 200_000, (len(lengths), t), generator=g)
        valid = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).to(device)
        with torch.no_grad():
            out.append((lengths, encoder.embed(ids), valid))
    return out


def forward_section(
    run: Run, encoder: TextEncoder, name: str, batches: list[list[int]], combos: dict[str, dict[str, str]]
) -> None:
    cfg, device = encoder.cfg, run.device
    flops = useful_flops(cfg, batches)
    peak = run.results["meta"]["matmul_peak_tflops"]
    data = make_batches(encoder, batches, device)

    def padded() -> list[torch.Tensor]:
        return [pool(encoder(e, v).float(), v.long()) for _, e, v in data]

    def packed(backends: dict[str, str]) -> Callable[[], list[torch.Tensor]]:
        def step() -> list[torch.Tensor]:
            out = []
            for lengths, e, v in data:
                packing = Packing.from_lengths(lengths, device)
                tokens = encoder.forward_packed(e[v], packing, backends)
                out.append(packing.pool(tokens.float()))
            return out

        return step

    with torch.inference_mode():
        reference = padded()

        def padded_entry() -> dict[str, Any]:
            ms = run.time(padded)
            tokens = sum(len(b) * max(b) for b in batches)
            return {"ms": ms, "padded_tokens": tokens, **flops, **rate(flops["total_flops"], ms, peak)}

        run.measure("forward", name, "padded", padded_entry)
        for combo, backends in combos.items():

            def packed_entry(backends: dict[str, str] = backends) -> dict[str, Any]:
                step = packed(backends)
                got = step()
                cos = min(float((a * b).sum(-1).min()) for a, b in zip(got, reference, strict=True))
                ms = run.time(step)
                tokens = sum(sum(b) for b in batches)
                return {"ms": ms, "tokens": tokens, "min_cosine_vs_padded": round(cos, 6),
                        **rate(flops["total_flops"], ms, peak)}  # fmt: skip

            run.measure("forward", name, combo, packed_entry)


def attention_section(
    run: Run, cfg: TextConfig, name: str, lengths: list[int], combos: dict[str, dict[str, str]]
) -> None:
    """One layer's attention alone, per kind: the padded path's SDPA call against each backend."""
    packing = Packing.from_lengths(lengths, run.device)
    with torch.inference_mode():
        for kind in (SLIDING, FULL):
            backends = sorted({c[kind] for c in combos.values()})
            attention_kind(run, cfg, f"{name} / {kind}", kind, lengths, packing, backends)


def attention_kind(
    run: Run,
    cfg: TextConfig,
    label: str,
    kind: str,
    lengths: list[int],
    packing: Packing,
    backends: list[str],
) -> None:
    device, peak = run.device, run.results["meta"]["matmul_peak_tflops"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layer = cfg.layer_types.index(kind)
    hd, kv, nh = cfg.head_dims[layer], cfg.kv_heads[layer], cfg.num_heads
    window = cfg.sliding_window if kind == SLIDING else None
    flops = 4 * nh * hd * sum(allowed_pairs(x, window) for x in lengths)
    g = torch.Generator(device=device).manual_seed(2)
    q, k, v = (
        torch.randn(packing.num_tokens, x, hd, generator=g, device=device, dtype=dtype) for x in (nh, kv, kv)
    )

    # The padded path's call: (B, heads, T, hd), its mask, kv heads repeated where it repeats them.
    t = max(lengths)
    valid = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).to(device)
    mask = attention_masks(valid, cfg.sliding_window)[kind]
    padded = []
    for x in (q, k, v):
        y = x.new_zeros(len(lengths), t, *x.shape[1:])
        y[valid] = x
        padded.append(y.transpose(1, 2))
    gqa = mask is None and hd <= 256
    if not gqa and kv != nh:
        padded[1:] = [y.repeat_interleave(nh // kv, dim=1) for y in padded[1:]]

    def sdpa() -> torch.Tensor:
        q_, k_, v_ = padded
        return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, scale=1.0, enable_gqa=gqa)  # type: ignore[arg-type]

    def timed(call: Callable[[], torch.Tensor]) -> dict[str, Any]:
        call()
        ms = run.time(call)
        return {"ms": ms, **rate(flops, ms, peak)}

    run.measure("attention", label, "padded sdpa", lambda: timed(sdpa))
    # flex at blocks of 64 too: less of each block wasted on short items, more blocks to list
    runs = [(b, 128) for b in backends] + ([("flex", 64)] if "flex" in backends else [])
    for backend, block in runs:
        # flex serves the other kind (every kind needs a backend it takes); the block masks are
        # built per call, as they are per batch
        chosen = {SLIDING: "flex", FULL: "flex", kind: backend}

        # Past QUERY_ROWS tokens the efficient kernel writes its output over q: it gets a working
        # copy made once, outside the timed call (its time does not depend on q's values, and the
        # values written there are averages of v's rows, so they stay bounded call after call).
        scratch_q = q.clone() if backend == "efficient" else q

        def call(
            chosen: dict[str, str] = chosen, block: int = block, q_in: torch.Tensor = scratch_q
        ) -> torch.Tensor:
            return PackedAttention(packing, cfg, chosen, block_size=block)(kind, q_in, k, v)

        name = backend if block == 128 else f"{backend} (blocks of {block})"
        run.measure("attention", label, name, lambda call=call: timed(call))  # type: ignore[misc]

    if kind == FULL and len(lengths) == 1:
        # One item needs no mask at all: every exact kernel that takes head_dim 512 is a candidate.
        def sdpa_with(backend: SDPBackend) -> Callable[[], torch.Tensor]:
            def call() -> torch.Tensor:
                with sdpa_kernel(backend):
                    q_, k_, v_ = padded
                    return F.scaled_dot_product_attention(q_, k_, v_, scale=1.0)

            return call

        def matmul() -> torch.Tensor:
            # the reference's eager path: scores by cuBLAS, softmax in FP32, then P @ V
            qh, kh, vh = padded[0][0], padded[1][0], padded[2][0]  # (nh, T, hd)
            weights = torch.softmax(qh @ kh.transpose(-1, -2), dim=-1, dtype=torch.float32)
            return weights.to(qh.dtype) @ vh

        for label_, call_ in (
            ("sdpa cudnn", sdpa_with(SDPBackend.CUDNN_ATTENTION)),
            ("sdpa efficient", sdpa_with(SDPBackend.EFFICIENT_ATTENTION)),
            ("matmul + softmax", matmul),
        ):
            run.measure("attention", label, label_, lambda c=call_: timed(c))  # type: ignore[misc]


def flex_512_section(run: Run, cfg: TextConfig, name: str, lengths: list[int]) -> None:
    device = run.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = run.results["meta"]["matmul_peak_tflops"]
    layer = cfg.layer_types.index(FULL)
    hd, kv, nh = cfg.head_dims[layer], cfg.kv_heads[layer], cfg.num_heads
    packing = Packing.from_lengths(lengths, device)
    g = torch.Generator(device=device).manual_seed(3)
    q, k, v = (
        torch.randn(packing.num_tokens, x, hd, generator=g, device=device, dtype=dtype) for x in (nh, kv, kv)
    )
    flops = 4 * nh * hd * sum(x * x for x in lengths)
    key = (dtype, hd)
    saved = packed_attention.FLEX_KERNEL_OPTIONS.get(key)
    with torch.inference_mode():
        reference = (
            PackedAttention(packing, cfg, {SLIDING: "dense", FULL: "dense"})(FULL, q, k, v)
            if packing.num_tokens <= 4096
            else None
        )
        for options in FLEX_512_OPTIONS:

            def entry(options: dict[str, Any] | None = options) -> dict[str, Any]:
                if options is None:
                    packed_attention.FLEX_KERNEL_OPTIONS.pop(key, None)
                else:
                    packed_attention.FLEX_KERNEL_OPTIONS[key] = options
                attention = PackedAttention(packing, cfg, {SLIDING: "flex", FULL: "flex"})
                out = attention(FULL, q, k, v)
                ms = run.time(lambda: attention(FULL, q, k, v))
                extra = (
                    {}
                    if reference is None
                    else {"max_abs_diff_vs_dense": float((out - reference).abs().max())}
                )
                return {"ms": ms, **rate(flops, ms, peak), **extra}

            run.measure("flex_512", name, json.dumps(options), entry)
    if saved is None:
        packed_attention.FLEX_KERNEL_OPTIONS.pop(key, None)
    else:
        packed_attention.FLEX_KERNEL_OPTIONS[key] = saved


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the JSON file to write")
    p.add_argument("--size", choices=("full", "tiny"), default="full", help="random checkpoint size")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="short workloads and few rounds (CPU dry run)")
    p.add_argument("--model", type=Path, help="a checkpoint directory (default: a random one, generated)")
    p.add_argument("--sections", default="forward,attention,flex_512", help="comma-separated, of those")
    p.add_argument("--workloads", default="", help="run only workloads whose name contains this")
    args = p.parse_args(argv)
    sections = set(args.sections.split(","))
    # Every tile option and shape is one more compile of flex_attention; past dynamo's default limit
    # of 8 it would fall back to the unfused eager path and time that instead.
    torch._dynamo.config.recompile_limit = 256

    device = torch.device(args.device)
    budget = Budget(0.5, 1, 2, 3, 1.0) if args.quick else Budget(1.0, 3, 5, 20, 3.0)
    run = Run(args.out, device, budget)
    combos = CUDA_COMBOS if device.type == "cuda" else CPU_COMBOS
    meta = run.results["meta"]
    meta.update(
        argv=sys.argv, torch=torch.__version__, python=platform.python_version(), device=str(device),
        started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )  # fmt: skip
    if device.type == "cuda":
        import triton

        meta.update(
            gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda, triton=triton.__version__
        )
    meta["matmul_peak_tflops"] = matmul_peak_tflops(device)
    run.save()
    print(f"{device}: BF16 matmul peak {meta['matmul_peak_tflops']:.1f} TFLOP/s", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or write_demo_model(Path(tmp) / "model", size=args.size, seed=0)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = load_model(model_dir, device, modalities={"text"}, dtype=dtype)[0]
    encoder = model.language_model
    meta["model"] = "random " + args.size if args.model is None else str(args.model)

    for name, batches in workloads(args.quick).items():
        if args.workloads not in name:
            continue
        if "forward" in sections:
            forward_section(run, encoder, name, batches, combos)
        if "attention" in sections:
            attention_section(run, encoder.cfg, name, batches[0], combos)
        # On a CPU (a dry run) the tile options do nothing: eager flex has no tiles.
        if "flex_512" in sections and name.startswith("1 doc") and (device.type == "cuda" or args.quick):
            flex_512_section(run, encoder.cfg, name, batches[0])

    from torch._dynamo.utils import counters

    meta["dynamo"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "recompiles", "graph_break")}
    meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    run.save()
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
