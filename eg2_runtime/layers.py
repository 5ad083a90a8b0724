"""Leaf modules shared by the three towers: RMSNorm, rotary helpers, the gated MLP, the clippable
linear wrapper.

Module and parameter names match the Hugging Face checkpoint, so a state dict loads as stored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from eg2_runtime.quant import end_to_end_flat


class RMSNorm(nn.Module):
    """Gemma RMSNorm: `x * (mean(x^2) + eps)^-0.5 * w`, computed in fp32 (w, not 1 + w).

    `with_scale=False` is the parameter-free variant (v_norm, the multimodal embedders).
    `fused`: the one-kernel Triton version (rmsnorm_triton.rms_norm), set by `use_fused_norms` or
    fused.use_fused_kernels on a CUDA model; None runs `reference`.
    """

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None
        self.fused: Callable[[torch.Tensor, torch.Tensor | None, float], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(x, self.weight, self.eps)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        # torch.pow rather than rsqrt: the reference does, and rsqrt rounds differently.
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` by angles whose cos/sin broadcast against it (the half-split convention)."""
    return x * cos + rotate_half(x) * sin


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (*positions.shape, head_dim) for 1-D RoPE.

    Angles are computed in fp32 and then rounded to the compute dtype, as the reference does.
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=positions.device) / head_dim)
    )
    freqs = positions.float()[..., None] * inv_freq  # (..., head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class GatedMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)). `linear` builds the three projections (plain or clippable).

    `fused`: gelu_tanh(gate) * up in one kernel (mlp_triton.gelu_tanh_mul), set by
    fused.use_fused_kernels; None runs the torch reference.
    """

    def __init__(
        self, hidden: int, intermediate: int, linear: type[nn.Module] | None = None, **kw: object
    ) -> None:
        super().__init__()
        make = linear or _plain_linear
        self.intermediate = intermediate
        self.gate_proj = make(hidden, intermediate, **kw)
        self.up_proj = make(hidden, intermediate, **kw)
        self.down_proj = make(intermediate, hidden, **kw)
        self.fused: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.gate_up: MergedWeight | None = None  # (2 I, H): gate's rows, then up's (merge_weights)

    def merges(self) -> dict[str, tuple[str, ...]]:
        """The merged weight (`gate_up`) and the Linears that view it, which the loader lays end to
        end as it loads them. Only plain bias-free Linears merge: a packed or clamped projection
        runs its own forward."""
        return {"gate_up": ("gate_proj", "up_proj")} if plain_linears(self.gate_proj, self.up_proj) else {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.fused is not None
            and (w := live_weight(self.gate_up, self.gate_proj, self.up_proj)) is not None
        ):
            # Two views of one (..., 2 I) product: the kernel reads each in place.
            gate, up = F.linear(x, w).split(self.intermediate, dim=-1)
            return self.down_proj(self.fused(gate, up))
        if self.fused is not None:
            return self.down_proj(self.fused(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))

    def in_rows(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """`forward` of (..., H) taken `rows` rows at a time, so that its (rows, 3 I) intermediates
        live for one chunk instead of the whole batch (8,192 tokens: 96 MiB in BF16). Rows are
        independent: the same products, though a GEMM of another shape may round differently."""
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] <= rows:
            return self(x)
        out = torch.empty_like(flat)  # down_proj maps back to the hidden size
        for start in range(0, flat.shape[0], rows):
            out[start : start + rows] = self(flat[start : start + rows])
        return out.view(x.shape)


def plain_linears(*modules: nn.Module) -> bool:
    """Whether every module is a plain bias-free nn.Linear (what can share a merged weight)."""
    return all(type(m) is nn.Linear and m.bias is None for m in modules)


class MergedWeight:
    """One (sum of out, in) weight whose rows the Linears it was made from view, end to end: one
    matmul makes all their outputs, and nothing is held twice.

    `live(*linears)`: whether those Linears still view it. A model moved (`.to()`) or given new
    weights after the merge no longer does; its fused path then runs the Linears one by one, with
    the weights they hold.
    """

    def __init__(self, weight: torch.Tensor, linears: Sequence[nn.Module]) -> None:
        self.weight = weight
        self._views = tuple(_where(_weight(m)) for m in linears)

    def live(self, *linears: nn.Module) -> bool:
        return tuple(_where(_weight(m)) for m in linears) == self._views


def live_weight(merged: MergedWeight | None, *linears: nn.Module) -> torch.Tensor | None:
    """`merged`'s weight while the Linears still view it, else None (run them one by one)."""
    return merged.weight if merged is not None and merged.live(*linears) else None


def _where(w: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """A weight's address, shape and strides: a view of other rows (or fewer) differs in one."""
    return w.data_ptr(), tuple(w.shape), w.stride()


def _weight(m: nn.Module) -> torch.Tensor:
    w = m.weight
    assert isinstance(w, torch.Tensor)
    return w


def end_to_end(
    parts: Sequence[torch.Tensor], device: torch.device | str
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(out_i, in) weights -> their rows end to end on `device`, and each one's rows as a view of it."""
    flat, views = end_to_end_flat(list(parts), device)
    return flat.view(-1, parts[0].shape[-1]), views


def merge_weights(module: nn.Module, merges: dict[str, tuple[str, ...]]) -> None:
    """For each `attr: linears` of `merges`, give `module.attr` a MergedWeight of the Linears'
    weights and have each Linear view its rows. For a model built otherwise than by the loader, which
    merges as it loads (the fused kernels switched on for it); a live merge is kept."""
    for attr, names in merges.items():
        linears = [module.get_submodule(n) for n in names]
        current = getattr(module, attr)
        if isinstance(current, MergedWeight) and current.live(*linears):
            continue
        weights = [_weight(m).detach() for m in linears]
        merged, views = end_to_end(weights, weights[0].device)
        for m, view in zip(linears, views, strict=True):
            m.weight = nn.Parameter(view, requires_grad=False)
        setattr(module, attr, MergedWeight(merged, linears))


def _plain_linear(in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False)


class ClippableLinear(nn.Module):
    """A bias-free Linear under `.linear`, optionally clamping its input and output.

    The four scalar bounds are checkpoint buffers (audio tower); the vision tower stores none. The
    inner `.linear` is what a hybrid-w4 checkpoint packs, so its name keeps the `.linear` suffix.
    """

    def __init__(self, in_features: int, out_features: int, clipped: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.clipped = clipped
        # (input_min, input_max, output_min, output_max) as Python floats once `freeze_bounds` has
        # read them; None: the reference path, which clamps by the buffers on every call.
        self.bounds: tuple[float, float, float, float] | None = None
        if clipped:
            self.input_min = nn.Buffer(torch.tensor(-float("inf")))
            self.input_max = nn.Buffer(torch.tensor(float("inf")))
            self.output_min = nn.Buffer(torch.tensor(-float("inf")))
            self.output_max = nn.Buffer(torch.tensor(float("inf")))

    def freeze_bounds(self) -> None:
        """Read the loaded bounds once. A clamp by tensor bounds runs PyTorch's generic broadcasting
        kernel (three inputs, two of stride 0); by Python floats, its vectorized one-input kernel, and a
        pair of infinite bounds is no clamp at all. The values are the buffers' own, so the results are
        bit for bit the reference's: a clamp only ever returns its input or a bound."""
        if self.clipped:
            bounds = torch.stack([self.input_min, self.input_max, self.output_min, self.output_max])
            lo, hi, out_lo, out_hi = bounds.float().tolist()
            self.bounds = (lo, hi, out_lo, out_hi)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        if self.bounds is None:
            x = torch.clamp(x, self.input_min, self.input_max)
            return torch.clamp(self.linear(x), self.output_min, self.output_max)
        lo, hi, out_lo, out_hi = self.bounds
        if lo > -math.inf or hi < math.inf:
            x = x.clamp(lo, hi)
        y = self.linear(x)  # a tensor of its own: clamped in place
        return y.clamp_(out_lo, out_hi) if out_lo > -math.inf or out_hi < math.inf else y


def key_padding_mask(valid: torch.Tensor) -> torch.Tensor:
    """(B, T) bool of valid keys -> (B, 1, 1, T) bool attention mask for SDPA (True = attend).

    Broadcast over the queries: B x T bytes where a (B, 1, T, T) mask took B x T^2 (a 1,120-token image,
    10,080 patch slots: 97 MiB, and twice that again once SDPA turns it into an additive bias).
    Every query row must see at least one key: a row with none makes SDPA return NaN, and a NaN in a
    padding row poisons valid rows through 0 * NaN in the next layer. A padding query of a partly
    valid item sees that item's valid keys; an item with no valid key at all (a CUDA graph's padding
    item) sees its first key. Valid rows are unchanged, and padding rows are never read.
    """
    empty = ~valid.any(dim=1, keepdim=True)  # (B, 1)
    first = torch.zeros_like(valid)
    first[:, 0] = True
    return (valid | (empty & first))[:, None, None, :]


def additive_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool SDPA mask (True = attend) as the additive mask SDPA makes of it on every call: 0 where
    kept, the dtype's lowest value elsewhere. Build it once per forward and pass it to every layer.

    The lowest finite value rather than -inf (SDPA's cuDNN path uses a finite one too): each row
    keeps at least one key (key_padding_mask), so a masked key's weight underflows to exactly 0
    either way, and the outputs equal those of the bool mask bit for bit.
    """
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(
        ~keep, torch.finfo(dtype).min
    )


def use_fused_norms(model: nn.Module, enable: bool = True) -> int:
    """Point every RMSNorm of `model` at the Triton kernel (or back at the reference with
    `enable=False`). Returns how many now run fused: 0 where Triton is missing.

    Call it on a CUDA model (or under Triton's CPU interpreter): a fused module runs its kernel on
    whatever tensors it is given. fused.use_fused_kernels switches every fused kernel, norms included.
    """
    kernel: Callable[[torch.Tensor, torch.Tensor | None, float], torch.Tensor] | None = None
    if enable:
        try:
            from eg2_runtime.rmsnorm_triton import rms_norm as kernel
        except ImportError:  # a CPU-only install: the reference runs
            return 0
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    for m in norms:
        m.fused = kernel
    return len(norms) if kernel is not None else 0
