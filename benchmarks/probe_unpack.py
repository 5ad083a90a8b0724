"""Probe (GPU): packed towers against BF16 ones, by how the Unpacker's unpacks are scheduled.

    python -m benchmarks.probe_unpack --out DIR [--ahead 1,2,3] [--priority] [--main-priority]
                                      [--block-words 128,2048] [--per-slot 0,1] [--repeat N] [--trace]
                                      [--seconds S] [--budget-mib 8000] [--layer-major 2]
    python -m benchmarks.probe_unpack --out /tmp/pu --device cpu --size tiny --seconds 0.1   # dry run

For `eg2 bench`'s packed / BF16 cells on the media rows. Each variant runs in its own process, booted
as the bench's in-process configurations boot (warm-up, start-up graphs): the hybrid-w4 engine at
its default budget with `EngineOptions.unpack_ahead` = each --ahead, and the BF16 engine at that
budget plus what its weights add (bench.matched_budget), so the two differ in the weights' format
alone. Per media row of the bench matrix (batches 1 and 8) it times, as the bench does,
`Engine.embed` on items prepared beforehand and the engine's forward alone (CUDA events), and
reports each w4 variant's forward as a ratio of BF16's (BF16 ms / w4 ms: 1.0 is parity). Each slot
comes out of the graph pool at the same budget, so a deeper ring may capture fewer buckets: each
variant's plan and tower graphs are in its JSON.

The scheduling variants: `--priority` captures the unpacks on a stream of the device's greatest
priority (at each --ahead); `--main-priority` (ahead 1) captures the towers' own kernels (the graph
capture stream) at that priority instead, so the unpacks yield to them. torch instantiates graphs
with cudaGraphInstantiateFlagUseNodePriority, so a node keeps the priority of the stream it was
captured on. `--block-words` runs the unpack kernel with that many int32 words a program
(unpack_triton.BLOCK_WORDS; more words, fewer and longer programs). `--repeat` runs the whole list
that many times, alternated, BF16 included. `--trace` profiles five forwards of image/b8, video/b1
and audio_short/b1 per variant and sums their kernels' device time by kind (kernel_summary): whether
a packed forward loses its time to slower matmuls beside the unpacks or to the unpacks themselves.
`--per-slot` runs ahead 1 with unpack groups of at most that many times the largest layer's weights
(loader.LAYERS_PER_SLOT; 0: one launch a layer). `--budget-mib` also runs ahead 1 and BF16 at each of
these budgets (BF16's plus what its weights add), where the pool admits larger tower buckets: a
batch then runs in fewer graph replays, and so unpacks each tower fewer times (a replay unpacks
every packed layer once). The default-budget pair beside it says what the replays cost.
`--layer-major` also runs w4 and BF16 at each --budget-mib with the vision tower's attention and MLP
taken that many images (or frames) at a time inside a bucket (the lab's `_layer_major`), the batch
through one layer before the next: an unpack group serves each of its chunks while it keeps running,
which an attention's q, k, v and o (one group) do; a vision MLP's gate, up and down are a group each
(loader.LAYERS_PER_SLOT 1), so they unpack again for every chunk. It needs --budget-mib: a chunked
bucket holds less than the pool's estimate, so the default budget would admit the same buckets.
Writes unpack.json into DIR and prints the table. Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.bench import matched_budget
from benchmarks.workloads import DEFAULT_CACHE, FULL, checkpoints
from eg2_runtime.memory_plan import DEFAULT_MEDIA_BUDGET, MIB

ROWS = ("image/b1", "image/b8", "audio_short/b1", "audio_short/b8", "audio_long/b1", "video/b1", "video/b8")


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One variant, in this process: boot the engine, then time the media rows."""
    import torch

    from app.service import GPU_BATCH_TOKENS
    from app.settings import Settings
    from benchmarks.inprocess import Ours
    from benchmarks.timing import Budget
    from benchmarks.workloads import Factory, matrix
    from eg2_runtime.engine import Engine, EngineOptions

    if spec.get("priority"):
        _high_priority_stream(spec["priority"])
    if spec.get("block_words"):
        from eg2_runtime import unpack_triton

        unpack_triton.BLOCK_WORDS = spec["block_words"]  # read by dequantize_run at each launch
    if spec.get("kernel"):
        _lab_kernel(spec["kernel"])
    if spec.get("layer_major"):
        _layer_major(spec["layer_major"])
    if spec.get("per_slot") is not None:
        from eg2_runtime import loader

        loader.LAYERS_PER_SLOT = spec["per_slot"]  # read by unpack_groups as the engine loads
    options = EngineOptions(gpu_memory_budget=spec["budget"], unpack_ahead=spec["ahead"])
    engine = Engine.from_dir(spec["model_dir"], device=spec["device"], options=options)
    graphs = 0
    if engine.device.type == "cuda":  # as the bench boots it; a CPU dry run has nothing to warm
        engine.warm_up(Settings.model_fields["max_batch_items"].default, GPU_BATCH_TOKENS)
        graphs = engine.capture_graphs()
    runner = Ours(engine)
    budget = Budget(
        seconds=spec["seconds"], warmup=3, min_rounds=5, max_rounds=200, cap_s=3 * spec["seconds"]
    )
    rows: dict[str, Any] = {}
    for w in matrix(Factory(engine.preprocessor), FULL, (1, 8)):
        if w.key not in ROWS:
            continue
        extras = runner.extras(w, budget, flops=False)
        rows[w.key] = {"embed_ms": extras["embed"]["p50_ms"], "forward_ms": extras["forward"]["p50_ms"]}
        if spec.get("trace") and w.key in TRACED and engine.device.type == "cuda":
            rows[w.key]["kernels"] = kernel_summary(engine, runner.forwards(runner.prepare(w.calls[0]))[0])
    towers = engine.towers
    return {
        "plan": engine.plan.describe() if engine.plan is not None else None,
        "graphs_at_start": graphs,
        "tower_graphs": sorted(str(k) for k in towers.graphs) if towers is not None else [],
        "unpack_scratch_mib": (engine.model.unpacker.scratch_bytes / 2**20) if engine.model.unpacker else 0,
        "unpack_launches": engine.model.unpacker.launches() if engine.model.unpacker else 0,
        "memory": engine.memory(),
        "rows": rows,
        "torch": torch.__version__,
    }


TRACED = ("image/b8", "video/b1", "audio_short/b1")  # the rows --trace profiles

# Kernel kinds by name, first match wins (cuDNN's SDPA kernels carry "sm90" too).
KINDS = (
    ("dequant", ("dequant",)),
    ("attention", ("sdpa", "fmha", "flash", "attention")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma")),
)


def kernel_summary(engine: Any, prepared: list[Any], forwards: int = 5) -> dict[str, Any]:
    """Five forwards of one batch under torch.profiler: their kernels' device time by kind (us per
    forward, summed over every stream). A graph replay runs its branches on streams of the graph's
    own, so which stream a kernel ran on says nothing of the capture's main or side stream: the
    kinds compare instead. Kernels of two streams overlap, so the sum can pass the forward's time."""
    import torch
    from torch.profiler import DeviceType, ProfilerActivity, profile

    ids, on_device = engine.device_batch([p.inputs for p in prepared])
    with torch.inference_mode():
        engine.forward(ids, on_device)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(forwards):
                engine.forward(ids, on_device)
            torch.cuda.synchronize()
    if engine.towers is not None:  # what Engine.embed checks after each batch
        engine.towers.check_counts()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]

    def kind(name: str) -> str:
        n = name.lower()
        for k, marks in KINDS:
            if any(m in n for m in marks):
                return k
        return "other"

    us: dict[str, float] = {}
    count: dict[str, int] = {}
    for e in kernels:
        k = kind(e.name)
        us[k] = us.get(k, 0.0) + e.time_range.elapsed_us() / forwards
        count[k] = count.get(k, 0) + 1
    return {
        "us": {k: round(v, 1) for k, v in sorted(us.items())},
        "kernels": {k: v / forwards for k, v in sorted(count.items())},
        "streams": len({e.device_resource_id for e in kernels}),
    }


def _lab_kernel(kind: str) -> None:
    """Replace the unpack kernel the Unpacker launches, for timing only: "skip" launches nothing (the
    matmuls read whatever the scratch holds: the forward with the unpacks' cost removed and the
    graph's events and edges kept); "ctas:N" runs the same arithmetic in N persistent programs, each
    looping over blocks, so the unpack holds at most N SMs' worth of blocks beside the matmuls;
    "serial" enqueues each unpack on the towers' own stream instead of the side stream (a graph then
    has no fork and join per group: the unpacks run between the matmuls, never beside them), and
    "serial-skip" does that and launches nothing (neither the unpacks' cost nor the graph's edges)."""
    from eg2_runtime import quant, unpack_triton

    if kind in ("serial", "serial-skip"):
        enqueue = quant.Unpacker._enqueue_unpack

        def on_main(self: Any, group: int, slot: int) -> None:
            side, self.stream = self.stream, self.main  # the side stream's waits become no-ops
            try:
                enqueue(self, group, slot)
            finally:
                self.stream = side

        quant.Unpacker._enqueue_unpack = on_main  # type: ignore[method-assign]
        if kind == "serial":
            return
    if kind in ("skip", "serial-skip"):
        vars(unpack_triton)["dequantize_run"] = lambda words, scales, out: out
        return
    import torch
    import triton

    programs = int(kind.removeprefix("ctas:"))
    block = unpack_triton.BLOCK_WORDS

    def run(words: Any, scales: Any, out: Any) -> Any:
        total = words.numel()
        grid = min(programs, triton.cdiv(total, block))
        _persistent_kernel()[(grid,)](
            words, scales, out.view(torch.int16), total,
            WORDS_PER_GROUP=total // scales.numel(), BLOCK=block, PROGRAMS=grid,
        )  # fmt: skip
        return out

    vars(unpack_triton)["dequantize_run"] = run


@functools.cache
def _persistent_kernel() -> Any:
    """unpack_triton's kernel with each program looping over blocks, PROGRAMS apart (the same
    arithmetic, line for line); compiled once per process."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(packed_ptr, scale_ptr, out_ptr, total_words,
               WORDS_PER_GROUP: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):  # fmt: skip
        blocks = tl.cdiv(total_words, BLOCK)
        for b in range(tl.program_id(0), blocks, PROGRAMS):
            f = b * BLOCK + tl.arange(0, BLOCK)  # int32: a group is at most a few million words
            live = f < total_words
            word = tl.load(packed_ptr + f, mask=live, other=0)
            nibble = (word[:, None] >> (tl.arange(0, 8) * 4)[None, :]) & 0xF
            scale = tl.load(scale_ptr + f // WORDS_PER_GROUP, mask=live, other=0.0).to(tl.float32)
            value = (nibble - 8).to(tl.float32) * scale[:, None]
            bits = value.to(tl.uint32, bitcast=True)
            bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)
            cols = f[:, None] * 8 + tl.arange(0, 8)[None, :]
            tl.store(out_ptr + cols, bf16, mask=live[:, None])

    return kernel


def _layer_major(items: int) -> None:
    """Run each vision layer's attention and MLP `items` images at a time, the whole batch through one
    layer before the next (lab only): the Unpacker keeps a group's slot for every call of its layers
    until another group starts, so a group whose layers a chunk calls back to back (an attention's)
    is unpacked once per forward however many chunks run."""
    import torch

    from eg2_runtime import vision

    def chunked(forward: Any) -> Any:
        """forward(x, *per_item) over `items` of dim 0 at a time, into one output of x's shape."""

        def run(x: Any, *rest: Any) -> Any:
            if x.shape[0] <= items:
                return forward(x, *rest)
            out = torch.empty_like(x)  # attention's o_proj and the MLP's down_proj map back to x's width
            for i in range(0, x.shape[0], items):
                out[i : i + items] = forward(
                    x[i : i + items], *(r if r is None else r[i : i + items] for r in rest)
                )
            return out

        return run

    attend = vision.VisionAttention.forward
    layer_forward = vision.VisionLayer.forward

    def attention(self: Any, x: Any, cos: Any, sin: Any, mask: Any) -> Any:
        return chunked(functools.partial(attend, self))(x, cos, sin, mask)

    def layer(self: Any, x: Any, cos: Any, sin: Any, mask: Any) -> Any:
        if "forward" not in vars(self.mlp):  # the MLP's own forward, by items, on this instance
            self.mlp.forward = chunked(type(self.mlp).forward.__get__(self.mlp))
        return layer_forward(self, x, cos, sin, mask)

    vision.VisionAttention.forward = attention  # type: ignore[method-assign]
    vision.VisionLayer.forward = layer  # type: ignore[method-assign]


def _high_priority_stream(purpose: str) -> None:
    """Make the side stream for `purpose` ("unpack", or "capture": the stream the tower graphs are
    captured on) with the device's greatest stream priority; the other keeps the least."""
    import ctypes

    import torch

    from eg2_runtime import graphs, quant, streams
    from eg2_runtime.gpu_memory import cudart

    plain, wanted = streams.side_stream, purpose

    def side_stream(device: torch.device, purpose: str) -> torch.cuda.Stream:
        if purpose != wanted:
            return plain(device, purpose)
        runtime = cudart()
        assert runtime is not None
        least, greatest, raw = ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p()
        with torch.cuda.device(device):
            torch.cuda.init()
            runtime.cudaDeviceGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest))
            err = runtime.cudaStreamCreateWithPriority(ctypes.byref(raw), 0x01, greatest)
        assert not err, f"CUDA error {err}"
        print(f"{purpose} stream priority {greatest.value} (least {least.value})", flush=True)
        return torch.cuda.ExternalStream(raw.value, device=device)

    # The names quant.py and graphs.py imported: the Unpacker and the captures call them.
    vars(quant)["side_stream"] = side_stream
    vars(graphs)["side_stream"] = side_stream


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ahead", default="1,2,3", help="unpack_ahead values to run [1,2,3]")
    ap.add_argument(
        "--priority", action="store_true", help="also run each --ahead with a high-priority unpack stream"
    )
    ap.add_argument(
        "--main-priority", action="store_true", help="also run ahead 1 with high-priority tower kernels"
    )
    ap.add_argument("--block-words", default="", help="also run ahead 1 with these kernel block sizes")
    ap.add_argument("--per-slot", default="", help="also run ahead 1 with these unpack group caps")
    ap.add_argument("--budget-mib", default="", help="also run ahead 1 and BF16 at these GPU memory budgets")
    ap.add_argument(
        "--layer-major", default="", help="also run those with the vision layers in chunks of N items"
    )
    ap.add_argument(
        "--kernel",
        default="",
        help="also run ahead 1 with these lab unpack kernels (skip, ctas:N, serial, serial-skip)",
    )
    ap.add_argument("--repeat", type=int, default=1, help="run the variant list this many times [1]")
    ap.add_argument("--trace", action="store_true", help="sum each traced row's kernels by kind")
    ap.add_argument("--seconds", type=float, default=1.0, help="time box of each cell's timed rounds [1]")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", choices=("tiny", "full"), default="full")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # a variant's spec: run it here
    args = ap.parse_args(argv)
    if args.layer_major and not args.budget_mib:
        ap.error("--layer-major runs at the --budget-mib budgets: give one")
    if args.child is not None:
        spec = json.loads(args.child.read_text())
        Path(spec["out"]).write_text(json.dumps(child(spec), indent=1))
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"argv": sys.argv, "variants": {}}
    with checkpoints(None, args.cache_dir, args.size, print) as (bf16, w4):
        one: dict[str, dict[str, Any]] = {
            f"w4 ahead {a}": {"model_dir": w4, "ahead": int(a)} for a in args.ahead.split(",")
        }
        if args.priority:
            for a in args.ahead.split(","):
                one[f"w4 unpack-priority ahead {a}"] = {
                    "model_dir": w4,
                    "ahead": int(a),
                    "priority": "unpack",
                }
        if args.main_priority:
            one["w4 main-priority"] = {"model_dir": w4, "priority": "capture"}
        for words in filter(None, args.block_words.split(",")):
            one[f"w4 block {words}"] = {"model_dir": w4, "block_words": int(words)}
        for kernel in filter(None, args.kernel.split(",")):
            one[f"w4 kernel {kernel}"] = {"model_dir": w4, "kernel": kernel}
        for per_slot in filter(None, args.per_slot.split(",")):
            one[f"w4 per-slot {per_slot}"] = {"model_dir": w4, "per_slot": int(per_slot)}
        budget = matched_budget(bf16, w4) if args.device == "cuda" else None
        one["bf16"] = {"model_dir": bf16, "budget": budget}
        for mib in filter(None, args.budget_mib.split(",")):
            over = budget - DEFAULT_MEDIA_BUDGET if budget is not None else 0  # what BF16's weights add
            one[f"w4 {mib} MiB"] = {"model_dir": w4, "budget": int(mib) * MIB}
            one[f"bf16 {mib} MiB"] = {"model_dir": bf16, "budget": int(mib) * MIB + over}
            for n in filter(None, args.layer_major.split(",")):
                one[f"w4 {mib} MiB lm{n}"] = one[f"w4 {mib} MiB"] | {"layer_major": int(n)}
                one[f"bf16 {mib} MiB lm{n}"] = one[f"bf16 {mib} MiB"] | {"layer_major": int(n)}
        variants = {
            (name if r == 0 else f"{name} #{r + 1}"): v for r in range(args.repeat) for name, v in one.items()
        }
        for name, variant in variants.items():
            tag = name.replace(" ", "-").replace("#", "")
            spec_path, out_path = args.out / f"{tag}.spec.json", args.out / f"{tag}.json"
            spec = {
                "budget": None,
                "ahead": 1,
                **variant,
                "model_dir": str(variant["model_dir"]),
                "seconds": args.seconds,
                "device": args.device,
                "trace": args.trace,
            }
            spec_path.write_text(json.dumps(spec | {"out": str(out_path)}))
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.probe_unpack",
                    "--out",
                    str(args.out),
                    "--child",
                    str(spec_path),
                ],
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                results["variants"][name] = {"error": done.stderr[-3000:]}
                print(f"{name}: failed\n{done.stderr[-3000:]}", flush=True)
                continue
            results["variants"][name] = json.loads(out_path.read_text())
            print(f"{name}: {results['variants'][name]['plan']}", flush=True)
    (args.out / "unpack.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


def table(results: dict[str, Any]) -> str:
    """Forward ms per row and variant, each as a ratio of BF16's (BF16 ms / this variant's ms; base_of)."""
    variants = {k: v for k, v in results["variants"].items() if "rows" in v}

    def base_of(name: str) -> dict[str, Any]:
        """The BF16 rows a variant's ratio is against: BF16's own at the same budget and chunking
        ("w4 8000 MiB lm2" -> "bf16 8000 MiB lm2"), else the first BF16 run at the default budget. A
        BF16 variant's is the first run of itself: 1.0, or a repeat's spread."""
        rest = name.split(" #")[0].removeprefix("w4 ").removeprefix("bf16 ")  # "8000 MiB lm2", ...
        same = f"bf16 {rest}" if " MiB" in rest else "bf16"
        return variants.get(same, {}).get("rows", {})

    lines = ["| row | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
    for row in ROWS:
        cells = []
        for name, v in variants.items():
            base = base_of(name)
            r = v["rows"].get(row)
            if r is None:
                cells.append("-")
                continue
            ratio = base[row]["forward_ms"] / r["forward_ms"] if row in base else None
            cells.append(
                f"{r['forward_ms']:.2f} ms (embed {r['embed_ms']:.2f})"
                + (f", {ratio:.3f}x" if ratio is not None else "")
            )
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
