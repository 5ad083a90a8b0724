"""Engine: the one contract between the service and the model.

    prepare(item, options) -> PreparedItem      CPU only, thread-safe: decode, tokenize, featurize
    embed([PreparedItem, ...]) -> (B, 768) f32  the accelerator; call from exactly one thread

The service sees only a PreparedItem's `modality`, `num_tokens` and `cost`; the model inputs it
carries are opaque to it. Vectors come back as unit-norm float32 numpy rows; `matryoshka` cuts them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eg2_runtime.inputs import MATRYOSHKA_DIMS, Modality


@dataclass
class PreparedItem:
    modality: Modality  # batch key: items of one modality are batched together
    num_tokens: int  # tokens the text encoder sees, soft tokens and markers included (usage)
    cost: int  # what this item spends of a batch's token budget
    inputs: Any = field(repr=False, default=None)  # model inputs (tensors); opaque to the service


def matryoshka(vectors: np.ndarray, dim: int) -> np.ndarray:
    """Keep the leading `dim` dimensions of (B, 768) unit vectors and L2-renormalize them."""
    if dim not in MATRYOSHKA_DIMS:
        raise ValueError(f"dimensions must be one of {MATRYOSHKA_DIMS}, got {dim}")
    cut = vectors[:, :dim].astype(np.float32, copy=True)
    cut /= np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
    return cut
