"""The runtime equals the reference (transformers EmbeddingGemma2Model + sentence-transformers mean
pooling and L2) on the same inputs, in FP32 on the CPU, within 1e-5 max abs difference.

"The same inputs": the reference processor's tensors are fed to our model, so this file tests the
model; tests/test_preprocess_*.py test that our preprocessing builds those tensors.
Reference path: transformers with torchvision (the Gemma4 torchvision image processor and the
EmbeddingGemma2 video processor), eager attention.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from eg2_runtime import samples
from eg2_runtime.loader import load_model
from eg2_runtime.model import EG2Model
from tests.support.reference import Reference, load_reference

TOL = 1e-5
PROMPT = "task: search result | query: "


def smooth_image(width: int, height: int, seed: int) -> Image.Image:
    """A smooth gradient image (random weights are ill-conditioned on white noise in bf16)."""
    return Image.fromarray(samples.gradient(width, height, seed))


def tone(seconds: float, hz: float = 440.0) -> tuple[np.ndarray, int]:
    return samples.tone(seconds, 16_000, hz), 16_000


def video(frames: int, seed: int) -> dict[str, object]:
    imgs = [np.asarray(smooth_image(96, 64, seed + i)) for i in range(frames)]
    return {"video": np.stack(imgs), "fps": 1.0}


CASES: dict[str, tuple[list[object], str | None]] = {
    "text": (["hello world", "a second, longer sentence about embeddings and sliding windows"], None),
    "text+prompt": (["what is the capital of France?"], PROMPT),
    "one image": ([smooth_image(640, 480, 0)], None),
    "two image sizes": ([smooth_image(300, 200, 1), smooth_image(120, 500, 2)], None),
    "audio 1 s and 10 s": ([{"audio": tone(1.0)}, {"audio": tone(10.0, 220.0)}], None),
    "8-frame video": ([video(8, 3)], None),
    "text+image": (
        [{"content": [("text", "a photo of"), ("image", smooth_image(200, 150, 4)), ("text", "a cat")]}],
        None,
    ),
}


@pytest.fixture(scope="module")
def reference(tiny_fp32: Path) -> Reference:
    return load_reference(tiny_fp32, dtype=torch.float32)


@pytest.fixture(scope="module")
def model(tiny_fp32: Path) -> EG2Model:
    return load_model(tiny_fp32, "cpu")[0]


def ours(model: EG2Model, features: dict[str, torch.Tensor]) -> np.ndarray:
    with torch.no_grad():
        return model(**{k: v for k, v in features.items() if k != "num_frames_per_video"}).numpy()


@pytest.mark.parametrize("case", CASES)
def test_embeddings_match_reference(case: str, reference: Reference, model: EG2Model) -> None:
    inputs, prompt = CASES[case]
    expected = reference.encode(inputs, prompt=prompt)
    got = ours(model, reference.model_inputs(inputs, prompt=prompt))
    assert got.shape == expected.shape == (len(inputs), 768)
    diff = float(np.abs(got - expected).max())
    assert diff <= TOL, f"{case}: max abs diff {diff:.2e} > {TOL:.0e} against the reference"
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


def test_batch_equals_one_by_one(reference: Reference, model: EG2Model) -> None:
    """Padding in a batch changes nothing: each vector equals the one computed alone."""
    for inputs in (CASES["text"][0] + ["x"], CASES["two image sizes"][0], CASES["audio 1 s and 10 s"][0]):
        batched = ours(model, reference.model_inputs(inputs))
        single = np.concatenate([ours(model, reference.model_inputs([x])) for x in inputs])
        diff = float(np.abs(batched - single).max())
        assert diff <= TOL, f"batched vs one-by-one: max abs diff {diff:.2e} > {TOL:.0e}"


def test_packed_model_equals_reference_on_dequantized_weights(tiny_w4: Path) -> None:
    """hybrid-w4 through our unpack hooks == transformers with compressed-tensors dequantize=True."""
    reference = load_reference(tiny_w4, dtype=torch.float32, dequantize=True)
    model, report = load_model(tiny_w4, "cpu")
    assert report.packed_total > 0
    inputs = [*CASES["one image"][0], CASES["audio 1 s and 10 s"][0][0], "some text"]
    for x in inputs:
        expected = reference.encode([x])
        got = ours(model, reference.model_inputs([x]))
        diff = float(np.abs(got - expected).max())
        assert diff <= TOL, f"packed vs dequantized reference on {type(x).__name__}: {diff:.2e} > {TOL:.0e}"


@pytest.fixture(scope="module")
def reference_bf16(tiny_bf16: Path) -> Reference:
    return load_reference(tiny_bf16, dtype=torch.bfloat16)


@pytest.mark.parametrize("case", ["text+prompt", "two image sizes", "audio 1 s and 10 s", "8-frame video"])
def test_bf16_on_cpu_reproduces_reference_rounding(
    case: str, reference_bf16: Reference, tiny_bf16: Path
) -> None:
    """In BF16 (CPU kernels, deterministic) we round where the reference rounds: same vectors to
    float precision, so GPU differences can only come from kernel choices, not from our math."""
    model = load_model(tiny_bf16, "cpu", dtype=torch.bfloat16)[0]
    inputs, prompt = CASES[case]
    features = reference_bf16.model_inputs(inputs, prompt=prompt)
    diff = float(np.abs(ours(model, features) - reference_bf16.embed_features(features)).max())
    assert diff <= 1e-6, f"{case}: BF16 max abs diff {diff:.2e} > 1e-6"
