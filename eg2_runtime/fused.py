"""The switch between the torch reference paths and the fused Triton kernels beside them.

Each module with a fast path keeps it in a `fused` attribute, None for its reference path; this is
the one place that knows which kernel each gets:

- RMSNorm: rmsnorm_triton.rms_norm (every tower);
- GatedMLP: mlp_triton.gelu_tanh_mul (text and vision), after one matmul of gate and up merged
  (`layers.merge_weights`) where both are plain Linears (the text encoder's);
- VisionAttention: rope_triton.rms_norm_rope, q and k normalized and rotated in one kernel each;
- VisionLayer: rmsnorm_triton.add_rms_norm, each residual add with the norms around it;
- TextAttention: rope_triton.qkv_norm_rope on the packed path (text.TextAttention.forward_packed),
  after one matmul of q, k and v merged (`layers.merge_weights`);
- TextLayer: rmsnorm_triton.add_rms_norm, as VisionLayer, and the PLE block's add and norm (on the
  padded path too: EG2Model.forward of a fused model runs it);
- PLEBlock: mlp_triton.gelu_tanh_mul, the gate's gelu times this layer's PLE slice.

A fused module runs its kernel on whatever tensors it gets: switch a model on CUDA (the engine does,
after one probe launch), or anywhere under Triton's CPU interpreter (the tests). The kernels
allocate their outputs with torch and never read back to the host, so CUDA graphs capture them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from eg2_runtime.layers import GatedMLP, RMSNorm, merge_weights
from eg2_runtime.text import MERGING, PLEBlock, TextAttention, TextLayer
from eg2_runtime.vision import VisionAttention, VisionLayer

FUSABLE = (RMSNorm, GatedMLP, VisionAttention, VisionLayer, TextAttention, TextLayer, PLEBlock)


def use_fused_kernels(model: nn.Module, enable: bool = True) -> int:
    """Point every module of `model` that has a fused kernel at it (or back at its reference with
    `enable=False`). Returns how many modules now run fused: 0 where Triton is missing."""
    kernels = _kernels() if enable else {}
    fused = 0
    for m in model.modules():
        if isinstance(m, FUSABLE):
            m.fused = kernels.get(type(m))
            fused += m.fused is not None
            if m.fused is not None and isinstance(m, MERGING):
                merge_weights(m, m.merges())
    return fused


def _kernels() -> dict[type[nn.Module], Any]:
    try:
        from eg2_runtime import mlp_triton, rmsnorm_triton, rope_triton
    except ImportError:  # a CPU-only install: the reference runs
        return {}
    return {
        RMSNorm: rmsnorm_triton.rms_norm,
        GatedMLP: mlp_triton.gelu_tanh_mul,
        VisionAttention: rope_triton.rms_norm_rope,
        VisionLayer: rmsnorm_triton.add_rms_norm,
        TextAttention: rope_triton.qkv_norm_rope,
        TextLayer: rmsnorm_triton.add_rms_norm,
        PLEBlock: mlp_triton.gelu_tanh_mul,
    }
