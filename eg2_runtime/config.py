"""Architecture configuration: frozen dataclasses built from a checkpoint's config.json.

This is the only place that reads config.json. Field names follow the Hugging Face config where
they exist there (`HF_NAMES` maps the others); derived values (per-layer head dims, kv heads, rope
theta) are resolved here once so the modules never look at raw dicts. A default is written once, on
its dataclass field: a key config.json leaves out keeps it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from eg2_runtime.errors import CheckpointError

FULL = "full_attention"
SLIDING = "sliding_attention"
# The text config's per-layer values where config.json gives neither a global nor a per-layer one
# (the sliding layers' shape), and its RoPE when it gives none.
TEXT_HEAD_DIM, TEXT_KV_HEADS = 256, 2
TEXT_ROPE = {SLIDING: {"rope_theta": 10_000.0}, FULL: {"rope_theta": 1_000_000.0}}


def read_fields(cls: Any, d: dict[str, Any]) -> dict[str, Any]:
    """The fields of dataclass `cls` that config.json's `d` sets, each under its Hugging Face name
    (`cls.HF_NAMES`, else its own). Fields `d` leaves out are absent: the dataclass default applies."""
    names: dict[str, str] = getattr(cls, "HF_NAMES", {})
    return {f.name: d[names.get(f.name, f.name)] for f in fields(cls) if names.get(f.name, f.name) in d}


def default(cls: Any, name: str) -> Any:
    """The default written on field `name` of dataclass `cls`."""
    return next(f.default for f in fields(cls) if f.name == name)


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int = 262_144
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_layers: int = 24
    num_heads: int = 4
    layer_types: tuple[str, ...] = ()
    # Per layer, resolved from `head_dim` / `num_key_value_heads` and `per_layer_config` overrides.
    head_dims: tuple[int, ...] = ()
    kv_heads: tuple[int, ...] = ()
    rope_thetas: dict[str, float] = field(default_factory=dict)
    sliding_window: int = 512  # a radius: |q - k| <= sliding_window
    rms_norm_eps: float = 1e-6
    ple_dim: int = 512  # hidden_size_per_layer_input
    embedding_dim: int = 768
    pad_token_id: int = 0
    eos_token_id: int = 1
    bos_token_id: int = 2

    HF_NAMES: ClassVar[dict[str, str]] = {
        "num_layers": "num_hidden_layers",
        "num_heads": "num_attention_heads",
        "ple_dim": "hidden_size_per_layer_input",
    }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TextConfig:
        given = read_fields(cls, d)
        n = given.get("num_layers", default(cls, "num_layers"))
        layer_types = tuple(d.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(n)])
        overrides = {int(k): v for k, v in (d.get("per_layer_config") or {}).items()}
        head_dims = tuple(
            overrides.get(i, {}).get("head_dim", d.get("head_dim", TEXT_HEAD_DIM)) for i in range(n)
        )
        kv_heads = tuple(
            overrides.get(i, {}).get("num_key_value_heads", d.get("num_key_value_heads", TEXT_KV_HEADS))
            for i in range(n)
        )
        rope = d.get("rope_parameters") or TEXT_ROPE
        for kind, params in rope.items():
            if params.get("rope_type", "default") != "default":
                raise ValueError(f"text rope_type {params['rope_type']!r} for {kind} is not supported")
        derived: dict[str, Any] = {
            "layer_types": layer_types,
            "head_dims": head_dims,
            "kv_heads": kv_heads,
            "rope_thetas": {k: float(v["rope_theta"]) for k, v in rope.items()},
        }
        if "eos_token_id" in given:
            derived["eos_token_id"] = _first(given["eos_token_id"])
        return cls(**{**given, **derived})


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_layers: int = 16
    num_heads: int = 12
    num_kv_heads: int = 12
    head_dim: int = 64
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10 * 1024
    rope_theta: float = 100.0
    rms_norm_eps: float = 1e-6
    use_clipped_linears: bool = False
    standardize: bool = False

    HF_NAMES: ClassVar[dict[str, str]] = {
        "num_layers": "num_hidden_layers",
        "num_heads": "num_attention_heads",
        "num_kv_heads": "num_key_value_heads",
    }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VisionConfig:
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision rope_type {rope['rope_type']!r} is not supported")
        derived = {"rope_theta": float(rope["rope_theta"])} if "rope_theta" in rope else {}
        return cls(**{**read_fields(cls, d), **derived})


@dataclass(frozen=True)
class AudioConfig:
    hidden_size: int = 1024
    num_layers: int = 12
    num_heads: int = 8
    subsampling_conv_channels: tuple[int, int] = (128, 32)
    conv_kernel_size: int = 5
    residual_weight: float = 0.5
    chunk_size: int = 12
    context_left: int = 13
    context_right: int = 0
    logit_cap: float = 50.0
    invalid_logits_value: float = -1.0e9
    use_clipped_linears: bool = True
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    output_proj_dims: int = 1536

    HF_NAMES: ClassVar[dict[str, str]] = {
        "num_layers": "num_hidden_layers",
        "num_heads": "num_attention_heads",
        "chunk_size": "attention_chunk_size",
        "context_left": "attention_context_left",
        "context_right": "attention_context_right",
        "logit_cap": "attention_logit_cap",
        "invalid_logits_value": "attention_invalid_logits_value",
    }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AudioConfig:
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"audio hidden_act {d['hidden_act']!r} is not supported")
        given = read_fields(cls, d)
        if "subsampling_conv_channels" in given:
            c0, c1 = given["subsampling_conv_channels"]
            given["subsampling_conv_channels"] = (c0, c1)
        return cls(**given)


@dataclass(frozen=True)
class QuantConfig:
    """The `quantization_config` of a hybrid-w4 checkpoint (compressed-tensors pack-quantized)."""

    num_bits: int = 4
    group_size: int = 128
    symmetric: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantConfig:
        if d.get("quant_method") != "compressed-tensors" or d.get("format") != "pack-quantized":
            raise ValueError(
                "only compressed-tensors pack-quantized checkpoints are supported, got "
                f"quant_method={d.get('quant_method')!r} format={d.get('format')!r}"
            )
        groups = list(d.get("config_groups", {}).values())
        if len(groups) != 1:
            raise ValueError(f"expected one quantization config group, got {len(groups)}")
        w = groups[0]["weights"]
        if (w.get("type"), w.get("strategy"), w.get("num_bits"), w.get("symmetric")) != (
            "int",
            "group",
            4,
            True,
        ):
            raise ValueError(f"only int4 group-wise symmetric weights are supported, got {w}")
        return cls(num_bits=4, group_size=int(w["group_size"]), symmetric=True)


@dataclass(frozen=True)
class ModelConfig:
    text: TextConfig
    vision: VisionConfig | None = None
    audio: AudioConfig | None = None
    boi_token_id: int = 255_999
    eoi_token_id: int = 258_882
    image_token_id: int = 258_880
    video_token_id: int = 258_884
    boa_token_id: int = 256_000
    eoa_token_id: int = 258_883
    audio_token_id: int = 258_881
    quantization: QuantConfig | None = None
    torch_dtype: str | None = None  # as stored in config.json ("bfloat16", "float32", ...)

    HF_NAMES: ClassVar[dict[str, str]] = {"eoa_token_id": "eoa_token_index"}
    # Built below from their own sections, never read as plain values.
    _SECTIONS: ClassVar[tuple[str, ...]] = ("text", "vision", "audio", "quantization", "torch_dtype")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        vision, audio = d.get("vision_config"), d.get("audio_config")
        quant = d.get("quantization_config")
        ids = {k: v for k, v in read_fields(cls, d).items() if k not in cls._SECTIONS}
        return cls(
            text=TextConfig.from_dict(d.get("text_config") or {}),
            vision=VisionConfig.from_dict(vision) if vision else None,
            audio=AudioConfig.from_dict(audio) if audio else None,
            quantization=QuantConfig.from_dict(quant) if quant else None,
            torch_dtype=d.get("dtype") or d.get("torch_dtype"),
            **ids,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(
                f"config.json not found in {Path(model_dir).name}: a model directory needs it"
            )
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"config.json is not valid JSON: {e}") from None
        try:
            return cls.from_dict(raw)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"config.json does not describe an EmbeddingGemma 2 model: {e}") from None


def _first(value: int | list[int]) -> int:
    return value[0] if isinstance(value, list) else value
