"""The audio tower: a conformer over log-mel frames (Gemma 4's USM-style encoder).

Shapes: B clips, F mel frames (10 ms each), 128 mel bins, T = F / 4 encoder steps (40 ms each, two
stride-2 convolutions), A audio hidden (1024), nh heads x hd (8 x 128), O output width (1536).

Attention is local and causal: step t sees steps t-11..t. It is computed in blocks of 12 queries
against 24-key windows with a Transformer-XL relative position bias, in fp32, as the reference does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from eg2_runtime.config import AudioConfig
from eg2_runtime.layers import ClippableLinear, RMSNorm


class SubsampleLayer(nn.Module):
    """Conv2d 3x3 stride 2 (no bias) -> LayerNorm over channels (weight only) -> ReLU."""

    def __init__(self, c_in: int, c_out: int, eps: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size=3, stride=2, padding=1, bias=False)
        self.norm = nn.LayerNorm(c_out, eps=eps, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, C, F, bins), mask (B, F) -> halved in both axes."""
        x = self.conv((x * mask[:, None, :, None]).to(self.conv.weight.dtype))
        x = F.relu(self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2).contiguous())
        return x, mask[:, ::2]


# The log-mel frames one pass of the two convolutions takes. The first one's output (C0 channels at
# half the frames and bins) and its LayerNorm's copy are most of the tower's activations, ~25 kB a
# frame in BF16 (H200, 2026-12-03, benchmarks/probe_live_sets.py: 8 clips of 1,024 frames held
# 200 MiB there and nothing else at the step's peak), so a batch goes through them a few clips at a
# time: one 30 s clip (3,001 frames) at most. Each clip's convolutions are its own, so the passes
# give what one pass over the batch gives.
FRONT_FRAMES = 3072


class SubsampleConvProjection(nn.Module):
    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        c0, c1 = cfg.subsampling_conv_channels
        self.layer0 = SubsampleLayer(1, c0, cfg.rms_norm_eps)
        self.layer1 = SubsampleLayer(c0, c1, cfg.rms_norm_eps)
        # The reference sizes this from c0 // 4 (it equals bins / 4 for the 128-bin, c0=128 model).
        self.input_proj_linear = nn.Linear((c0 // 4) * c1, cfg.hidden_size, bias=False)
        # A bound past any batch (tests/runtime/test_audio_front.py) runs the reference: one pass.
        self.frames_per_pass = FRONT_FRAMES

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, F, bins), (B, F) -> (B, T, A), (B, T)."""
        b, f, _ = features.shape
        clips = max(1, self.frames_per_pass // f)  # per pass of the convolutions
        if b <= clips:
            x, mask = self._convolve(features, mask)
        else:
            passes = [
                self._convolve(features[i : i + clips], mask[i : i + clips]) for i in range(0, b, clips)
            ]
            x, mask = torch.cat([x for x, _ in passes]), torch.cat([m for _, m in passes])
        _, _, t, _ = x.shape
        x = x.permute(0, 2, 3, 1).reshape(b, t, -1)  # frequency-major flatten: index = f * C + c
        return self.input_proj_linear(x), mask

    def _convolve(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(b, F, bins), (b, F) -> (b, C1, T, bins / 4), (b, T)."""
        x, mask = self.layer0(features[:, None], mask)
        return self.layer1(x, mask)


class FeedForward(nn.Module):
    """Macaron half-step FFN: x + residual_weight * norm(ffw2(silu(ffw1(norm(x)))))."""

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        clip = cfg.use_clipped_linears
        self.ffw_layer_1 = ClippableLinear(cfg.hidden_size, cfg.hidden_size * 4, clip)
        self.ffw_layer_2 = ClippableLinear(cfg.hidden_size * 4, cfg.hidden_size, clip)
        self.pre_layer_norm = RMSNorm(cfg.hidden_size)
        self.post_layer_norm = RMSNorm(cfg.hidden_size)
        self.clip = cfg.gradient_clipping
        self.residual_weight = cfg.residual_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clip = min(self.clip, torch.finfo(x.dtype).max)
        h = self.pre_layer_norm(torch.clamp(x, -clip, clip))
        h = self.ffw_layer_2(F.silu(self.ffw_layer_1(h)))
        return x + self.post_layer_norm(torch.clamp(h, -clip, clip)) * self.residual_weight


class LightConv(nn.Module):
    """x + linear_end(silu(norm(causal_depthwise_conv(glu(linear_start(norm(x)))))))."""

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        a, clip = cfg.hidden_size, cfg.use_clipped_linears
        self.linear_start = ClippableLinear(a, 2 * a, clip)
        self.linear_end = ClippableLinear(a, a, clip)
        self.depthwise_conv1d = nn.Conv1d(a, a, cfg.conv_kernel_size, groups=a, bias=False)
        self.pre_layer_norm = RMSNorm(a, cfg.rms_norm_eps)
        self.conv_norm = RMSNorm(a, cfg.rms_norm_eps)
        self.clip = cfg.gradient_clipping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1)  # (B, T, A)
        # Causal: pad kernel - 1 steps on the left only, so step t never sees t + 1.
        h = F.pad(h.transpose(1, 2), (self.depthwise_conv1d.kernel_size[0] - 1, 0))
        h = self.depthwise_conv1d(h).transpose(1, 2)
        clip = min(self.clip, torch.finfo(h.dtype).max)
        h = self.conv_norm(torch.clamp(h, -clip, clip))
        return x + self.linear_end(F.silu(h))


class AudioAttention(nn.Module):
    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        a, clip = cfg.hidden_size, cfg.use_clipped_linears
        self.num_heads = cfg.num_heads
        self.head_dim = a // cfg.num_heads
        self.chunk = cfg.chunk_size
        self.past = cfg.context_left - 1
        self.future = cfg.context_right
        self.context = self.chunk + self.past + self.future  # keys per block (24)
        self.softcap = cfg.logit_cap
        self.invalid = cfg.invalid_logits_value
        self.q_scale = (self.head_dim**-0.5) / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)
        self.q_proj = ClippableLinear(a, a, clip)
        self.k_proj = ClippableLinear(a, a, clip)
        self.v_proj = ClippableLinear(a, a, clip)
        self.post = ClippableLinear(a, a, clip)
        self.relative_k_proj = nn.Linear(a, a, bias=False)
        self.per_dim_scale = nn.Parameter(torch.zeros(self.head_dim))

    def blocks(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, nh, hd) -> (B, nb, chunk, nh, hd) non-overlapping query blocks."""
        b, t = x.shape[:2]
        nb = -(-t // self.chunk)
        x = F.pad(x, (0, 0, 0, 0, 0, nb * self.chunk - t))
        return x.reshape(b, nb, self.chunk, *x.shape[2:])

    def windows(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, nh, hd) -> (B, nb, context, nh, hd): block i sees steps [12i - 12, 12i + 12)."""
        x = F.pad(x, (0, 0, 0, 0, self.past, self.future + self.chunk - 1))
        return torch.movedim(x.unfold(1, self.context, self.chunk), -1, 2)

    def window_mask(self, valid: torch.Tensor) -> torch.Tensor:
        """(B, T) valid -> (B, 1, nb, chunk, context) bool: key allowed for this query."""
        t = valid.shape[1]
        nb = -(-t // self.chunk)
        q = torch.arange(nb * self.chunk, device=valid.device).view(nb, self.chunk, 1)
        k = (
            (torch.arange(nb, device=valid.device) * self.chunk).view(nb, 1, 1)
            + torch.arange(self.context, device=valid.device)
            - self.past
        )  # (nb, 1, context) absolute key step
        dist = q - k  # (nb, chunk, context)
        # The reference's window: 0 <= q - k < left (past 11 steps and itself), 0 < k - q < right.
        seen = ((dist >= 0) & (dist < self.past)) | ((dist < 0) & (-dist < self.future))
        in_range = (k >= 0) & (k < t) & seen
        key_valid = valid[:, k.clamp(0, t - 1).squeeze(1)]  # (B, nb, context)
        return (in_range[None] & key_valid[:, :, None, :])[:, None]

    def rel_shift(self, x: torch.Tensor) -> torch.Tensor:
        """Transformer-XL shift (appendix B of arXiv 1901.02860): (..., chunk, P) -> (..., chunk, context)."""
        *lead, c, p = x.shape
        x = F.pad(x, (0, self.context + 1 - p)).reshape(*lead, c * (self.context + 1))
        return x[..., : c * self.context].reshape(*lead, c, self.context)

    def forward(self, x: torch.Tensor, pos_embed: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        shape = (b, t, self.num_heads, self.head_dim)
        q = self.q_proj(x).float().view(shape) * self.q_scale * F.softplus(self.per_dim_scale)
        k = self.k_proj(x).float().view(shape) * self.k_scale
        v = self.v_proj(x).float().view(shape)
        q = self.blocks(q).permute(0, 3, 1, 2, 4)  # (B, nh, nb, chunk, hd)
        k, v = self.windows(k), self.windows(v)  # (B, nb, context, nh, hd)
        nb = q.shape[2]
        rel = self.relative_k_proj(pos_embed).float().view(-1, self.num_heads, self.head_dim)  # (P, nh, hd)
        content = q @ k.permute(0, 3, 1, 4, 2)  # (B, nh, nb, chunk, context)
        position = (q.reshape(b, self.num_heads, -1, self.head_dim) @ rel.permute(1, 2, 0)).view(
            b, self.num_heads, nb, self.chunk, -1
        )
        logits = content + self.rel_shift(position)
        logits = torch.tanh(logits / self.softcap) * self.softcap
        logits = logits.masked_fill(~mask, self.invalid)
        out = logits.softmax(dim=-1) @ v.permute(0, 3, 1, 2, 4)  # (B, nh, nb, chunk, hd)
        out = out.permute(0, 2, 3, 1, 4).reshape(b, nb * self.chunk, -1)[:, :t]
        return self.post(out.to(x.dtype))


class AudioLayer(nn.Module):
    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.feed_forward1 = FeedForward(cfg)
        self.feed_forward2 = FeedForward(cfg)
        self.self_attn = AudioAttention(cfg)
        self.lconv1d = LightConv(cfg)
        self.norm_pre_attn = RMSNorm(cfg.hidden_size)
        self.norm_post_attn = RMSNorm(cfg.hidden_size)
        self.norm_out = RMSNorm(cfg.hidden_size)
        self.clip = cfg.gradient_clipping

    def forward(self, x: torch.Tensor, pos_embed: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        clip = min(self.clip, torch.finfo(x.dtype).max)
        x = self.feed_forward1(x)
        h = self.self_attn(self.norm_pre_attn(torch.clamp(x, -clip, clip)), pos_embed, mask)
        x = x + self.norm_post_attn(torch.clamp(h, -clip, clip))
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(torch.clamp(x, -clip, clip))


def relative_positions(cfg: AudioConfig, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Sinusoidal embeddings of relative distances 12..0: (13, A) as [sin..., cos...].

    The inverse timescales are computed in fp32 and stored in the compute dtype, and the angles and
    their sin/cos are then computed in that dtype, as the reference does (its timescale buffer has
    the model's dtype): in BF16 the rounded angles differ visibly from FP32 ones.
    """
    context = cfg.chunk_size + cfg.context_left - 1 + cfg.context_right
    half = cfg.hidden_size // 2
    inv = torch.exp(torch.arange(half, device=device).float() * -(math.log(10_000.0) / max(half - 1, 1))).to(
        dtype
    )
    t = torch.arange(context // 2, -1, -1, device=device)[:, None] * inv[None]  # (13, A/2) in dtype
    return torch.cat((t.sin(), t.cos()), dim=-1)


class AudioTower(nn.Module):
    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.subsample_conv_projection = SubsampleConvProjection(cfg)
        self.layers = nn.ModuleList(AudioLayer(cfg) for _ in range(cfg.num_layers))
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.output_proj_dims, bias=True)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, F, 128) log-mel, (B, F) bool valid -> (B, T, O) states and (B, T) bool valid."""
        x, valid = self.subsample_conv_projection(features, mask)
        pos = relative_positions(self.cfg, x.dtype, x.device)
        first = self.layers[0]  # every layer has the same window: build its mask once
        assert isinstance(first, AudioLayer)
        attn_mask = first.self_attn.window_mask(valid)
        for layer in self.layers:
            x = layer(x, pos, attn_mask)
        return self.output_proj(x), valid
