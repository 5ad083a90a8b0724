"""The vision tower (images and video frames): patch embedding with a learned 2-D position table,
a bidirectional encoder with axial 2-D RoPE, then k x k average pooling into soft tokens.

Shapes: N images (or frames), S patch slots per image (budget x k^2, padded), C = 3 * 16 * 16 = 768
pixel values per patch, V vision hidden (768), k pooling kernel (3), M soft tokens per image slot
(S / k^2). Padding patches carry position (-1, -1).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from eg2_runtime.config import VisionConfig
from eg2_runtime.layers import ClippableLinear, GatedMLP, RMSNorm, apply_rope, key_padding_mask

RESCALE = 1 / 255  # the processor's rescale_factor, applied in float32 as `uint8 * 0.00392156862745098`


def unit_pixels(codes: torch.Tensor) -> torch.Tensor:
    """uint8 pixel codes -> float32 pixels in [0, 1], as the reference processor rescales them:
    float32(code) * float32(1/255), one correctly rounded product, so any device gives the same bits.

    The patches travel as codes (a quarter of the bytes through collation, the copy to the GPU and
    the tower graphs' static inputs) and are scaled by the patch embedder."""
    # A Python scalar times a float32 tensor multiplies in float32 (the scalar rounded to float32
    # first), on any device, with no host-to-device copy: a CUDA graph can capture it.
    return codes.to(torch.float32) * RESCALE


class PatchEmbedder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.input_proj = nn.Linear(3 * cfg.patch_size**2, cfg.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(
            torch.zeros(2, cfg.position_embedding_size, cfg.hidden_size)
        )

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        """(N, S, C) pixels in [0, 1] (or their uint8 codes), (N, S, 2) positions, (N, S) padding
        -> (N, S, V)."""
        if pixels.dtype == torch.uint8:
            pixels = unit_pixels(pixels)
        # No mean/std normalisation in the processor: the model maps [0, 1] to [-1, 1] itself.
        # The table's dtype is the compute dtype (a packed input_proj stores int32 codes).
        h = self.input_proj((2 * (pixels - 0.5)).to(self.position_embedding_table.dtype))
        pos = positions.clamp(min=0)
        table = self.position_embedding_table
        pe = F.embedding(pos[..., 0], table[0]) + F.embedding(pos[..., 1], table[1])
        return h + torch.where(padding[..., None], 0.0, pe)


def axial_rope(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """cos/sin (N, S, head_dim): channels [0, hd/2) rotate by x, [hd/2, hd) by y, each half-split."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float, device=positions.device) / half))
    freqs = positions.float()[..., None] * inv_freq  # (N, S, 2, hd/4)
    fx, fy = freqs[..., 0, :], freqs[..., 1, :]
    angles = torch.cat((fx, fx, fy, fy), dim=-1)  # (N, S, hd)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_axial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, S, heads, hd); the x half and the y half are rotated independently."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, :, None], sin[:, :, None]
    return torch.cat(
        (
            apply_rope(x[..., :half], cos[..., :half], sin[..., :half]),
            apply_rope(x[..., half:], cos[..., half:], sin[..., half:]),
        ),
        dim=-1,
    )


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        clip = cfg.use_clipped_linears
        self.head_dim = cfg.head_dim
        h, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = ClippableLinear(h, cfg.num_heads * hd, clip)
        self.k_proj = ClippableLinear(h, cfg.num_kv_heads * hd, clip)
        self.v_proj = ClippableLinear(h, cfg.num_kv_heads * hd, clip)
        self.o_proj = ClippableLinear(cfg.num_heads * hd, h, clip)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.v_norm = RMSNorm(hd, cfg.rms_norm_eps, with_scale=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        n, s, _ = x.shape
        shape = (n, s, -1, self.head_dim)
        q = apply_axial_rope(self.q_norm(self.q_proj(x).view(shape)), cos, sin).transpose(1, 2)
        k = apply_axial_rope(self.k_norm(self.k_proj(x).view(shape)), cos, sin).transpose(1, 2)
        v = self.v_norm(self.v_proj(x).view(shape)).transpose(1, 2)  # (N, heads, S, hd)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(n, s, -1))


class VisionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = VisionAttention(cfg)
        self.mlp = GatedMLP(
            cfg.hidden_size, cfg.intermediate_size, ClippableLinear, clipped=cfg.use_clipped_linears
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(cfg) for _ in range(cfg.num_layers))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embedder = PatchEmbedder(cfg)
        self.encoder = VisionEncoder(cfg)
        if cfg.standardize:
            self.std_bias = nn.Buffer(torch.zeros(cfg.hidden_size))
            self.std_scale = nn.Buffer(torch.ones(cfg.hidden_size))

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(N, S, C) pixels, (N, S, 2) positions -> (n_soft, V) soft tokens of every image, in order."""
        padding = (positions == -1).all(dim=-1)  # (N, S)
        # No mask when no image is padded: SDPA then takes its fastest kernel, as the reference does.
        soft, used = self.slots(pixels, positions, padding, masked=bool(padding.any()))
        return soft[used]

    def slots(
        self, pixels: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor, masked: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tower with static shapes and no host sync (what a CUDA graph captures): (N, M, V) soft
        tokens of every pooling slot, and (N, M) bool of the slots an image uses; `forward` keeps
        those. `masked`: hide padding patches as keys (needed whenever an image has any)."""
        cfg = self.cfg
        x = self.patch_embedder(pixels, positions, padding)
        cos, sin = axial_rope(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        mask = key_padding_mask(~padding) if masked else None
        for layer in self.encoder.layers:
            x = layer(x, cos, sin, mask)
        pooled, used = self.pool(x.masked_fill(padding[..., None], 0.0), positions)
        # Scale by sqrt(V) in fp32: the magnitude would overflow fp16, and bf16 would lose bits.
        soft = pooled.float() * math.sqrt(cfg.hidden_size)  # (N, M, V) fp32, elementwise from here
        if cfg.standardize:
            soft = (soft - self.std_bias.float()) * self.std_scale.float()
        return soft.to(x.dtype), used

    def pool(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Average k x k patch blocks: (N, S, V) -> (N, M, V) in x's dtype, (N, M) bool of used slots.

        Output slot of patch (x, y) is (x // k) + (W / k) * (y // k), W the image's width in patches.
        Padding patches are zero and land in slot 0, so they add nothing. The average is a one-hot
        matmul in fp32 rounded to x's dtype, exactly as the reference computes it.
        """
        k = self.cfg.pooling_kernel_size
        m = x.shape[1] // (k * k)
        pos = positions.clamp(min=0)
        width = pos[..., 0].amax(dim=-1, keepdim=True) + 1  # (N, 1) patches per row
        slot = pos[..., 0] // k + (width // k) * (pos[..., 1] // k)  # (N, S)
        # A one-hot by comparison: F.one_hot may check its indices on the host (a sync no CUDA graph allows).
        weights = (slot[..., None] == torch.arange(m, device=slot.device)).float() / (k * k)  # (N, S, M)
        pooled = weights.transpose(1, 2) @ x.float()  # (N, M, V)
        return pooled.to(x.dtype), (weights != 0).any(dim=1)
