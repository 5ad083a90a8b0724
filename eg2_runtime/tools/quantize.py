"""`eg2 quantize SRC DST`: a BF16 Hugging Face checkpoint -> hybrid-w4.

Every nn.Linear of the vision and audio towers (247 in the full model) is stored in compressed-tensors
`pack-quantized` form (int4, group-wise, symmetric, BF16 scales); every other tensor is copied as is.
The tokenizer, processor and sentence-transformers files are copied along. The output is a function
of the input alone (sorted tensors, fixed metadata): quantizing twice gives identical bytes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from eg2_runtime.config import ModelConfig
from eg2_runtime.errors import CheckpointError
from eg2_runtime.loader import read_header
from eg2_runtime.model import EG2Model
from eg2_runtime.quant import PACK, packable_linears, quantize
from eg2_runtime.tools.writer import SafetensorsWriter

GROUP_SIZES = (32, 64, 128)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


@dataclass(frozen=True)
class QuantizeReport:
    packed: dict[str, int]
    copied: int
    bytes_in: int
    bytes_out: int


def quantization_config(group_size: int) -> dict[str, object]:
    """The config.json entry that compressed-tensors, transformers and vLLM read.

    Targets are the Linear modules; everything outside the two towers is ignored. The clippable
    wrappers hold their Linear under `.linear`, so the class target is what matches them.
    """
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": group_size,
                    "dynamic": False,
                    "actorder": None,
                    "observer": "minmax",
                },
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ["re:.*language_model.*", "re:.*embed_vision.*", "re:.*embed_audio.*"],
        "kv_cache_scheme": None,
    }


def quantize_checkpoint(
    src: str | Path, dst: str | Path, group_size: int = 128, progress: bool = True
) -> QuantizeReport:
    src, dst = Path(src), Path(dst)
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group size must be one of {GROUP_SIZES}, got {group_size}")
    raw = json.loads((src / "config.json").read_text())
    if "quantization_config" in raw:
        raise CheckpointError(
            f"{src} is already quantized ({raw['quantization_config'].get('format')}); give a BF16 source"
        )
    stored = read_header(src)
    if any(n.endswith(".weight_packed") for n in stored):
        raise CheckpointError(f"{src} already holds packed weights; give a BF16 source")
    if fp16 := [n for n, t in stored.items() if t.dtype == torch.float16]:
        raise CheckpointError(
            f"{src} stores float16 weights (e.g. {fp16[0]}); EmbeddingGemma 2 is BF16-only: convert to bfloat16 first"
        )
    if bad := [n for n, t in stored.items() if t.dtype == torch.float32]:
        raise CheckpointError(f"{src} stores float32 weights (e.g. {bad[0]}); quantize a bfloat16 checkpoint")

    with torch.device("meta"):
        targets = set(packable_linears(EG2Model(ModelConfig.from_dict(raw))))
    if missing := sorted(f"{t}.weight" for t in targets if f"{t}.weight" not in stored):
        raise CheckpointError(f"{src} lacks tower weights: {', '.join(missing[:10])}")
    for t in targets:
        if stored[f"{t}.weight"].shape[1] % group_size:
            raise CheckpointError(
                f"{t} has in_features {stored[f'{t}.weight'].shape[1]}, not a multiple of {group_size}"
            )

    # The output layout, known from the header alone, so tensors can be streamed one at a time.
    layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name in sorted(stored):
        meta = stored[name]
        module = name.removesuffix(".weight")
        if module in targets:
            out_f, in_f = meta.shape
            layout[f"{module}.weight_packed"] = (torch.int32, (out_f, in_f // PACK))
            layout[f"{module}.weight_scale"] = (torch.bfloat16, (out_f, in_f // group_size))
            layout[f"{module}.weight_shape"] = (torch.int64, (2,))
        else:
            layout[name] = (meta.dtype, meta.shape)

    dst.mkdir(parents=True, exist_ok=True)
    _copy_side_files(src, dst)
    raw["quantization_config"] = quantization_config(group_size)
    handles = {f: safe_open(str(f), framework="pt", device="cpu") for f in {m.file for m in stored.values()}}
    with SafetensorsWriter(dst / "model.safetensors", layout, metadata={"format": "pt"}) as out:
        for name in tqdm(sorted(stored), desc="quantize", unit="tensor", disable=not progress):
            t = handles[stored[name].file].get_tensor(name)
            module = name.removesuffix(".weight")
            if module in targets:
                packed, scale = quantize(t, group_size)
                out.write(f"{module}.weight_packed", packed)
                out.write(f"{module}.weight_scale", scale)
                out.write(f"{module}.weight_shape", torch.tensor(t.shape, dtype=torch.int64))
            else:
                out.write(name, t)
    (dst / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")

    towers: dict[str, int] = {}
    for t in targets:
        towers[t.split(".", 1)[0]] = towers.get(t.split(".", 1)[0], 0) + 1
    return QuantizeReport(
        packed=dict(sorted(towers.items(), reverse=True)),
        copied=len(stored) - len(targets),
        bytes_in=sum(f.stat().st_size for f in handles),
        bytes_out=(dst / "model.safetensors").stat().st_size,
    )


def _copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, processor and sentence-transformers files: everything but the weights."""
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if (
            path.is_dir()
            or rel.name in WEIGHT_FILES
            or rel.suffix == ".safetensors"
            or rel == Path("config.json")
        ):
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dst / rel)
