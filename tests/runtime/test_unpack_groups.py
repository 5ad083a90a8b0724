"""Unpack groups: which packed layers one launch unpacks (loader.unpack_groups), and the loader's
layout of each group's codes and scales end to end, which is what lets one launch read them.

The launch itself against the reference is tests/runtime/test_unpack_triton.py (Triton's CPU
interpreter) and tests/gpu/test_gpu.py (every group of the full-size checkpoint, on the GPU).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eg2_runtime.config import ModelConfig
from eg2_runtime.loader import LAYERS_PER_SLOT, load_model, unpack_groups
from eg2_runtime.model import EG2Model
from eg2_runtime.quant import PackedLinear, Unpacker, flat_run, packable_linears, replace_module
from eg2_runtime.tools.demo_model import demo_config


def _packed_on_meta(size: str) -> EG2Model:
    """The architecture of `size` with its tower Linears packed (group 128), on the meta device."""
    with torch.device("meta"):
        model = EG2Model(ModelConfig.from_dict(demo_config(size)))
        for name in packable_linears(model):
            m = model.get_submodule(name)
            assert isinstance(m, torch.nn.Linear)
            replace_module(model, name, PackedLinear(m.in_features, m.out_features, m.bias is not None, 128))
    return model


def _numel(model: torch.nn.Module, name: str) -> int:
    m = model.get_submodule(name)
    assert isinstance(m, PackedLinear)
    return m.in_features * m.out_features


def _owner(name: str) -> str:
    return name.removesuffix(".linear").rpartition(".")[0]


@pytest.mark.parametrize("per_slot", [0, 1, 2, 3])
def test_groups_cover_every_layer_in_order_within_one_owner_and_the_cap(per_slot: int) -> None:
    model = _packed_on_meta("full")
    groups = unpack_groups(model, per_slot)
    names = [n for n, m in model.named_modules() if isinstance(m, PackedLinear)]
    assert [n for g in groups for n in g] == names, "a layer is missing, repeated or out of order"
    assert len(names) == 247
    largest = max(_numel(model, n) for n in names)
    for g in groups:
        assert len({_owner(n) for n in g}) == 1, f"a group spans two owners: {g}"
        if len(g) > 1:
            assert sum(_numel(model, n) for n in g) <= per_slot * largest, f"over the cap: {g}"
    # Greedy: the next group of the same owner would not have fit into this one.
    for a, b in itertools.pairwise(groups):
        if _owner(a[0]) == _owner(b[0]):
            assert sum(_numel(model, n) for n in a) + _numel(model, b[0]) > per_slot * largest, (a, b)
    if per_slot == 0:
        assert all(len(g) == 1 for g in groups)


@pytest.mark.parametrize(
    ("per_slot", "vision", "audio", "slot_mib"),
    [
        # The default: an attention's q, k, v and o in one launch; the slot of one launch a layer.
        (1, 1 + 16 * 4, 2 + 12 * 7, 8),
        # A vision block in two launches (attention; MLP), an audio block in four (each feed-forward
        # half, the attention, the light conv): 2 x 1024 x 4096 BF16 weights a slot.
        (2, 1 + 16 * 2, 2 + 12 * 4, 16),
    ],
)
def test_groups_of_the_full_towers(per_slot: int, vision: int, audio: int, slot_mib: int) -> None:
    """The figures docs/FORMAT.md and loader.LAYERS_PER_SLOT give."""
    model = _packed_on_meta("full")
    groups = unpack_groups(model, per_slot)
    assert sum(g[0].startswith("vision_tower") for g in groups) == vision
    assert sum(g[0].startswith("audio_tower") for g in groups) == audio
    assert max(sum(_numel(model, n) for n in g) for g in groups) * 2 == slot_mib * 2**20
    attention = next(g for g in groups if ".self_attn." in g[0] and g[0].startswith("vision_tower"))
    assert [n.split(".")[-2] for n in attention] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    if per_slot == 2:
        mlp = next(g for g in groups if ".mlp." in g[0])
        assert [n.split(".")[-2] for n in mlp] == ["gate_proj", "up_proj", "down_proj"]


def test_the_default_keeps_the_scratch_of_one_launch_a_layer() -> None:
    assert LAYERS_PER_SLOT == 1, "docs/FORMAT.md and the GPU weight-memory bound assume one"


def test_groups_stop_where_the_group_size_changes() -> None:
    model = _packed_on_meta("tiny")
    q, k, v, o = (f"vision_tower.encoder.layers.0.self_attn.{p}_proj.linear" for p in "qkvo")
    assert [q, k, v, o] in unpack_groups(model, per_slot=8)
    odd = model.get_submodule(k)
    assert isinstance(odd, PackedLinear)
    odd.group_size = 64  # one launch reads one scale group size
    groups = unpack_groups(model, per_slot=8)
    assert [q] in groups and [k] in groups and [v, o] in groups


def _stored(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys() if k.endswith(("weight_packed", "weight_scale"))}  # noqa: SIM118
    return out


def test_the_loader_lays_each_group_end_to_end_with_the_stored_values(tiny_w4: Path) -> None:
    model, _ = load_model(tiny_w4, "cpu")
    assert model.unpacker is not None
    unpacker = model.unpacker
    stored = _stored(tiny_w4)
    by_module = {m: n for n, m in model.named_modules()}
    assert any(len(g) > 1 for g in unpacker.groups), "the tiny towers have no group of two"
    assert unpacker.launches() == len(unpacker.groups), "a group the loader did not lay out end to end"
    for group, run in zip(unpacker.groups, unpacker.runs, strict=True):
        assert run is not None
        words, scales = run
        assert torch.equal(
            words, torch.cat([stored[f"{by_module[m]}.weight_packed"].view(-1) for m in group])
        )
        assert torch.equal(
            scales, torch.cat([stored[f"{by_module[m]}.weight_scale"].view(-1) for m in group])
        )
    for name, t in stored.items():
        assert torch.equal(
            model.get_submodule(name.rpartition(".")[0]).get_buffer(name.rpartition(".")[2]), t
        )


def test_packing_at_load_lays_out_the_same_groups(tiny_bf16: Path, tiny_w4: Path) -> None:
    packed_at_load, _ = load_model(tiny_bf16, "cpu", pack=True, group_size=32)
    from_file, _ = load_model(tiny_w4, "cpu")
    a, b = packed_at_load.unpacker, from_file.unpacker
    assert a is not None and b is not None
    names = lambda m, u: [[n for n, x in m.named_modules() if x in g] for g in u.groups]  # noqa: E731
    assert names(packed_at_load, a) == names(from_file, b)
    assert a.launches() == len(a.groups), "a group packed at load is not laid out end to end"
    for ra, rb in zip(a.runs, b.runs, strict=True):
        assert ra is not None and rb is not None
        assert torch.equal(ra[0], rb[0]) and torch.equal(ra[1], rb[1])


def test_the_run_kernel_refuses_what_it_would_misread() -> None:
    pytest.importorskip("triton")
    from eg2_runtime.unpack_triton import dequantize_run

    words, scales = torch.zeros(64, dtype=torch.int32), torch.zeros(4, dtype=torch.bfloat16)
    out = torch.empty(512, dtype=torch.bfloat16)
    bad = {
        "2-D words": (words.view(8, 8), scales, out),
        "scales that do not split the words": (words, torch.zeros(5, dtype=torch.bfloat16), out),
        "out of another size": (words, scales, torch.empty(256, dtype=torch.bfloat16)),
        "out not bf16": (words, scales, torch.empty(512)),
        "strided words": (torch.zeros(128, dtype=torch.int32)[::2], scales, out),
    }
    for case, args in bad.items():
        with pytest.raises(ValueError):
            dequantize_run(*args)
            pytest.fail(f"{case} was accepted")


def test_flat_run_needs_the_parts_end_to_end_in_order() -> None:
    whole = torch.arange(10, dtype=torch.int32)
    a, b = whole[:4].view(2, 2), whole[4:10].view(3, 2)
    run = flat_run([a, b])
    assert run is not None and torch.equal(run, whole)
    assert flat_run([b, a]) is None, "out of order"
    assert flat_run([a, whole[5:10]]) is None, "a gap"
    assert flat_run([a, torch.arange(4, 10, dtype=torch.int32)]) is None, "another storage"
    assert flat_run([whole[:6].view(3, 2).t(), whole[6:]]) is None, "not contiguous"


def test_an_unpacker_without_groups_takes_a_group_a_layer(tiny_w4: Path) -> None:
    model, _ = load_model(tiny_w4, "cpu", unpack_hooks=False)
    unpacker = Unpacker.attach(model, torch.float32)
    assert unpacker is not None
    try:
        assert all(len(g) == 1 for g in unpacker.groups)
        assert len(unpacker.groups) == sum(isinstance(m, PackedLinear) for m in model.modules())
    finally:
        unpacker.remove()
