"""The Docker files, checked by reading them (no Docker engine in CI): the properties the issue asks for."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = (REPO / "docker" / "Dockerfile").read_text()


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stage(name: str) -> list[tuple[str, str]]:
    """The instructions of one build stage."""
    current, out = None, []
    for word, rest in instructions(DOCKERFILE):
        if word == "FROM":
            current = rest.split(" AS ")[-1].strip() if " AS " in rest else None
        elif current == name:
            out.append((word, rest))
    return out


def test_variants_cuda_runtime_and_cpu() -> None:
    froms = [rest for word, rest in instructions(DOCKERFILE) if word == "FROM"]
    assert any(re.match(r"nvidia/cuda:\S+-runtime-\S+ AS base-cuda$", f) for f in froms), froms
    assert any(f.endswith("AS base-cpu") for f in froms)
    assert "base-${VARIANT} AS runtime" in froms
    assert ("ARG", "VARIANT=cuda") in instructions(DOCKERFILE)
    assert froms[-1] == "runtime AS serve", "the default target must be the image without baked weights"


def test_runtime_stage_properties() -> None:
    runtime = stage("runtime")
    words = [w for w, _ in runtime]
    users = [rest for w, rest in runtime if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "runs as non-root"
    assert words.index("USER") > max(i for i, w in enumerate(words) if w == "RUN"), (
        "no RUN after dropping root"
    )
    assert ("EXPOSE", "8000") in runtime
    healthcheck = next(rest for w, rest in runtime if w == "HEALTHCHECK")
    assert "/ready" in healthcheck
    env = " ".join(rest for w, rest in runtime if w == "ENV")
    assert "EG2_MODEL=/models" in env and "EG2_HOST=0.0.0.0" in env
    assert ("ENTRYPOINT", '["eg2"]') in runtime and ("CMD", '["serve"]') in runtime
    assert any(w == "ARG" and re.fullmatch(r"TORCH_VERSION=\d+\.\d+\.\d+", r) for w, r in runtime), (
        "torch pinned"
    )
    assert any("pyproject.toml" in r and "dependencies" in r for w, r in runtime if w == "RUN")


def test_weights_stage_is_pinned_and_returns_to_non_root() -> None:
    weights = stage("with-weights")
    assert ("ARG", "HF_REVISION") in weights
    assert weights[-1][0] == "USER" and weights[-1][1].startswith("10001")


def test_compose_reserves_a_gpu() -> None:
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    service = compose["services"]["eg2"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert service["build"]["dockerfile"] == "docker/Dockerfile"
    assert any(v.endswith(":/models:ro") for v in service["volumes"])
    grace = int(service["stop_grace_period"].rstrip("s"))
    assert grace > int(service["environment"]["EG2_DRAIN_DEADLINE_S"]), "grace must exceed the drain deadline"


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".git", "*.safetensors"} <= set(ignored)
