"""GPU checks of the fused vision kernels (fused.use_fused_kernels) on the full-size random
checkpoint, hybrid-w4 as served, BF16 (run on the H200):

    python -m pytest -m gpu -q -s --results out tests/gpu/test_gpu_kernels.py

- the fused tower against the reference tower: per image, the cosine of all its soft tokens >= 0.9999,
  and no further from the FP32 tower than the BF16 reference is (3x its distance + 1e-5, the rule
  test_gpu.py holds the fused RMSNorm to); smooth images, as bf16 vision with random weights is
  ill-conditioned on noise (docs/CORRECTNESS.md);
- the fused tower inside CUDA graphs (tower_graphs.GraphedTowers): captured, two replays bit-identical,
  and equal to the eager fused tower to 1e-5 in cosine (bucket padding changes cuBLAS's choices).
Times are the benchmark's (benchmarks/vision_kernels.py), not a test's. Figures go to --results.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eg2_runtime import samples
from eg2_runtime.engine import Engine, EngineOptions
from eg2_runtime.fused import use_fused_kernels
from eg2_runtime.inputs import Item, MediaPart, PrepareOptions
from eg2_runtime.tools.demo_model import write_demo_model
from eg2_runtime.tools.quantize import quantize_checkpoint
from eg2_runtime.tower_graphs import GraphedTowers
from tests.gpu.test_gpu import SHARED_BUDGET, record

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Width x height: the probe's 641x479 (266 of 280 soft tokens: padding patches), a portrait, a wide
# strip, a small image the budget scales up, and four more of the common size.
SIZES = [(641, 479), (300, 500), (1024, 256), (96, 64), (640, 480), (641, 479), (500, 500), (800, 600)]


@pytest.fixture(scope="module")
def w4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    t0 = time.perf_counter()
    bf16 = write_demo_model(tmp_path_factory.mktemp("full-bf16"), size="full", seed=0)
    dst = tmp_path_factory.mktemp("full-w4")
    quantize_checkpoint(bf16, dst, group_size=128, progress=False)
    print(f"full w4 checkpoint in {time.perf_counter() - t0:.1f} s")
    return dst


def _engine(model_dir: Path, dtype: torch.dtype) -> Engine:
    # Every module on torch until switched; a budget that holds the test's engines side by side.
    options = EngineOptions(gpu_memory_budget=SHARED_BUDGET, graph_max_tokens=0, fused_norms=False)
    return Engine.from_dir(model_dir, device="cuda", dtype=dtype, options=options)


def _inputs(engine: Engine) -> tuple[torch.Tensor, torch.Tensor]:
    items = [Item((MediaPart("image", samples.png(w, h, i)),)) for i, (w, h) in enumerate(SIZES)]
    prepared = [engine.prepare(x, PrepareOptions()) for x in items]
    _, inputs = engine.device_batch([p.inputs for p in prepared])  # type: ignore[misc]
    return inputs["pixel_values"], inputs["image_position_ids"]


def _per_image(engine: Engine, pixels: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
    """Each image's soft tokens (n_i, H), fp32, through the model's own entry point."""
    tower = engine.model.vision_tower
    assert tower is not None
    with torch.inference_mode():
        soft = engine.model.image_soft_tokens(pixels, positions)
        _, used = tower.slots(pixels, positions, (positions == -1).all(-1), masked=True)
    return list(soft.float().split(used.sum(1).tolist()))


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


def test_fused_vision_tower_matches_reference(w4: Path, results: Path | None) -> None:
    bf16, fp32 = _engine(w4, torch.bfloat16), _engine(w4, torch.float32)
    pixels, positions = _inputs(bf16)
    exact = _per_image(fp32, pixels, positions)
    del fp32
    reference = _per_image(bf16, pixels, positions)
    fused_modules = use_fused_kernels(bf16.model)
    fused = _per_image(bf16, pixels, positions)
    figures: dict[str, object] = {"sizes": SIZES, "fused_modules": fused_modules, "images": []}
    failures = []
    for i, (x, r, f) in enumerate(zip(exact, reference, fused, strict=True)):
        row = {
            "soft_tokens": r.shape[0],
            "fused_vs_reference": round(_cos(f, r), 7),
            "fused_vs_reference_min_token": round(F.cosine_similarity(f, r, dim=-1).min().item(), 6),
            "reference_vs_fp32": round(_cos(r, x), 7),
            "fused_vs_fp32": round(_cos(f, x), 7),
        }
        figures["images"].append(row)  # type: ignore[attr-defined]
        if row["fused_vs_reference"] < 0.9999:
            failures.append(f"image {i} {SIZES[i]}: cosine {row['fused_vs_reference']} < 0.9999")
        if 1 - row["fused_vs_fp32"] > 3 * (1 - row["reference_vs_fp32"]) + 1e-5:
            failures.append(f"image {i} {SIZES[i]}: fused further from FP32 than the BF16 reference")
    record(results, "gpu_fused_vision_tower", figures)
    assert fused_modules > 0, "no module switched to a fused kernel: is Triton installed?"
    assert not failures, f"{failures}: {figures}"


def test_fused_vision_tower_in_cuda_graphs(w4: Path, results: Path | None) -> None:
    engine = _engine(w4, torch.bfloat16)
    pixels, positions = _inputs(engine)
    use_fused_kernels(engine.model)
    with torch.inference_mode():
        eager = engine.model.image_soft_tokens(pixels, positions)
        slots = pixels.shape[0] * pixels.shape[1]  # one bucket for the whole batch
        towers = GraphedTowers(engine.model, vision_slots=slots, audio_tokens=0, tower_slots=slots)
        graphed = towers.image_soft_tokens(pixels, positions).clone()
        again = towers.image_soft_tokens(pixels, positions)
    captured = [key for key, c in towers.graphs.items() if c.graph is not None]
    cos = F.cosine_similarity(graphed.float(), eager.float(), dim=-1).min().item()
    record(
        results,
        "gpu_fused_vision_graphs",
        {"captured": [list(k) for k in captured], "graphed_vs_eager_min_token_cosine": round(cos, 7)},
    )
    assert captured, f"no tower graph was captured: {list(towers.graphs)}"
    assert torch.equal(graphed, again), "two replays of one graph differ"
    assert cos >= 1 - 1e-5, f"graphed fused tower vs eager: min token cosine {cos:.7f} < 1 - 1e-5"


SIDE_STREAM_SCRIPT = """
import json
import torch
from eg2_runtime.gpu_memory import ProcessGpuMemory
mem = ProcessGpuMemory()
from eg2_runtime.streams import side_stream

def now():
    torch.cuda.synchronize()
    return mem.read().bytes / 2**20

a = torch.ones(1 << 20, device="cuda")
(a + 1).sum().item()  # the kernels load here, before anything is counted
before = now()
ours = side_stream(torch.device("cuda"), "test")
with torch.cuda.stream(ours):
    (a + 2).sum().item()
after_ours = now()
pooled = torch.cuda.Stream()
with torch.cuda.stream(pooled):
    (a + 3).sum().item()
print(json.dumps({
    "external": isinstance(ours, torch.cuda.ExternalStream),
    "side_stream_mib": after_ours - before,
    "torch_pool_stream_mib": now() - after_ours,
}))
"""


def test_side_streams_are_the_runtimes_not_torchs_pools(results: Path | None) -> None:
    """The engine's side streams (streams.side_stream) are made by the CUDA runtime, and cost the
    process less GPU memory than the first stream from torch's pools, which creates every stream of
    them. A fresh process, so nothing before it made the pools."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", SIDE_STREAM_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    record(results, "gpu_side_streams", figures)
    assert figures["external"]
    assert figures["side_stream_mib"] < figures["torch_pool_stream_mib"] / 2, figures
