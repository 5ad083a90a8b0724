"""The hybrid-w4 format: our pack/unpack against the compressed-tensors library, the quantizer's
output, and the packed linear's fast path (hooks) against its reference path (on-the-fly dequant)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationScheme
from safetensors import safe_open

from eg2_runtime.config import ModelConfig
from eg2_runtime.errors import CheckpointError
from eg2_runtime.loader import load_model
from eg2_runtime.model import EG2Model
from eg2_runtime.quant import PackedLinear, Unpacker, dequantize, pack, packable_linears, quantize, unpack
from eg2_runtime.tools.demo_model import demo_config, write_demo_model
from eg2_runtime.tools.quantize import quantization_config, quantize_checkpoint


def test_pack_matches_compressed_tensors_bit_for_bit() -> None:
    q = torch.randint(-8, 8, (48, 256), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    assert torch.equal(pack(q), pack_to_int32(q, 4)), (
        "our int32 words differ from compressed-tensors' pack_to_int32"
    )
    assert torch.equal(unpack(pack(q)), q), "unpack(pack(q)) != q"


def test_quantize_roundtrip_error_is_bounded() -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    packed, scale = quantize(w, 32)
    w_hat = dequantize(packed, scale).float()
    # Symmetric int4: |w - w_hat| <= scale / 2 per group, except at the group's positive max, which
    # maps to 7.5 steps and is clamped to 7: up to 0.5 + 7.5 * 2^-8 steps with the bf16-rounded scale.
    bound = scale.float().repeat_interleave(32, dim=1) * (0.5 + 7.5 / 256) + 4e-3 * w.abs()
    assert ((w - w_hat).abs() <= bound).all(), "quantization error exceeds half a step"


def test_quantizer_output_is_decompressed_identically_by_compressed_tensors(tiny_w4: Path) -> None:
    """Unpacked weights equal, bit for bit, the compressed-tensors library's decompression of the file."""
    cfg = json.loads((tiny_w4 / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme(targets=["Linear"], **{"weights": cfg["config_groups"]["group_0"]["weights"]})
    model, _ = load_model(tiny_w4, "cpu", unpack_hooks=False)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert layers, "the quantized tiny checkpoint loaded with no packed layer"
    with safe_open(str(tiny_w4 / "model.safetensors"), framework="pt") as f:
        for name, layer in layers.items():
            stored = {
                k: f.get_tensor(f"{name}.{k}") for k in ("weight_packed", "weight_scale", "weight_shape")
            }
            theirs = PackedQuantizationCompressor.decompress(stored, scheme)["weight"]
            ours = layer.dequantize()
            assert ours.dtype == theirs.dtype == torch.bfloat16
            assert torch.equal(ours, theirs), (
                f"{name}: our dequantized weight differs from compressed-tensors'"
            )


def test_full_architecture_packs_exactly_247_linears() -> None:
    with torch.device("meta"):
        model = EG2Model(ModelConfig.from_dict(demo_config("full")))
    names = packable_linears(model)
    by_tower = {t: sum(n.startswith(t) for n in names) for t in ("vision_tower", "audio_tower")}
    assert by_tower == {"vision_tower": 113, "audio_tower": 134}, by_tower
    assert all(model.get_submodule(n).in_features % 128 == 0 for n in names), (
        "an in_features is not a multiple of 128"
    )


def test_quantizer_is_deterministic_and_complete(tiny_bf16: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    report = quantize_checkpoint(tiny_bf16, a, group_size=32, progress=False)
    quantize_checkpoint(tiny_bf16, b, group_size=32, progress=False)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes(), (
        "not deterministic"
    )
    with torch.device("meta"):
        expected = len(packable_linears(EG2Model(ModelConfig.from_dir(tiny_bf16))))
    assert sum(report.packed.values()) == expected
    side = sorted(
        p.relative_to(tiny_bf16) for p in tiny_bf16.rglob("*") if p.is_file() and p.suffix != ".safetensors"
    )
    assert all((a / p).is_file() for p in side), (
        "tokenizer/processor/sentence-transformers files were not copied"
    )
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["quantization_config"] == quantization_config(32)
    with safe_open(str(a / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        clip = [k for k in keys if k.startswith("audio_tower") and k.endswith(("input_min", "output_max"))]
        assert clip, "the audio clip buffers were dropped"
        assert not [
            k
            for k in keys
            if k.endswith(".weight_packed") and not k.startswith(("vision_tower", "audio_tower"))
        ]
        assert f.get_tensor(next(k for k in keys if k.endswith("weight_scale"))).dtype == torch.bfloat16


def test_quantizer_refuses_fp16_and_quantized_sources(tiny_w4: Path, tmp_path: Path) -> None:
    fp16 = write_demo_model(tmp_path / "fp16", size="tiny", seed=3, dtype="float16")
    with pytest.raises(CheckpointError, match="float16"):
        quantize_checkpoint(fp16, tmp_path / "out1", progress=False)
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(tiny_w4, tmp_path / "out2", progress=False)
    with pytest.raises(ValueError, match="group size"):
        quantize_checkpoint(tiny_w4, tmp_path / "out3", group_size=100, progress=False)


def test_unpack_hooks_equal_the_reference_path() -> None:
    """Fast path (Unpacker hooks, here the synchronous CPU variant) == reference (dequantize in forward)."""
    torch.manual_seed(0)
    seq = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 64, bias=False))
    packed = torch.nn.Sequential(
        PackedLinear.from_linear(seq[0], 32), seq[1], PackedLinear.from_linear(seq[2], 32)
    )
    x = torch.randn(5, 64)
    reference = packed(x)
    unpacker = Unpacker.attach(packed, torch.float32)
    try:
        fast = packed(x)
        again = packed(x)
    finally:
        unpacker.remove()
    assert torch.equal(fast, reference) and torch.equal(again, reference)
    assert all(m.unpacked is None for m in packed if isinstance(m, PackedLinear)), (
        "dense weights outlived forward"
    )
