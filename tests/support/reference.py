"""The reference for parity tests: transformers' EmbeddingGemma2Model under sentence-transformers.

Only tests import this (it imports transformers; eg2_runtime never does). `load_reference` wraps
`SentenceTransformer(model_dir)`: the checkpoint's own modules.json pipeline, i.e. the
EmbeddingGemma2Processor (chat template, tokenizer, Gemma4 image processor, Gemma4 audio feature
extractor, EmbeddingGemma2 video processor), `EmbeddingGemma2Model.last_hidden_state` (768-d per
token, `embedding_projection` included), mean pooling over the attention mask, L2 normalization.

Input format, one embedding per input:

    "some text"                                      text
    PIL.Image.Image  or  {"image": PIL.Image}        an image
    {"audio": (waveform, 16000)}  or  {"audio": waveform}
                                                     mono float32 (n,) at 16 kHz; the reference
                                                     feature extractor does not resample, so any
                                                     other rate is refused here
    {"video": frames, "fps": 25.0}                   uint8 (T, H, W, 3) array or list of PIL frames
                                                     decoded at `fps` (default 1.0); the processor
                                                     samples 1 frame per second, at most 32
    {"video": "clip.mp4"}                            a file, decoded here with PyAV at its own rate
    {"content": [("text", "a photo of"), ("image", img), ("audio", (w, 16000)), ...]}
                                                     several parts, embedded in this order; a
                                                     video part is ("video", (frames, fps)) or a
                                                     path, and cannot sit between parts of other
                                                     kinds (its metadata cannot ride in a message)

sentence-transformers renders every input, text included, through the checkpoint's chat template
and the processor. A prompt (e.g. "task: search result | query: ") becomes a system message that the
template renders first, so it reads as a prefix of the input's text: <bos> prompt text <eos>.
In bfloat16, sentence-transformers pools and normalizes in bfloat16: norms are 1 +- 3e-3.

Everything goes through sentence-transformers' own `encode` (`Reference.encode`). `model_inputs`
returns the processor tensors that path builds, so a runtime can be fed identical inputs, and
`embed_features` runs `EmbeddingGemma2Model` on given tensors and pools them itself (mean over
attention_mask in fp32, then L2): use it for inputs sentence-transformers cannot express, e.g.
features a runtime prepared.

Pitfalls (docs/CORRECTNESS.md lists them too):
- Without torchvision, transformers falls back to the PIL image processor (up to 2/255 per pixel off)
  and the video processor does not load at all; `Reference.image_backend` says which one is in use.
- The audio tower has no SDPA path: the reference loads with eager attention.
- `input_features` without `input_features_mask` raises in the model; placeholders without features
  silently stay pad embeddings.
- A compressed-tensors (pack-quantized) checkpoint loads densely only with
  `CompressedTensorsConfig(dequantize=True)`, passed here through `model_kwargs`.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from PIL import Image
from sentence_transformers import SentenceTransformer

SAMPLING_RATE = 16_000
# Keys of the processor output that are model inputs (the rest is bookkeeping: modality, counts).
MODEL_INPUT_NAMES = (
    "input_ids",
    "attention_mask",
    "pixel_values",
    "image_position_ids",
    "input_features",
    "input_features_mask",
    "pixel_values_videos",
    "video_position_ids",
    "num_frames_per_video",
)


def _audio(value: Any) -> dict[str, Any]:
    wave, rate = value if isinstance(value, tuple) else (value, SAMPLING_RATE)
    if rate != SAMPLING_RATE:
        raise ValueError(
            f"the reference feature extractor does not resample: give 16 kHz audio, got {rate} Hz"
        )
    wave = np.asarray(wave, dtype=np.float32)
    if wave.ndim != 1:
        raise ValueError(f"audio must be mono (n,), got shape {wave.shape}")
    return {"array": wave, "sampling_rate": SAMPLING_RATE}


def _decode_video(path: str | Path) -> tuple[np.ndarray, float]:
    """All frames of a video file as uint8 (T, H, W, 3) and its frame rate, decoded with PyAV
    (transformers' own path decoding needs torchcodec, which this environment lacks)."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)])
        return frames, float(stream.average_rate)


def _video(value: Any, fps: float) -> dict[str, Any]:
    if isinstance(value, str | Path):
        value, fps = _decode_video(value)
    frames = (
        np.stack([np.asarray(f) for f in value]) if isinstance(value, list | tuple) else np.asarray(value)
    )
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"video frames must be uint8 (T, H, W, 3), got {frames.dtype} {frames.shape}")
    n = frames.shape[0]
    # fps and duration let the processor sample at 1 fps; without them it keeps every frame.
    return {"array": frames, "video_metadata": {"fps": fps, "total_num_frames": n, "duration": n / fps}}


def _part(kind: str, value: Any) -> Any:
    if kind in ("text", "image"):
        return value
    if kind == "audio":
        return _audio(value)
    if kind == "video":
        frames, fps = value if isinstance(value, tuple) else (value, 1.0)
        return _video(frames, fps)
    raise ValueError(f"unknown content part {kind!r}: expected text, image, audio or video")


def _content(parts: Sequence[tuple[str, Any]]) -> Any:
    """Interleaved parts -> a sentence-transformers multimodal dict, or a chat message."""
    kinds = [kind for kind, _ in parts]
    runs = [kind for i, kind in enumerate(kinds) if i == 0 or kinds[i - 1] != kind]
    if len(runs) == len(set(runs)):
        # Each kind in one contiguous run: a multimodal dict keeps that order (sentence-transformers
        # >= 6.1) and carries audio sampling rates and video metadata (fps sampling) itself.
        grouped: dict[str, list[Any]] = {}
        for kind, value in parts:
            grouped.setdefault(kind, []).append(_part(kind, value))
        return grouped
    # Truly interleaved (text, image, text, ...): a chat message, rendered in order by the chat
    # template. Video metadata cannot travel with a message, so video is refused here.
    content = []
    for kind, value in parts:
        if kind == "video":
            raise ValueError("video inside interleaved content is not supported: group parts by kind")
        item = _part(kind, value)
        content.append({"type": kind, kind: item["array"] if kind == "audio" else item})
    return [{"role": "user", "content": content}]


def _is_message(converted: Any) -> bool:
    return isinstance(converted, list)


def to_sentence_transformers(item: Any) -> Any:
    """One input of this module's format -> the input sentence-transformers 6 takes for it."""
    if isinstance(item, str | Image.Image):
        return item
    if not isinstance(item, dict):
        raise TypeError(
            f"unsupported input {type(item).__name__}: see the tests/support/reference.py docstring"
        )
    if item.keys() == {"content"}:
        return _content(item["content"])
    if item.keys() == {"image"}:
        return item["image"]
    if item.keys() == {"audio"}:
        return _audio(item["audio"])
    if "video" in item and item.keys() <= {"video", "fps"}:
        return _video(item["video"], float(item.get("fps", 1.0)))
    raise ValueError(f"unsupported input keys {sorted(item)}: see the tests/support/reference.py docstring")


@dataclass
class Reference:
    model: SentenceTransformer

    @property
    def transformer(self) -> Any:  # sentence_transformers' Transformer module (processor + model)
        return self.model[0]

    @property
    def hf_model(self) -> torch.nn.Module:  # the EmbeddingGemma2Model
        return self.transformer.auto_model

    @property
    def processor(self) -> Any:  # the EmbeddingGemma2Processor
        return self.transformer.processor

    @property
    def image_backend(self) -> str:
        """Which image processor runs: "torchvision" (Gemma4ImageProcessor) or "pil" (its Pil twin)."""
        return "pil" if type(self.processor.image_processor).__name__.endswith("Pil") else "torchvision"

    def encode(
        self,
        inputs: Sequence[Any],
        prompt: str | None = None,
        batch_size: int = 8,
        processing_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> np.ndarray:
        """(N, 768) float32 unit vectors, through sentence-transformers' encode.

        `processing_kwargs`: per-modality processor overrides, e.g. `{"image": {"max_soft_tokens": 70}}`
        for an image budget other than the checkpoint's."""
        extra = {} if processing_kwargs is None else {"processing_kwargs": processing_kwargs}
        converted = [to_sentence_transformers(x) for x in inputs]
        out = np.zeros((len(converted), 768), dtype=np.float32)
        # sentence-transformers 6.2 mangles a chat message batched with other kinds of input (it
        # wraps it as content of type "message", which the template drops): encode them apart.
        is_message = [_is_message(x) for x in converted]
        for group in (True, False):
            index = [i for i, m in enumerate(is_message) if m == group]
            if index:
                batch = [converted[i] for i in index]
                vectors = self.model.encode(
                    batch, prompt=prompt, batch_size=batch_size, convert_to_numpy=True, **extra
                )
                out[index] = np.asarray(vectors, dtype=np.float32)
        return out

    def model_inputs(self, inputs: Sequence[Any], prompt: str | None = None) -> dict[str, torch.Tensor]:
        """The processor tensors sentence-transformers builds for `inputs` as one padded batch."""
        converted = [to_sentence_transformers(x) for x in inputs]
        if len({_is_message(x) for x in converted}) > 1:
            raise ValueError(
                "interleaved content (a chat message) cannot share a batch with other inputs in "
                "sentence-transformers 6.2: build its inputs in a separate call"
            )
        features = self.transformer.preprocess(converted, prompt=prompt)
        return {k: v for k, v in features.items() if k in MODEL_INPUT_NAMES and v is not None}

    @torch.no_grad()
    def embed_features(self, features: dict[str, torch.Tensor]) -> np.ndarray:
        """Run EmbeddingGemma2Model on `features` (as `model_inputs` returns them) and pool:
        mean over attention_mask in fp32, then L2. (N, 768) float32."""
        model = self.hf_model
        device = next(model.parameters()).device
        # Media tensors stay in the processor's fp32, as sentence-transformers passes them: the model
        # casts them itself (e.g. the patch embedder maps [0, 1] to [-1, 1] before the cast).
        kwargs = {k: v.to(device) for k, v in features.items() if k in MODEL_INPUT_NAMES}
        hidden = model(**kwargs).last_hidden_state.float()  # (B, T, 768)
        mask = kwargs["attention_mask"].unsqueeze(-1).float()  # (B, T, 1)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).cpu().numpy()


def load_reference(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    dequantize: bool | None = None,
    attn_implementation: str | None = None,
) -> Reference:
    """Load the sentence-transformers reference from a local checkpoint directory.

    dequantize: load a compressed-tensors checkpoint with its 4-bit weights dequantized to dense
    (`CompressedTensorsConfig(dequantize=True)`); None decides from config.json's
    `quantization_config`.
    attn_implementation: None is transformers' default, what a user gets (SDPA for the text and
    vision towers; the audio tower has only its eager path); "eager" forces eager everywhere.
    """
    model_dir = Path(model_dir)
    if dequantize is None:
        config = json.loads((model_dir / "config.json").read_text())
        dequantize = "quantization_config" in config
    model_kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        model_kwargs["attn_implementation"] = attn_implementation
    if dequantize:
        from transformers import CompressedTensorsConfig

        model_kwargs["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    with warnings.catch_warnings():
        # transformers warns that the checkpoint's own quantization_config wins, yet it does merge
        # the loading attribute `dequantize` into it: the warning is noise here.
        warnings.filterwarnings("ignore", message="You passed `quantization_config`", category=UserWarning)
        model = SentenceTransformer(
            str(model_dir), device=device, model_kwargs=model_kwargs, local_files_only=True
        )
    model.eval()
    return Reference(model)
