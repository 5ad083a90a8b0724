"""Shared fixtures: tiny random checkpoints of the real architecture, generated once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The reference stack must never reach for a hub: every model here is generated locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from eg2_runtime.tools.demo_model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("tiny-bf16"), size="tiny", seed=0, dtype="bfloat16")


@pytest.fixture(scope="session")
def tiny_fp32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FP32 weights: strict (1e-5) parity against the reference needs both sides in FP32."""
    from eg2_runtime.tools.demo_model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("tiny-fp32"), size="tiny", seed=0, dtype="float32")


@pytest.fixture(scope="session")
def tiny_w4(tmp_path_factory: pytest.TempPathFactory, tiny_bf16: Path) -> Path:
    from eg2_runtime.tools.quantize import quantize_checkpoint

    dst = tmp_path_factory.mktemp("tiny-w4")
    quantize_checkpoint(tiny_bf16, dst, group_size=32, progress=False)
    return dst


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--results", default=None, help="directory for JSON figures and traces of GPU tests")


@pytest.fixture(scope="session")
def results(request: pytest.FixtureRequest) -> Path | None:
    value = request.config.getoption("--results")
    return Path(value) if value else None
