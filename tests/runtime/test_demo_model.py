"""The demo checkpoint writer: it loads in transformers and sentence-transformers, every tensor is
random and non-degenerate, the bytes are a function of the seed, and the reference encodes every
modality from it. CPU only; the tiny checkpoints (tiny_bf16, tiny_fp32, tiny_w4) come from conftest."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from tokenizers import Tokenizer

from eg2_runtime.tools import demo_model
from eg2_runtime.tools.demo_model import MEDIA_TOKENS, checkpoint_shapes, demo_config, write_demo_model
from tests.support.reference import load_reference

FULL_PARAMETERS = 744_371_488
CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


def _tensors(model_dir) -> dict[str, torch.Tensor]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)


def _file_bytes(model_dir) -> dict[str, bytes]:
    return {
        str(p.relative_to(model_dir)): p.read_bytes() for p in sorted(model_dir.rglob("*")) if p.is_file()
    }


# ---------------------------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------------------------
def test_tiny_loads_in_transformers_with_exactly_the_expected_keys(tiny_bf16):
    from transformers import EmbeddingGemma2Model

    model, info = EmbeddingGemma2Model.from_pretrained(tiny_bf16, output_loading_info=True)
    assert info["missing_keys"] == set(), info
    assert info["unexpected_keys"] == set(), info
    assert info["mismatched_keys"] == set(), info
    assert model.dtype == torch.bfloat16
    # EmbeddingGemma2Model silently ignores unexpected vision/audio keys, so compare the sets too.
    saved = _tensors(tiny_bf16)
    expected = model.state_dict()
    assert set(saved) == set(expected)
    assert all(saved[k].shape == expected[k].shape for k in saved)
    assert all(t.dtype == torch.bfloat16 for t in saved.values())


def test_the_runtime_model_and_transformers_agree_on_names_and_shapes():
    from transformers import EmbeddingGemma2Config, EmbeddingGemma2Model

    config = demo_config("tiny")
    with torch.device("meta"):
        hf = EmbeddingGemma2Model(EmbeddingGemma2Config.from_dict(config))
    assert checkpoint_shapes(config) == {k: tuple(v.shape) for k, v in hf.state_dict().items()}


def test_processor_loads_with_the_real_gemma_token_ids(tiny_bf16):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_bf16)
    assert type(processor).__name__ == "EmbeddingGemma2Processor"
    assert type(processor.image_processor).__name__ == "Gemma4ImageProcessor"
    assert type(processor.feature_extractor).__name__ == "Gemma4AudioFeatureExtractor"
    assert type(processor.video_processor).__name__ == "EmbeddingGemma2VideoProcessor"
    assert processor.image_processor.max_soft_tokens == 280
    assert processor.image_processor.do_normalize is False
    assert (processor.video_processor.fps, processor.video_processor.max_frames) == (1, 32)
    assert processor.video_processor.max_soft_tokens == 70
    assert processor.feature_extractor.sampling_rate == 16_000
    assert processor.feature_extractor.feature_size == 128

    tok = processor.tokenizer
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert (tok.image_token_id, tok.audio_token_id, processor.video_token_id) == (258_880, 258_881, 258_884)
    for name in ("boi_token", "eoi_token", "boa_token", "eoa_token"):
        assert tok.convert_tokens_to_ids(getattr(tok, name)) == MEDIA_TOKENS[getattr(tok, name)]

    config = json.loads((tiny_bf16 / "config.json").read_text())
    assert (config["boi_token_id"], config["eoi_token_id"]) == (
        tok.convert_tokens_to_ids(tok.boi_token),
        258_882,
    )
    assert (config["boa_token_id"], config["eoa_token_index"]) == (256_000, 258_883)


@pytest.mark.parametrize(
    "text",
    [
        "hello world",
        "  two  spaces ",
        "task: search result | query: ünïcödé 中文 😀",
        "\U00020000 outside",
        "",
    ],
)
def test_tokenizer_json_alone_matches_transformers_and_wraps_in_bos_eos(tiny_bf16, text):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_bf16)
    ids = Tokenizer.from_file(str(tiny_bf16 / "tokenizer.json")).encode(text).ids
    assert ids == hf(text).input_ids
    assert ids[0] == 2 and ids[-1] == 1  # <bos> ... <eos>
    inner = ids[1:-1]
    assert all(4 < i < 255_999 for i in inner), "characters must not take special or media ids"


def test_tokenizer_is_one_token_per_character(tiny_bf16):
    tok = Tokenizer.from_file(str(tiny_bf16 / "tokenizer.json"))
    assert len(tok.encode("abc déf").ids) == len("abc déf") + 2
    assert tok.encode("<|image|>", add_special_tokens=False).ids == [258_880]
    assert (tiny_bf16 / "tokenizer.json").stat().st_size < 3_000_000


# ---------------------------------------------------------------------------------------------
# The weights
# ---------------------------------------------------------------------------------------------
def test_no_tensor_is_degenerate(tiny_bf16):
    tensors = {k: v.float() for k, v in _tensors(tiny_bf16).items()}
    for name, t in tensors.items():
        assert torch.isfinite(t).all(), name
        if t.numel() > 1:
            assert t.std() > 0, f"{name} is constant"
    position = tensors["vision_tower.patch_embedder.position_embedding_table"]
    assert not torch.all(position == 1)

    bounds = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[-1] in CLIP_BOUNDS}
    config = demo_config("tiny")
    # 10 clipped linears per conformer layer (q, k, v, post, 2 x 2 feed-forward, lconv start, end).
    assert len(bounds) == 4 * 10 * config["audio_config"]["num_hidden_layers"]
    for name, t in bounds.items():
        assert t.shape == ()
        lo, hi = (-4.0, -2.0) if name.endswith("_min") else (2.0, 4.0)
        assert lo <= float(t) <= hi, f"{name} = {float(t)}"
    # Several clip bounds must differ (not one shared constant).
    assert len({float(t) for t in bounds.values()}) > len(bounds) // 2

    scalars = torch.stack([v for k, v in tensors.items() if k.endswith("layer_scalar")])
    assert (scalars > 0).all() and scalars.std() > 0
    for name in [k for k in tensors if k.endswith("per_dim_scale")]:
        assert tensors[name].abs().sum() > 0, name


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = _file_bytes(write_demo_model(tmp_path / "a", seed=7))
    b = _file_bytes(write_demo_model(tmp_path / "b", seed=7))
    c = _file_bytes(write_demo_model(tmp_path / "c", seed=8))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert {k: v for k, v in a.items() if k != "model.safetensors"} == {
        k: v for k, v in c.items() if k != "model.safetensors"
    }


@pytest.mark.parametrize(("dtype", "torch_dtype"), [("float32", torch.float32), ("float16", torch.float16)])
def test_dtype_option_sets_tensors_and_config(tmp_path, dtype, torch_dtype):
    model_dir = write_demo_model(tmp_path, dtype=dtype)
    assert {t.dtype for t in _tensors(model_dir).values()} == {torch_dtype}
    config = json.loads((model_dir / "config.json").read_text())
    assert config["dtype"] == dtype
    assert {config[part]["dtype"] for part in ("text_config", "vision_config", "audio_config")} == {dtype}


def test_large_tensors_are_streamed_in_blocks(tmp_path, monkeypatch):
    # The full model writes its 262144 x 512 table in blocks; exercise that path on the tiny one.
    monkeypatch.setattr(demo_model, "_CHUNK_ELEMENTS", 1000)
    model_dir = write_demo_model(tmp_path)
    tensors = _tensors(model_dir)
    shapes = checkpoint_shapes(demo_config("tiny"))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    table = tensors["language_model.embed_tokens.weight"].float()
    assert torch.isfinite(table).all() and table[-100:].std() > 0


def test_tiny_int4_linears_take_group_size_32():
    config = demo_config("tiny")
    linears = {
        k: s
        for k, s in checkpoint_shapes(config).items()
        if k.startswith(("vision_tower.", "audio_tower.")) and k.endswith("weight") and len(s) == 2
    }
    assert linears
    assert all(s[1] % 32 == 0 for s in linears.values()), {k: s for k, s in linears.items() if s[1] % 32}


def test_full_config_has_the_released_parameter_count():
    from transformers import EmbeddingGemma2Config, EmbeddingGemma2Model

    from eg2_runtime.config import ModelConfig
    from eg2_runtime.model import EG2Model

    config = demo_config("full")
    with torch.device("meta"):
        hf = EmbeddingGemma2Model(EmbeddingGemma2Config.from_dict(config))
        ours = EG2Model(ModelConfig.from_dict(config))
    assert sum(p.numel() for p in hf.parameters()) == FULL_PARAMETERS
    assert sum(p.numel() for p in ours.parameters()) == FULL_PARAMETERS
    # Plus the persistent buffers: 24 layer scalars and 4 clip bounds on 120 audio linears.
    assert sum(math.prod(s) for s in checkpoint_shapes(config).values()) == FULL_PARAMETERS + 24 + 480


# ---------------------------------------------------------------------------------------------
# sentence-transformers
# ---------------------------------------------------------------------------------------------
def test_sentence_transformers_files(tiny_bf16):
    st = json.loads((tiny_bf16 / "config_sentence_transformers.json").read_text())
    assert st["prompts"]["query"] == "task: search result | query: "
    assert st["prompts"]["document"] == "title: none | text: "
    assert st["similarity_fn_name"] == "cosine"
    modules = json.loads((tiny_bf16 / "modules.json").read_text())
    assert [m["path"] for m in modules] == ["", "1_Pooling", "2_Normalize"]
    pooling = json.loads((tiny_bf16 / "1_Pooling" / "config.json").read_text())
    assert (pooling["pooling_mode"], pooling["embedding_dimension"]) == ("mean", 768)


@pytest.mark.slow
def test_reference_encodes_every_modality_to_unit_vectors(tiny_fp32):
    ref = load_reference(tiny_fp32)
    assert ref.image_backend == "torchvision"
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:96, 0:128]
    smooth = np.stack([np.sin(xx / 20), np.cos(yy / 15), np.sin((xx + yy) / 25)], axis=-1) * 0.5 + 0.5
    image = Image.fromarray((smooth * 255).astype(np.uint8))
    wave = (0.1 * rng.standard_normal(16_000)).astype(np.float32)  # 1 s
    frames = np.stack([np.roll(np.asarray(image), 8 * i, axis=1) for i in range(4)])  # 2 s at 2 fps
    inputs = [
        "hello world",
        image,
        {"audio": (wave, 16_000)},
        {"video": frames, "fps": 2.0},
        {"content": [("text", "a picture of"), ("image", image), ("text", "and its sound"), ("audio", wave)]},
    ]
    vectors = ref.encode(inputs)
    assert vectors.shape == (5, 768) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    off_diagonal = (vectors @ vectors.T)[~np.eye(5, dtype=bool)]
    assert off_diagonal.max() < 0.99, "different inputs must not collapse to one vector"

    # One at a time gives the same vectors as one batch (padding is masked out).
    singles = np.concatenate([ref.encode([item]) for item in inputs])
    np.testing.assert_allclose(singles, vectors, atol=1e-5)

    # The processor tensors of that path, pooled by hand, give the same vectors.
    for item, vector in zip(inputs, vectors, strict=True):
        features = ref.model_inputs([item])
        np.testing.assert_allclose(ref.embed_features(features)[0], vector, atol=1e-5)
    features = ref.model_inputs([inputs[3]])
    assert features["num_frames_per_video"].tolist() == [2]  # sampled at 1 fps
    assert int((features["input_ids"] == MEDIA_TOKENS["<|audio|>"]).sum()) == 0

    audio = ref.model_inputs([inputs[2]])
    assert int((audio["input_ids"] == MEDIA_TOKENS["<|audio|>"]).sum()) == 25  # 25 soft tokens per second


def test_reference_text_prompt_is_a_prefix(tiny_fp32):
    ref = load_reference(tiny_fp32)
    prompt = "task: search result | query: "
    with_prompt = ref.model_inputs(["hello"], prompt=prompt)["input_ids"][0].tolist()
    as_text = ref.model_inputs([prompt + "hello"])["input_ids"][0].tolist()
    assert with_prompt == as_text
    plain, prompted = ref.encode(["hello"]), ref.encode(["hello"], prompt=prompt)
    assert float(plain[0] @ prompted[0]) < 0.999


@pytest.mark.slow
def test_reference_loads_a_packed_checkpoint_dequantized(tiny_bf16, tiny_w4):
    dense = load_reference(tiny_bf16, dtype=torch.bfloat16)
    packed = load_reference(tiny_w4, dtype=torch.bfloat16)  # dequantize decided from config.json
    assert isinstance(packed.hf_model.vision_tower.encoder.layers[0].mlp.up_proj.linear.weight, torch.Tensor)
    rng = np.random.default_rng(1)
    wave = (0.1 * rng.standard_normal(16_000)).astype(np.float32)
    a, b = (
        dense.encode(["hello", {"audio": (wave, 16_000)}]),
        packed.encode(["hello", {"audio": (wave, 16_000)}]),
    )
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cos[0] > 0.9999, f"text does not touch 4-bit weights: cos {cos[0]}"
    assert 0.9 < cos[1] < 0.9999, f"audio goes through int4 linears: cos {cos[1]}"
