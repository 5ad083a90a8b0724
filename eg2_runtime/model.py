"""EG2Model: the three towers, the two multimodal embedders, placeholder scatter, mean pooling and
L2 normalisation. Parameter names are those of the Hugging Face checkpoint.

Shapes: B items, T tokens, H text hidden (512), D embedding dim (768). Media soft tokens replace the
placeholder ids (image, video, audio) of input_ids in reading order, unscaled; everything else takes
the token embedding, scaled by sqrt(H). Placeholders themselves embed as the pad token.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from eg2_runtime.audio import AudioTower
from eg2_runtime.config import ModelConfig
from eg2_runtime.layers import RMSNorm
from eg2_runtime.quant import Unpacker
from eg2_runtime.text import TextEncoder
from eg2_runtime.vision import VisionTower

ALL_MODALITIES = frozenset({"text", "image", "audio", "video"})


class SoftTokens(Protocol):
    """What computes media soft tokens: EG2Model itself, or eg2_runtime.tower_graphs.GraphedTowers.
    `count`: how many soft tokens the placeholders ask for, known on the host; the graphed towers use
    it to select without a device sync, EG2Model does not need it."""

    def image_soft_tokens(
        self, pixels: torch.Tensor, positions: torch.Tensor, count: int | None = None
    ) -> torch.Tensor: ...
    def audio_soft_tokens(
        self, features: torch.Tensor, mask: torch.Tensor, count: int | None = None
    ) -> torch.Tensor: ...


class MultimodalEmbedder(nn.Module):
    """Parameter-free RMSNorm, then a Linear into the text hidden size."""

    def __init__(self, width: int, text_hidden: int, eps: float) -> None:
        super().__init__()
        self.embedding_pre_projection_norm = RMSNorm(width, eps, with_scale=False)
        self.embedding_projection = nn.Linear(width, text_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))


class EG2Model(nn.Module):
    def __init__(self, config: ModelConfig, modalities: Iterable[str] | None = None) -> None:
        """`modalities`: the towers to build; None builds every tower the checkpoint has."""
        super().__init__()
        self.config = config
        if modalities is None:
            modalities = ({"image", "video"} if config.vision else set()) | (
                {"audio"} if config.audio else set()
            )
        wanted = frozenset(modalities) | {"text"}
        if unknown := wanted - ALL_MODALITIES:
            raise ValueError(f"unknown modalities {sorted(unknown)}; choose from {sorted(ALL_MODALITIES)}")
        h = config.text.hidden_size
        self.language_model = TextEncoder(config.text)
        self.vision_tower: VisionTower | None = None
        self.embed_vision: MultimodalEmbedder | None = None
        self.audio_tower: AudioTower | None = None
        self.embed_audio: MultimodalEmbedder | None = None
        if wanted & {"image", "video"}:
            if config.vision is None:
                raise ValueError("images or video were asked for, but the checkpoint has no vision_config")
            self.vision_tower = VisionTower(config.vision)
            self.embed_vision = MultimodalEmbedder(config.vision.hidden_size, h, config.vision.rms_norm_eps)
        if "audio" in wanted:
            if config.audio is None:
                raise ValueError("audio was asked for, but the checkpoint has no audio_config")
            self.audio_tower = AudioTower(config.audio)
            self.embed_audio = MultimodalEmbedder(config.audio.output_proj_dims, h, config.audio.rms_norm_eps)
        # Unpacks the packed towers' weights a group of layers at a time (quant.Unpacker); set by the loader.
        self.unpacker: Unpacker | None = None
        self.modalities = frozenset(
            {"text"}
            | ({"image", "video"} & wanted if self.vision_tower is not None else set())
            | ({"audio"} if self.audio_tower is not None else set())
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.language_model.embed_tokens.weight.dtype

    def image_soft_tokens(
        self, pixels: torch.Tensor, positions: torch.Tensor, count: int | None = None
    ) -> torch.Tensor:
        """(N, S, 768) pixels, (N, S, 2) positions -> (n_soft, H), images in order. `count` is not
        needed here (SoftTokens): the caller checks n_soft."""
        if self.vision_tower is None or self.embed_vision is None:
            raise ValueError("this model was loaded without the vision tower")
        return self.embed_vision(self.vision_tower(pixels, positions))

    def audio_soft_tokens(
        self, features: torch.Tensor, mask: torch.Tensor, count: int | None = None
    ) -> torch.Tensor:
        """(N, F, 128) log-mel, (N, F) mask -> (n_soft, H): each clip's valid steps, clips in order.
        `count` as for image_soft_tokens."""
        if self.audio_tower is None or self.embed_audio is None:
            raise ValueError("this model was loaded without the audio tower")
        states, valid = self.audio_tower(features.to(self.dtype), mask.bool())
        return self.embed_audio(states)[valid]

    def input_embeddings(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_position_ids: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_position_ids: torch.Tensor | None = None,
        input_features: torch.Tensor | None = None,
        input_features_mask: torch.Tensor | None = None,
        *,
        towers: SoftTokens | None = None,
    ) -> torch.Tensor:
        """(B, T, H): token embeddings with the media soft tokens scattered in, the text encoder's
        input. Argument names are the HF processor's. `input_ids` may stay on the host (the engine
        keeps them there): counting placeholders then needs no device sync. `towers`: another way to
        compute the soft tokens (the engine's CUDA graphs), the same functions by default; given the
        placeholders' count, the graphs return that many rows and leave a mismatch to their
        `check_counts`, which Engine.embed calls after its sync."""
        cfg = self.config
        image = towers.image_soft_tokens if towers is not None else self.image_soft_tokens
        audio = towers.audio_soft_tokens if towers is not None else self.audio_soft_tokens
        media = {
            cfg.image_token_id: (pixel_values, image_position_ids, image),
            cfg.video_token_id: (pixel_values_videos, video_position_ids, image),
            cfg.audio_token_id: (input_features, input_features_mask, audio),
        }
        slots_of, text_ids = _placeholders(input_ids, list(media), cfg.text.pad_token_id)
        embeds = self.language_model.embed(text_ids)
        for token_id, (values, aux, encode) in media.items():
            slots, n_slots = slots_of[token_id]  # (B, T) bool, where input_ids is; how many
            if values is None or aux is None:
                if n_slots:
                    raise ValueError(f"{n_slots} placeholder tokens {token_id} but no media inputs for them")
                continue
            soft = encode(values, aux, n_slots).to(embeds.dtype)  # (n_soft, H)
            if soft.shape[0] != n_slots:
                raise ValueError(
                    f"media gave {soft.shape[0]} soft tokens for {n_slots} placeholders of {token_id}"
                )
            if slots.device != embeds.device:
                # Non-blocking, so the copy queues behind the towers' work instead of waiting for it
                # (as the count's sync would, tower_graphs.py); pinned, so that the copy really is
                # asynchronous (from pageable memory the driver may wait for the stream).
                slots = slots.pin_memory().to(embeds.device, non_blocking=True)
            embeds = embeds.masked_scatter(slots[..., None], soft)
        return embeds

    def encode(self, embeds: torch.Tensor, attention_mask: torch.Tensor, lean: bool = False) -> torch.Tensor:
        """(B, T, H) input embeddings -> (B, D) fp32 unit vectors: the text encoder, then `pool`.
        `lean`: the text encoder's memory-lean path (TextEncoder.forward)."""
        tokens = self.language_model(embeds, attention_mask.bool(), lean=lean)
        return pool(tokens.float(), attention_mask)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **media: torch.Tensor | None
    ) -> torch.Tensor:
        """Unit embeddings (B, D) in fp32: mean over every token with attention_mask 1, then L2."""
        embeds = self.input_embeddings(input_ids, **media)  # type: ignore[arg-type]  # tensors only
        return self.encode(embeds, attention_mask)


def pool(tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T, D) per-token embeddings -> (B, D) unit vectors: masked mean, then L2 normalise."""
    m = attention_mask.to(tokens.dtype)[..., None]
    mean = (tokens * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
    return F.normalize(mean, p=2, dim=-1)


def _placeholders(
    input_ids: torch.Tensor, token_ids: list[int], pad_id: int
) -> tuple[dict[int, tuple[torch.Tensor, int]], torch.Tensor]:
    """Where each media placeholder id sits in (B, T) `input_ids` ((B, T) bool each, and how many
    there are), and the ids with every placeholder replaced by `pad_id` (the rows the token table
    gives them are overwritten).

    Host ids (the engine's) are compared in numpy: each torch op on the CPU lets the GIL go and has
    to win it back, and under a busy event loop each of those waits up to a switch interval (H200,
    2026-12-02, benchmarks/probe_gil_batch.py: 48 hand-offs to embed a 64-text batch). Device ids
    take the same steps in torch."""
    if input_ids.device.type == "cpu":
        ids = input_ids.numpy()
        found = {t: ids == t for t in token_ids}
        text = np.where(np.logical_or.reduce(list(found.values())), pad_id, ids)
        return {t: (torch.from_numpy(m), int(m.sum())) for t, m in found.items()}, torch.from_numpy(text)
    slots = {t: input_ids == t for t in token_ids}
    placeholder = torch.zeros_like(input_ids, dtype=torch.bool)
    for m in slots.values():
        placeholder |= m
    return {t: (m, int(m.sum())) for t, m in slots.items()}, torch.where(placeholder, pad_id, input_ids)
