"""One source of truth for rules that were written twice: the architecture defaults (on the
dataclass fields, read from config.json under the names transformers' own config classes write),
the version (pyproject.toml,
through `eg2_runtime.__version__`) and the Matryoshka sizes (`MATRYOSHKA_DIMS`). Prompts:
tests/service/test_guards_prompts.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest

import eg2_runtime
from app.cli import build_parser
from eg2_runtime.config import AudioConfig, ModelConfig, TextConfig, VisionConfig
from eg2_runtime.inputs import MATRYOSHKA_DIMS
from tests.support.fake_engine import live

REPO = Path(__file__).resolve().parents[2]
# Fields computed from other keys rather than read as one value.
DERIVED = {
    TextConfig: {"layer_types", "head_dims", "kv_heads", "rope_thetas"},
    VisionConfig: {"rope_theta"},
    AudioConfig: set(),
    ModelConfig: {"text", "vision", "audio", "quantization", "torch_dtype"},
}


def sentinel(value: Any, i: int) -> Any:
    """A value of the field's type that no default holds."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return 7_001 + i
    if isinstance(value, float):
        return 0.123 + i
    if isinstance(value, tuple):
        return tuple(sentinel(v, i + j) for j, v in enumerate(value))
    raise TypeError(value)


def transformers_keys(cls: Any) -> set[str]:
    """The keys transformers' own config class writes for this section: the names to read."""
    from transformers import AutoConfig

    model_type = {
        TextConfig: None,
        VisionConfig: "gemma4_vision",
        AudioConfig: "gemma4_audio",
        ModelConfig: "embedding_gemma2",
    }[cls]
    if model_type is None:
        return set(AutoConfig.for_model("embedding_gemma2").text_config.to_dict())
    return set(AutoConfig.for_model(model_type).to_dict())


def build(cls: Any, d: dict[str, Any]) -> Any:
    if cls is ModelConfig:
        return ModelConfig.from_dict({"text_config": {}, **d})
    return cls.from_dict(d)


@pytest.mark.parametrize("cls", list(DERIVED), ids=lambda c: c.__name__)
def test_config_reads_every_plain_field_and_defaults_on_the_field(cls: Any) -> None:
    plain = [f for f in dataclasses.fields(cls) if f.name not in DERIVED[cls]]
    defaults = build(cls, {})
    for f in plain:
        assert getattr(defaults, f.name) == f.default, (
            f"{cls.__name__}.{f.name}: from_dict({{}}) != the field default"
        )
    names = getattr(cls, "HF_NAMES", {})
    keys = transformers_keys(cls)
    foreign = [
        f"{f.name} as {names.get(f.name, f.name)!r}" for f in plain if names.get(f.name, f.name) not in keys
    ]
    assert not foreign, f"{cls.__name__} reads keys transformers' config does not write: {foreign}"
    given = {names.get(f.name, f.name): sentinel(f.default, i) for i, f in enumerate(plain)}
    if cls is TextConfig:
        given["num_hidden_layers"] = 6  # sizes the per-layer tuples
    read = build(cls, given)
    unread = [f.name for f in plain if getattr(read, f.name) != given[names.get(f.name, f.name)]]
    assert not unread, f"{cls.__name__}: fields not read from config.json under their names: {unread}"


def pyproject_version() -> str:
    return str(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"])


def test_one_version_everywhere(tiny_fp32: Path) -> None:
    from eg2_runtime.engine import Engine

    version = eg2_runtime.__version__
    assert version.removesuffix("+source") == pyproject_version()
    assert Engine.from_dir(tiny_fp32, device="cpu").info()["version"] == version
    with live() as server:
        info = httpx.get(f"{server.url}/info", timeout=10).json()
    assert info["version"] == version


def test_version_from_a_source_tree_never_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import PackageNotFoundError

    def not_installed(name: str) -> str:
        raise PackageNotFoundError(name)

    monkeypatch.setattr(eg2_runtime, "version", not_installed)
    assert eg2_runtime._version() == f"{pyproject_version()}+source"


def test_cli_dimensions_are_the_matryoshka_sizes() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    embed = sub.choices["embed"]
    (dims,) = [a for a in embed._actions if a.dest == "dimensions"]
    assert sorted(dims.choices or ()) == sorted(MATRYOSHKA_DIMS)
