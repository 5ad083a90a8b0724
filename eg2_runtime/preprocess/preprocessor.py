"""Preprocessor: one Item (text and media parts) -> `Prepared` model inputs, on the CPU.

Built once from a model directory: tokenizer.json, config_sentence_transformers.json (prompts) and
processor_config.json (image / video / audio settings; class defaults when absent). Holds no mutable
state after construction, so `prepare` may run on many threads at once. Decoding is guarded by the
caller's `MediaLimits`; errors are the runtime's InputError family with client-safe messages.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eg2_runtime.config import ModelConfig
from eg2_runtime.errors import CheckpointError, EG2Error, InputError, ModalityNotLoadedError
from eg2_runtime.inputs import (
    IMAGE_TOKEN_BUDGETS,
    Item,
    MediaKind,
    MediaLimits,
    MediaPart,
    PrepareOptions,
    TextPart,
)
from eg2_runtime.preprocess import audio, image, video
from eg2_runtime.preprocess.layout import Markers, Prepared, check_text, expand
from eg2_runtime.preprocess.text import MAX_TOKENS, Prompts, TextTokenizer


class Preprocessor:
    def __init__(
        self,
        tokenizer: TextTokenizer,
        config: ModelConfig,
        *,
        prompts: Prompts | None = None,
        processor_config: dict[str, Any] | None = None,
        limits: MediaLimits | None = None,
        modalities: Sequence[MediaKind] | None = None,
        max_tokens: int = MAX_TOKENS,
    ) -> None:
        pc = processor_config or {}
        self.tokenizer = tokenizer
        self.config = config
        self.prompts = prompts or Prompts({})
        self.limits = limits or MediaLimits.unbounded()
        self.max_tokens = max_tokens
        vision = config.vision
        pixels = pc.get("image_processor") or {}  # patch geometry: the processor's, else the tower's
        self.geometry = image.PatchGeometry(
            patch_size=pixels.get("patch_size", vision.patch_size if vision else 16),
            pooling_kernel_size=pixels.get(
                "pooling_kernel_size", vision.pooling_kernel_size if vision else 3
            ),
        )
        self.video_config = video.VideoConfig.from_dict(pc.get("video_processor") or {})
        self.log_mel = audio.LogMel(audio.MelConfig.from_dict(pc.get("feature_extractor") or {}))
        if modalities is None:
            modalities = [*(("image", "video") if vision else ()), *(("audio",) if config.audio else ())]
        self.modalities = frozenset(modalities)
        self.markers = self._markers(tokenizer, config)

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        config: ModelConfig | None = None,
        *,
        limits: MediaLimits | None = None,
        modalities: Sequence[MediaKind] | None = None,
    ) -> Preprocessor:
        model_dir = Path(model_dir)
        config = config or ModelConfig.from_dir(model_dir)
        pc_path = model_dir / "processor_config.json"
        processor_config = _read_json(pc_path) if pc_path.is_file() else {}
        if "feature_extractor" not in processor_config and (model_dir / "preprocessor_config.json").is_file():
            processor_config["feature_extractor"] = _read_json(model_dir / "preprocessor_config.json")
        try:
            return cls(
                TextTokenizer.from_file(model_dir / "tokenizer.json"),
                config,
                prompts=Prompts.from_dir(model_dir),
                processor_config=processor_config,
                limits=limits,
                modalities=modalities,
            )
        except ValueError as e:  # a processor setting this implementation does not reproduce
            raise CheckpointError(f"processor_config.json: {e}") from e

    @staticmethod
    def _markers(tokenizer: TextTokenizer, config: ModelConfig) -> Markers:
        markers = Markers()
        expected = {
            markers.boi: config.boi_token_id,
            markers.eoi: config.eoi_token_id,
            markers.boa: config.boa_token_id,
            markers.eoa: config.eoa_token_id,
            markers.image: config.image_token_id,
            markers.video: config.video_token_id,
            markers.audio: config.audio_token_id,
        }
        for marker, want in expected.items():
            got = tokenizer.token_id(marker)
            if got != want:
                raise CheckpointError(f"tokenizer maps {marker} to {got}, config.json says {want}")
        markers = Markers(ids=expected)
        # Each block must tokenize to exactly its three marker ids, splitting the text around it: the
        # layout renders one block per media part and relies on that.
        e = expected
        blocks = {
            markers.image_block(): [e[markers.boi], e[markers.image], e[markers.eoi]],
            markers.audio_block(): [e[markers.boa], e[markers.audio], e[markers.eoa]],
            markers.video_block(None, 1): [e[markers.boi], e[markers.video], e[markers.eoi]],
        }
        a, b = tokenizer.encode_batch(["a", "b"])
        for block, ids in blocks.items():
            if tokenizer.encode_batch([f"a{block}b"])[0] != [*a, *ids, *b]:
                raise CheckpointError(f"tokenizer.json does not keep {block} as three special tokens")
        return markers

    def resolve_prompt(self, prompt_name: str | None = None, prompt: str | None = None) -> str | None:
        """The literal prefix for a request's prompt / prompt_name (see `Prompts.resolve`)."""
        return self.prompts.resolve(prompt_name, prompt)

    # ------------------------------------------------------------------------------------ prepare

    def prepare(self, item: Item, options: PrepareOptions) -> Prepared:
        out = self.prepare_batch([item], options, raise_errors=True)[0]
        assert isinstance(out, Prepared)  # errors were raised
        return out

    def prepare_batch(
        self,
        items: Sequence[Item],
        options: PrepareOptions,
        *,
        raise_errors: bool = False,
        executor: Executor | None = None,
    ) -> list[Prepared | EG2Error]:
        """Prepare several items, their text tokenized in one call. A failing item gives its error in
        its slot (or raises, with `raise_errors`); the others are unaffected.

        `executor`: decode and featurize the media of the items in parallel (PIL, PyAV, soxr and
        numpy release the GIL for the heavy parts)."""

        def stage(item: Item) -> _Staged | EG2Error:
            try:
                return self._stage(item, options)
            except EG2Error as e:
                if raise_errors:
                    raise
                return e

        has_media = any(isinstance(p, MediaPart) for item in items for p in item.parts)
        # Text alone is staged in microseconds: a thread hop per item would cost more than it saves.
        staged = list(executor.map(stage, items) if executor is not None and has_media else map(stage, items))
        texts = [s.text for s in staged if isinstance(s, _Staged)]
        encoded = iter(self.tokenizer.encode_batch(texts) if texts else [])
        out: list[Prepared | EG2Error] = []
        for s in staged:
            if not isinstance(s, _Staged):
                out.append(s)
                continue
            try:
                out.append(self._finish(s, next(encoded), options))
            except EG2Error as e:
                if raise_errors:
                    raise
                out.append(e)
        return out

    def _stage(self, item: Item, options: PrepareOptions) -> _Staged:
        """Decode and featurize the media, and render the item's string with one placeholder per block."""
        if not item.parts:
            raise InputError("an input item has no parts", param="input")
        if options.image_tokens not in IMAGE_TOKEN_BUDGETS:
            raise InputError(f"image_tokens must be one of {IMAGE_TOKEN_BUDGETS}", param="image_tokens")
        for part in item.parts:
            if isinstance(part, MediaPart) and part.kind not in self.modalities:
                raise ModalityNotLoadedError(f"this server does not embed {part.kind}", param="input")
        m = self.markers
        prompt = options.prompt or ""
        check_text(prompt, m, param="prompt")
        s = _Staged(item=item, pieces=[prompt])
        for part in item.parts:
            if isinstance(part, TextPart):
                check_text(part.text, m)
                s.pieces.append(part.text)
            elif part.kind == "image":
                rgb = image.decode_image(part.data, max_pixels=self.limits.max_image_pixels)
                patched = image.prepare_image(rgb, options.image_tokens, self.geometry)
                s.images.append(patched)
                s.soft[m.ids[m.image]].append(patched.num_soft_tokens)
                s.pieces.append(m.image_block())
            elif part.kind == "audio":
                wave, cut = audio.load_audio(part.data, truncate=options.truncate, limits=self.limits)
                features, mask = self.log_mel(wave)
                if not np.isfinite(features).all():  # finite samples so large the spectrum overflows
                    raise InputError("audio sample values are out of range", param="input")
                n = audio.num_soft_tokens(mask)
                if n == 0:
                    raise InputError("audio is too short: it needs at least 10 ms of sound", param="input")
                s.audio.append((features, mask))
                s.audio_truncated |= cut
                s.soft[m.ids[m.audio]].append(n)
                s.pieces.append(m.audio_block())
            else:
                vc = self.video_config
                sampled = video.decode_video(part.data, vc, self.limits)
                patched = video.prepare_frames(sampled.frames, vc.budget, self.geometry)
                frames = len(sampled.indices)
                s.videos.append(patched)
                s.frame_counts.append(frames)
                s.timestamps.append(sampled.timestamps)
                s.soft[m.ids[m.video]].extend([patched.num_soft_tokens] * frames)
                s.pieces.append(m.video_block(sampled.timestamps if vc.add_timestamps else None, frames))
        s.text = "".join(s.pieces)
        return s

    def _finish(self, s: _Staged, ids: list[int], options: PrepareOptions) -> Prepared:
        input_ids, truncated = expand(
            ids,
            {k: iter(v) for k, v in s.soft.items()},
            prefix=self.tokenizer.prefix,
            suffix=self.tokenizer.suffix,
            max_tokens=self.max_tokens,
            truncate=options.truncate,
            marker_ids=set(self.markers.ids.values()),
        )
        p = Prepared(
            input_ids=input_ids,
            modality=s.item.modality,
            text_truncated=truncated,
            audio_truncated=s.audio_truncated,
            frame_timestamps=s.timestamps,
        )
        if s.images:
            p.pixel_values = _cat([x.pixel_values for x in s.images])
            p.image_position_ids = _cat([x.position_ids for x in s.images])
        if s.videos:
            p.pixel_values_videos = _cat([x.pixel_values for x in s.videos])
            p.video_position_ids = _cat([x.position_ids for x in s.videos])
            p.num_frames_per_video = torch.tensor(s.frame_counts, dtype=torch.int64)
        if s.audio:
            # Pad every audio's frames to the longest, as the reference's batch padding does.
            frames = max(f.shape[0] for f, _ in s.audio)
            feats = np.zeros((len(s.audio), frames, self.log_mel.config.feature_size), dtype=np.float32)
            masks = np.zeros((len(s.audio), frames), dtype=bool)
            for i, (f, mask) in enumerate(s.audio):
                feats[i, : len(f)], masks[i, : len(mask)] = f, mask
            p.input_features, p.input_features_mask = torch.from_numpy(feats), torch.from_numpy(masks)
        return p


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat, without its copy for the usual single part (one image's patches are 7.7 MB)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass
class _Staged:
    """An item between decoding and tokenization."""

    item: Item
    pieces: list[str]  # the rendered string, piece by piece: prompt, text, one placeholder block per media
    text: str = ""
    images: list[image.PatchedImages] = field(default_factory=list)
    videos: list[image.PatchedImages] = field(default_factory=list)
    frame_counts: list[int] = field(default_factory=list)
    timestamps: list[list[float]] = field(default_factory=list)
    audio: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (F, 128) features, (F,) mask
    audio_truncated: bool = False
    soft: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))  # placeholder id -> counts


def _read_json(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path.name} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{path.name} must hold a JSON object")
    return d


def prepare_item(item: Item, options: PrepareOptions, ctx: Preprocessor) -> Prepared:
    """Preprocess one item with the tokenizer, prompts and settings held by `ctx`."""
    return ctx.prepare(item, options)
