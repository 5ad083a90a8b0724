"""The layering rules, checked on the source: the runtime never imports the app nor transformers'
modeling code (transformers is the reference: tests and the benchmark's reference configuration only);
the product (app/, eg2_runtime/) holds no benchmark and never imports benchmarks/, which is not shipped."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
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


APP = REPO / "app"
# What the app may import from the runtime at module level: the torch-free contract.
CONTRACT = {"eg2_runtime", "eg2_runtime.api", "eg2_runtime.errors", "eg2_runtime.inputs"}
HEAVY = ("torch", "PIL", "soundfile", "av", "tokenizers", "safetensors", "soxr", "triton")


def module_level_imports(path: Path) -> set[str]:
    """Imports a module runs when it is imported: its top level, not those inside functions."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_app_imports_only_the_contract_of_the_runtime() -> None:
    """The app knows nothing of tensors: at module level it imports eg2_runtime's api, inputs and
    errors only, and no tensor or media library; the engine is imported where a model loads."""
    found = {}
    for p in APP.rglob("*.py"):
        names = module_level_imports(p)
        bad = sorted(
            n
            for n in names
            if (n.startswith("eg2_runtime") and n not in CONTRACT) or n.split(".")[0] in HEAVY
        )
        if bad:
            found[p.name] = bad
    assert not found, f"the app imports the runtime's tensor side at import time: {found}"


def test_the_app_imports_and_builds_with_torch_unimportable() -> None:
    """`import app.main` and create_app() in a fresh interpreter where torch and the media libraries
    cannot be imported (None in sys.modules makes an import of them fail)."""
    import subprocess
    import sys

    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in HEAVY)
    code = (
        f"import sys; {blocked}\n"
        "import app.main, app.server, app.cli, app.routes, app.batcher, app.service, app.media, app.schemas\n"
        "from app.main import create_app\nfrom app.settings import Settings\ncreate_app(Settings())\n"
        "print('built without torch')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "built without torch" in done.stdout, done.stderr[-2000:]
