"""The loader: what it reports, what it refuses, and that load-time packing equals the quantizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eg2_runtime.errors import CheckpointError
from eg2_runtime.loader import load_model
from eg2_runtime.quant import PackedLinear


def _copy_with(src: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_report_counts_what_is_stored(tiny_w4: Path) -> None:
    model, report = load_model(tiny_w4, "cpu", dtype=torch.bfloat16)
    n_packed = sum(isinstance(m, PackedLinear) for m in model.modules())
    assert report.packed_total == n_packed > 0
    assert set(report.packed) == {"vision_tower", "audio_tower"}
    assert report.resident_bytes < report.bf16_bytes, "packed weights should be smaller than BF16"
    assert (
        f"{n_packed} packed (vision {report.packed['vision_tower']}, audio {report.packed['audio_tower']})"
        in (report.summary())
    )


def test_merged_projections_hold_the_stored_weights_once(tiny_bf16: Path) -> None:
    """Text attention's q, k, v and the text MLP's gate, up load into one merged tensor each, which
    the Linears view: the stored values, and no second copy (the report counts what is resident)."""
    from eg2_runtime.text import MERGING

    model, report = load_model(tiny_bf16, "cpu", modalities={"text"}, dtype=torch.bfloat16)
    stored = load_file(str(tiny_bf16 / "model.safetensors"))
    merged = 0
    for name, m in model.named_modules():
        if isinstance(m, MERGING) and m.merges():
            for attr, linears in m.merges().items():
                whole = getattr(m, attr).weight
                parts = [stored[f"{name}.{linear}.weight"].to(torch.bfloat16) for linear in linears]
                assert torch.equal(whole, torch.cat(parts)), (name, attr)
                for linear in linears:
                    weight = m.get_submodule(linear).weight
                    assert weight.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
                merged += 1
    assert merged == 2 * model.config.text.num_layers
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.parameters()}
    assert sum(storages.values()) == report.resident_bytes - sum(b.nbytes for b in model.buffers())


def test_a_merged_weight_given_up_is_not_used_and_merges_again(tiny_bf16: Path) -> None:
    """A Linear given a new weight after load no longer views the merged one: the fused path must not
    read the stale rows (`live` says so), and merging again lays the new weights end to end."""
    from torch import nn

    from eg2_runtime.layers import merge_weights
    from eg2_runtime.text import TextAttention

    model, _ = load_model(tiny_bf16, "cpu", modalities={"text"}, dtype=torch.float32)
    attn = next(m for m in model.modules() if isinstance(m, TextAttention))
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    assert attn.qkv is not None and attn.qkv.live(*projections)
    rows = attn.q_proj.weight.shape[0]
    attn.q_proj.weight = nn.Parameter(attn.qkv.weight[: rows // 2], requires_grad=False)  # same address
    assert not attn.qkv.live(*projections)
    attn.q_proj.weight = nn.Parameter(attn.qkv.weight[:rows] * 2, requires_grad=False)
    assert not attn.qkv.live(*projections)
    merge_weights(attn, attn.merges())
    assert attn.qkv.live(*projections)
    assert torch.equal(attn.qkv.weight[: attn.q_proj.weight.shape[0]], attn.q_proj.weight)


def test_a_text_projection_stored_packed_loads_unmerged(tiny_bf16: Path, tmp_path: Path) -> None:
    """A checkpoint may store any Linear packed; a text attention with one packed projection keeps
    its three matmuls (nothing to merge) instead of failing to load."""
    from eg2_runtime.quant import quantize
    from eg2_runtime.text import TextAttention

    name = "language_model.layers.0.self_attn.q_proj"

    def pack_one(tensors: dict[str, torch.Tensor]) -> None:
        w = tensors.pop(f"{name}.weight")
        tensors[f"{name}.weight_packed"], tensors[f"{name}.weight_scale"] = quantize(w, 32)
        tensors[f"{name}.weight_shape"] = torch.tensor(list(w.shape))

    model, _ = load_model(_copy_with(tiny_bf16, tmp_path / "m", pack_one), "cpu", modalities={"text"})
    attn = model.get_submodule("language_model.layers.0.self_attn")
    assert isinstance(attn, TextAttention) and isinstance(attn.q_proj, PackedLinear)
    assert attn.qkv is None and attn.merges() == {}


def test_packed_scales_must_split_a_row_into_equal_groups(tiny_w4: Path, tmp_path: Path) -> None:
    """A packed layer whose scale columns do not split its inputs into equal groups of whole words (a
    format with a partial last group) is refused at load: the unpack would read wrong scales."""
    name = next(n for n in load_file(str(tiny_w4 / "model.safetensors")) if n.endswith(".weight_scale"))

    def one_more_group(tensors: dict[str, torch.Tensor]) -> None:
        scale = tensors[name]
        tensors[name] = torch.cat([scale, scale[:, :1]], dim=1)

    with pytest.raises(CheckpointError, match="do not split"):
        load_model(_copy_with(tiny_w4, tmp_path / "m", one_more_group), "cpu")


def test_text_only_loads_no_tower(tiny_w4: Path) -> None:
    model, report = load_model(tiny_w4, "cpu", modalities={"text"})
    assert model.vision_tower is None and model.audio_tower is None
    assert report.packed_total == 0
    assert not any(
        n.startswith(("vision_tower", "audio_tower", "embed_")) for n, _ in model.named_parameters()
    )


def test_load_time_packing_equals_the_quantizer(tiny_bf16: Path, tiny_w4: Path) -> None:
    packed_at_load, _ = load_model(tiny_bf16, "cpu", pack=True, group_size=32)
    from_file, _ = load_model(tiny_w4, "cpu")
    a, b = packed_at_load.state_dict(), from_file.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), (
        "pack=True gave different codes or scales than eg2 quantize"
    )


def test_fp16_is_refused(tiny_bf16: Path, tmp_path: Path) -> None:
    fp16 = _copy_with(tiny_bf16, tmp_path / "fp16", lambda t: t.update({k: v.half() for k, v in t.items()}))
    with pytest.raises(CheckpointError, match="float16"):
        load_model(fp16, "cpu")
    with pytest.raises(ValueError, match="float16 is not supported"):
        load_model(tiny_bf16, "cpu", dtype=torch.float16)


def test_truncated_file_is_named(tiny_bf16: Path, tmp_path: Path) -> None:
    bad = tmp_path / "truncated"
    shutil.copytree(tiny_bf16, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors is truncated"):
        load_model(bad, "cpu")
    (bad / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        load_model(bad, "cpu")


def test_missing_extra_and_misshaped_tensors_are_listed(tiny_bf16: Path, tmp_path: Path) -> None:
    name = "language_model.layers.1.mlp.up_proj.weight"

    missing = _copy_with(tiny_bf16, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"missing tensors: {name}"):
        load_model(missing, "cpu")

    extra = _copy_with(
        tiny_bf16, tmp_path / "extra", lambda t: t.update({"language_model.bogus": torch.zeros(2)})
    )
    with pytest.raises(CheckpointError, match=r"unexpected tensors: language_model.bogus"):
        load_model(extra, "cpu")

    def reshape(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name][:-1]

    wrong = _copy_with(tiny_bf16, tmp_path / "wrong", reshape)
    with pytest.raises(CheckpointError, match=rf"wrong shapes: {name} \(stored"):
        load_model(wrong, "cpu")


def test_missing_weights_file(tiny_bf16: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    shutil.copytree(tiny_bf16, empty)
    (empty / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors is missing"):
        load_model(empty, "cpu")
