"""Prompts through HTTP as sentence-transformers' `encode` applies them, on a checkpoint whose
config_sentence_transformers.json sets `default_prompt_name`: no prompt field gives the default
prompt, `"prompt": ""` gives none, a `prompt_name` its own. The reference is `SentenceTransformer.encode`
on the same checkpoint (FP32, CPU, 1e-5); one rule, `eg2_runtime.inputs.resolve_prompt`, serves both
the service and the engine's preprocessor.
"""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from eg2_runtime.engine import Engine
from eg2_runtime.inputs import resolve_prompt
from eg2_runtime.preprocess.text import Prompts
from tests.support.fake_engine import LiveServer, live, make_settings
from tests.support.reference import Reference, load_reference

TOL = 1e-5
DEFAULT = "query"
TEXT = "how do cats purr"


@pytest.fixture(scope="module")
def checkpoint(tiny_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with default_prompt_name set."""
    model_dir = tmp_path_factory.mktemp("tiny-default-prompt") / "model"
    shutil.copytree(tiny_fp32, model_dir)
    path = model_dir / "config_sentence_transformers.json"
    config = json.loads(path.read_text())
    config["default_prompt_name"] = DEFAULT
    path.write_text(json.dumps(config, indent=2))
    return model_dir


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Reference:
    return load_reference(checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[LiveServer]:
    engine = Engine.from_dir(checkpoint, device="cpu", modalities={"text"})
    with live(make_settings(max_batch_tokens=2048), engine, ready_timeout=120) as s:
        yield s


def embed(server: LiveServer, **fields: Any) -> np.ndarray:
    body = {"input": [TEXT], "encoding_format": "base64", **fields}
    r = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), "<f4")


@pytest.mark.parametrize(
    ("fields", "reference_prompt"),
    [
        ({}, None),  # sentence-transformers applies default_prompt_name itself
        ({"prompt": ""}, ""),
        ({"prompt_name": "document"}, "title: none | text: "),
        ({"prompt": "literal: "}, "literal: "),
    ],
    ids=["default", "empty-literal", "named", "literal"],
)
def test_prompts_as_sentence_transformers_applies_them(
    server: LiveServer, reference: Reference, fields: dict[str, str], reference_prompt: str | None
) -> None:
    assert reference.model.default_prompt_name == DEFAULT
    want = reference.encode([TEXT], prompt=reference_prompt)[0]
    got = embed(server, **fields)
    diff = float(np.abs(got - want).max())
    assert diff <= TOL, f"{fields}: {diff:.2e} from sentence-transformers' encode ({TOL:.0e})"


def test_the_default_prompt_changes_the_vector(server: LiveServer) -> None:
    """Else the cases above could not tell a default applied from one ignored."""
    diff = float(np.abs(embed(server) - embed(server, prompt="")).max())
    assert diff > 1e-3, f"the default prompt moved the vector by only {diff:.2e}"


def test_the_preprocessor_resolves_by_the_same_rule(checkpoint: Path) -> None:
    prompts = Prompts.from_dir(checkpoint)
    for name, prompt in [(None, None), (None, ""), ("document", None), (None, "x: ")]:
        want = resolve_prompt(prompts.prompts, DEFAULT, name, prompt)
        assert prompts.resolve(name, prompt) == want
    assert prompts.resolve() == prompts.prompts[DEFAULT]
