"""The layering rules, checked on the source: the runtime never imports the app nor transformers'
modeling code (transformers is the reference: tests and the benchmark's reference configuration only);
the product (app/, eg2_runtime/) holds no benchmark and never imports benchmarks/, which is not shipped."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNTIME = REPO / "eg2_runtime"
PRODUCT = (REPO / "app", RUNTIME)
# `eg2 bench` is a product command that runs benchmarks/ from a source checkout (app/cli.py _bench).
BENCH_ENTRY = REPO / "app" / "cli.py"
REFERENCE = {"transformers", "sentence_transformers"}


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def product_files() -> list[Path]:
    return [p for root in PRODUCT for p in root.rglob("*.py")]


def test_runtime_never_imports_the_app() -> None:
    offenders = {
        str(p.relative_to(RUNTIME)): sorted(n for n in imports(p) if n == "app" or n.startswith("app."))
        for p in RUNTIME.rglob("*.py")
    }
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_product_never_imports_the_reference() -> None:
    found = {
        str(p.relative_to(REPO)): sorted(n for n in imports(p) if n.split(".")[0] in REFERENCE)
        for p in product_files()
    }
    assert not {k: v for k, v in found.items() if v}, f"the reference imported by the product: {found}"


def test_no_benchmark_inside_the_product() -> None:
    named = [str(p.relative_to(REPO)) for p in product_files() if re.search(r"bench|probe", p.name)]
    assert not named, f"benchmark modules in the product: {named} (they belong in benchmarks/)"
    importers = {
        str(p.relative_to(REPO)): sorted(n for n in imports(p) if n.split(".")[0] == "benchmarks")
        for p in product_files()
        if p != BENCH_ENTRY
    }
    assert not {k: v for k, v in importers.items() if v}, importers


def test_benchmarks_are_not_shipped() -> None:
    """Neither in the wheel (its packages) nor in the image (.dockerignore)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert config["tool"]["setuptools"]["packages"]["find"]["include"] == ["app*", "eg2_runtime*"]
    ignored = (REPO / ".dockerignore").read_text().split()
    assert "benchmarks" in ignored
