"""The text encoder: a bidirectional Gemma encoder with per-layer embeddings (PLE), then a
per-token projection to the embedding dimension.

Shapes: B batch, T tokens, H hidden (512), L layers, P PLE width (512), D embedding dim (768); N
tokens of a packed batch. Layers alternate sliding attention (|q - k| <= window, a radius) and full
attention, each kind with its own head_dim, kv-head count and RoPE theta, all read from the config.

Two ways in, sharing every layer: `forward` takes a padded (B, T, H) batch with dense masks (the
reference path); `forward_packed` takes the items end to end, (N, H), and attention that keeps each
item to itself (packing.py, packed_attention.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from eg2_runtime.config import FULL, SLIDING, TextConfig
from eg2_runtime.layers import (
    GatedMLP,
    MergedWeight,
    RMSNorm,
    apply_rope,
    key_padding_mask,
    live_weight,
    plain_linears,
    rope_cos_sin,
)
from eg2_runtime.packed_attention import QUERY_ROWS, PackedAttention
from eg2_runtime.packing import Packing

# The packed forward computes every layer's PLE slice up front for batches of up to this many tokens
# (the query and short-text buckets, whose time is the count of their kernels, each too small to fill
# the GPU); larger batches take one slice a layer, whose memory does not grow with the layer count.
# Bounded so that the up-front slices (N x L x P, twice) fit blocks a larger bucket's graph leaves in
# the shared graph pool: at 1,024 tokens (48 MiB) the text-only engine's start-up set, captured
# largest first from a 1,536-token graph, overran its pool (H200, benchmarks/probe_boot.py).
PLE_UPFRONT_TOKENS = 256
# The packed forward runs the MLP this many tokens at a time (GatedMLP.in_rows): its gate, up and
# product take 12 kB a token in BF16. An 8,192-token forward peaked at 18.0 kB a token in chunks of
# 2,048 against 22.0 whole (H200, benchmarks/probe_costs.py), but the cut slowed the 2,200-token
# document (docs/PERF.md): at or below this (every start-up graph), one matmul as before. The same
# rule as the full layers' query chunks, so the same constant.
MLP_ROWS = QUERY_ROWS

# q (N, nh, hd), k and v (N, kv, hd) -> (N, nh, hd): attention over a packed batch.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# rope_triton.qkv_norm_rope: (qkv, heads, kv_heads, q_weight, k_weight, eps, cos, sin) -> q, k, v
QkvNormRope = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# rmsnorm_triton.add_rms_norm: (x, y, y_weight, y_eps, sum_weight, sum_eps) -> (x + norm(y), norm(sum))
AddNorm = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


class TextAttention(nn.Module):
    """`fused` (the packed path): q, k and v from one matmul of the merged weight (`qkv`), then
    normalized, and q and k rotated, in one kernel (rope_triton.qkv_norm_rope), set by
    fused.use_fused_kernels; None runs q_proj / k_proj / v_proj, their norms, then apply_rope."""

    def __init__(self, cfg: TextConfig, layer: int) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dims[layer]
        self.kv_heads = cfg.kv_heads[layer]
        h, hd = cfg.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.v_norm = RMSNorm(hd, cfg.rms_norm_eps, with_scale=False)
        self.fused: QkvNormRope | None = None
        self.qkv: MergedWeight | None = None  # ((nh + 2 kv) hd, H): q's rows, k's, v's (merge_weights)

    def merges(self) -> dict[str, tuple[str, ...]]:
        """The merged weight (`qkv`) and the Linears that view it, which the loader lays end to end
        as it loads them; none where a projection is not a plain Linear (stored packed, say)."""
        plain = plain_linears(self.q_proj, self.k_proj, self.v_proj)
        return {"qkv": ("q_proj", "k_proj", "v_proj")} if plain else {}

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(..., H) -> q (..., nh, hd), k and v (..., kv, hd), normed: the per-token half of attention.

        Norms before any transpose: the same per-row math, on contiguous rows.
        """
        lead = x.shape[:-1]
        q = self.q_norm(self.q_proj(x).view(*lead, -1, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(*lead, -1, self.head_dim))
        v = self.v_norm(self.v_proj(x).view(*lead, -1, self.head_dim))
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Mask) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (y.transpose(1, 2) for y in self.project(x))  # (B, nh or kv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # SDPA's GQA path only where the reference takes it too (no mask, head_dim <= 256): elsewhere
        # the kv heads are repeated, so both runs pick the same kernels and round alike on the GPU.
        gqa = mask is None and self.head_dim <= 256
        if not gqa and self.kv_heads != self.num_heads:
            k = k.repeat_interleave(self.num_heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.num_heads // self.kv_heads, dim=1)
        # Scaling is 1.0: q_norm / k_norm already fix the logit scale.
        if isinstance(mask, Band):
            out = banded_attention(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def forward_packed(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """(N, H) tokens of packed items, cos/sin (N, hd) -> (N, H); `attend` keeps each item to
        itself (packed_attention.py)."""
        n = x.shape[0]
        q, k, v = self._packed_qkv(x, cos, sin)
        out = attend(q, k, v)  # (N, nh, hd)
        del q, k, v  # freed before o_proj: a long batch's peak is one layer's live set
        return self.o_proj(out.reshape(n, -1))

    def _packed_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(N, H) -> q (N, nh, hd), k and v (N, kv, hd), normed and rotated. A function of its own so
        that the merged product (N, (nh + 2 kv) hd) is freed on return, before attention runs."""
        if self.fused is None:
            q, k, v = self.project(x)  # (N, nh or kv, hd)
            q, k = apply_rope(q, cos[:, None], sin[:, None]), apply_rope(k, cos[:, None], sin[:, None])
        else:
            # (N, (nh + 2 kv) hd): one matmul where the merged weight is live, else three
            w = live_weight(self.qkv, self.q_proj, self.k_proj, self.v_proj)
            qkv = (
                F.linear(x, w)
                if w is not None
                else torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
            )
            norms = (self.q_norm, self.k_norm, self.v_norm)
            q, k, v = self.fused(
                qkv,
                self.num_heads,
                self.kv_heads,
                norms[0].weight,
                norms[1].weight,
                tuple(m.eps for m in norms),
                cos,
                sin,
            )
        return q, k, v


class PLEBlock(nn.Module):
    """Gates the residual stream with this layer's slice of the per-layer embeddings. `fused`: the
    gate's gelu and product in one kernel."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.per_layer_input_gate = nn.Linear(cfg.hidden_size, cfg.ple_dim, bias=False)
        self.per_layer_projection = nn.Linear(cfg.ple_dim, cfg.hidden_size, bias=False)
        self.post_per_layer_input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # mlp_triton.gelu_tanh_mul (the MLP's own gate kernel), set by fused.use_fused_kernels
        self.fused: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, ple: torch.Tensor) -> torch.Tensor:
        return x + self.post_per_layer_input_norm(self.update(x, ple))

    def update(self, x: torch.Tensor, ple: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> (B, T, H): what is normalized and added to the stream."""
        gate = self.per_layer_input_gate(x)  # (B, T, P)
        if self.fused is not None:
            return self.per_layer_projection(self.fused(gate, ple))
        return self.per_layer_projection(F.gelu(gate, approximate="tanh") * ple)


class TextLayer(nn.Module):
    """`fused`: each residual add with the norm before it, and the MLP's pre-norm, in one kernel
    (rmsnorm_triton.add_rms_norm), set by fused.use_fused_kernels; None runs the modules one by one."""

    def __init__(self, cfg: TextConfig, layer: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = TextAttention(cfg, layer)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.ple_block = PLEBlock(cfg)
        self.layer_scalar = nn.Buffer(torch.ones(1))
        self.fused: AddNorm | None = None

    def forward(
        self,
        x: torch.Tensor,
        ple: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: Mask,
    ) -> torch.Tensor:
        return self.after_attention(x, self.self_attn(self.input_layernorm(x), cos, sin, mask), ple)

    def forward_packed(
        self,
        x: torch.Tensor,
        ple: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        normed: torch.Tensor | None = None,
        then: RMSNorm | None = None,
        mlp_rows: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(N, H) stream -> (the new stream, then(new stream) or None). `normed`: input_layernorm(x)
        where the layer before made it; `then`: the norm applied to this layer's output next (the
        next layer's input norm, the encoder's final norm), made here with the last residual add
        when fused, else left to the caller (None). `mlp_rows`: the MLP in chunks of that many
        tokens (GatedMLP.in_rows), None at once."""
        h = normed if normed is not None else self.input_layernorm(x)
        attn = self.self_attn.forward_packed(h, cos, sin, attend)
        return self._after_attention(x, attn, ple, then, mlp_rows)

    def after_attention(self, x: torch.Tensor, attn: torch.Tensor, ple: torch.Tensor) -> torch.Tensor:
        """The per-token rest of the layer: residual, MLP block, PLE gate, layer scalar."""
        return self._after_attention(x, attn, ple, None)[0]

    def _after_attention(
        self,
        x: torch.Tensor,
        attn: torch.Tensor,
        ple: torch.Tensor,
        then: RMSNorm | None,
        mlp_rows: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        mlp = self.mlp if mlp_rows is None else functools.partial(self.mlp.in_rows, rows=mlp_rows)
        if self.fused is None:
            x = x + self.post_attention_layernorm(attn)
            x = x + self.post_feedforward_layernorm(mlp(self.pre_feedforward_layernorm(x)))
            x = self.ple_block(x, ple)
            return x * self.layer_scalar, None
        post, pre = self.post_attention_layernorm, self.pre_feedforward_layernorm
        x, h = self.fused(x, attn, post.weight, post.eps, pre.weight, pre.eps)
        assert h is not None
        post = self.post_feedforward_layernorm
        x = self.fused(x, mlp(h), post.weight, post.eps, None, None)[0]
        # The PLE add, the layer scalar and the next norm in one kernel.
        post = self.ple_block.post_per_layer_input_norm
        following = (then.weight, then.eps) if then is not None else (None, None)
        update = self.ple_block.update(x, ple)
        return self.fused(x, update, post.weight, post.eps, *following, scale=self.layer_scalar)


class PerLayerEmbeddings(nn.Module):
    """Projection-only PLE: (B, T, H) merged embeddings -> (B, T, L, P), one slice per layer."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.num_layers, self.ple_dim = cfg.num_layers, cfg.ple_dim
        self.per_layer_model_projection = nn.Linear(cfg.hidden_size, cfg.num_layers * cfg.ple_dim, bias=False)
        self.scale = cfg.hidden_size**-0.5
        self.per_layer_projection_norm = RMSNorm(cfg.ple_dim, cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        p = self.per_layer_model_projection(embeds) * self.scale
        return self.per_layer_projection_norm(p.reshape(*embeds.shape[:-1], self.num_layers, self.ple_dim))

    def layer(self, embeds: torch.Tensor, i: int) -> torch.Tensor:
        """(B, T, H) -> (B, T, P): layer i's slice of `forward`, from its rows of the projection.

        The same products and the same per-slice norm; only one layer's (B, T, P) is alive instead of
        all L of them (24 x 512 values per token, 48 KiB in BF16 with the projection's own output).
        """
        p = self.ple_dim
        weight = self.per_layer_model_projection.weight[i * p : (i + 1) * p]  # (P, H)
        return self.per_layer_projection_norm(F.linear(embeds, weight) * self.scale)


class TextEncoder(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TextLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ple = PerLayerEmbeddings(cfg)
        self.embedding_projection = nn.Linear(cfg.hidden_size, cfg.embedding_dim, bias=False)
        self._scales: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.table_pinned = False  # keep_table_on_host pins it; asking CUDA per batch costs a call

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) ids -> (B, T, H) on the compute device, scaled by sqrt(H) rounded to the weight
        dtype (22.625 in bf16).

        The table may live in pinned host memory (`keep_table_on_host`): rows are then gathered on
        the CPU and only the (B, T, H) result crosses the bus. The product is the same either way.
        """
        table = self.embed_tokens.weight
        device = self.embedding_projection.weight.device
        if table.device == device:
            rows = self.embed_tokens(input_ids.to(device, non_blocking=True))
        else:
            ids = input_ids.to(table.device).reshape(-1)
            staged = torch.empty(
                (ids.numel(), table.shape[1]), dtype=table.dtype, pin_memory=self.table_pinned
            )
            torch.index_select(table, 0, ids, out=staged)
            rows = staged.to(device, non_blocking=True).view(*input_ids.shape, -1)
        return rows * self._scale(device, table.dtype)

    def _scale(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """sqrt(H) in `dtype` on `device`, made once: a host scalar copied per batch was a blocking
        copy (CUDA syncs the stream before a copy from pageable memory)."""
        key = (device, dtype)
        if key not in self._scales:
            with torch.inference_mode(False):  # a plain tensor: usable outside inference mode too
                self._scales[key] = torch.tensor(math.sqrt(self.cfg.hidden_size), dtype=dtype).to(device)
        return self._scales[key]

    def keep_table_on_host(self) -> int:
        """Keep the (V, H) token table in pinned host memory (pinned only where the model computes
        on CUDA, which copies from it); returns the device bytes freed.

        262144 x 512 bf16 is 256 MiB, a third of a hybrid-w4 checkpoint's resident weights. The cost
        is a host gather and one (B, T, H) copy per batch instead of a device gather.
        """
        table = self.embed_tokens.weight
        freed = table.nbytes if table.device.type == "cuda" else 0
        if self.embedding_projection.weight.device.type == "cuda" and not self.table_pinned:
            self.embed_tokens.weight = nn.Parameter(table.cpu().pin_memory(), requires_grad=False)
            self.table_pinned = True
        return freed

    def keep_table_on_device(self) -> int:
        """Move the token table to the compute device (the other projections' device); returns the
        device bytes it now takes (0 if it was there)."""
        table, device = self.embed_tokens.weight, self.embedding_projection.weight.device
        if table.device == device:
            return 0
        self.embed_tokens.weight = nn.Parameter(table.to(device), requires_grad=False)
        self.table_pinned = False
        return table.nbytes

    def forward(
        self, embeds: torch.Tensor, valid: torch.Tensor, static: bool = False, lean: bool = False
    ) -> torch.Tensor:
        """(B, T, H) merged embeddings, (B, T) bool valid -> (B, T, D) per-token embeddings.

        `static`: always build the attention masks, never branch on the data, so the call can be
        captured in a CUDA graph (graphs.py). The default skips masks where nothing is masked.
        `lean`: the engine's memory-lean path, the same math: sliding layers of long inputs attend
        block by block (banded_attention), and each layer's PLE slice is computed when the layer runs
        (PerLayerEmbeddings.layer). The default is the reference: dense (B, 1, T, T) window masks and
        all PLE slices up front, as transformers computes them.
        """
        cfg = self.cfg
        ple = None if lean else self.ple(embeds)  # (B, T, L, P)
        t = embeds.shape[1]
        positions = torch.arange(t, device=embeds.device)
        masks = attention_masks(valid, cfg.sliding_window, static, banded=lean)
        rope: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        x = embeds
        for i, layer in enumerate(self.layers):
            kind = cfg.layer_types[i]
            key = (kind, cfg.head_dims[i])
            if key not in rope:
                rope[key] = rope_cos_sin(positions, cfg.head_dims[i], cfg.rope_thetas[kind], x.dtype)
            cos, sin = rope[key]
            x = layer(x, self.ple.layer(embeds, i) if ple is None else ple[:, :, i], cos, sin, masks[kind])
        return self.embedding_projection(self.norm(x))

    def forward_packed(
        self,
        embeds: torch.Tensor,
        packing: Packing,
        backends: Mapping[str, str] | None = None,
        block_size: int = 128,
        mlp_rows: int = MLP_ROWS,
    ) -> torch.Tensor:
        """(N, H) merged embeddings of items laid end to end -> (N, D) per-token embeddings; each
        item's rows equal what `forward` gives it in a padded batch. `packing.pool` makes the vectors.

        `backends`: the attention kernel per layer kind (packed_attention.py; the device's default
        when None). Block masks are built here from the packing's tensors with no host sync, so a
        CUDA graph can capture this call whole and replay it after `packing.copy_`. `mlp_rows`: the
        MLP's chunk (MLP_ROWS).
        """
        cfg = self.cfg
        attention = PackedAttention(packing, cfg, backends, block_size)
        rope: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # Up to PLE_UPFRONT_TOKENS, every layer's PLE slice at once, as the reference computes them
        # (3 kernels in all, where a slice per layer takes 3 a layer); past it, each layer's slice
        # when the layer runs, as the lean path: all of them hold 24 KiB a token.
        ples = self.ple(embeds) if embeds.shape[0] <= PLE_UPFRONT_TOKENS else None  # (N, L, P)
        layers = [cast(TextLayer, layer) for layer in self.layers]
        x, h = embeds, None  # the stream, and its input norm where the layer before made it
        for i, layer in enumerate(layers):
            kind = cfg.layer_types[i]
            key = (kind, cfg.head_dims[i])
            if key not in rope:
                # (N, hd): one angle per token and channel, shared by the heads
                rope[key] = rope_cos_sin(packing.positions, cfg.head_dims[i], cfg.rope_thetas[kind], x.dtype)
            attend = functools.partial(attention, kind)
            ple = ples[:, i] if ples is not None else self.ple.layer(embeds, i)  # (N, P)
            then = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            x, h = layer.forward_packed(x, ple, *rope[key], attend, normed=h, then=then, mlp_rows=mlp_rows)
        return self.embedding_projection(h if h is not None else self.norm(x))


@dataclass(frozen=True)
class Band:
    """Sliding-window attention done block by block: queries in blocks of `size`, each block against
    the keys within `window` of it (size + 2 * window of them), instead of all T keys.

    mask: (B * blocks, 1, size, size + 2 * window) bool. Query a of block i sits at i * size + a, key
    c of its span at i * size - window + c; a key is visible when it is valid, inside the sequence and
    |q - k| <= window, and every query sees itself (a padding query must see some key, see
    layers.key_padding_mask).
    """

    size: int
    window: int
    blocks: int
    mask: torch.Tensor


Mask = torch.Tensor | Band | None


def band(valid: torch.Tensor, window: int, size: int | None = None) -> Band:
    """The Band of a (B, T) validity mask: B x T x (size + 2 window) mask bytes, where a dense window
    mask takes B x T^2 (8,192 tokens: 64 MiB per mask, plus SDPA's float copy of it)."""
    size = size or window
    b, t = valid.shape
    blocks = -(-t // size)
    span = size + 2 * window
    # Keys padded by `window` before and after, so block i's span starts at padded index i * size.
    keys = F.pad(valid, (window, blocks * size - t + window)).unfold(1, span, size)  # (B, blocks, span)
    a = torch.arange(size, device=valid.device)[:, None]
    c = torch.arange(span, device=valid.device)[None, :]
    near = (a + window - c).abs() <= window  # (size, span): |q - k| <= window
    mask = (keys[:, :, None, :] & near) | (c == a + window)  # (B, blocks, size, span)
    return Band(size, window, blocks, mask.reshape(b * blocks, 1, size, span))


def banded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, band: Band) -> torch.Tensor:
    """SDPA of (B, h, T, hd) q, k, v under a Band: (B, h, T, hd), as the dense masked call gives it.

    Work and memory grow with T x (size + 2 window) instead of T^2: for 8,192 tokens and a radius of
    512, a sixth of the scores. Keys are gathered per block (a copy of size + 2 window rows each).
    """
    b, h, t, d = q.shape
    size, window, n = band.size, band.window, band.blocks
    span = size + 2 * window
    tail = n * size - t
    q = F.pad(q, (0, 0, 0, tail)).view(b, h, n, size, d).transpose(1, 2).reshape(b * n, h, size, d)

    def spans(x: torch.Tensor) -> torch.Tensor:  # (B, h, T, hd) -> (B * n, h, span, hd)
        x = F.pad(x, (0, 0, window, tail + window)).unfold(2, span, size)  # (B, h, n, hd, span)
        return x.permute(0, 2, 1, 4, 3).reshape(b * n, h, span, d)

    out = F.scaled_dot_product_attention(q, spans(k), spans(v), attn_mask=band.mask, scale=1.0)
    return out.view(b, n, h, size, d).transpose(1, 2).reshape(b, h, n * size, d)[:, :, :t]


def attention_masks(
    valid: torch.Tensor, window: int, static: bool = False, banded: bool = False
) -> dict[str, Mask]:
    """SDPA masks (True = attend) per layer kind, or None where nothing is masked.

    None lets SDPA take its fastest kernel, the one the reference's SDPA path takes on the same
    input; a batch without padding that fits the window needs no mask at all. Finding that out reads
    `valid` on the host (a device sync), so `static` skips the check and always masks. Full layers
    get a key-padding mask (B, 1, 1, T). Sliding layers of inputs longer than three blocks of
    `window` get a Band when `banded`; shorter ones (and the reference) a dense (B, 1, T, T) mask.
    """
    t = valid.shape[1]
    if not static and bool(valid.all()) and t - 1 <= window:
        return {FULL: None, SLIDING: None}
    padded = key_padding_mask(valid)
    full = None if not static and bool(valid.all()) else padded
    if banded and t > 3 * window:
        return {FULL: full, SLIDING: band(valid, window)}
    positions = torch.arange(t, device=valid.device)
    in_window = (positions[:, None] - positions[None, :]).abs() <= window  # (T, T)
    # Each query sees itself too: a padding query further than `window` from any valid key would
    # see nothing (see layers.key_padding_mask).
    itself = positions[:, None] == positions[None, :]
    return {FULL: full, SLIDING: (padded & in_window) | itself}


# The modules whose Linears can share one merged weight (their `merges()`): the loader lays them end
# to end as it loads, and fused.use_fused_kernels merges a model built otherwise.
MERGING = (TextAttention, GatedMLP)
