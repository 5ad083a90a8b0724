"""Benchmark (one GPU): the unpack kernel's variants on a whole tower's unpack groups, against a plain
copy of the same output bytes.

    python -m benchmarks.unpack_variants --out DIR

Each tower's groups are those the loader makes at the default cap (loader.unpack_groups: an
attention's four projections in one, an MLP projection alone), each with codes and scales of its own
(so the reads come from HBM, not L2), unpacked in order into two alternating slots as the Unpacker's
ring does. One pass over the tower is timed as a CUDA graph of 5 passes, replayed (benchmarks.
vision_kernels.graph_us). The variants: the int-to-float step (a conversion, or the exponent trick
0x4B000000 | code - (2^23 + 8)), the BF16 rounding (by hand, as the product kernel does so that
Triton's CPU interpreter rounds alike, or the GPU's own round-to-nearest-even conversion), words per
program and warps. Every variant's output is compared bit for bit with the product kernel's. The
floor beside them: `copy_` of the same output bytes from one BF16 source (which moves more bytes than
an unpack, half of them from L2). Writes unpack_variants.json into DIR. Not a test: it asserts
nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from benchmarks.vision_kernels import graph_us
from eg2_runtime.config import ModelConfig
from eg2_runtime.loader import unpack_groups
from eg2_runtime.model import EG2Model
from eg2_runtime.quant import PACKED_TOWERS, PackedLinear, packable_linears, quantize, replace_module
from eg2_runtime.tools.demo_model import demo_config
from eg2_runtime.unpack_triton import dequantize_run

GROUP = 128


def group_sizes(tower: str) -> list[int]:
    """Weights per unpack group of `tower` in the full architecture, as the loader groups them
    (loader.unpack_groups at its default cap), on the meta device: no weights are made."""
    with torch.device("meta"):
        model = EG2Model(ModelConfig.from_dict(demo_config("full")))
        for name in packable_linears(model):
            m = model.get_submodule(name)
            assert isinstance(m, torch.nn.Linear)
            replace_module(model, name, PackedLinear(m.in_features, m.out_features, False, GROUP))
    weights = {
        n: m.in_features * m.out_features for n, m in model.named_modules() if isinstance(m, PackedLinear)
    }
    return [sum(weights[n] for n in group) for group in unpack_groups(model) if group[0].startswith(tower)]


@triton.jit
def _variant(
    packed_ptr,
    scale_ptr,
    out_ptr,
    total_words,
    WORDS_PER_GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    MAGIC: tl.constexpr,
    NATIVE: tl.constexpr,
):
    f = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = f < total_words
    word = tl.load(packed_ptr + f, mask=live, other=0)
    nibble = (word[:, None] >> (tl.arange(0, 8) * 4)[None, :]) & 0xF
    scale = tl.load(scale_ptr + f // WORDS_PER_GROUP, mask=live, other=0.0).to(tl.float32)
    if MAGIC:  # 2^23 + code as a float's bits, less 2^23 + 8: the code - 8, exactly, without a conversion
        code = (nibble | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    else:
        code = (nibble - 8).to(tl.float32)
    value = code * scale[:, None]
    if NATIVE:
        bf16 = value.to(tl.bfloat16).to(tl.int16, bitcast=True)
    else:
        bits = value.to(tl.uint32, bitcast=True)
        bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)
    cols = f[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(out_ptr + cols, bf16, mask=live[:, None])


def _run(words: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, v: dict[str, Any]) -> None:
    total = words.numel()
    _variant[(triton.cdiv(total, v["block"]),)](
        words, scales, out.view(torch.int16), total,
        WORDS_PER_GROUP=total // scales.numel(), BLOCK=v["block"], MAGIC=v["magic"], NATIVE=v["native"],
        num_warps=v["warps"],
    )  # fmt: skip


VARIANTS = [
    {"magic": magic, "native": native, "block": block, "warps": warps}
    for magic in (False, True)
    for native in (False, True)
    for block in (256, 512, 1024, 2048)
    for warps in (2, 4, 8)
]


def measure(tower: str, gen: torch.Generator) -> dict[str, Any]:
    """One tower's row: the product kernel, the copy floor and every variant."""
    sizes = group_sizes(tower)
    runs = []
    for n in sizes:
        packed, scale = quantize(torch.randn(n // 768, 768, device="cuda", generator=gen), GROUP)
        runs.append((packed.reshape(-1), scale.reshape(-1).contiguous()))
    slots = [torch.empty(max(sizes), dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    source = torch.zeros(max(sizes), dtype=torch.bfloat16, device="cuda")
    reference = []
    for words, scales in runs:
        reference.append(
            dequantize_run(words, scales, torch.empty(words.numel() * 8, dtype=torch.bfloat16, device="cuda"))
        )

    def product() -> None:
        for i, (words, scales) in enumerate(runs):
            dequantize_run(words, scales, slots[i % 2][: words.numel() * 8])

    def copy() -> None:
        for i, (words, _) in enumerate(runs):
            slots[i % 2][: words.numel() * 8].copy_(source[: words.numel() * 8])

    row: dict[str, Any] = {
        "groups": len(sizes),
        "weights": sum(sizes),
        "product_us": round(graph_us(product, 5, rounds=7), 1),
        "copy_us": round(graph_us(copy, 5, rounds=7), 1),
        "variants": [],
    }
    for v in VARIANTS:
        equal = True
        for (words, scales), ref in zip(runs, reference, strict=True):
            out = torch.empty_like(ref)
            _run(words, scales, out, v)
            equal &= torch.equal(out.view(torch.int16), ref.view(torch.int16))

        def variant(v: dict[str, Any] = v) -> None:
            for i, (words, scales) in enumerate(runs):
                _run(words, scales, slots[i % 2][: words.numel() * 8], v)

        row["variants"].append(
            {**v, "us": round(graph_us(variant, 5, rounds=7), 1), "bit_equal": bool(equal)}
        )
    best = min(row["variants"], key=lambda r: r["us"])
    print(
        f"{tower}: {len(sizes)} groups, product {row['product_us']} us, copy {row['copy_us']} us, best {best}"
    )
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "towers": {},
    }
    for tower in PACKED_TOWERS:
        result["towers"][tower] = measure(tower, gen)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "unpack_variants.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
