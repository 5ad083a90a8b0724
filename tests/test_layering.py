"""The layering rules, checked on the source: the runtime never imports the app nor transformers'
modeling code (transformers is the reference, in tests and in the benchmark's reference config only)."""

from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[1] / "eg2_runtime"
# Reference-only imports allowed in the benchmarks, which time the reference on purpose.
BENCHMARKS = {"tools/bench_measure.py", "preprocess/bench.py"}


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_runtime_never_imports_the_app() -> None:
    offenders = {
        str(p.relative_to(RUNTIME)): sorted(n for n in imports(p) if n == "app" or n.startswith("app."))
        for p in RUNTIME.rglob("*.py")
    }
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_runtime_never_imports_transformers_modeling_code() -> None:
    found = {}
    for p in RUNTIME.rglob("*.py"):
        rel = str(p.relative_to(RUNTIME))
        names = [n for n in imports(p) if n.split(".")[0] in {"transformers", "sentence_transformers"}]
        if names and rel not in BENCHMARKS:
            found[rel] = names
        if any("modeling" in n for n in names):
            found[rel] = names
    assert not found, f"transformers imported by the runtime: {found}"


APP = RUNTIME.parent / "app"
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
        if p.name.startswith("bench"):
            continue  # lab code, moving out of the package
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
