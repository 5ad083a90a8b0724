"""Every benchmark and probe module imports: they run only on the H200, where a broken import costs
a device call (benchmarks/text_attention.py once imported a module a restructure had removed)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = sorted(
    p.stem for p in (Path(__file__).parents[2] / "benchmarks").glob("*.py") if p.stem != "__init__"
)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_the_benchmark_module_imports(name: str) -> None:
    importlib.import_module(f"benchmarks.{name}")
