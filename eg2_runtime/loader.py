"""Load a checkpoint directory into an EG2Model: header scan, meta-device build, mmap load, report.

What is packed is decided per layer from what is stored (a `<name>.weight_packed` tensor), never
from layer types. A plain BF16 checkpoint loads as BF16, or packed at load time with `pack=True`.
Tensors are read one at a time from the memory-mapped safetensors file and moved straight to the
device, so no full copy of the weights is ever held in host RAM; the projections a module holds
merged wait on the host only until their group (one layer's) is complete.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from eg2_runtime.config import ModelConfig
from eg2_runtime.errors import CheckpointError
from eg2_runtime.layers import ClippableLinear, MergedWeight, end_to_end
from eg2_runtime.model import EG2Model
from eg2_runtime.quant import (
    PACK,
    PACKED_TOWERS,
    PackedLinear,
    Unpacker,
    end_to_end_flat,
    lay_out_end_to_end,
    pack_linears,
    replace_module,
)
from eg2_runtime.text import MERGING

log = logging.getLogger(__name__)

MiB = 1 << 20
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I32": torch.int32,
                      "I64": torch.int64, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}  # fmt: skip


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class LoadReport:
    packed: dict[str, int] = field(default_factory=dict)  # tower -> packed Linear count
    dense_tensors: int = 0
    resident_bytes: int = 0  # weights on the device, as loaded
    host_bytes: int = 0  # weights kept in pinned host memory (the token table, on request)
    bf16_bytes: int = 0  # the same weights if every tensor were BF16
    group_size: int | None = None

    @property
    def packed_total(self) -> int:
        return sum(self.packed.values())

    def summary(self) -> str:
        towers = ", ".join(f"{t.removesuffix('_tower')} {n}" for t, n in self.packed.items())
        return (
            f"{self.packed_total} packed ({towers or 'none'}), {self.dense_tensors} dense tensors, "
            f"{self.resident_bytes / MiB:.1f} MiB resident vs {self.bf16_bytes / MiB:.1f} MiB as BF16 "
            f"({self.resident_bytes / max(self.bf16_bytes, 1):.3f}x)"
            + (f", {self.host_bytes / MiB:.1f} MiB in host memory" if self.host_bytes else "")
        )


def read_header(model_dir: Path) -> dict[str, StoredTensor]:
    """Every stored tensor's file, dtype and shape, from the safetensors headers alone."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [model_dir / "model.safetensors"]
    stored: dict[str, StoredTensor] = {}
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"weights file {f.name} is missing from the model directory")
        size = f.stat().st_size
        try:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > size - 8 or n > 100 * MiB:
                    raise ValueError(f"header length {n} exceeds the file")
                header = json.loads(fh.read(n))
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{f.name} is not a valid safetensors file: {e}") from None
        end = 0
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            if meta["dtype"] not in SAFETENSORS_DTYPES:
                raise CheckpointError(f"{f.name}: tensor {name} has unsupported dtype {meta['dtype']}")
            stored[name] = StoredTensor(f, SAFETENSORS_DTYPES[meta["dtype"]], tuple(meta["shape"]))
            end = max(end, meta["data_offsets"][1])
        if 8 + n + end > size:
            raise CheckpointError(
                f"{f.name} is truncated: the header describes {8 + n + end} bytes, the file has {size}"
            )
    return stored


def compute_dtype(device: torch.device, dtype: torch.dtype | None) -> torch.dtype:
    """BF16 on CUDA, FP32 on CPU, unless asked otherwise; FP16 is refused (activations overflow)."""
    if dtype == torch.float16:
        raise ValueError(
            "float16 is not supported for EmbeddingGemma 2: its activations overflow; use bfloat16"
        )
    if dtype is not None:
        return dtype
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


TOKEN_TABLE = "language_model.embed_tokens.weight"


def load_model(
    model_dir: str | Path,
    device: str | torch.device = "auto",
    modalities: frozenset[str] | set[str] | None = None,
    dtype: torch.dtype | None = None,
    pack: bool = False,
    group_size: int = 128,
    unpack_hooks: bool = True,
    unpack_ahead: int = 1,
    table_on_host: bool = False,
) -> tuple[EG2Model, LoadReport]:
    """Build, load and prepare a model for inference. Returns it in eval mode with its report.

    `modalities`: the towers to load; None loads every tower the checkpoint has.
    `pack`: quantize a BF16 checkpoint's tower Linears at load time (already-packed layers stay).
    `unpack_hooks`: attach the side-stream Unpacker; without it packed layers dequantize on the fly.
    `unpack_ahead`: the unpack groups it unpacks ahead of the running one (quant.Unpacker).
    `table_on_host`: on CUDA, the token table loads into host memory and stays there until the
    caller places it (TextEncoder.keep_table_on_host, keep_table_on_device). The engine places it
    only once it has measured the base; loaded to the GPU first, the table's 256 MiB would join the
    boot peak of a server that then keeps it in host memory.
    """
    model_dir = Path(model_dir)
    dev = resolve_device(device)
    cdtype = compute_dtype(dev, dtype)
    config = ModelConfig.from_dir(model_dir)
    stored = read_header(model_dir)
    if fp16 := [n for n, t in stored.items() if t.dtype == torch.float16]:
        raise CheckpointError(
            f"the checkpoint stores {len(fp16)} float16 tensors (e.g. {fp16[0]}): EmbeddingGemma 2 overflows "
            "in float16; convert the source to bfloat16"
        )

    with torch.device("meta"):
        model = EG2Model(config, modalities)
        for name in [n.removesuffix(".weight_packed") for n in stored if n.endswith(".weight_packed")]:
            if not _loaded(model, name):
                continue
            try:
                linear = model.get_submodule(name)
            except AttributeError:
                raise CheckpointError(
                    f"packed tensor {name}.weight_packed matches no layer of the model"
                ) from None
            if not isinstance(linear, torch.nn.Linear):
                raise CheckpointError(f"{name} is stored packed but is not a Linear layer")
            n_groups = stored[f"{name}.weight_scale"].shape[-1]
            g = linear.in_features // max(n_groups, 1)
            if g * n_groups != linear.in_features or g % PACK:
                # The reference and the fused unpack both read a row as whole groups of whole words.
                raise CheckpointError(
                    f"{name}: {n_groups} scale groups do not split {linear.in_features} inputs into equal "
                    f"groups of a multiple of {PACK}"
                )
            replace_module(
                model, name, PackedLinear(linear.in_features, linear.out_features, linear.bias is not None, g)
            )

    expected = model.state_dict()
    wanted = {n: t for n, t in stored.items() if _loaded(model, n)}
    _check_names_and_shapes(expected, wanted)

    # Weights some modules hold merged (text attention's q, k, v; a plain MLP's gate and up) are laid
    # end to end on the host as their group completes (one layer's projections at a time) and moved
    # to the device once, so the device never holds them twice. So are the codes, and the scales, of
    # each unpack group of packed layers (flat: their rows differ in length), which one launch reads.
    groups: dict[str, tuple[torch.nn.Module, str, list[str]]] = {}  # module.attr -> (module, attr, names)
    for prefix, module in model.named_modules():
        if isinstance(module, MERGING):
            for attr, linears in module.merges().items():
                groups[f"{prefix}.{attr}"] = (module, attr, [f"{prefix}.{n}.weight" for n in linears])
    unpacking = unpack_groups(model)
    flat: dict[str, list[str]] = {}  # group key -> the stored names laid end to end, flat
    for i, names in enumerate(g for g in unpacking if len(g) > 1):
        for suffix in ("weight_packed", "weight_scale"):
            flat[f"unpack group {i}.{suffix}"] = [f"{n}.{suffix}" for n in names]
    group_of = {name: key for key, (_, _, names) in groups.items() for name in names}
    group_of |= {name: key for key, names in flat.items() for name in names}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    merged: dict[str, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    handles: dict[Path, object] = {}
    try:
        for name, meta in wanted.items():
            if meta.file not in handles:
                handles[meta.file] = safe_open(str(meta.file), framework="pt", device="cpu")
            t = handles[meta.file].get_tensor(name)  # type: ignore[attr-defined]
            # Packed codes, scales and shapes keep their stored dtype; everything else computes in cdtype.
            keep = (
                name.endswith((".weight_packed", ".weight_scale", ".weight_shape"))
                or not t.is_floating_point()
            )
            if name not in group_of:
                if table_on_host and name == TOKEN_TABLE and dev.type == "cuda":
                    state[name] = t.to(dtype=cdtype)  # pageable: pinned only if it stays (text.py)
                    continue
                state[name] = t.to(dev, dtype=None if keep else cdtype)
                continue
            key = group_of[name]
            parts = pending.setdefault(key, {})
            parts[name] = t if keep else t.to(dtype=cdtype)
            names = flat[key] if key in flat else groups[key][2]
            if len(parts) == len(names):
                lay_out = end_to_end_flat if key in flat else end_to_end
                whole, views = lay_out([parts[n] for n in names], dev)
                if key in groups:
                    merged[key] = whole
                state.update(zip(names, views, strict=True))
                del pending[key]
    except Exception as e:  # safetensors raises its own error types on corrupt data
        raise CheckpointError(f"could not read the weights: {e}") from None
    model.load_state_dict(state, strict=True, assign=True)
    del state, handles
    for key, weight in merged.items():
        module, attr, names = groups[key]
        setattr(
            module,
            attr,
            MergedWeight(weight, [model.get_submodule(n.removesuffix(".weight")) for n in names]),
        )

    if pack:
        with torch.no_grad():
            pack_linears(model, group_size)
            unpacking = unpack_groups(model)
            for names in unpacking:  # packed only now: laid out on the device
                layers = [model.get_submodule(n) for n in names]
                lay_out_end_to_end([m for m in layers if isinstance(m, PackedLinear)])
    model.eval().requires_grad_(False)
    for module in model.modules():
        if isinstance(module, ClippableLinear):
            module.freeze_bounds()
    report = build_report(model)
    table = model.language_model.embed_tokens.weight
    if table.device.type != dev.type:
        report.host_bytes, report.resident_bytes = table.nbytes, report.resident_bytes - table.nbytes
    if unpack_hooks:
        model.unpacker = Unpacker.attach(model, cdtype, unpack_ahead, unpacking)
    log.info("loaded %s: %s", model_dir.name, report.summary())
    return model, report


# A group holds at most this many times the largest packed layer's weights: the size of a scratch
# slot. One keeps the slots of one launch a layer (two of 8 MiB on the full model) and puts an
# attention's q, k, v and o in one launch (65 vision launches a forward instead of 113). Two also puts
# a vision MLP's gate, up and down in one, and an audio feed-forward half's two layers (33): on an
# H100 that halved the unpacks' device time, but the forwards were no faster (docs/PERF.md,
# 2026-12-07), and it costs 16 MiB more scratch, past 0.56x of BF16's memory after load. 0: one
# launch a layer.
LAYERS_PER_SLOT = 1


def unpack_groups(model: torch.nn.Module, per_slot: int | None = None) -> list[list[str]]:
    """The names of the packed layers, in the groups one launch unpacks.

    A group is a run of packed layers of one owner module (an attention, an MLP, a feed-forward
    half: the nearest ancestor that is not a ClippableLinear wrapper), in registration order, with
    one group size, and at most `per_slot` (LAYERS_PER_SLOT) times the largest layer's weights. An
    owner's forward runs its layers back to back with no other packed layer between them, which is
    what lets a group's slot be reused once the next group starts (Unpacker).
    """
    per_slot = LAYERS_PER_SLOT if per_slot is None else per_slot
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, PackedLinear)]
    if not layers:
        return []
    cap = per_slot * max(m.in_features * m.out_features for _, m in layers)
    groups: list[list[str]] = []
    key: tuple[str, int] | None = None
    size = 0
    for name, m in layers:
        numel = m.in_features * m.out_features
        this = (_owner(model, name), m.group_size)
        if this != key or size + numel > cap:
            groups.append([])
            key, size = this, 0
        groups[-1].append(name)
        size += numel
    return groups


def _owner(model: torch.nn.Module, name: str) -> str:
    parent = name.rpartition(".")[0]
    while parent and isinstance(model.get_submodule(parent), ClippableLinear):
        parent = parent.rpartition(".")[0]
    return parent


def _loaded(model: EG2Model, name: str) -> bool:
    """Does a stored tensor belong to a part this model built (towers not asked for are skipped)?"""
    top = name.split(".", 1)[0]
    return top == "language_model" or getattr(model, top, None) is not None


def _check_names_and_shapes(expected: dict[str, torch.Tensor], stored: dict[str, StoredTensor]) -> None:
    missing = sorted(set(expected) - set(stored))
    extra = sorted(set(stored) - set(expected))
    wrong = sorted(
        f"{n} (stored {list(stored[n].shape)}, expected {list(expected[n].shape)})"
        for n in set(expected) & set(stored)
        if tuple(expected[n].shape) != stored[n].shape
    )
    problems = [
        f"{label}: {', '.join(items[:20])}{' ...' if len(items) > 20 else ''} ({len(items)} in all)"
        for label, items in (
            ("missing tensors", missing),
            ("unexpected tensors", extra),
            ("wrong shapes", wrong),
        )
        if items
    ]
    if problems:
        raise CheckpointError(
            "the checkpoint does not match the architecture in config.json: " + "; ".join(problems)
        )


def build_report(model: EG2Model) -> LoadReport:
    report = LoadReport()
    packed_params: set[int] = set()
    for name, m in model.named_modules():
        if isinstance(m, PackedLinear):
            tower = name.split(".", 1)[0]
            report.packed[tower] = report.packed.get(tower, 0) + 1
            report.group_size = m.group_size
            report.resident_bytes += m.packed_bytes() + m.weight_shape.nbytes
            report.bf16_bytes += m.in_features * m.out_features * 2 + m.weight_shape.nbytes
            packed_params.update(id(t) for t in (m.weight_packed, m.weight_scale, m.weight_shape))
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in packed_params:
            continue
        report.dense_tensors += 1
        report.resident_bytes += t.nbytes
        report.bf16_bytes += t.numel() * 2 if t.is_floating_point() else t.nbytes
    report.packed = {t: report.packed[t] for t in PACKED_TOWERS if t in report.packed}
    return report
