"""scripts/wheelhouse.py's choice of wheels, offline: pip's download is replaced by a small fake index
that writes real wheel files (a zip with METADATA), so the rounds, the host's package list and the
exclusions run as they do for `make wheelhouse`.
"""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]


def load_script() -> Any:
    spec = importlib.util.spec_from_file_location("wheelhouse", REPO / "scripts" / "wheelhouse.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wheelhouse = load_script()

# name -> {version: requirements}
INDEX: dict[str, dict[str, list[str]]] = {
    "tokenizers": {"0.23.3": ["huggingface-hub>=0.16"]},
    "transformers": {
        "5.23.0": ["tokenizers>=0.23.1,<0.24", "regex>=2025.10", "numpy>=1.17", "safetensors>=0.8"]
    },
    "fastapi": {"0.165.0": ["starlette>=0.40", "pydantic>=2", "typing-extensions>=4.8"]},
    "starlette": {
        "1.9.0": [],
        "1.10.0": ['anyio>=3.6; python_version >= "3.10"', "uvloop; sys_platform == 'win32'"],
    },
    "pydantic": {"2.14.4": ["pydantic-core==2.50.5", "typing-extensions>=4.8"]},
    "pydantic-core": {"2.50.5": ["typing-extensions>=4.8"]},
    "regex": {"2026.1.1": []},
    "anyio": {"4.0.0": ["idna>=2.8"]},
    "idna": {"3.10": []},
    "compressed-tensors": {"0.20.0": ["torch>=2.7", "transformers", "loguru", "nvidia-cublas"]},
    "loguru": {"0.7.3": ['colorama>=0.3.4; sys_platform == "win32"']},
    "numpy": {"2.4.6": []},
}
HOST = {
    "torch": Version("2.11.0"),
    "numpy": Version("2.5.2"),
    "safetensors": Version("0.8.0"),
    "huggingface-hub": Version("1.33.0"),
    "regex": Version("2024.1.1"),  # too old for transformers' requirement: fetched
    "typing-extensions": None,  # recorded without its version: serves any range
    "idna": None,
}
PINS = [
    "torch>=2.11,<2.15",
    "numpy==2.4.6",
    "safetensors==0.8.0",
    "tokenizers==0.23.3",
    "fastapi==0.165.0",
    "transformers==5.23.0",
    "compressed-tensors==0.20.0",
]


def fake_download(house: Any, reqs: list[str]) -> list[Path]:
    paths = []
    for text in reqs:
        req = Requirement(text)
        versions = [v for v in INDEX[req.name] if req.specifier.contains(v)]
        assert versions, f"no version of {req.name} meets {req.specifier}"
        version = max(versions, key=Version)
        path = house.dest / f"{req.name.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as z:
            meta = [f"Name: {req.name}", f"Version: {version}"]
            meta += [f"Requires-Dist: {r}" for r in INDEX[req.name][version]]
            z.writestr(f"{req.name.replace('-', '_')}-{version}.dist-info/METADATA", "\n".join(meta) + "\n")
        paths.append(path)
    return paths


@pytest.fixture()
def house(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    h = wheelhouse.Wheelhouse("3.12", "manylinux_2_39_x86_64", dict(HOST), tmp_path / ".whl")
    monkeypatch.setattr(h, "download", lambda reqs: fake_download(h, reqs))
    h.build([Requirement(p) for p in PINS])
    return h


def test_fetches_what_the_host_lacks_or_holds_at_another_version(house: Any) -> None:
    carried = {name: str(v) for name, (v, _) in house.carried.items()}
    assert carried == {
        "tokenizers": "0.23.3",  # the host has no tokenizers here
        "fastapi": "0.165.0",
        "transformers": "5.23.0",
        "compressed-tensors": "0.20.0",
        "starlette": "1.10.0",  # the newest that meets the requirement
        "pydantic": "2.14.4",
        "pydantic-core": "2.50.5",
        "regex": "2026.1.1",  # the host's 2024.1.1 is too old for transformers
        "anyio": "4.0.0",  # its marker holds for Python 3.12
        "loguru": "0.7.3",
    }
    assert sorted(p.name for p in house.dest.iterdir()) == sorted(p.name for _, p in house.carried.values())


def test_never_torch_nvidia_or_the_hosts_own(house: Any) -> None:
    for name in ("torch", "nvidia-cublas", "safetensors", "huggingface-hub", "typing-extensions", "idna"):
        assert name not in house.carried, name
    assert "colorama" not in house.carried and "uvloop" not in house.carried  # markers for Windows


def test_a_pin_the_host_serves_is_kept_and_said(house: Any) -> None:
    assert "numpy" not in house.carried  # 2.4.6 pinned, the host's 2.5.2 serves (HOST_SERVES)
    assert any(line.startswith("numpy: the host's 2.5.2 for the pinned 2.4.6") for line in house.kept)


def test_a_host_version_below_a_requirement_is_reported() -> None:
    h = wheelhouse.Wheelhouse(
        "3.12", "manylinux_2_39_x86_64", {"torch": Version("2.5.0")}, Path("/nonexistent")
    )
    assert h.wanted([Requirement("torch>=2.11")], top=True) == []
    assert h.unmet == ["torch>=2.11 (host: 2.5.0)"]


def test_an_unrecorded_host_version_does_not_serve_an_exact_pin() -> None:
    h = wheelhouse.Wheelhouse("3.12", "manylinux_2_39_x86_64", {"httpx": None}, Path("/nonexistent"))
    assert h.wanted([Requirement("httpx==0.28.1")], top=True) == ["httpx==0.28.1"]
    assert h.wanted([Requirement("httpx>=0.20")], top=False) == []
    assert h.specs["httpx"] == SpecifierSet("==0.28.1,>=0.20")


def test_platform_tags_cover_every_older_glibc() -> None:
    tags = wheelhouse.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert "manylinux_2_31_x86_64" not in tags


def test_project_pins_are_pyprojects_with_the_reference_packages() -> None:
    pins = {Requirement(str(r)).name for r in wheelhouse.project_pins()}
    assert {"torch", "numpy", "fastapi", "av"} <= pins
    assert {"transformers", "sentence-transformers", "compressed-tensors"} <= pins
    assert "pytest" not in pins and "ray" not in pins
