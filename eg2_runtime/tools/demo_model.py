"""Write a random-weight EmbeddingGemma 2 checkpoint, laid out as `google/embeddinggemma-2` is.

The directory loads offline both in transformers (`EmbeddingGemma2Model`, `AutoProcessor`) and in
sentence-transformers (`SentenceTransformer(dir)`: mean pooling + L2 normalization, text, image,
audio and video), so the runtime can be tested against the reference without the real weights.

    config.json                     EmbeddingGemma2Config: text, gemma4_vision and gemma4_audio parts
    model.safetensors               every tensor random, seeded, streamed to disk one at a time
    tokenizer.json                  stand-in: one token per character, the real Gemma special ids,
                                    <bos> ... <eos> added to every text by its post-processor
    tokenizer_config.json           GemmaTokenizer and the media token names the processor reads
    chat_template.jinja             the embedding-only template (no turn markers), used by ST
    processor_config.json           EmbeddingGemma2Processor and its four sub-processors
    preprocessor_config.json        the audio feature extractor again, as the real conversion writes it
    modules.json, sentence_bert_config.json, config_sentence_transformers.json,
    1_Pooling/config.json, 2_Normalize/config.json      the sentence-transformers pipeline

Sizes: "full" is the released architecture (744,371,488 parameters, ~1.5 GB in BF16); "tiny" has
the same structure at toy widths (CPU tests in seconds) but keeps the 262,144-token vocabulary (the
real special ids must be valid), the 768-d output (Matryoshka 512/256/128), the vision position table
(positions index it) and 128 mel bins. Every vision/audio Linear of "tiny" has in_features a
multiple of 32 so int4 group size 32 applies.

The parameter names and shapes come from `eg2_runtime.model.EG2Model` built on the meta device,
whose state_dict keys are the Hugging Face checkpoint keys. This module only writes files: it never
imports transformers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from eg2_runtime.config import ModelConfig
from eg2_runtime.model import EG2Model
from eg2_runtime.tools.writer import SafetensorsWriter

logger = logging.getLogger(__name__)

SIZES = ("tiny", "full")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
TRANSFORMERS_VERSION = "5.23.0"  # the reference the written configs mirror

# ---------------------------------------------------------------------------------------------
# Token ids: the real Gemma ones. Placeholders (image/audio/video soft tokens) and markers are
# special tokens of the tokenizer; characters fill ids 261.. (below the first media id 255999).
# ---------------------------------------------------------------------------------------------
BASE_SPECIAL_TOKENS = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
MEDIA_TOKENS = {
    "<|image>": 255_999,  # boi
    "<|audio>": 256_000,  # boa
    "<|image|>": 258_880,  # image soft token
    "<|audio|>": 258_881,  # audio soft token
    "<image|>": 258_882,  # eoi
    "<audio|>": 258_883,  # eoa
    "<|video|>": 258_884,  # video soft token (frames are wrapped in boi/eoi)
}
# The tokenizer attributes the EmbeddingGemma2Processor reads (`tokenizer.image_token`, ...).
TOKENIZER_MEDIA_ATTRIBUTES = {
    "image_token": "<|image|>",
    "video_token": "<|video|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
}
_BYTE_TOKENS_START = 5  # <0x00>..<0xFF>: byte fallback for characters outside the table
_CHARS_START = _BYTE_TOKENS_START + 256
# The BMP without surrogates, then the emoji / pictograph planes U+1F000..U+1FAFF.
_CODE_POINTS = [*(c for c in range(0x10000) if not 0xD800 <= c <= 0xDFFF), *range(0x1F000, 0x1FB00)]

# Embedding-only chat template of the real conversion: system messages (sentence-transformers
# prompts) first, then the user content in order; each media item becomes a bare placeholder that
# the processor expands to <|image> N x <|image|> <image|> (or the audio / video equivalent).
CHAT_TEMPLATE = (
    "{%- for msg in messages if msg.get('role') == 'system' -%}"
    "{%- if msg.get('content') is string -%}"
    "{{ msg['content'] }}"
    "{%- else -%}"
    "{%- for item in msg['content'] if item.get('type') == 'text' -%}"
    "{{ item['text'] }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- for msg in messages if msg.get('role') != 'system' -%}"
    "{%- if msg.get('content') is string -%}"
    "{{ msg['content'] }}"
    "{%- else -%}"
    "{%- set existing_text = msg['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join -%}"
    "{%- set has_manual_placeholders = ('<|image|>' in existing_text) or ('<|video|>' in existing_text) or ('<|audio|>' in existing_text) -%}"
    "{%- for item in msg['content'] -%}"
    "{%- if item.get('type') == 'text' -%}"
    "{{ item['text'] }}"
    "{%- elif not has_manual_placeholders and item.get('type') == 'image' -%}"
    "<|image|>"
    "{%- elif not has_manual_placeholders and item.get('type') == 'video' -%}"
    "<|video|>"
    "{%- elif not has_manual_placeholders and item.get('type') == 'audio' -%}"
    "<|audio|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# Task prompts (prepended to the text) as the real model declares them.
PROMPTS = {
    "query": "task: search result | query: ",
    "document": "title: none | text: ",
    "BitextMining": "task: search result | query: ",
    "Clustering": "task: clustering | query: ",
    "Classification": "task: classification | query: ",
    "CodeRetrieval": "task: code retrieval | query: ",
    "FactChecking": "task: fact checking | query: ",
    "QuestionAnswering": "task: question answering | query: ",
    "Retrieval-query": "task: search result | query: ",
    "Retrieval-document": "title: none | text: ",
    "SearchQuery": "task: search result | query: ",
    "SentenceSimilarity": "task: sentence similarity | query: ",
    "STS": "task: sentence similarity | query: ",
    "Summarization": "task: sentence similarity | query: ",
}


# ---------------------------------------------------------------------------------------------
# Architecture
# ---------------------------------------------------------------------------------------------
def demo_config(size: str = "tiny", dtype: str = "bfloat16") -> dict[str, Any]:
    """The config.json of a demo checkpoint: every field explicit, as transformers 5.23 saves it."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if size == "full":
        text = dict(hidden=512, layers=24, heads=4, kv=2, head_dim=256, full_kv=1, full_head_dim=512,
                    mlp=2048, ple=512, window=512)  # fmt: skip
        layer_types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(24)]
        vision = dict(hidden=768, layers=16, heads=12, head_dim=64, mlp=3072)
        audio = dict(hidden=1024, layers=12, heads=8, channels=[128, 32], out=1536)
    else:
        text = dict(hidden=64, layers=4, heads=4, kv=2, head_dim=16, full_kv=1, full_head_dim=32,
                    mlp=128, ple=16, window=8)  # fmt: skip
        layer_types = ["sliding_attention", "full_attention"] * 2
        vision = dict(hidden=64, layers=2, heads=4, head_dim=16, mlp=128)
        # The first conv keeps 128 channels: transformers sizes `input_proj_linear` as
        # (channels[0] // 4) * channels[1], which equals the real flatten width (128 mel // 4) *
        # channels[1] only when channels[0] == 128. channels[1] = 8 gives in_features 256.
        audio = dict(hidden=64, layers=2, heads=4, channels=[128, 8], out=96)

    text_config = {
        "model_type": "embedding_gemma2_text",
        "vocab_size": 262_144,
        "hidden_size": text["hidden"],
        "intermediate_size": text["mlp"],
        "num_hidden_layers": text["layers"],
        "num_attention_heads": text["heads"],
        "num_key_value_heads": text["kv"],
        "head_dim": text["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 262_144,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "pad_token_id": BASE_SPECIAL_TOKENS["<pad>"],
        "eos_token_id": BASE_SPECIAL_TOKENS["<eos>"],
        "bos_token_id": BASE_SPECIAL_TOKENS["<bos>"],
        "rope_parameters": {
            "full_attention": {"rope_theta": 1_000_000.0, "rope_type": "default"},
            "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "sliding_window": text["window"],
        "layer_types": layer_types,
        # Full-attention layers are wider: fewer kv heads, larger head_dim.
        "per_layer_config": {
            str(i): {"head_dim": text["full_head_dim"], "num_key_value_heads": text["full_kv"]}
            for i, kind in enumerate(layer_types)
            if kind == "full_attention"
        },
        "hidden_size_per_layer_input": text["ple"],
        "embedding_dim": 768,
        "dtype": dtype,
    }
    vision_config = {
        "model_type": "gemma4_vision",
        "hidden_size": vision["hidden"],
        "intermediate_size": vision["mlp"],
        "num_hidden_layers": vision["layers"],
        "num_attention_heads": vision["heads"],
        "num_key_value_heads": vision["heads"],
        "head_dim": vision["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131_072,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_parameters": {"rope_theta": 100.0, "rope_type": "axial"},
        "pooling_kernel_size": 3,
        "patch_size": 16,
        "position_embedding_size": 10_240,
        "use_clipped_linears": False,
        "standardize": False,
        "initializer_range": 0.02,
        "dtype": dtype,
    }
    audio_config = {
        "model_type": "gemma4_audio",
        "hidden_size": audio["hidden"],
        "num_hidden_layers": audio["layers"],
        "num_attention_heads": audio["heads"],
        "hidden_act": "silu",
        "subsampling_conv_channels": audio["channels"],
        "conv_kernel_size": 5,
        "residual_weight": 0.5,
        "attention_chunk_size": 12,
        "attention_context_left": 13,
        "attention_context_right": 0,
        "attention_logit_cap": 50.0,
        "attention_invalid_logits_value": -1.0e9,
        "use_clipped_linears": True,
        "rms_norm_eps": 1e-6,
        "gradient_clipping": 1e10,
        "output_proj_dims": audio["out"],
        "initializer_range": 0.02,
        "dtype": dtype,
    }
    return {
        "architectures": ["EmbeddingGemma2Model"],
        "model_type": "embedding_gemma2",
        "text_config": text_config,
        "vision_config": vision_config,
        "audio_config": audio_config,
        "boi_token_id": MEDIA_TOKENS["<|image>"],
        "eoi_token_id": MEDIA_TOKENS["<image|>"],
        "image_token_id": MEDIA_TOKENS["<|image|>"],
        "video_token_id": MEDIA_TOKENS["<|video|>"],
        "boa_token_id": MEDIA_TOKENS["<|audio>"],
        "eoa_token_index": MEDIA_TOKENS["<audio|>"],  # sic: the HF config's name
        "audio_token_id": MEDIA_TOKENS["<|audio|>"],
        "initializer_range": 0.02,
        "dtype": dtype,
        "transformers_version": TRANSFORMERS_VERSION,
    }


def checkpoint_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the checkpoint (parameters and persistent buffers)."""
    with torch.device("meta"):
        model = EG2Model(ModelConfig.from_dict(config))
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------
_CHUNK_ELEMENTS = 1 << 24  # generate big tensors in row blocks: 64 MB of fp32 at a time


def _generator(seed: int, name: str) -> torch.Generator:
    # One stream per tensor, keyed by name: values do not depend on the order of the state_dict.
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """One fp32 tensor, scaled so activations neither explode nor collapse through random layers.

    The transformers init leaves degenerate values (position table of ones, clip bounds of +-inf,
    layer_scalar ones, per_dim_scale zeros); here nothing is constant.
    """
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("input_min", "output_min", "input_max", "output_max"):
        # Finite, wide enough that most values pass but the tails of (roughly unit-RMS) activations
        # are clamped, so the clamp is exercised.
        bound = 2.0 + 2.0 * torch.rand(shape, generator=gen)
        return -bound if leaf.endswith("min") else bound
    if leaf == "layer_scalar":
        return 0.75 + 0.5 * torch.rand(shape, generator=gen)
    if leaf == "per_dim_scale":  # the audio query scale goes through softplus: around log(2)
        return 0.1 * torch.randn(shape, generator=gen)
    if leaf == "position_embedding_table":  # (2, 10240, hidden): x and y rows, added to patches
        return 0.5 * torch.randn(shape, generator=gen)
    if name.endswith("embed_tokens.weight"):
        # Scaled by sqrt(hidden) in the forward: unit RMS after scaling.
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    if leaf == "weight" and len(shape) == 1 and "norm" in name:
        scale = torch.ones(shape)
        if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            # Text and vision attention use scaling 1.0 on RMS-normed q and k: with weights ~1 the
            # logits would have std sqrt(head_dim) (16-22 in the full model, one-hot softmax).
            # These weights give logits of std ~2.
            scale = scale * (2.0 / math.sqrt(shape[0])) ** 0.5
        return scale * (1.0 + 0.1 * torch.randn(shape, generator=gen))
    if leaf == "bias":
        return 0.1 * torch.randn(shape, generator=gen)
    if leaf == "weight" and len(shape) >= 2:  # Linear (out, in), Conv1d (c, 1, k), Conv2d (o, i, kh, kw)
        return torch.randn(shape, generator=gen) / math.sqrt(math.prod(shape[1:]))
    raise ValueError(f"no init rule for checkpoint tensor {name} {shape}")


def _tensor_chunks(
    name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype
) -> Iterator[torch.Tensor]:
    """The tensor's values in row blocks (all of it at once unless it is large), cast to dtype."""
    gen = _generator(seed, name)
    rows = shape[0] if shape else 1
    row_elements = math.prod(shape[1:]) if shape else 1
    block = max(1, _CHUNK_ELEMENTS // max(1, row_elements))
    if not shape or rows <= block:
        yield _random_tensor(name, shape, gen).to(dtype)
        return
    for start in range(0, rows, block):
        n = min(block, rows - start)
        yield _random_tensor(name, (n, *shape[1:]), gen).to(dtype)


def _write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], seed: int, dtype: torch.dtype) -> int:
    """Stream a safetensors file: each tensor generated and written in turn, so memory stays at one
    block. Returns bytes of data."""
    layout = {name: (dtype, shapes[name]) for name in sorted(shapes)}
    with SafetensorsWriter(path, layout, metadata={"format": "pt"}) as out:
        for name, (_, shape) in layout.items():
            out.write_parts(name, _tensor_chunks(name, shape, seed, dtype))
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(shape) for shape in shapes.values()) * itemsize


# ---------------------------------------------------------------------------------------------
# Tokenizer and processor
# ---------------------------------------------------------------------------------------------
def build_tokenizer() -> Tokenizer:
    """The stand-in tokenizer: Gemma's structure (BPE with byte fallback, " " -> "▁") with one token
    per character and no merges. `tokenizers.Tokenizer.from_file` and transformers' GemmaTokenizer
    give the same ids; every text becomes <bos> ... <eos>."""
    vocab = dict(BASE_SPECIAL_TOKENS)
    vocab.update({f"<0x{b:02X}>": _BYTE_TOKENS_START + b for b in range(256)})
    vocab.update({chr(c): _CHARS_START + i for i, c in enumerate(_CODE_POINTS)})
    vocab.update(MEDIA_TOKENS)
    tok = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    bos, eos = BASE_SPECIAL_TOKENS["<bos>"], BASE_SPECIAL_TOKENS["<eos>"]
    # The template transformers builds for add_bos_token = add_eos_token = True.
    tok.post_processor = processors.TemplateProcessing(
        single="<bos>:0 $A:0 <eos>:0",
        pair="<bos>:0 $A:0 <eos>:0 <bos>:1 $B:1 <eos>:1",
        special_tokens=[("<bos>", bos), ("<eos>", eos)],
    )
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in [*BASE_SPECIAL_TOKENS, *MEDIA_TOKENS]]
    )
    return tok


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "GemmaTokenizer",
        "backend": "tokenizers",
        "processor_class": "EmbeddingGemma2Processor",
        # No add_bos_token / add_eos_token: transformers 5 drops them whenever tokenizer.json exists;
        # its TemplateProcessing post-processor alone adds <bos> ... <eos>.
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "mask_token": "<mask>",
        "padding_side": "right",
        # A dict: each key becomes a tokenizer attribute (tokenizer.image_token, .image_token_id).
        "extra_special_tokens": TOKENIZER_MEDIA_ATTRIBUTES,
    }


def _feature_extractor_config() -> dict[str, Any]:
    # Gemma4AudioFeatureExtractor defaults: 16 kHz, 128 mel bins, 20 ms frames, 10 ms hop.
    return {
        "feature_extractor_type": "Gemma4AudioFeatureExtractor",
        "feature_size": 128,
        "sampling_rate": 16_000,
        "padding_value": 0.0,
        "padding_side": "right",
        "return_attention_mask": True,
        "frame_length": 320,
        "hop_length": 160,
        "fft_length": 512,
        "fft_overdrive": False,
        "min_frequency": 0.0,
        "max_frequency": 8000.0,
        "preemphasis": 0.0,
        "preemphasis_htk_flavor": True,
        "dither": 0.0,
        "input_scale_factor": 1.0,
        "mel_floor": 0.001,
        "per_bin_mean": None,
        "per_bin_stddev": None,
    }


def _processor_config() -> dict[str, Any]:
    pixels = {
        "do_convert_rgb": True,
        "do_resize": True,
        "resample": 3,  # bicubic
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": False,  # pixels stay in [0, 1]; the vision tower maps them to [-1, 1]
        "image_mean": [0.0, 0.0, 0.0],
        "image_std": [1.0, 1.0, 1.0],
        "patch_size": 16,
        "pooling_kernel_size": 3,
    }
    return {
        "processor_class": "EmbeddingGemma2Processor",
        "image_seq_length": 280,
        "audio_seq_length": 750,  # 30 s at 25 soft tokens per second
        "audio_ms_per_token": 40,
        "image_processor": {"image_processor_type": "Gemma4ImageProcessor", **pixels, "max_soft_tokens": 280},
        "video_processor": {
            "video_processor_type": "EmbeddingGemma2VideoProcessor",
            **pixels,
            "max_soft_tokens": 70,  # per frame
            "do_sample_frames": True,
            "fps": 1,
            "max_frames": 32,
            "overflow_strategy": "uniform",
            "add_timestamps": False,
            "return_metadata": False,
        },
        "feature_extractor": _feature_extractor_config(),
    }


# ---------------------------------------------------------------------------------------------
# sentence-transformers
# ---------------------------------------------------------------------------------------------
def _sentence_transformers_files() -> dict[str, Any]:
    forward = {"method": "forward", "method_output_name": "last_hidden_state"}
    return {
        "modules.json": [
            {
                "idx": 0,
                "name": "0",
                "path": "",
                "type": "sentence_transformers.base.modules.transformer.Transformer",
            },
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
            },
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.base.modules.normalize.Normalize",
            },
        ],
        # Every modality goes through `forward` -> last_hidden_state (already 768-d per token). With
        # "message" present, sentence-transformers renders every input (text too) through the chat
        # template; prompts become a system message in front of the content.
        "sentence_bert_config.json": {
            "transformer_task": "feature-extraction",
            "modality_config": {
                "text": forward,
                "image": forward,
                "audio": forward,
                "video": forward,
                "message": {**forward, "format": "structured"},
            },
            "module_output_name": "token_embeddings",
        },
        "1_Pooling/config.json": {"embedding_dimension": 768, "pooling_mode": "mean", "include_prompt": True},
        "2_Normalize/config.json": {
            "module_input_name": "sentence_embedding",
            "module_output_name": "sentence_embedding",
        },
        "config_sentence_transformers.json": {
            "model_type": "SentenceTransformer",
            "prompts": PROMPTS,
            "default_prompt_name": None,
            "similarity_fn_name": "cosine",
            "requirements": {
                "sentence-transformers": {
                    "specifier": ">=6.1.0",
                    "reason": "content order and several media per input in multimodal dict inputs",
                }
            },
        },
    }


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------
def write_demo_model(dst: str | Path, size: str = "tiny", seed: int = 0, dtype: str = "bfloat16") -> Path:
    """Write a random-weight checkpoint of `size` ("tiny" or "full") into `dst` and return it.

    Deterministic: the same (size, seed, dtype) gives the same bytes. dtype "bfloat16" (default)
    or "float32" (strict CPU parity); "float16" exists to test that consumers refuse it.
    """
    config = demo_config(size, dtype)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)

    def write_json(name: str, obj: Any) -> None:
        path = dst / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    write_json("config.json", config)
    shapes = checkpoint_shapes(config)
    nbytes = _write_safetensors(dst / "model.safetensors", shapes, seed, DTYPES[dtype])

    build_tokenizer().save(str(dst / "tokenizer.json"))
    write_json("tokenizer_config.json", _tokenizer_config())
    (dst / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    write_json("processor_config.json", _processor_config())
    write_json(
        "preprocessor_config.json",
        {**_feature_extractor_config(), "processor_class": "EmbeddingGemma2Processor"},
    )
    for name, obj in _sentence_transformers_files().items():
        write_json(name, obj)

    logger.info(
        "wrote %s EmbeddingGemma 2 demo checkpoint to %s: %d tensors, %.1f MB %s, seed %d",
        size, dst, len(shapes), nbytes / 1e6, dtype, seed,
    )  # fmt: skip
    return dst
